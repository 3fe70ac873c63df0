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
#include <vector>

#include "keel/store/queue.hpp"
#include "test_support.hpp"

extern char** environ;

namespace keel::store {
namespace {

using namespace std::chrono_literals;

// A child process with its stdout and stderr in files.
class Process {
 public:
  Process(const std::vector<std::string>& args, const std::filesystem::path& dir,
          const std::string& tag) {
    out_ = dir / (tag + ".out");
    err_ = dir / (tag + ".err");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, out_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&actions, 2, err_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    std::vector<std::string> copy = args;
    std::vector<char*> argv;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&actions);
  }
  ~Process() {
    if (pid_ > 0 && !exited_) {
      ::kill(pid_, SIGKILL);
      (void)wait();
    }
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  [[nodiscard]] pid_t pid() const { return pid_; }
  void signal(int sig) const { ::kill(pid_, sig); }
  /// Exit status, or 128 + signal.
  int wait() {
    if (exited_) return status_;
    int st = 0;
    while (::waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
    }
    exited_ = true;
    status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    return status_;
  }
  /// Whether it has exited (reaped).
  bool poll() {
    if (exited_) return true;
    int st = 0;
    if (::waitpid(pid_, &st, WNOHANG) == pid_) {
      exited_ = true;
      status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    return exited_;
  }
  [[nodiscard]] std::string out() const { return slurp(out_); }
  [[nodiscard]] std::string err() const { return slurp(err_); }

 private:
  static std::string slurp(const std::filesystem::path& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = -1;
  std::filesystem::path out_, err_;
};

struct CmdResult {
  int status = -1;
  std::string out;
  std::string err;
};

// The receiver: POST /hook applies an effect once per Idempotency-Key (a repeat is answered 200
// without applying it again); a share of requests fail with 503 before anything is applied.
// /poison always answers 400. /always503 answers 503 until `fixed` is set.
class Receiver {
 public:
  Receiver() {
    server_.Post("/hook", [this](const httplib::Request& req, httplib::Response& res) {
      handle(req, res, /*poison=*/false, /*always_fail=*/false);
    });
    server_.Post("/poison", [this](const httplib::Request& req, httplib::Response& res) {
      handle(req, res, true, false);
    });
    server_.Post("/always503", [this](const httplib::Request& req, httplib::Response& res) {
      handle(req, res, false, !fixed.load());
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(1ms);
  }
  ~Receiver() {
    server_.stop();
    thread_.join();
  }
  [[nodiscard]] std::string url(const std::string& path) const {
    return "http://127.0.0.1:" + std::to_string(port_) + path;
  }

  std::atomic<double> fail_rate{0.0};
  std::atomic<bool> fixed{false};

  std::mutex mu;
  std::map<std::string, int> applied;    // key -> effects applied (guarded by mu)
  std::map<std::string, int> requests;   // key -> requests seen (guarded by mu)
  std::map<std::string, int> in_flight;  // key -> requests being handled (guarded by mu)
  int overlaps = 0;                      // a key handled twice at once (guarded by mu)
  int missing_key = 0;                   // requests without Idempotency-Key (guarded by mu)

 private:
  void handle(const httplib::Request& req, httplib::Response& res, bool poison, bool always_fail) {
    const std::string key = req.get_header_value("Idempotency-Key");
    bool fail = false;
    {
      std::lock_guard lock(mu);
      if (key.empty()) ++missing_key;
      ++requests[key];
      if (in_flight[key]++ > 0) ++overlaps;
      fail = std::uniform_real_distribution<double>(0, 1)(rng_) < fail_rate.load();
    }
    std::this_thread::sleep_for(1ms);  // widen the window in which two holders would overlap
    std::lock_guard lock(mu);
    --in_flight[key];
    if (poison) {
      res.status = 400;
      res.set_content(R"({"error":"field 'to' is required"})", "application/json");
    } else if (always_fail || fail) {
      res.status = 503;
      res.set_content("busy", "text/plain");
    } else {
      if (applied[key] == 0) applied[key] = 1;  // dedupe by key: the effect happens once
      res.status = 200;
      res.set_content("{}", "application/json");
    }
  }

  httplib::Server server_;
  int port_ = 0;
  std::thread thread_;
  std::mt19937_64 rng_{2024};  // guarded by mu
};

class JobsProcessTest : public test::BackendTest {
 protected:
  CmdResult keel(std::vector<std::string> args) {
    args.insert(args.begin(), KEEL_BINARY);
    Process p(args, dir().path(), "run" + std::to_string(runs_++));
    CmdResult r;
    r.status = p.wait();
    r.out = p.out();
    r.err = p.err();
    return r;
  }
  std::unique_ptr<Process> spawn(std::vector<std::string> args) {
    args.insert(args.begin(), KEEL_BINARY);
    return std::make_unique<Process>(args, dir().path(), "bg" + std::to_string(runs_++));
  }
  std::vector<std::string> work_args(const std::string& queue, const std::string& deliver_url) {
    return {"jobs",          "--db",      url_text(),  "work",           "--queue",
            queue,           "--deliver", deliver_url, "--backoff-base", "10ms",
            "--backoff-cap", "100ms",     "--poll",    "10ms",           "--exit-when-idle"};
  }
  // Enqueues n jobs in one transaction through the library (the CLI's enqueue is tested below).
  void enqueue_many(const std::string& queue, int n) {
    auto conn = open_database(url());
    JobQueue::migrate(*conn);
    JobQueue q;
    std::vector<EnqueueRequest> batch;
    for (int i = 0; i < n; ++i) {
      batch.push_back({.queue = queue, .payload = R"({"n":)" + std::to_string(i) + "}"});
    }
    for (const auto& r : q.enqueue_many(*conn, batch)) ASSERT_TRUE(r.ok()) << r.error;
  }
  std::int64_t count(const std::string& sql) {
    auto conn = open_database(url());
    return conn->query(sql).integer(0, 0);
  }
  std::set<std::string> keys(const std::string& queue) {
    auto conn = open_database(url());
    const Rows r = conn->query("SELECT idem_key FROM keel_jobs WHERE queue = $1", {queue});
    std::set<std::string> out;
    for (std::size_t i = 0; i < r.size(); ++i) out.insert(r.text(i, 0));
    return out;
  }

  int runs_ = 0;
};

TEST_P(JobsProcessTest, ThousandJobsThroughThirtyPercent503sAreAppliedExactlyOnce) {
  Receiver receiver;
  receiver.fail_rate = 0.3;
  enqueue_many("hooks", 1000);
  auto args = work_args("hooks", receiver.url("/hook"));
  args.insert(args.end(), {"--concurrency", "4"});
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
  int kills = 0;
  const auto start = std::chrono::steady_clock::now();
  while (kills < 6 && std::chrono::steady_clock::now() - start < 30s) {
    std::this_thread::sleep_for(std::chrono::milliseconds(150 + rng() % 300));
    auto& victim = workers[rng() % workers.size()];
    if (victim->poll()) break;  // the queue drained already
    victim->signal(SIGKILL);
    EXPECT_EQ(victim->wait(), 128 + SIGKILL);
    ++kills;
    victim = spawn(args);
  }
  // Let them drain. A worker exits 0 when nothing is ready, running or scheduled; a lease held by
  // a killed worker keeps the queue busy until it expires and is taken over.
  for (auto& w : workers) EXPECT_EQ(w->wait(), 0) << w->err();
  EXPECT_GE(kills, 3) << "the queue drained before the workers could be killed";
  const CmdResult again = keel(args);  // in case both exited while a lease was being reaped
  ASSERT_EQ(again.status, 0) << again.err;
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'"), 1000);
  const std::set<std::string> job_keys = keys("fleet");
  std::lock_guard lock(receiver.mu);
  EXPECT_EQ(receiver.applied.size(), 1000u);
  for (const auto& k : job_keys) EXPECT_EQ(receiver.applied.count(k), 1u) << k;
  EXPECT_EQ(receiver.overlaps, 0) << "a job was held by two live workers at the same time";
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
  EXPECT_NE(r.err.find("--db: invalid database URL"), std::string::npos) << r.err;
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
  // Attempt 1 fails with EX_TEMPFAIL, attempt 2 sleeps (SIGTERM arrives) and succeeds.
  const std::string cmd = "read -r body; echo \"$KEEL_IDEMPOTENCY_KEY $KEEL_ATTEMPT $body\" >> " +
                          log.string() + "; [ \"$KEEL_ATTEMPT\" = 1 ] && exit 75; sleep 0.5";
  auto worker = spawn({"jobs", "--db", db, "work", "--queue", "x", "--exec", cmd, "--backoff-base",
                       "10ms", "--backoff-cap", "10ms", "--poll", "10ms", "--grace", "20s",
                       "--metrics-listen", "127.0.0.1:0"});
  // Wait for the second attempt to start, then ask the worker to stop.
  for (int i = 0; i < 500; ++i) {
    std::ifstream in(log);
    std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (all.find(" 2 ") != std::string::npos) break;
    std::this_thread::sleep_for(10ms);
  }
  // Scrape the metrics while it runs.
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
  EXPECT_NE(res->body.find("keel_queue_attempts_total{queue=\"x\",outcome=\"transient\"} 1"),
            std::string::npos);
  EXPECT_NE(res->body.find("keel_queue_dead_lettered_total{queue=\"x\",reason=\"permanent\"} 0"),
            std::string::npos);
  EXPECT_NE(res->body.find("keel_queue_oldest_ready_age_seconds{queue=\"x\"}"), std::string::npos);
  worker->signal(SIGTERM);
  EXPECT_EQ(worker->wait(), 0) << worker->err();
  std::ifstream in(log);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(all, "k-exec 1 {\"v\":1}\nk-exec 2 {\"v\":1}\n");
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'"), 1)
      << "the running job should finish within the grace period";
}

INSTANTIATE_TEST_SUITE_P(Backends, JobsProcessTest,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

}  // namespace
}  // namespace keel::store
