// `keel jobs` and `keel dlq` as real processes against real SQLite files and a real PostgreSQL
// server, delivering to a real HTTP receiver on 127.0.0.1 that deduplicates by Idempotency-Key:
// exactly-once effects under 30% failures and under SIGKILLed workers, poison and always-503 jobs
// in the dead-letter queue, replay with the same key, discard, depth, metrics, bad input.
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "build_kind.hpp"
#include "keel/queue/queue.hpp"
#include "support/jobs_process_support.hpp"
#include "support/waiting.hpp"

namespace keel::store {
namespace {

using namespace std::chrono_literals;

using test_jobs::CmdResult;
using test_jobs::Process;
using test_jobs::Receiver;

class JobsProcessTest : public test_jobs::JobsHarness<test::BackendTest> {};

using keel::test::kTimingAsserted;  // build_kind.hpp

// An --exec command whose grandchild (a shell started in the background, its sleep one generation
// further) sleeps `delay_s` seconds then appends the attempt number to `effect`; the command
// writes the grandchild's pid to `pid_file` (written whole: through a rename) and waits for it.
// `prefix` runs first (a condition that skips the rest, say).
std::string grandchild_command(const std::filesystem::path& dir, const std::string& delay_s,
                               const std::string& prefix = "") {
  const std::string effect = (dir / "effect").string();
  const std::string tmp = (dir / "pid.tmp").string();
  const std::string pid_file = (dir / "pid").string();
  return prefix + "sh -c 'sleep " + delay_s + "; echo $KEEL_ATTEMPT >> " + effect +
         "' & echo $! > " + tmp + " && mv " + tmp + " " + pid_file + "; wait";
}

pid_t read_pid(const std::filesystem::path& file) {
  std::ifstream in(file);
  pid_t pid = -1;
  in >> pid;
  return pid;
}

std::string read_text(const std::filesystem::path& file) {
  std::ifstream in(file);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST_P(JobsProcessTest, ThousandJobsThroughThirtyPercent503sAreAppliedExactlyOnce) {
  Receiver receiver;
  receiver.fail_rate = 0.3;
  enqueue_many("hooks", 1000);
  auto args = work_args("hooks", receiver.url("/hook"));
  // A budget above the failure rate: this test is about exactly-once, not about the budget.
  args.insert(args.end(), {"--concurrency", "4", "--retry-budget", "1"});
  const CmdResult r = keel(args);
  ASSERT_EQ(r.status, 0) << r.err;
  const std::set<std::string> job_keys = keys("hooks");
  ASSERT_EQ(job_keys.size(), 1000u);
  std::lock_guard lock(receiver.mu);
  EXPECT_EQ(receiver.applied.size(), 1000u);
  for (const auto& k : job_keys) EXPECT_EQ(receiver.applied.count(k), 1u) << k;
  EXPECT_EQ(receiver.missing_key, 0);
  int total_requests = 0;
  for (const auto& [k, n] : receiver.requests) total_requests += n;
  EXPECT_GT(total_requests, 1200) << "the receiver should have failed about 30% of requests";
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'"), 1000);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'dead'"), 0);
  // The history records every failed attempt with the delay chosen.
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_job_attempts WHERE outcome = 'throttled'"
                  " AND delay_ms IS NOT NULL"),
            total_requests - 1000);
}

TEST_P(JobsProcessTest, JobsRefusedByAnOpenCircuitBreakerAreNeverMarkedDone) {
  // The receiver fails every request until it has seen 20, which opens the worker's per-host
  // breaker; jobs refused by the open breaker were sent nowhere and must be retried (or, out of
  // attempts, dead-lettered), never recorded as done.
  Receiver receiver;
  receiver.fail_rate = 1.0;
  enqueue_many("hooks", 40);
  auto args = work_args("hooks", receiver.url("/hook"));
  args.insert(args.end(), {"--concurrency", "4"});
  // A longer backoff cap so the breaker's 5 s break can pass within the 25 default attempts.
  *(std::find(args.begin(), args.end(), "--backoff-cap") + 1) = "300ms";
  auto worker = spawn(args);
  for (int i = 0; i < 2000; ++i) {
    {
      std::lock_guard lock(receiver.mu);
      int seen = 0;
      for (const auto& [k, n] : receiver.requests) seen += n;
      if (seen >= 20) break;
    }
    std::this_thread::sleep_for(10ms);
  }
  receiver.fail_rate = 0.0;
  ASSERT_EQ(worker->wait(), 0);
  auto conn = open_database(url());
  const Rows done = conn->query("SELECT idem_key FROM keel_jobs WHERE state = 'done'");
  std::lock_guard lock(receiver.mu);
  for (std::size_t i = 0; i < done.size(); ++i) {
    EXPECT_EQ(receiver.applied.count(done.text(i, 0)), 1u)
        << "job with key " << done.text(i, 0) << " is done but was never delivered";
  }
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state IN ('done', 'dead')"), 40);
}

TEST_P(JobsProcessTest, WorkersKilledAtRandomAndRestartedLoseNothingAndDuplicateNothing) {
  Receiver receiver;
  receiver.fail_rate = 0.1;
  enqueue_many("fleet", 1000);
  auto args = work_args("fleet", receiver.url("/hook"));
  args.insert(args.end(), {"--concurrency", "2", "--lease", "2s"});
  std::mt19937 rng(7);
  std::vector<std::unique_ptr<Process>> workers;
  workers.push_back(spawn(args));
  workers.push_back(spawn(args));  // two worker processes at once: the fleet case
  // The kills land at random points of the progress read from the database, all before 70% of
  // the jobs are done, rather than after fixed sleeps: however fast or slow the machine drains
  // the queue, every kill finds the fleet with work in hand.
  constexpr int kKills = 6;
  int kills = 0;
  const auto until = std::chrono::steady_clock::now() + 60s;
  for (int k = 0; k < kKills; ++k) {
    const std::int64_t at = (k + 1) * 100 + static_cast<std::int64_t>(rng() % 80);
    while (count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'") < at &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(20ms);
    }
    auto& victim = workers[rng() % workers.size()];
    if (victim->poll()) break;  // it exited: the queue drained already
    victim->signal(SIGKILL);
    const int status = victim->wait();
    if (status == 0) break;  // it drained the queue and exited before the kill landed
    EXPECT_EQ(status, 128 + SIGKILL) << victim->err();
    ++kills;
    victim = spawn(args);
  }
  // Let them drain. A worker exits 0 when nothing is ready, running or scheduled; a lease held by
  // a killed worker keeps the queue busy until it expires and is taken over.
  for (auto& w : workers) EXPECT_EQ(w->wait(), 0) << w->err();
  EXPECT_EQ(kills, kKills) << "the queue drained before the workers could be killed";
  const CmdResult again = keel(args);  // in case both exited while a lease was being reaped
  ASSERT_EQ(again.status, 0) << again.err;
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'"), 1000);
  const std::set<std::string> job_keys = keys("fleet");
  std::lock_guard lock(receiver.mu);
  EXPECT_EQ(receiver.applied.size(), 1000u);
  for (const auto& k : job_keys) EXPECT_EQ(receiver.applied.count(k), 1u) << k;
  EXPECT_EQ(receiver.overlaps, 0) << "a job was held by two live workers at the same time";
}

TEST_P(JobsProcessTest, ARetentionOfZeroDeletesEachJobWithItsSuccessAndAppliesEachOnce) {
  // --retain-done 0s: each success deletes its job in the statement that records it, batched and
  // with failures among them; the receiver still applies every job once.
  Receiver receiver;
  receiver.fail_rate = 0.1;
  enqueue_many("gone", 500);
  const std::set<std::string> job_keys = keys("gone");
  ASSERT_EQ(job_keys.size(), 500u);
  auto args = work_args("gone", receiver.url("/hook"));
  args.insert(args.end(), {"--concurrency", "2", "--batch", "10", "--retain-done", "0s"});
  const CmdResult r = keel(args);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE queue = 'gone'"), 0);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_job_attempts"), 0);
  std::lock_guard lock(receiver.mu);
  int requests = 0;
  for (const auto& [key, n] : receiver.requests) requests += n;
  EXPECT_GT(requests, 500) << "no attempt failed: the failures' path was not taken";
  EXPECT_EQ(receiver.applied.size(), 500u);
  for (const auto& k : job_keys) EXPECT_EQ(receiver.applied.count(k), 1u) << k;
  EXPECT_EQ(receiver.overlaps, 0);
}

