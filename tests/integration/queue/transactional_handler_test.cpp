// Transactional job handlers on real SQLite files and a real PostgreSQL server: JobQueue::
// complete_in records a success in the caller's transaction, fenced there; a Worker with a
// TransactionalJobHandler commits each job's writes with its completion, rolls a failure's
// writes back, and writes each job's effect once with several threads.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>

#include "keel/queue/queue.hpp"
#include "keel/queue/queue_worker.hpp"
#include "support/test_support.hpp"

namespace keel::store {
namespace {

using namespace std::chrono_literals;

class TransactionalHandlerTest : public test::BackendTest {
 protected:
  void SetUp() override {
    test::BackendTest::SetUp();
    if (IsSkipped()) return;
    conn_ = open_database(url());
    JobQueue::migrate(*conn_);
    conn_->execute("CREATE TABLE ledger (job BIGINT NOT NULL, attempt INTEGER NOT NULL)");
  }

  [[nodiscard]] std::int64_t count(const std::string& sql) {
    return conn_->query(sql).integer(0, 0);
  }

  std::unique_ptr<Connection> conn_;
};

TEST_P(TransactionalHandlerTest, CompleteInCommitsTheSuccessWithTheCallersWrites) {
  ManualClock clock;
  JobQueue queue({.backoff = {.base = 1s, .cap = 1s}, .clock = &clock, .seed = 5});
  const auto job = queue.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  auto leased = queue.lease(*conn_, "q", "w", 1);
  ASSERT_EQ(leased.size(), 1u);
  // Rolled back: neither the write nor the success.
  conn_->begin();
  conn_->query("INSERT INTO ledger (job, attempt) VALUES ($1, 1)", {job.id});
  EXPECT_TRUE(queue.complete_in(*conn_, job.id, leased[0].fence));
  conn_->rollback();
  EXPECT_EQ(queue.get(*conn_, job.id)->state, JobState::kRunning);
  EXPECT_EQ(count("SELECT COUNT(*) FROM ledger"), 0);
  // Committed: both.
  conn_->begin();
  conn_->query("INSERT INTO ledger (job, attempt) VALUES ($1, 1)", {job.id});
  EXPECT_TRUE(queue.complete_in(*conn_, job.id, leased[0].fence));
  conn_->commit();
  const auto done = queue.get(*conn_, job.id);
  EXPECT_EQ(done->state, JobState::kDone);
  EXPECT_EQ(done->attempts, 1);
  EXPECT_EQ(done->history.back().outcome, "success");
  EXPECT_EQ(count("SELECT COUNT(*) FROM ledger"), 1);
  EXPECT_THROW((void)queue.complete_in(*conn_, job.id, leased[0].fence), std::invalid_argument);
}

TEST_P(TransactionalHandlerTest, CompleteInWithALostLeaseRecordsNothing) {
  ManualClock clock;
  JobQueue queue({.backoff = {.base = 1s, .cap = 1s}, .clock = &clock, .seed = 5});
  const auto job = queue.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  const auto first = queue.lease(*conn_, "q", "w1", 1);
  ASSERT_EQ(first.size(), 1u);
  // The lease is given back (charged) and taken by another worker: a new fence.
  ASSERT_TRUE(queue.release(*conn_, job.id, first[0].fence, "shutdown"));
  clock.advance(1h);
  const auto second = queue.lease(*conn_, "q", "w2", 1);
  ASSERT_EQ(second.size(), 1u);
  ASSERT_NE(second[0].fence, first[0].fence);
  conn_->begin();
  EXPECT_FALSE(queue.complete_in(*conn_, job.id, first[0].fence));
  conn_->rollback();
  EXPECT_EQ(queue.get(*conn_, job.id)->state, JobState::kRunning);
  conn_->begin();
  EXPECT_TRUE(queue.complete_in(*conn_, job.id, second[0].fence));
  conn_->commit();
  EXPECT_EQ(queue.get(*conn_, job.id)->state, JobState::kDone);
}

TEST_P(TransactionalHandlerTest, AWorkersHandlerWritesCommitWithTheJobOnce) {
  JobQueue queue({.backoff = {.base = 1ms, .cap = 5ms}, .seed = 9});
  constexpr int kJobs = 60;
  std::vector<EnqueueRequest> requests;
  for (int i = 0; i < kJobs; ++i) {
    requests.push_back({.queue = "ledger", .payload = "{\"n\":" + std::to_string(i) + "}"});
  }
  ASSERT_TRUE(queue.enqueue_many(*conn_, requests).front().ok());
  // A poison job: its handler writes, then throws.
  const auto poison = queue.enqueue(*conn_, {.queue = "ledger", .payload = R"({"poison":true})"});
  ConnectionPool pool(url(), {.max_connections = 6});
  std::atomic<int> stale{0};
  std::atomic<int> done{0};
  Worker worker(
      pool, queue,
      {.queue = "ledger",
       .concurrency = 4,
       .poll_interval = 5ms,
       .exit_when_idle = true,
       .on_event =
           [&](const WorkerEvent& e) {
             if (e.result.status == CompleteStatus::kStale) stale.fetch_add(1);
             if (e.result.status == CompleteStatus::kDone) done.fetch_add(1);
           },
       .log = [](std::string_view) {}},
      [&](Connection& tx, const LeasedJob& job, const std::atomic<bool>&) {
        tx.query("INSERT INTO ledger (job, attempt) VALUES ($1, $2)", {job.id, job.attempt});
        if (job.payload == R"({"poison":true})") throw std::runtime_error("poison");
        // Every job's first attempt fails after its write: the write is rolled back.
        if (job.attempt == 1) return AttemptReport{.outcome = Outcome::transient()};
        return AttemptReport::success();
      });
  EXPECT_EQ(worker.run(), 2 * kJobs + 1);
  EXPECT_EQ(stale.load(), 0);
  EXPECT_EQ(done.load(), kJobs);
  EXPECT_EQ(count("SELECT COUNT(*) FROM ledger"), kJobs);
  EXPECT_EQ(count("SELECT COUNT(DISTINCT job) FROM ledger"), kJobs);
  EXPECT_EQ(count("SELECT COUNT(*) FROM ledger WHERE attempt <> 2"), 0);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'"), kJobs);
  const auto dead = queue.get(*conn_, poison.id);
  EXPECT_EQ(dead->state, JobState::kDead);
  EXPECT_NE(dead->dead_reason.find("poison"), std::string::npos) << dead->dead_reason;
}

TEST_P(TransactionalHandlerTest, AnEmptyHandlerIsRefused) {
  JobQueue queue;
  ConnectionPool pool(url(), {.max_connections = 2});
  EXPECT_THROW(Worker(pool, queue, {.queue = "q"}, TransactionalJobHandler()),
               std::invalid_argument);
}

INSTANTIATE_TEST_SUITE_P(Backends, TransactionalHandlerTest,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

}  // namespace
}  // namespace keel::store
