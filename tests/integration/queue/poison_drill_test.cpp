// The poison drill: three `keel jobs work --exec` processes drain 3,000 jobs in batches, five of
// the jobs poison (each run SIGKILLs the worker running it), every killed worker started again
// at once, as a supervisor would. At batch 1 a job starts with its lease, so each crash charges
// only the poison job it ran. In batches of 100 (two slots a process) a crash charges nothing:
// the batch comes back counted in crashed_batches, and each of its jobs runs alone, its start
// committed and no other handler of its process running, so that the poison job's next crashes
// are its own. Either way: every poison job dead as crashed after exactly its three attempts, no
// innocent job charged an attempt, every innocent job done, and only jobs that finished within a
// crashed batch's flush window run twice. Release build only: it measures processes, which the
// sanitizer builds test piece by piece (job_queue_test.cpp runs a batched Worker in-process).
// The lease is 1.5 s: a heartbeat late by more than a lease under a loaded machine would be read
// as a crash and charge a live worker's started job.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "keel/queue/queue.hpp"
#include "support/jobs_process_support.hpp"

namespace keel::store {
namespace {

using namespace std::chrono_literals;

// (backend, batch size).
using DrillCase = std::tuple<Backend, int>;

std::string case_name(const ::testing::TestParamInfo<DrillCase>& info) {
  return std::string(std::get<0>(info.param) == Backend::kSqlite ? "Sqlite" : "Postgres") +
         "Batch" + std::to_string(std::get<1>(info.param));
}

constexpr int kJobs = 3000;
constexpr int kWorkers = 3;
constexpr int kMaxAttempts = 3;
// Spread over the queue, none at a batch's edge.
const std::set<int> kPoison = {137, 1021, 1544, 2310, 2877};

class PoisonDrillTest : public test_jobs::JobsHarness<test::BackendParamTest<DrillCase>> {
 protected:
  [[nodiscard]] int batch() const { return std::get<1>(GetParam()); }

  std::vector<std::string> enqueue() {
    std::vector<std::string> keys;
    auto conn = open_database(url());
    JobQueue::migrate(*conn);
    JobQueue q;
    std::vector<EnqueueRequest> requests;
    for (int i = 0; i < kJobs; ++i) {
      keys.push_back("job-" + std::to_string(i));
      requests.push_back({.queue = "drill",
                          .payload = kPoison.count(i) ? R"({"poison":true})"
                                                      : R"({"n":)" + std::to_string(i) + "}",
                          .key = keys.back(),
                          .max_attempts = kMaxAttempts});
    }
    for (const auto& r : q.enqueue_many(*conn, requests)) EXPECT_TRUE(r.ok()) << r.error;
    return keys;
  }

  // The poison job SIGKILLs its worker (the command's parent) before any effect; every other job
  // appends its key to effects.log.
  [[nodiscard]] std::string command() const {
    return "read -r body; case \"$body\" in *poison*) kill -9 $PPID; exit 75;; esac; "
           "echo \"$KEEL_IDEMPOTENCY_KEY\" >> " +
           effects().string();
  }
  [[nodiscard]] std::filesystem::path effects() const { return dir().path() / "effects.log"; }

  [[nodiscard]] std::vector<std::string> worker_args() const {
    return {"jobs",
            "--db",
            url_text(),
            "work",
            "--queue",
            "drill",
            "--exec",
            command(),
            "--batch",
            std::to_string(batch()),
            "--concurrency",
            batch() == 1 ? "1" : "2",
            "--lease",
            "1500ms",
            "--poll",
            "10ms",
            "--backoff-base",
            "10ms",
            "--backoff-cap",
            "50ms",
            "--exit-when-idle"};
  }

  struct Run {
    int crashes = 0;
    int other_exits = 0;  // neither a SIGKILL nor an idle exit
    bool drained = false;
    std::string errors;
  };

  // Keeps kWorkers workers running, each killed one started again, until one exits because the
  // queue is idle; bounded by `limit`.
  Run supervise(std::chrono::seconds limit) {
    Run run;
    std::vector<std::unique_ptr<test_jobs::Process>> workers;
    for (int i = 0; i < kWorkers; ++i) workers.push_back(spawn(worker_args()));
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (!run.drained && std::chrono::steady_clock::now() < deadline) {
      for (auto& w : workers) {
        if (!w->poll()) continue;
        const int status = w->wait();
        if (status == 0) {
          run.drained = true;
          continue;
        }
        if (status == 128 + SIGKILL) {
          ++run.crashes;
        } else {
          ++run.other_exits;
          run.errors += "exit " + std::to_string(status) + ": " + w->err() + "\n";
        }
        if (!run.drained) w = spawn(worker_args());
      }
      // wait: bound: the drill's processes, polled every 20 ms
      std::this_thread::sleep_for(20ms);
    }
    // The queue is idle: the others exit on their own (or are killed when the drill timed out).
    for (auto& w : workers) {
      if (!run.drained) w->signal(SIGKILL);
      const int status = w->wait();
      if (status == 128 + SIGKILL && run.drained) ++run.crashes;
    }
    return run;
  }

