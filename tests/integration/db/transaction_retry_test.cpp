// with_transaction_retry against real databases: serialization failures provoked under
// SERIALIZABLE on PostgreSQL, SQLITE_BUSY on SQLite, and a connection lost at COMMIT.
#include <gtest/gtest.h>

#include <barrier>
#include <thread>

#include "keel/db/transaction.hpp"
#include "support/test_support.hpp"

namespace keel::store {
namespace {

using namespace std::chrono_literals;

const RetryPolicy& patient_policy() {
  static const RetryPolicy policy({.max_attempts = 50, .backoff = {.base = 1ms, .cap = 20ms}});
  return policy;
}

// Moves `amount` from one account to another if the balance allows: read, check, write.
bool transfer(Connection& tx, int from, int to, int amount) {
  const std::int64_t balance =
      tx.query("SELECT balance FROM accounts WHERE id = $1", {from}).integer(0, 0);
  if (balance < amount) return false;
  tx.query("UPDATE accounts SET balance = balance - $1 WHERE id = $2", {amount, from});
  tx.query("UPDATE accounts SET balance = balance + $1 WHERE id = $2", {amount, to});
  return true;
}

class TransactionRetry : public test::BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped()) return;
    auto conn = open_database(url());
    conn->execute("CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance BIGINT NOT NULL)");
    conn->execute("INSERT INTO accounts (id, balance) VALUES (1, 1000), (2, 1000)");
  }
};

TEST_P(TransactionRetry, ConcurrentTransfersAreRetriedAndBalancesStayConsistent) {
  constexpr int kTransfers = 25;
  std::atomic<int> attempts{0};
  std::atomic<int> committed{0};
  std::atomic<int> conflicts{0};
  // Both threads read their first balance before either writes: under SERIALIZABLE one of the
  // two first transactions must fail with 40001 (on SQLite the write lock serialises them).
  std::barrier first_read(2);
  auto worker = [&](int from, int to) {
    auto conn = open_database(url(), {.busy_timeout = 2ms});
    for (int i = 0; i < kTransfers; ++i) {
      bool arrived = false;
      const TransactionResult r = with_transaction_retry(
          *conn,
          [&](Connection& tx) {
            if (i == 0 && !arrived && GetParam() == Backend::kPostgres) {
              (void)tx.query("SELECT balance FROM accounts WHERE id = $1", {from});
              arrived = true;
              first_read.arrive_and_wait();
            }
            return transfer(tx, from, to, 10);
          },
          patient_policy(), Isolation::kSerializable);
      attempts += r.attempts;
      if (r.attempts > 1) ++conflicts;
      if (r.committed()) ++committed;
      EXPECT_TRUE(r.committed()) << to_string(r.status) << ": " << r.error;
      if (!arrived && i == 0 && GetParam() == Backend::kPostgres) first_read.arrive_and_wait();
    }
  };
  std::thread a(worker, 1, 2);
  std::thread b(worker, 2, 1);
  a.join();
  b.join();
  EXPECT_EQ(committed.load(), 2 * kTransfers);
  if (GetParam() == Backend::kPostgres) {
    EXPECT_GE(conflicts.load(), 1) << "no serialization failure was provoked";
  }
  auto conn = open_database(url());
  const Rows rows = conn->query("SELECT id, balance FROM accounts ORDER BY id");
  EXPECT_EQ(rows.integer(0, 1), 1000);  // equal traffic both ways
  EXPECT_EQ(rows.integer(1, 1), 1000);
}

TEST_P(TransactionRetry, FalseRollsBackWithoutRetrying) {
  auto conn = open_database(url());
  const TransactionResult r = with_transaction_retry(*conn, [](Connection& tx) {
    tx.query("UPDATE accounts SET balance = 0");
    return false;
  });
  EXPECT_EQ(r.status, TransactionStatus::kRolledBack);
  EXPECT_EQ(r.attempts, 1);
  EXPECT_EQ(conn->query("SELECT SUM(balance) FROM accounts").integer(0, 0), 2000);
}

TEST_P(TransactionRetry, PermanentErrorIsNotRetried) {
  auto conn = open_database(url());
  const TransactionResult r = with_transaction_retry(*conn, [](Connection& tx) {
    tx.query("INSERT INTO accounts (id, balance) VALUES ($1, $2)", {1, 5});  // duplicate id
    return true;
  });
  EXPECT_EQ(r.status, TransactionStatus::kFailed);
  EXPECT_EQ(r.attempts, 1);
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kPermanent);
  EXPECT_FALSE(conn->in_transaction());
}

// What the database says when a transaction lost a race: retried by with_transaction_retry.
DatabaseError lost_race(Backend backend) {
  DatabaseError::Details details{.backend = backend};
  if (backend == Backend::kPostgres) {
    details.sqlstate = "40001";  // serialization_failure
  } else {
    details.sqlite_code = 5;  // SQLITE_BUSY
  }
  return DatabaseError("lost a race", details);
}

TEST_P(TransactionRetry, ADeadlineThatHasPassedRunsNothingAndSaysSo) {
  auto conn = open_database(url());
  ManualClock clock;
  int runs = 0;
  const TransactionResult r =
      with_transaction_retry(*conn,
                             [&](Connection& tx) {
                               ++runs;
                               tx.query("UPDATE accounts SET balance = 0");
                               return true;
                             },
                             default_transaction_retry_policy(), Isolation::kReadCommitted,
                             {.clock = &clock, .ceiling = Deadline::at(clock.now())});
  EXPECT_EQ(runs, 0);
  EXPECT_EQ(r.status, TransactionStatus::kFailed) << "not committed: nothing ran";
  EXPECT_EQ(r.attempts, 0);
  EXPECT_FALSE(r.outcome.attempted());
  EXPECT_NE(r.error.find("deadline"), std::string::npos) << r.error;
  EXPECT_FALSE(conn->in_transaction());
  EXPECT_EQ(conn->query("SELECT SUM(balance) FROM accounts").integer(0, 0), 2000);
}

