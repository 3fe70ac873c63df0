// The queue's edges, as a user meets them: `keel jobs work --exec` whose poison job SIGKILLs its
// own worker, with batches of 1, 10 and 100, on SQLite and PostgreSQL. A crash charges only the
// job that caused it: a batch's crash charges nothing and its jobs come back counted in
// crashed_batches; each then runs alone, so the poison job's next crashes are its own, and it
// reaches the dead-letter queue through keel::core's retry rules (attempts or max age) with a
// reason that says the worker died while running it. Every other job is done on its first
// attempt; those of the crashed batch that had finished within the flush window run twice (none
// with --flush-window 0).
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "keel/queue/queue.hpp"
#include "support/jobs_process_support.hpp"

namespace keel::store {
namespace {

using namespace std::chrono_literals;

using test_jobs::CmdResult;

// (backend, batch size).
using DrillCase = std::tuple<Backend, int>;

std::string case_name(const ::testing::TestParamInfo<DrillCase>& info) {
  return std::string(std::get<0>(info.param) == Backend::kSqlite ? "Sqlite" : "Postgres") +
         "Batch" + std::to_string(std::get<1>(info.param));
}

class CrashDrillTest : public test_jobs::JobsHarness<test::BackendParamTest<DrillCase>> {
 protected:
  [[nodiscard]] int batch() const { return std::get<1>(GetParam()); }

  // Enqueues `n` jobs on queue "drill" with `max_attempts` each, job `poison_at` (0-based)
  // poisoned: its command kills the worker that runs it. Returns the keys in order.
  std::vector<std::string> enqueue(int n, int poison_at, int max_attempts) {
    std::vector<std::string> keys;
    auto conn = open_database(url());
    JobQueue::migrate(*conn);
    JobQueue q;
    std::vector<EnqueueRequest> batch;
    for (int i = 0; i < n; ++i) {
      keys.push_back("job-" + std::to_string(i));
      batch.push_back(
          {.queue = "drill",
           .payload = i == poison_at ? R"({"poison":true})" : R"({"n":)" + std::to_string(i) + "}",
           .key = keys.back(),
           .max_attempts = max_attempts});
    }
    for (const auto& r : q.enqueue_many(*conn, batch)) EXPECT_TRUE(r.ok()) << r.error;
    return keys;
  }

  // The command: the poison job SIGKILLs the worker (its parent) before any effect; every other
  // job appends its key to effects.log.
  [[nodiscard]] std::string command() const {
    return "read -r body; echo \"$PPID $body\" >> " + (dir().path() / "trace").string() +
           "; case \"$body\" in *poison*) kill -9 $PPID; exit 75;; esac; "
           "echo \"$KEEL_IDEMPOTENCY_KEY\" >> " +
           effects().string();
  }
  [[nodiscard]] std::filesystem::path effects() const { return dir().path() / "effects.log"; }

  std::map<std::string, int> effect_counts() const { return test_jobs::line_counts(effects()); }

  // Runs workers one after another until one exits because the queue is idle; returns the exit
  // statuses. Bounded: at most `max_runs` workers.
  std::vector<int> run_workers(const std::vector<std::string>& extra, int max_runs) {
    std::vector<int> statuses;
    for (int i = 0; i < max_runs; ++i) {
      std::vector<std::string> args = {"jobs",
                                       "--db",
                                       url_text(),
                                       "work",
                                       "--queue",
                                       "drill",
                                       "--exec",
                                       command(),
                                       "--batch",
                                       std::to_string(batch()),
                                       "--lease",
                                       "700ms",
                                       "--poll",
                                       "10ms",
                                       "--backoff-base",
                                       "10ms",
                                       "--backoff-cap",
                                       "50ms",
                                       "--exit-when-idle"};
      args.insert(args.end(), extra.begin(), extra.end());
      const CmdResult r = keel(args);
      statuses.push_back(r.status);
      last_err_ += r.err;
      if (r.status == 0) break;
      EXPECT_EQ(r.status, 128 + SIGKILL) << "a worker exited other than by the poison's SIGKILL\n"
                                         << r.err;
    }
    return statuses;
  }

