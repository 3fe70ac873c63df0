// JobQueue::enqueue_in and enqueue_many_in on real SQLite files and a real PostgreSQL server: a
// job enqueued in the caller's transaction exists if and only if that transaction commits, with
// the caller's other writes; a rollback leaves no job and no key; misuse is refused as a value.
#include <gtest/gtest.h>

#include <chrono>
#include <future>

#include "keel/db/transaction.hpp"
#include "keel/queue/queue.hpp"
#include "support/test_support.hpp"

namespace keel::store {
namespace {

using namespace std::chrono_literals;

class TransactionalEnqueueTest : public test::BackendTest {
 protected:
  void SetUp() override {
    test::BackendTest::SetUp();
    if (IsSkipped()) return;
    conn_ = open_database(url());
    JobQueue::migrate(*conn_);
    conn_->execute("CREATE TABLE orders (id TEXT PRIMARY KEY, total BIGINT NOT NULL)");
  }

  [[nodiscard]] std::int64_t count(Connection& conn, const std::string& sql) {
    return conn.query(sql).integer(0, 0);
  }
  [[nodiscard]] std::int64_t count(const std::string& sql) { return count(*conn_, sql); }

  ManualClock clock_;
  JobQueue queue_{{.clock = &clock_, .seed = 7}};
  std::unique_ptr<Connection> conn_;
};

TEST_P(TransactionalEnqueueTest, TheJobCommitsWithTheCallersWrites) {
  auto observer = open_database(url());
  EnqueueResult job;
  const TransactionResult r = with_transaction_retry(*conn_, [&](Connection& tx) {
    tx.query("INSERT INTO orders (id, total) VALUES ('o-1', 100)");
    job = queue_.enqueue_in(
        tx, {.queue = "receipts", .payload = R"({"order":"o-1"})", .key = "receipt-o-1"});
    // Not visible to anyone else before the commit.
    EXPECT_EQ(count(*observer, "SELECT COUNT(*) FROM keel_jobs"), 0);
    return job.ok();
  });
  ASSERT_TRUE(r.committed()) << r.error;
  ASSERT_TRUE(job.ok()) << job.error;
  EXPECT_TRUE(job.created);
  EXPECT_EQ(job.idempotency_key, "receipt-o-1");
  EXPECT_EQ(count(*observer, "SELECT COUNT(*) FROM orders"), 1);
  const auto stored = queue_.get(*observer, job.id);
  ASSERT_TRUE(stored);
  EXPECT_EQ(stored->state, JobState::kReady);
  EXPECT_EQ(stored->payload, R"({"order":"o-1"})");
  const auto leased = queue_.lease(*observer, "receipts", "w", 10);
  ASSERT_EQ(leased.size(), 1u);
  EXPECT_EQ(leased[0].idempotency_key, "receipt-o-1");
}

TEST_P(TransactionalEnqueueTest, ARollbackLeavesNoJobAndNoKey) {
  const TransactionResult r = with_transaction_retry(*conn_, [&](Connection& tx) {
    tx.query("INSERT INTO orders (id, total) VALUES ('o-1', 100)");
    const auto job = queue_.enqueue_in(tx, {.queue = "receipts", .payload = "{}", .key = "k-1"});
    EXPECT_TRUE(job.ok() && job.created) << job.error;
    const auto many =
        queue_.enqueue_many_in(tx, {{.queue = "receipts", .payload = "{}", .key = "k-2"},
                                    {.queue = "audit", .payload = "{}", .key = "k-3"}});
    EXPECT_TRUE(many[0].ok() && many[1].ok());
    return false;  // the business transaction gives up
  });
  EXPECT_EQ(r.status, TransactionStatus::kRolledBack);
  EXPECT_EQ(count("SELECT COUNT(*) FROM orders"), 0);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs"), 0);
  // The queues first used in it went too.
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_queues"), 0);
  EXPECT_FALSE(queue_.queue_exists(*conn_, "receipts"));
  // The keys are free: the next enqueue creates the job.
  const auto again = queue_.enqueue(*conn_, {.queue = "receipts", .payload = "{}", .key = "k-1"});
  ASSERT_TRUE(again.ok()) << again.error;
  EXPECT_TRUE(again.created);
  // A database error in the caller's transaction after the enqueue rolls the job back too.
  const TransactionResult failed = with_transaction_retry(*conn_, [&](Connection& tx) {
    EXPECT_TRUE(queue_.enqueue_in(tx, {.queue = "receipts", .payload = "{}", .key = "k-9"}).ok());
    tx.query("INSERT INTO orders (id, total) VALUES ('o-1', NULL)");  // NOT NULL
    return true;
  });
  EXPECT_EQ(failed.status, TransactionStatus::kFailed);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE idem_key = 'k-9'"), 0);
}

TEST_P(TransactionalEnqueueTest, AKeyAlreadyEnqueuedReturnsTheExistingJob) {
  const auto first = queue_.enqueue(*conn_, {.queue = "q", .payload = R"({"n":1})", .key = "k"});
  ASSERT_TRUE(first.ok());
  std::vector<EnqueueResult> many;
  ASSERT_TRUE(with_transaction_retry(*conn_, [&](Connection& tx) {
                many = queue_.enqueue_many_in(tx, {{.queue = "q", .payload = "{}", .key = "k"},
                                                   {.queue = "q", .payload = "{}", .key = "n"},
                                                   {.queue = "q", .payload = "{}", .key = "n"}});
                return true;
              }).committed());
  ASSERT_EQ(many.size(), 3u);
  EXPECT_FALSE(many[0].created);
  EXPECT_EQ(many[0].id, first.id);
  EXPECT_TRUE(many[1].created);
  EXPECT_FALSE(many[2].created);
  EXPECT_EQ(many[2].id, many[1].id);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs"), 2);
  EXPECT_EQ(queue_.get(*conn_, first.id)->payload, R"({"n":1})");
}

TEST_P(TransactionalEnqueueTest, MisuseIsRefusedAndWritesNothing) {
  // enqueue_in needs the caller's transaction.
  const auto outside = queue_.enqueue_in(*conn_, {.queue = "q", .payload = "{}"});
  EXPECT_FALSE(outside.ok());
  EXPECT_NE(outside.error.find("no transaction open"), std::string::npos) << outside.error;
  // enqueue inside a transaction would commit it early (PostgreSQL) or fail (SQLite): refused,
  // and the caller's transaction is left as it was.
  conn_->begin();
  conn_->query("INSERT INTO orders (id, total) VALUES ('o-1', 100)");
  const auto inside = queue_.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  EXPECT_FALSE(inside.ok());
  EXPECT_NE(inside.error.find("enqueue_in"), std::string::npos) << inside.error;
  EXPECT_TRUE(conn_->in_transaction());
  // An invalid request in the transaction writes nothing and leaves the transaction usable.
  const auto invalid = queue_.enqueue_in(*conn_, {.queue = "q", .payload = "not json"});
  EXPECT_FALSE(invalid.ok());
  EXPECT_NE(invalid.error.find("payload"), std::string::npos) << invalid.error;
  conn_->rollback();
  EXPECT_EQ(count("SELECT COUNT(*) FROM orders"), 0);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs"), 0);
}

TEST_P(TransactionalEnqueueTest, AConcurrentEnqueueOfTheSameKeyWaitsForTheFirstTransaction) {
  std::promise<void> enqueued;
  std::promise<void> commit;
  std::shared_future<void> committing = commit.get_future().share();
  auto first = std::async(std::launch::async, [&] {
    auto conn = open_database(url());
    EnqueueResult job;
    const auto r = with_transaction_retry(*conn, [&](Connection& tx) {
      job = queue_.enqueue_in(tx, {.queue = "q", .payload = R"({"from":"first"})", .key = "k"});
      enqueued.set_value();
      committing.wait();
      return true;
    });
    EXPECT_TRUE(r.committed()) << r.error;
    return job;
  });
  enqueued.get_future().wait();
  auto second = std::async(std::launch::async, [&] {
    auto conn = open_database(url());
    EnqueueResult job;
    const auto r = with_transaction_retry(*conn, [&](Connection& tx) {
      job = queue_.enqueue_in(tx, {.queue = "q", .payload = R"({"from":"second"})", .key = "k"});
      return true;
    });
    EXPECT_TRUE(r.committed()) << r.error;
    return job;
  });
  EXPECT_EQ(second.wait_for(200ms), std::future_status::timeout);
  commit.set_value();
  const EnqueueResult a = first.get();
  const EnqueueResult b = second.get();
  EXPECT_TRUE(a.created);
  EXPECT_FALSE(b.created);
  EXPECT_EQ(a.id, b.id);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs"), 1);
  EXPECT_EQ(queue_.get(*conn_, a.id)->payload, R"({"from":"first"})");
}

INSTANTIATE_TEST_SUITE_P(Backends, TransactionalEnqueueTest,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

}  // namespace
}  // namespace keel::store