TEST_P(TransactionRetry, TheCeilingStopsTheRetriesOfALostRace) {
  auto conn = open_database(url());
  ManualClock clock;
  int runs = 0;
  // Each transaction takes 300 ms and loses its race; 500 ms are left.
  const TransactionResult r =
      with_transaction_retry(*conn,
                             [&](Connection&) -> bool {
                               ++runs;
                               clock.advance(300ms);
                               throw lost_race(GetParam());
                             },
                             default_transaction_retry_policy(), Isolation::kReadCommitted,
                             {.clock = &clock, .ceiling = Deadline::at(clock.now() + 500ms)});
  EXPECT_EQ(runs, 2) << "the policy allows 5; the deadline passed during the second";
  EXPECT_EQ(r.attempts, 2);
  EXPECT_EQ(r.status, TransactionStatus::kFailed);
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kTransient);
}

// A transaction the caller opened is never committed or ended by keel: BEGIN inside it, and so
// with_transaction_retry, refuse before sending anything, and the caller's rollback holds.
TEST_P(TransactionRetry, InsideTheCallersTransactionItRefusesAndTheCallersRollbackHolds) {
  auto conn = open_database(url());
  conn->begin();
  conn->query("UPDATE accounts SET balance = 0 WHERE id = 1");
  int runs = 0;
  EXPECT_THROW((void)with_transaction_retry(*conn,
                                            [&](Connection& tx) {
                                              ++runs;
                                              tx.query("UPDATE accounts SET balance = 1");
                                              return true;
                                            }),
               std::logic_error);
  EXPECT_THROW(conn->begin(), std::logic_error);
  EXPECT_THROW((void)conn->query_then_begin("SELECT 1", {}), std::logic_error);
  const Statement one{"SELECT 1", {}};
  EXPECT_THROW((void)conn->begin_then_query(Isolation::kReadCommitted, {&one, 1}),
               std::logic_error);
  EXPECT_EQ(runs, 0);
  EXPECT_TRUE(conn->in_transaction()) << "the caller's transaction is still open";
  conn->rollback();
  EXPECT_EQ(conn->query("SELECT SUM(balance) FROM accounts").integer(0, 0), 2000)
      << "the caller's rollback rolled its update back";
}

TEST_P(TransactionRetry, OtherExceptionsRollBackAndPropagate) {
  auto conn = open_database(url());
  EXPECT_THROW((void)with_transaction_retry(*conn,
                                            [](Connection& tx) -> bool {
                                              tx.query("UPDATE accounts SET balance = 0");
                                              throw std::logic_error("handler bug");
                                            }),
               std::logic_error);
  EXPECT_FALSE(conn->in_transaction());
  EXPECT_EQ(conn->query("SELECT SUM(balance) FROM accounts").integer(0, 0), 2000);
}

TEST(TransactionRetrySqlite, BusyDatabaseIsRetriedUntilTheWriterLetsGo) {
  test::TempDir dir;
  auto url = parse_database_url("sqlite:" + (dir.path() / "busy.db").string()).value();
  auto holder = open_database(url);
  holder->execute("CREATE TABLE t (id INTEGER)");
  holder->begin();
  holder->query("INSERT INTO t (id) VALUES ($1)", {1});
  // The holder lets go only after the writer has met SQLITE_BUSY and decided to retry.
  std::atomic<int> retries{0};
  RetryOptions options{.max_attempts = 1000, .backoff = {.base = 1ms, .cap = 5ms}};
  options.on_retry = [&](const RetryEvent& e) {
    EXPECT_EQ(e.outcome.kind, OutcomeKind::kTransient);
    ++retries;
  };
  const RetryPolicy policy(options);
  std::thread releaser([&] {
    while (retries.load() == 0) std::this_thread::yield();
    holder->commit();
  });
  auto writer = open_database(url, {.busy_timeout = 1ms});
  const TransactionResult r = with_transaction_retry(
      *writer,
      [](Connection& tx) {
        tx.query("INSERT INTO t (id) VALUES ($1)", {2});
        return true;
      },
      policy);
  releaser.join();
  EXPECT_TRUE(r.committed()) << r.error;
  EXPECT_GT(r.attempts, 1);
  EXPECT_EQ(writer->query("SELECT COUNT(*) FROM t").integer(0, 0), 2);
}

TEST(TransactionRetryPostgres, ConnectionLostAtCommitIsInDoubtAndNotRetried) {
  const auto url_text = test::postgres_url();
  if (!url_text) GTEST_SKIP() << "no PostgreSQL test server (run through ctest)";
  const auto url = parse_database_url(*url_text).value();
  auto conn = open_database(url);
  conn->execute("CREATE TABLE t (id INTEGER)");
  auto admin = open_database(url);
  const TransactionResult r = with_transaction_retry(*conn, [&](Connection& tx) {
    tx.query("INSERT INTO t (id) VALUES ($1)", {1});
    const std::string pid = tx.query("SELECT pg_backend_pid()").text(0, 0);
    admin->query("SELECT pg_terminate_backend($1::int)", {pid});
    return true;  // COMMIT now meets a dead connection
  });
  EXPECT_EQ(r.status, TransactionStatus::kCommitInDoubt) << r.error;
  EXPECT_EQ(r.attempts, 1);
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kAmbiguous);
  EXPECT_TRUE(conn->broken());
}

INSTANTIATE_TEST_SUITE_P(Backends, TransactionRetry,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

}  // namespace
}  // namespace keel::store