  std::string trace() const {
    std::ifstream in(dir().path() / "trace");
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  std::string jobs_dump() {
    auto conn = open_database(url());
    const Rows r = conn->query(
        "SELECT id, state, attempts, started_ms, last_error, lease_owner FROM keel_jobs"
        " ORDER BY id");
    std::string out;
    for (std::size_t i = 0; i < r.size(); ++i) {
      out += r.text(i, 0) + " " + r.text(i, 1) + " " + r.text(i, 2) + " " +
             (r.cell(i, 3) ? "started" : "-") + " " + (r.cell(i, 4) ? *r.cell(i, 4) : "") + " " +
             (r.cell(i, 5) ? *r.cell(i, 5) : "") + "\n";
    }
    return out;
  }
  std::string last_err_;  // every worker's stderr, for failure messages

  // Drains a queue of `n` jobs with one poison job in the middle of the first batch, workers
  // run one after another with `extra` flags; checks what the crashes charged and returns how
  // many jobs ran more than once.
  int drain_with_a_poison_job(const std::vector<std::string>& extra) {
    const int size = batch();
    const int n = std::max(30, 2 * size + 5);
    const int poison_at = size == 1 ? 7 : size / 2;  // mid-batch: jobs before and after it
    const auto keys = enqueue(n, poison_at, 3);
    const std::vector<int> statuses = run_workers(extra, /*max_runs=*/8);
    EXPECT_FALSE(statuses.empty());
    EXPECT_EQ(statuses.back(), 0) << "the queue never drained; the last worker said:\n"
                                  << last_err_ << "\ntrace:\n"
                                  << trace() << jobs_dump();
    int crashes = 0;
    for (int s : statuses) crashes += s == 128 + SIGKILL ? 1 : 0;
    // Alone (batch 1), the poison job runs once per attempt: three attempts. In a batch, its
    // first crash is charged to no one; its three attempts then run alone.
    EXPECT_EQ(crashes, size == 1 ? 3 : 4) << "the poison job's runs";

    const auto effects = effect_counts();
    int reruns = 0;
    for (int i = 0; i < n; ++i) {
      if (i == poison_at) continue;
      const int runs = effects.count(keys[i]) ? effects.at(keys[i]) : 0;
      EXPECT_GE(runs, 1) << keys[i] << " never ran";
      EXPECT_LE(runs, 2) << keys[i] << " ran more than once per crash of its batch";
      // Only a job that finished before the crash, in the crashed batch, can run twice.
      if (runs > 1) {
        ++reruns;
        EXPECT_LT(i, poison_at) << keys[i] << " ran twice but came after the poison job";
      }
    }
    EXPECT_EQ(effects.count(keys[poison_at]), 0u);
    check_charges(n, keys[poison_at]);
    return reruns;
  }

  // Only the poison job was charged, and it is dead as crashed after its three attempts.
  void check_charges(int n, const std::string& poison_key) {
    // Only the poison job was charged: every other job done on its first attempt.
    EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done' AND attempts = 1"), n - 1);
    EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'dead'"), 1);
    EXPECT_EQ(count("SELECT COUNT(*) FROM keel_job_attempts WHERE outcome = 'lease_expired'"), 3);
    auto conn = open_database(url());
    JobQueue q;
    const auto dead = q.list_dead(*conn, "drill");
    ASSERT_EQ(dead.size(), 1u);
    EXPECT_EQ(dead[0].idempotency_key, poison_key);
    EXPECT_EQ(dead[0].attempts, 3);
    EXPECT_EQ(dead[0].dead_kind, DeadReason::kCrashed);
    EXPECT_NE(dead[0].dead_reason.find("attempts exhausted (3 of 3)"), std::string::npos)
        << dead[0].dead_reason;
    EXPECT_NE(dead[0].dead_reason.find("the worker died while running it"), std::string::npos)
        << dead[0].dead_reason;
    // The batch's crash is counted on each job it returned, the poison job's included.
    if (batch() > 1) {
      EXPECT_EQ(dead[0].crashed_batches, 1);
    }
  }
};

TEST_P(CrashDrillTest, APoisonJobThatKillsItsWorkerChargesOnlyItself) {
  const int reruns = drain_with_a_poison_job({"--concurrency", "1"});
  std::printf("jobs run twice after the batch's crash (flush window 10ms): %d\n", reruns);
  if (batch() == 1) {
    EXPECT_EQ(reruns, 0);
  }
}

TEST_P(CrashDrillTest, WithoutAFlushWindowACrashRerunsNothing) {
  // Each success recorded before the next handler runs: the crash finds nothing unrecorded that
  // had run.
  EXPECT_EQ(drain_with_a_poison_job({"--concurrency", "1", "--flush-window", "0s"}), 0);
}

TEST_P(CrashDrillTest, ACrashLoopingJobIsDeadWithinItsMaxAge) {
  const auto keys = enqueue(batch() + 3, 1, 25);
  // 25 attempts would take minutes of crashes; a max age of 2 s ends them. The lease is 700 ms,
  // so at most a few crashes fit.
  const std::vector<int> statuses = run_workers({"--max-age", "2s"}, /*max_runs=*/12);
  ASSERT_FALSE(statuses.empty());
  EXPECT_EQ(statuses.back(), 0) << "the queue never drained";
  EXPECT_LT(statuses.size(), 12u);
  auto conn = open_database(url());
  JobQueue q;
  const auto dead = q.list_dead(*conn, "drill");
  ASSERT_EQ(dead.size(), 1u);
  EXPECT_EQ(dead[0].idempotency_key, keys[1]);
  EXPECT_NE(dead[0].dead_reason.find("max age 2s reached"), std::string::npos)
      << dead[0].dead_reason;
  EXPECT_NE(dead[0].dead_reason.find("the worker died while running it"), std::string::npos)
      << dead[0].dead_reason;
  // The crashes were spaced by the queue's backoff: each lease_expired attempt scheduled one.
  const Rows h = conn->query(
      "SELECT delay_ms FROM keel_job_attempts WHERE outcome = 'lease_expired' AND job_id = $1"
      " ORDER BY id",
      {dead[0].id});
  ASSERT_GE(h.size(), 1u);
  for (std::size_t i = 0; i + 1 < h.size(); ++i) {
    EXPECT_TRUE(h.cell(i, 0).has_value()) << "a crash made the job ready without a backoff";
  }
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done' AND attempts = 1"),
            batch() + 2);
}

INSTANTIATE_TEST_SUITE_P(
    Backends, CrashDrillTest,
    ::testing::Values(DrillCase{Backend::kSqlite, 1}, DrillCase{Backend::kSqlite, 10},
                      DrillCase{Backend::kSqlite, 100}, DrillCase{Backend::kPostgres, 1},
                      DrillCase{Backend::kPostgres, 10}, DrillCase{Backend::kPostgres, 100}),
    case_name);

}  // namespace
}  // namespace keel::store