TEST_P(JobsProcessTest, PoisonAnd503JobsDeadLetterThenReplayAndDiscard) {
  Receiver receiver;
  const std::string db = url_text();
  const CmdResult poison = keel({"jobs", "--db", db, "enqueue", "--queue", "p", "--payload", "{}"});
  ASSERT_EQ(poison.status, 0) << poison.err;
  const std::string poison_id = poison.out.substr(0, poison.out.find('\n'));
  CmdResult r = keel(work_args("p", receiver.url("/poison")));
  ASSERT_EQ(r.status, 0) << r.err;

  const CmdResult flaky = keel({"jobs", "--db", db, "enqueue", "--queue", "f", "--payload",
                                R"({"x":1})", "--key", "order-77", "--max-attempts", "4"});
  ASSERT_EQ(flaky.status, 0) << flaky.err;
  const std::string flaky_id = flaky.out.substr(0, flaky.out.find('\n'));
  r = keel(work_args("f", receiver.url("/always503")));
  ASSERT_EQ(r.status, 0) << r.err;
  {
    std::lock_guard lock(receiver.mu);
    EXPECT_EQ(receiver.requests["order-77"], 4) << "one HTTP request per job attempt";
    int poison_requests = 0;
    for (const auto& [k, n] : receiver.requests) {
      if (k != "order-77") poison_requests += n;
    }
    EXPECT_EQ(poison_requests, 1) << "a permanent failure is never retried";
  }

  r = keel({"dlq", "--db", db, "depth", "--fail-if-nonzero"});
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out, "2\n");
  r = keel({"dlq", "--db", db, "list", "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto list = nlohmann::json::parse(r.out);
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0]["attempts"], 1);
  EXPECT_NE(list[0]["dead_reason"].get<std::string>().find("permanent: HTTP 400"),
            std::string::npos)
      << list[0]["dead_reason"];
  EXPECT_EQ(list[1]["attempts"], 4);
  EXPECT_NE(list[1]["dead_reason"].get<std::string>().find("attempts exhausted (4 of 4)"),
            std::string::npos);
  r = keel({"dlq", "--db", db, "show", flaky_id, "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto shown = nlohmann::json::parse(r.out);
  ASSERT_EQ(shown["history"].size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(shown["history"][i]["attempt"], i + 1);
    EXPECT_EQ(shown["history"][i]["outcome"], "throttled");
    EXPECT_NE(shown["history"][i]["error"].get<std::string>().find("503"), std::string::npos);
  }
  EXPECT_TRUE(shown["history"][2]["delay_ms"].is_number());
  EXPECT_TRUE(shown["history"][3]["delay_ms"].is_null());
  EXPECT_EQ(shown["payload"]["x"], 1);
  r = keel({"dlq", "--db", db, "show", flaky_id});
  EXPECT_NE(r.out.find("attempt 4  throttled"), std::string::npos) << r.out;

  // The receiver is fixed; replay delivers with the SAME key.
  receiver.fixed = true;
  r = keel({"dlq", "--db", db, "replay", flaky_id});
  ASSERT_EQ(r.status, 0) << r.err;
  r = keel(work_args("f", receiver.url("/always503")));
  ASSERT_EQ(r.status, 0) << r.err;
  {
    std::lock_guard lock(receiver.mu);
    EXPECT_EQ(receiver.requests["order-77"], 5);
    EXPECT_EQ(receiver.applied["order-77"], 1);
  }
  r = keel({"dlq", "--db", db, "depth", "--queue", "f", "--fail-if-nonzero"});
  EXPECT_EQ(r.status, 0);
  r = keel({"dlq", "--db", db, "depth", "--fail-if-nonzero"});
  EXPECT_EQ(r.status, 1);
  r = keel({"dlq", "--db", db, "discard", poison_id});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE id = " + poison_id), 0);
  r = keel({"dlq", "--db", db, "depth", "--fail-if-nonzero"});
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r.out, "0\n");
  r = keel({"jobs", "--db", db, "stats", "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto stats = nlohmann::json::parse(r.out);
  EXPECT_EQ(stats["dead_letter_depth"], 0);
}

TEST_P(JobsProcessTest, BadInputIsRefusedWithAClearMessageAndWritesNothing) {
  const std::string db = url_text();
  CmdResult r = keel({"jobs", "--db", db, "enqueue", "--queue", "q", "--payload", "{not json"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--payload: not valid JSON"), std::string::npos) << r.err;
  r = keel({"jobs", "--db", "mysql://x/y", "enqueue", "--queue", "q", "--payload", "{}"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--db has the scheme 'mysql', which is not supported"), std::string::npos)
      << r.err;
  r = keel({"jobs", "--db", db, "enqueue", "--queue", "no spaces", "--payload", "{}"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--queue"), std::string::npos) << r.err;
  if (GetParam() == Backend::kSqlite) {
    EXPECT_FALSE(std::filesystem::exists(dir().path() / "test.db")) << "a database was created";
  } else {
    auto conn = open_database(url());
    EXPECT_EQ(schema_version(*conn, "queue"), 0) << "the queue's schema was created";
  }
  // A queue that exists, to tell "unknown queue" from "no database".
  r = keel({"jobs", "--db", db, "enqueue", "--queue", "real", "--payload", "{}"});
  ASSERT_EQ(r.status, 0) << r.err;
  r = keel({"jobs", "--db", db, "work", "--queue", "real"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--deliver URL or --exec CMD"), std::string::npos) << r.err;
  r = keel({"jobs", "--db", db, "work", "--queue", "typo", "--exec", "true"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("unknown queue 'typo'"), std::string::npos) << r.err;
  r = keel({"dlq", "--db", db, "depth", "--queue", "typo"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("unknown queue 'typo'"), std::string::npos) << r.err;
  r = keel(
      {"jobs", "--db", db, "enqueue", "--queue", "real", "--payload", "{}", "--delay", "soon"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--delay"), std::string::npos) << r.err;
  r = keel({"dlq", "--db", db, "replay"});
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs"), 1);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_job_attempts"), 0);
}

TEST_P(JobsProcessTest, PayloadsFromAFileAreEnqueuedAllOrNothingEachWithItsOwnKey) {
  const std::string db = url_text();
  const auto lines = dir().path() / "payloads.jsonl";
  {
    std::ofstream out(lines);
    out << R"({"amount":1})"
        << "\n\n"
        << R"({"amount":2})"
        << "\n"
        << R"({"amount":3})"
        << "\n";
  }
  CmdResult r = keel(
      {"jobs", "--db", db, "enqueue", "--queue", "charges", "--payloads-from", lines.string()});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 3) << r.out;  // one id per job
  EXPECT_EQ(keys("charges").size(), 3u);  // a distinct key per job, made at enqueue

  // One bad line: nothing at all is written, and the message names the line.
  const auto bad = dir().path() / "bad.jsonl";
  {
    std::ofstream out(bad);
    out << R"({"amount":4})"
        << "\n"
        << "{oops"
        << "\n";
  }
  r = keel({"jobs", "--db", db, "enqueue", "--queue", "charges", "--payloads-from", bad.string()});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("line 2 is not valid JSON"), std::string::npos) << r.err;
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs"), 3);

  r = keel({"jobs", "--db", db, "enqueue", "--queue", "charges"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("exactly one of --payload"), std::string::npos) << r.err;
  r = keel({"jobs", "--db", db, "enqueue", "--queue", "charges", "--payloads-from", lines.string(),
            "--key", "k1"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--key"), std::string::npos) << r.err;
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs"), 3);
}

TEST_P(JobsProcessTest, ExecHandlerSeesKeyAndAttemptAndSigtermLetsTheJobFinish) {
  const std::string db = url_text();
  const std::filesystem::path log = dir().path() / "exec.log";
  CmdResult r = keel({"jobs", "--db", db, "enqueue", "--queue", "x", "--payload", R"({"v":1})",
                      "--key", "k-exec"});
  ASSERT_EQ(r.status, 0) << r.err;
  // Attempt 1 fails with EX_TEMPFAIL. Attempt 2 waits for the test to create `release`, which it
  // does only after the worker has taken SIGTERM, so the job is certainly in flight at the signal
  // however slow the machine. The wait is bounded (about 30 s) and fails the attempt if `release`
  // never comes: a test that stops early leaves no shell behind for long, and a lost release
  // cannot pass for a finished job.
  const std::string release = (dir().path() / "release").string();
  const std::string wait_for_release = "i=0; while [ ! -e " + release +
                                       " ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done; " +
                                       "[ -e " + release + " ]";
  const std::string cmd = "read -r body; echo \"$KEEL_IDEMPOTENCY_KEY $KEEL_ATTEMPT $body\" >> " +
                          log.string() + "; [ \"$KEEL_ATTEMPT\" = 1 ] && exit 75; " +
                          wait_for_release;
  auto worker = spawn({"jobs", "--db", db, "work", "--queue", "x", "--exec", cmd, "--backoff-base",
                       "10ms", "--backoff-cap", "10ms", "--poll", "10ms", "--grace", "20s",
                       "--metrics-listen", "127.0.0.1:0"});
  const auto read_log = [&] {
    std::ifstream in(log);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  // Wait for the second attempt to start.
  for (const auto until = std::chrono::steady_clock::now() + 30s;
       read_log().find(" 2 ") == std::string::npos && std::chrono::steady_clock::now() < until;) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_NE(read_log().find(" 2 "), std::string::npos) << "the second attempt did not start\n"
                                                       << read_log() << worker->err();
  // Scrape the metrics while it runs (it cannot finish before `release` exists).
  const std::string err = worker->err();
  const auto at = err.find("metrics on http://127.0.0.1:");
  ASSERT_NE(at, std::string::npos) << err;
  const int port = std::stoi(err.substr(at + std::strlen("metrics on http://127.0.0.1:")));
  httplib::Client client("127.0.0.1", port);
  const auto res = client.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_NE(res->body.find("keel_queue_dead_letter_depth{queue=\"x\"} 0"), std::string::npos)
      << res->body;
  EXPECT_NE(res->body.find("keel_queue_jobs{queue=\"x\",state=\"running\"} 1"), std::string::npos);
  // prometheus-cpp writes labels in name order.
  EXPECT_NE(res->body.find("keel_queue_attempts_total{outcome=\"transient\",queue=\"x\"} 1"),
            std::string::npos);
  EXPECT_NE(res->body.find("keel_queue_dead_lettered_total{queue=\"x\",reason=\"permanent\"} 0"),
            std::string::npos);
  EXPECT_NE(res->body.find("keel_queue_oldest_ready_age_seconds{queue=\"x\"}"), std::string::npos);
  // Ask the worker to stop; once it says it is stopping, let the job finish within the grace.
  worker->signal(SIGTERM);
  for (const auto until = std::chrono::steady_clock::now() + 30s;
       worker->err().find("SIGTERM: stopping") == std::string::npos &&
       std::chrono::steady_clock::now() < until;) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_NE(worker->err().find("SIGTERM: stopping"), std::string::npos) << worker->err();
  std::ofstream(release).close();
  EXPECT_EQ(worker->wait(), 0) << worker->err();
  EXPECT_EQ(read_log(), "k-exec 1 {\"v\":1}\nk-exec 2 {\"v\":1}\n");
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'"), 1)
      << "the running job should finish within the grace period";
}

TEST_P(JobsProcessTest, SigtermKillsAnExecCommandsGrandchildAndTheNextWorkerRunsTheJobOnce) {
  const std::string db = url_text();
  CmdResult r = keel({"jobs", "--db", db, "enqueue", "--queue", "g", "--payload", "{}"});
  ASSERT_EQ(r.status, 0) << r.err;
  const std::filesystem::path effect = dir().path() / "effect";
  const std::filesystem::path pid_file = dir().path() / "pid";
  const std::string cmd = grandchild_command(dir().path(), "1");
  auto worker = spawn({"jobs", "--db", db, "work", "--queue", "g", "--exec", cmd, "--grace",
                       "200ms", "--poll", "10ms"});
  ASSERT_TRUE(test::wait_until([&] { return std::filesystem::exists(pid_file); }, 30s))
      << "the command did not start\n"
      << worker->err();
  const auto started = std::chrono::steady_clock::now();
  const pid_t grandchild = read_pid(pid_file);
  ASSERT_GT(grandchild, 0);
  worker->signal(SIGTERM);
  const auto signalled = std::chrono::steady_clock::now();
  EXPECT_TRUE(test::wait_until([&] { return worker->poll(); }, 30s)) << worker->err();
  const auto took = std::chrono::steady_clock::now() - signalled;
  EXPECT_EQ(worker->wait(), 0) << worker->err();
  if (kTimingAsserted) {
    EXPECT_LT(took, 200ms + 1s) << "the worker outlived its grace by more than 1 s";
  }
  EXPECT_TRUE(test::wait_until([&] { return test::process_gone(grandchild); }, 2s))
      << "the command's grandchild outlived the worker";
  // Past the grandchild's delay (1 s from its start, plus a margin): no effect.
  const auto past_delay = std::chrono::duration_cast<std::chrono::milliseconds>(
      started + 1500ms - std::chrono::steady_clock::now());
  EXPECT_FALSE(
      test::wait_until([&] { return std::filesystem::exists(effect); }, std::max(past_delay, 0ms)))
      << "the killed job applied its effect: " << read_text(effect);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'"), 0);

  // Another worker runs the job, once.
  std::filesystem::remove(pid_file);
  r = keel({"jobs", "--db", db, "work", "--queue", "g", "--exec", cmd, "--poll", "10ms",
            "--backoff-base", "10ms", "--backoff-cap", "10ms", "--exit-when-idle"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'"), 1);
  const std::string applied = read_text(effect);
  EXPECT_EQ(std::count(applied.begin(), applied.end(), '\n'), 1) << applied;
}

TEST_P(JobsProcessTest, ExecTimeoutKillsAHungCommandsGroupAndRecordsATransientFailure) {
  const std::string db = url_text();
  CmdResult r = keel(
      {"jobs", "--db", db, "enqueue", "--queue", "t", "--payload", "{}", "--max-attempts", "2"});
  ASSERT_EQ(r.status, 0) << r.err;
  // Attempt 1 hangs (its grandchild sleeps 30 s); attempt 2 succeeds at once.
  const std::string cmd =
      grandchild_command(dir().path(), "30", "[ \"$KEEL_ATTEMPT\" = 1 ] || exit 0; ");
  const auto start = std::chrono::steady_clock::now();
  r = keel({"jobs", "--db", db, "work", "--queue", "t", "--exec", cmd, "--timeout", "300ms",
            "--poll", "10ms", "--backoff-base", "10ms", "--backoff-cap", "10ms",
            "--exit-when-idle"});
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_LT(took, 20s) << "the hung command was not cut at its timeout";
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'"), 1);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_job_attempts WHERE attempt = 1 AND outcome = "
                  "'transient' AND error = 'timed out after 300ms'"),
            1);
  const pid_t grandchild = read_pid(dir().path() / "pid");
  ASSERT_GT(grandchild, 0);
  EXPECT_TRUE(test::wait_until([&] { return test::process_gone(grandchild); }, 2s))
      << "the hung command's grandchild outlived its timeout";
}

TEST_P(JobsProcessTest, WorkHelpSaysWhatEachExitOfAnExecCommandMeans) {
  const CmdResult r = keel({"jobs", "work", "--help"});
  EXPECT_EQ(r.status, 0) << r.err;
  for (const char* says : {"Exit 0 is", "75 (EX_TEMPFAIL) is transient", "is permanent",
                           "death by a signal", "than --timeout", "(default: none)"}) {
    EXPECT_NE(r.out.find(says), std::string::npos) << says << "\n" << r.out;
  }
}

TEST_P(JobsProcessTest, StatsShowJobsWaitingOnTheOpenCircuit) {
  Receiver api;
  api.set_outage(Receiver::kDown503);
  enqueue_many("payments", 30);
  auto args = work_args("payments", api.url("/hook"));
  args.pop_back();  // no --exit-when-idle: the worker runs until SIGTERM
  args.insert(args.end(), {"--concurrency", "2"});
  auto worker = spawn(args);
  std::int64_t deferred = 0;
  for (int i = 0; i < 200 && deferred == 0; ++i) {
    std::this_thread::sleep_for(50ms);
    deferred = count(
        "SELECT COUNT(*) FROM keel_jobs WHERE state = 'retry_scheduled' AND deferred_reason IS NOT "
        "NULL");
  }
  ASSERT_GT(deferred, 0);
  const CmdResult text = keel({"jobs", "--db", url_text(), "stats"});
  ASSERT_EQ(text.status, 0) << text.err;
  EXPECT_NE(text.out.find("DEFERRED"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("jobs wait for an open circuit"), std::string::npos) << text.out;
  const CmdResult json = keel({"jobs", "--db", url_text(), "stats", "--json"});
  ASSERT_EQ(json.status, 0) << json.err;
  const auto doc = nlohmann::json::parse(json.out);
  EXPECT_GE(doc["queues"][0]["deferred"].get<std::int64_t>(), 1) << json.out;
  worker->signal(SIGTERM);
  EXPECT_EQ(worker->wait(), 0);
}

// Every stop signal of a keel process (SIGTERM, SIGINT, SIGHUP: stop_signals.hpp) stops a worker
// cleanly, exit 0, with a line naming it. A hang-up used to kill `keel jobs work` outright.
TEST_P(JobsProcessTest, EachStopSignalStopsAWorkerCleanlyAndSaysWhich) {
  Receiver api;
  enqueue_many("signals", 1);
  for (const auto& [sig, name] :
       {std::pair{SIGTERM, "SIGTERM"}, std::pair{SIGINT, "SIGINT"}, std::pair{SIGHUP, "SIGHUP"}}) {
    SCOPED_TRACE(name);
    auto args = work_args("signals", api.url("/hook"));
    args.pop_back();  // no --exit-when-idle: the worker runs until a signal
    auto worker = spawn(args);
    bool up = false;
    for (int i = 0; i < 500 && !up; ++i) {
      up = worker->err().find("keel jobs: worker ") != std::string::npos;
      if (!up) std::this_thread::sleep_for(10ms);
    }
    ASSERT_TRUE(up) << worker->err();
    worker->signal(sig);
    EXPECT_EQ(worker->wait(), 0) << worker->err();
    EXPECT_NE(worker->err().find(std::string(name) + ": stopping"), std::string::npos)
        << worker->err();
  }
}

// Scrapes /metrics of a worker started with --metrics-listen 127.0.0.1:0 (port from its log).
std::string scrape(const Process& worker) {
  std::string err;
  std::size_t at = std::string::npos;
  for (int i = 0; i < 500 && at == std::string::npos; ++i) {
    err = worker.err();
    at = err.find("metrics on http://127.0.0.1:");
    if (at == std::string::npos) std::this_thread::sleep_for(10ms);
  }
  if (at == std::string::npos) return "no metrics address in: " + err;
  const int port = std::stoi(err.substr(at + std::strlen("metrics on http://127.0.0.1:")));
  httplib::Client client("127.0.0.1", port);
  const auto res = client.Get("/metrics");
  return res ? res->body : "no response from the metrics endpoint";
}

TEST_P(JobsProcessTest, ADeadLetterRetentionReportsExpiringJobsThenPrunesAndCountsThem) {
  const std::string db = url_text();
  CmdResult r = keel({"jobs", "--db", db, "enqueue", "--queue", "r", "--payload", "{}"});
  ASSERT_EQ(r.status, 0) << r.err;
  r = keel({"jobs", "--db", db, "work", "--queue", "r", "--exec", "exit 1", "--poll", "10ms",
            "--exit-when-idle"});
  ASSERT_EQ(r.status, 0) << r.err;
  ASSERT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'dead'"), 1);

  // Invalid values exit 2 naming the flag; the warning means nothing without a retention.
  for (const std::string cmd : {"stats", "work"}) {
    std::vector<std::string> base = {"jobs", "--db", db, cmd};
    if (cmd == "work") base.insert(base.end(), {"--queue", "r", "--exec", "true"});
    auto bad = base;
    bad.insert(bad.end(), {"--dead-letter-retention", "0s"});
    r = keel(bad);
    EXPECT_EQ(r.status, 2) << cmd;
    EXPECT_NE(r.err.find("--dead-letter-retention"), std::string::npos) << r.err;
    bad = base;
    bad.insert(bad.end(), {"--dead-letter-retention", "1h", "--dead-letter-warning", "soon"});
    r = keel(bad);
    EXPECT_EQ(r.status, 2) << cmd;
    EXPECT_NE(r.err.find("--dead-letter-warning"), std::string::npos) << r.err;
    bad = base;
    bad.insert(bad.end(), {"--dead-letter-warning", "1h"});
    r = keel(bad);
    EXPECT_EQ(r.status, 2) << cmd;
    EXPECT_NE(r.err.find("--dead-letter-warning: needs --dead-letter-retention"), std::string::npos)
        << r.err;
    // A window as long as the retention would only count jobs already gone.
    for (const char* warning : {"1h", "2h"}) {
      bad = base;
      bad.insert(bad.end(), {"--dead-letter-retention", "1h", "--dead-letter-warning", warning});
      r = keel(bad);
      EXPECT_EQ(r.status, 2) << cmd << " " << warning;
      EXPECT_NE(
          r.err.find("--dead-letter-warning must be shorter than --dead-letter-retention (1h)"),
          std::string::npos)
          << r.err;
      EXPECT_NE(r.err.find(std::string("(got '") + warning + "')"), std::string::npos) << r.err;
    }
  }

  // Stats: without a retention no EXPIRING column; with one, the job (dead for more than 10 ms
  // by now) is due within a window 10 ms shorter than the retention.
  r = keel({"jobs", "--db", db, "stats"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out.find("EXPIRING"), std::string::npos) << r.out;
  r = keel({"jobs", "--db", db, "stats", "--dead-letter-retention", "1h", "--dead-letter-warning",
            "3599.99s"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("EXPIRING"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("expiring: 1 dead jobs are pruned within "), std::string::npos) << r.out;
  r = keel({"jobs", "--db", db, "stats", "--json", "--dead-letter-retention", "1h"});
  ASSERT_EQ(r.status, 0) << r.err;
  auto doc = nlohmann::json::parse(r.out);
  EXPECT_EQ(doc["queues"][0]["dead_expiring"], 0)
      << "half the retention (30m) ahead by default, and nearly 1h is left";
  EXPECT_EQ(doc["dead_letter_expiring"], 0);
  r = keel({"jobs", "--db", db, "stats", "--dead-letter-retention", "2h"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("within 1h (retention 2h)"), std::string::npos) << r.out;
  r = keel({"jobs", "--db", db, "stats", "--dead-letter-retention", "168h"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("within 24h (retention 168h)"), std::string::npos) << r.out;

  // A worker with the same retention exports the gauge, and prunes nothing yet.
  auto worker = spawn({"jobs", "--db", db, "work", "--queue", "r", "--exec", "true", "--poll",
                       "10ms", "--lease", "300ms", "--dead-letter-retention", "1h",
                       "--dead-letter-warning", "3599.99s", "--metrics-listen", "127.0.0.1:0"});
  std::string body = scrape(*worker);
  EXPECT_NE(body.find("keel_queue_dead_letter_expiring_jobs{queue=\"r\"} 1"), std::string::npos)
      << body;
  EXPECT_NE(body.find("keel_queue_dead_letters_pruned_total{queue=\"r\"} 0"), std::string::npos)
      << body;
  worker->signal(SIGTERM);
  EXPECT_EQ(worker->wait(), 0) << worker->err();
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'dead'"), 1);

  // A retention the job has outlived: pruned at the first housekeeping, counted and logged.
  worker = spawn({"jobs", "--db", db, "work", "--queue", "r", "--exec", "true", "--poll", "10ms",
                  "--lease", "300ms", "--dead-letter-retention", "1ms", "--metrics-listen",
                  "127.0.0.1:0"});
  for (int i = 0; i < 500 && count("SELECT COUNT(*) FROM keel_jobs") > 0; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs"), 0);
  // The worker counts the pruned jobs once their DELETE has committed: a scrape can fall
  // between the two, so wait for the count rather than read it once.
  const std::string pruned = "keel_queue_dead_letters_pruned_total{queue=\"r\"} 1";
  body = scrape(*worker);
  for (int i = 0; i < 500 && body.find(pruned) == std::string::npos; ++i) {
    std::this_thread::sleep_for(10ms);
    body = scrape(*worker);
  }
  EXPECT_NE(body.find(pruned), std::string::npos) << body;
  EXPECT_NE(body.find("keel_queue_dead_letter_expiring_jobs{queue=\"r\"} 0"), std::string::npos)
      << body;
  worker->signal(SIGTERM);
  EXPECT_EQ(worker->wait(), 0) << worker->err();
  EXPECT_NE(worker->err().find("pruned 1 dead job(s) of queue 'r'"), std::string::npos)
      << worker->err();
}

TEST_P(JobsProcessTest, AnUnwritableDatabaseBacksOffAndExitsNonZero) {
  // A full disk: every write fails (a trigger raises the backend's own disk-full error on any
  // update of the jobs). The worker must back off (not log ten lines a second forever) and,
  // past --max-db-outage, exit 1 saying why.
  Receiver receiver;
  enqueue_many("ro", 5);
  {
    auto conn = open_database(url());
    if (GetParam() == Backend::kPostgres) {
      conn->query(
          "CREATE FUNCTION keel_test_disk_full() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION"
          " 'could not extend file: No space left on device' USING ERRCODE = '53100'; END $$"
          " LANGUAGE plpgsql");
      conn->query(
          "CREATE TRIGGER keel_test_disk_full BEFORE UPDATE ON keel_jobs FOR EACH STATEMENT"
          " EXECUTE FUNCTION keel_test_disk_full()");
    } else {
      conn->query(
          "CREATE TRIGGER keel_test_disk_full BEFORE UPDATE ON keel_jobs BEGIN"
          " SELECT RAISE(ABORT, 'database or disk is full'); END");
    }
  }
  const CmdResult r =
      keel({"jobs", "--db", url_text(), "work", "--queue", "ro", "--deliver", receiver.url("/hook"),
            "--poll", "10ms", "--exit-when-idle", "--max-db-outage", "2s"});
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_NE(r.err.find("giving up: the database has failed for"), std::string::npos) << r.err;
  EXPECT_NE(
      r.err.find(GetParam() == Backend::kPostgres ? "No space left on device" : "disk is full"),
      std::string::npos)
      << r.err;
  int lines = 0;
  for (std::size_t at = r.err.find("lease"); at != std::string::npos;
       at = r.err.find("lease", at + 1)) {
    ++lines;
  }
  EXPECT_LE(lines, 6) << "backs off and logs once, not once per poll:\n" << r.err;
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'ready'"), 5);
  EXPECT_EQ(receiver.total_requests(), 0);
}

TEST_P(JobsProcessTest, AnIdleWorkerIsWokenByAnEnqueueFromAnotherProcess) {
  // `keel jobs work` at default flags but for a minute-long safety net: the worker's first look
  // after going idle comes 30 s or more later, so a pickup within the bound was a wakeup.
  if (GetParam() != Backend::kPostgres) GTEST_SKIP() << "SQLite has no notifications";
  const std::string db = url_text();
  enqueue_many("wake", 1);
  auto worker = spawn(
      {"jobs", "--db", db, "work", "--queue", "wake", "--exec", "true", "--idle-poll", "60s"});
  ASSERT_TRUE(test::wait_until(
      [&] { return count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'") == 1; }, 30s));
  const auto enqueued = std::chrono::steady_clock::now();
  const CmdResult r = keel({"jobs", "--db", db, "enqueue", "--queue", "wake", "--payload", "{}"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(test::wait_until(
      [&] { return count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'") == 2; }, 25s))
      << "the enqueue did not wake the worker";
  // Includes starting the enqueueing process.
  if (kTimingAsserted) {
    EXPECT_LT(std::chrono::steady_clock::now() - enqueued, 3s);
  }
  worker->signal(SIGTERM);
  EXPECT_EQ(worker->wait(), 0) << worker->err();
}

INSTANTIATE_TEST_SUITE_P(Backends, JobsProcessTest,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

}  // namespace
}  // namespace keel::store