  // The innocent jobs charged an attempt, with their history, for a failure's message.
  static std::string charged_innocents(Connection& conn) {
    const Rows r = conn.query(
        "SELECT j.id, j.state, j.attempts, j.crashed_batches, a.attempt, a.outcome, a.worker,"
        " a.error FROM keel_jobs j JOIN keel_job_attempts a ON a.job_id = j.id"
        " WHERE j.payload NOT LIKE '%poison%' ORDER BY j.id, a.id");
    std::string out = "innocent jobs charged:\n";
    for (std::size_t i = 0; i < r.size(); ++i) {
      for (std::size_t c = 0; c < 8; ++c) out += (r.cell(i, c) ? *r.cell(i, c) : "-") + " ";
      out += "\n";
    }
    return out;
  }

  std::map<std::string, int> effect_counts() const { return test_jobs::line_counts(effects()); }
};

TEST_P(PoisonDrillTest, FivePoisonJobsAreChargedTheirCrashesAndNoInnocentJobIs) {
  const auto keys = enqueue();
  const Run run = supervise(180s);
  ASSERT_TRUE(run.drained) << "the queue did not drain within the drill's bound; crashes "
                           << run.crashes << "\n"
                           << run.errors;
  EXPECT_EQ(run.other_exits, 0) << run.errors;
  // Each poison job's attempts, each run alone. In batches, at most one more run each: the batch
  // it first crashed, charged to no one; two poison jobs first run together in one process (its
  // two slots) end in one crash.
  const int charged_crashes = static_cast<int>(kPoison.size()) * kMaxAttempts;
  if (batch() == 1) {
    EXPECT_EQ(run.crashes, charged_crashes);
  } else {
    EXPECT_GT(run.crashes, charged_crashes);
    EXPECT_LE(run.crashes, charged_crashes + static_cast<int>(kPoison.size()));
  }

  // Every poison job dead as crashed after exactly its attempts.
  auto conn = open_database(url());
  JobQueue q;
  const auto dead = q.list_dead(*conn, "drill");
  std::set<std::string> dead_keys;
  for (const Job& j : dead) {
    dead_keys.insert(j.idempotency_key);
    EXPECT_EQ(j.attempts, kMaxAttempts) << j.idempotency_key;
    EXPECT_EQ(j.dead_kind, DeadReason::kCrashed) << j.idempotency_key << ": " << j.dead_reason;
  }
  std::set<std::string> poison_keys;
  for (int i : kPoison) poison_keys.insert(keys[static_cast<std::size_t>(i)]);
  EXPECT_EQ(dead_keys, poison_keys);

  // No innocent job charged for a crash: each done on its first attempt.
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done' AND attempts = 1"),
            kJobs - static_cast<int>(kPoison.size()))
      << charged_innocents(*conn);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_job_attempts WHERE outcome = 'lease_expired'"),
            static_cast<std::int64_t>(kPoison.size()) * kMaxAttempts);

  // Every innocent job ran; those that ran twice had finished in a crashed batch before its
  // crash, their successes still in the flush window.
  const auto effects = effect_counts();
  int reruns = 0;
  for (int i = 0; i < kJobs; ++i) {
    if (kPoison.count(i)) continue;
    const auto it = effects.find(keys[static_cast<std::size_t>(i)]);
    const int runs = it == effects.end() ? 0 : it->second;
    EXPECT_GE(runs, 1) << keys[static_cast<std::size_t>(i)] << " never ran";
    reruns += runs > 1 ? runs - 1 : 0;
  }
  const std::int64_t returned =
      count("SELECT COALESCE(SUM(crashed_batches), 0) FROM keel_jobs WHERE state = 'done'");
  std::printf(
      "batch %d: %d crashes, %d re-runs of finished jobs (%.1f a crash), %lld innocent jobs "
      "returned uncharged from a crashed batch\n",
      batch(), run.crashes, reruns, run.crashes ? static_cast<double>(reruns) / run.crashes : 0.0,
      static_cast<long long>(returned));
  if (batch() == 1) {
    EXPECT_EQ(reruns, 0);
    EXPECT_EQ(returned, 0);
  } else {
    // Only a job returned from a crashed batch can run twice.
    EXPECT_LE(reruns, returned);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, PoisonDrillTest,
                         ::testing::Values(DrillCase{Backend::kSqlite, 1},
                                           DrillCase{Backend::kSqlite, 100},
                                           DrillCase{Backend::kPostgres, 1},
                                           DrillCase{Backend::kPostgres, 100}),
                         case_name);

}  // namespace
}  // namespace keel::store
