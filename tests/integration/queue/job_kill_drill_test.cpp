// The SIGKILL drill for transactional job handlers: a worker process (job_kill_helper.cpp) runs
// a queue of 300 jobs whose handler inserts one row per job into `effects` (no unique
// constraint: a second insert for a job would stay) and kills its own process with SIGKILL
// right after the insert, before the completion, at seeded random attempts (about one in ten).
// The test restarts it until the queue is drained: every job is done with exactly one row, on
// SQLite and on PostgreSQL. The control runs a plain JobHandler under the same kills: each kill
// leaves a row behind, so the jobs killed have two rows or more.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "keel/queue/queue.hpp"
#include "support/test_support.hpp"

extern char** environ;

namespace keel::store {
namespace {

using namespace std::chrono_literals;

constexpr int kJobs = 300;
constexpr int kKillPercent = 10;
constexpr int kMaxRuns = 300;

struct Drill {
  int runs = 0;
  int kills = 0;
  int last_status = -1;  // the last run's exit status; -1 killed, -2 not started, -3 timed out
};

// Runs the helper to its end (at most 60 s). Returns its exit status, -1 when it was killed by
// SIGKILL (its own), -2 when it did not start, -3 when it hung, -4 for another signal.
int run_helper(const std::vector<std::string>& args) {
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) return -2;
  const auto until = std::chrono::steady_clock::now() + 60s;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) != pid) {
    if (std::chrono::steady_clock::now() > until) {
      ::kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -3;
    }
    std::this_thread::sleep_for(1ms);
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) return -1;
  return -4;
}

class JobKillDrillTest : public test::BackendTest {
 protected:
  void SetUp() override {
    test::BackendTest::SetUp();
    if (IsSkipped()) return;
    conn_ = open_database(url());
    JobQueue::migrate(*conn_);
    // Deliberately no key: a job's second row must be possible, so that the count can fail.
    conn_->execute("CREATE TABLE effects (job BIGINT NOT NULL, attempt INTEGER NOT NULL)");
    std::vector<EnqueueRequest> requests;
    for (int i = 0; i < kJobs; ++i) {
      requests.push_back({.queue = "drill", .payload = "{\"n\":" + std::to_string(i) + "}"});
    }
    const JobQueue queue;
    ASSERT_TRUE(queue.enqueue_many(*conn_, requests).front().ok());
  }

  // Runs the helper in `mode` again and again until it exits on an idle queue.
  Drill drain(const std::string& mode) {
    Drill d;
    const std::string seed = GetParam() == Backend::kSqlite ? "11" : "12";
    while (d.runs < kMaxRuns) {
      ++d.runs;
      d.last_status =
          run_helper({KEEL_JOB_KILL_HELPER, url_text(), mode, seed, std::to_string(kKillPercent)});
      if (d.last_status != -1) break;
      ++d.kills;
    }
    return d;
  }

  [[nodiscard]] std::int64_t count(const std::string& sql) {
    return conn_->query(sql).integer(0, 0);
  }

  std::unique_ptr<Connection> conn_;
};

TEST_P(JobKillDrillTest, TransactionalHandlerWritesOneRowPerJobThroughKills) {
  const auto start = std::chrono::steady_clock::now();
  const Drill d = drain("tx");
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - start);
  ASSERT_EQ(d.last_status, 0) << "after " << d.runs << " runs";
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE queue = 'drill' AND state = 'done'"),
            kJobs);
  EXPECT_EQ(count("SELECT COUNT(*) FROM effects"), kJobs);
  EXPECT_EQ(count("SELECT COUNT(DISTINCT job) FROM effects"), kJobs);
  EXPECT_EQ(count("SELECT COUNT(*) FROM (SELECT job FROM effects GROUP BY job"
                  " HAVING COUNT(*) > 1) AS twice"),
            0);
  // Each row is the one of the attempt that completed the job.
  EXPECT_EQ(count("SELECT COUNT(*) FROM effects e JOIN keel_jobs j ON j.id = e.job"
                  " WHERE j.attempts = e.attempt"),
            kJobs);
  // Each kill was charged as an attempt to the job it killed when that job ran alone (a suspect:
  // its start committed), or returned its batch uncharged, each job of it counted; nothing was
  // charged that no kill caused.
  const std::int64_t retried = count("SELECT COUNT(*) FROM keel_jobs WHERE attempts > 1");
  EXPECT_GE(d.kills, 10);
  const std::int64_t charged =
      count("SELECT SUM(attempts) FROM keel_jobs WHERE queue = 'drill'") - kJobs;
  EXPECT_LE(charged, d.kills);
  EXPECT_GE(charged + count("SELECT SUM(crashed_batches) FROM keel_jobs WHERE queue = 'drill'"),
            d.kills);
  std::printf(
      "job kill drill (%s, transactional): %d jobs, %d runs, %d SIGKILLs, %lld jobs run "
      "again, %lld effect rows, %lld ms\n",
      std::string(to_string(GetParam())).c_str(), kJobs, d.runs, d.kills,
      static_cast<long long>(retried),
      static_cast<long long>(count("SELECT COUNT(*) FROM effects")),
      static_cast<long long>(took.count()));
}

// The control: the same kills with a plain handler, whose insert commits on its own before the
// job completes. Every kill leaves its row behind and the job's next attempt adds another.
TEST_P(JobKillDrillTest, PlainHandlerDuplicatesRowsUnderTheSameKills) {
  const Drill d = drain("plain");
  ASSERT_EQ(d.last_status, 0) << "after " << d.runs << " runs";
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE queue = 'drill' AND state = 'done'"),
            kJobs);
  const std::int64_t rows = count("SELECT COUNT(*) FROM effects");
  const std::int64_t twice = count(
      "SELECT COUNT(*) FROM (SELECT job FROM effects GROUP BY job HAVING COUNT(*) > 1) AS twice");
  EXPECT_GE(d.kills, 10);
  EXPECT_EQ(count("SELECT COUNT(DISTINCT job) FROM effects"), kJobs);
  EXPECT_GE(rows, kJobs + d.kills);
  EXPECT_GT(twice, 0);
  std::printf(
      "job kill drill (%s, plain control): %d jobs, %d runs, %d SIGKILLs, %lld effect "
      "rows, %lld jobs with two rows or more\n",
      std::string(to_string(GetParam())).c_str(), kJobs, d.runs, d.kills,
      static_cast<long long>(rows), static_cast<long long>(twice));
}

INSTANTIATE_TEST_SUITE_P(Backends, JobKillDrillTest,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

}  // namespace
}  // namespace keel::store
