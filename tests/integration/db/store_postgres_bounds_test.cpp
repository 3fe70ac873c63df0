// keel::store's PostgreSQL connection at the edges a production server has: a backend the server
// terminated while it sat in the pool, a backend that froze (SIGSTOP), a session on a node that
// stopped taking writes, a lock held by another session, a transaction pooler that does not keep
// named statements or session settings. Every wait ends within its bound, and no connection that
// cannot serve is lent again. On the test server of the ctest fixture `postgres`.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/types.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "build_kind.hpp"
#include "keel/db/database.hpp"
#include "keel/db/transaction.hpp"
#include "support/test_support.hpp"

namespace keel::store {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

class PostgresBounds : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto url = test::postgres_url();
    if (!url) GTEST_SKIP() << "no PostgreSQL test server (run through ctest)";
    url_ = *url;
    admin_ = open_database(parse_database_url(url_).value());
    admin_->execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)");
  }

  void TearDown() override {
    for (const int pid : stopped_) ::kill(pid, SIGCONT);
  }

  [[nodiscard]] DatabaseUrl url(std::string_view extra = {}) const {
    std::string text = url_;
    if (!extra.empty())
      text += std::string(text.find('?') == std::string::npos ? "?" : "&") += extra;
    return parse_database_url(text).value();
  }

  static int backend_pid(Connection& conn) {
    return static_cast<int>(conn.query("SELECT pg_backend_pid()").integer(0, 0));
  }

  // Freezes one server process (as a frozen primary is frozen); thawed in TearDown.
  void freeze(int pid) {
    ASSERT_EQ(::kill(pid, SIGSTOP), 0);
    stopped_.push_back(pid);
  }

  std::string url_;
  std::unique_ptr<Connection> admin_;
  std::vector<int> stopped_;
};

// pg_terminate_backend on every idle connection of a pool (what a DBA, a failover or a restart
// does): the pool notices each on its socket when it lends it and opens a fresh one, so no client
// meets an error.
TEST_F(PostgresBounds, BackendsTerminatedWhileIdleInThePoolCostNoClientAnError) {
  ConnectionPool pool(url(), {.max_connections = 8});
  std::vector<int> pids;
  {
    std::vector<ConnectionPool::Lease> all;
    for (int i = 0; i < 8; ++i) {
      all.push_back(pool.acquire());
      pids.push_back(backend_pid(*all.back()));
    }
  }
  for (const int pid : pids) {
    EXPECT_TRUE(admin_->query("SELECT pg_terminate_backend($1)", {pid}).text(0, 0) == "t");
  }
  std::this_thread::sleep_for(100ms);  // the terminations reach the sockets (no time in keel)
  int failures = 0;
  std::vector<int> fresh;
  for (int i = 0; i < 24; ++i) {
    try {
      auto conn = pool.acquire();
      fresh.push_back(backend_pid(*conn));
    } catch (const DatabaseError& e) {
      ++failures;
      ADD_FAILURE() << e.what();
    }
  }
  EXPECT_EQ(failures, 0);
  for (const int pid : fresh) {
    EXPECT_EQ(std::count(pids.begin(), pids.end(), pid), 0) << "a terminated backend was lent";
  }
}

// A frozen server answers nothing: the statement's bound (statement_timeout, plus half a second
// for the answer) ends the wait, the connection is closed, and the failure says the database is
// unavailable, or, for COMMIT, that the commit is in doubt.
TEST_F(PostgresBounds, AFrozenBackendCostsAStatementItsBoundThenTheConnectionIsClosed) {
  auto conn = open_database(url(), {.statement_timeout = 300ms});
  freeze(backend_pid(*conn));
  const auto start = Clock::now();
  try {
    (void)conn->query("SELECT 1");
    ADD_FAILURE() << "a frozen backend answered";
  } catch (const DatabaseError& e) {
    EXPECT_EQ(e.failure(), DatabaseFailure::kUnavailable) << e.what();
    EXPECT_TRUE(e.details().connection_lost);
    EXPECT_NE(std::string(e.what()).find("no answer"), std::string::npos) << e.what();
  }
  const auto took = Clock::now() - start;
  EXPECT_TRUE(conn->broken());
  if (test::kTimingAsserted) {
    EXPECT_GE(took, 700ms);
    EXPECT_LT(took, 1500ms) << "300 ms statement bound + 500 ms for the answer";
  }

  auto committing = open_database(url(), {.statement_timeout = 300ms});
  committing->begin();
  committing->query("INSERT INTO t (id, v) VALUES (1, 'in doubt')");
  freeze(backend_pid(*committing));
  try {
    committing->commit();
    ADD_FAILURE() << "a frozen backend committed";
  } catch (const DatabaseError& e) {
    EXPECT_EQ(e.failure(), DatabaseFailure::kInDoubt) << e.what();
    EXPECT_TRUE(e.details().during_commit);
  }
  EXPECT_TRUE(committing->broken());
}

// A session on a node that stopped taking writes (a standby, a demoted primary: here the session
// itself made read-only, which PostgreSQL reports as the same 25006) is never lent again: the
// pool's next connection is a new session, where the write works.
TEST_F(PostgresBounds, ASessionThatCannotWriteIsNotReturnedToThePool) {
  ConnectionPool pool(url(), {.max_connections = 1});
  int demoted = 0;
  {
    auto conn = pool.acquire();
    demoted = backend_pid(*conn);
    conn->execute("SET default_transaction_read_only = on");
    try {
      conn->query("INSERT INTO t (id, v) VALUES (2, 'x')");
      ADD_FAILURE() << "wrote on a read-only session";
    } catch (const DatabaseError& e) {
      EXPECT_EQ(e.failure(), DatabaseFailure::kWrongNode) << e.what();
      EXPECT_EQ(e.outcome().kind, OutcomeKind::kTransient);
    }
    EXPECT_TRUE(conn->broken());
  }
  auto next = pool.acquire();
  EXPECT_NE(backend_pid(*next), demoted);
  next->query("INSERT INTO t (id, v) VALUES (2, 'x')");
  EXPECT_EQ(admin_->query("SELECT COUNT(*) FROM t").integer(0, 0), 1);
}

// A lock another session holds is waited for at most the lock timeout (busy_timeout), or the
// connection's deadline when that is earlier; the failure is busy, and the session is kept.
TEST_F(PostgresBounds, ALockWaitEndsAtTheLockTimeoutOrTheDeadline) {
  admin_->begin();
  admin_->query("LOCK TABLE t IN EXCLUSIVE MODE");
  auto conn = open_database(url(), {.busy_timeout = 300ms});
  const auto timed_insert = [&](int id) {
    const auto start = Clock::now();
    try {
      conn->query("INSERT INTO t (id, v) VALUES ($1, 'x')", {id});
      ADD_FAILURE() << "the insert went through a held lock";
    } catch (const DatabaseError& e) {
      EXPECT_EQ(e.failure(), DatabaseFailure::kBusy) << e.what();
    }
    return Clock::now() - start;
  };
  const auto by_timeout = timed_insert(3);
  conn->set_deadline(Deadline::after(steady_clock(), 100ms));
  const auto by_deadline = timed_insert(4);
  conn->set_deadline(Deadline::infinite());
  EXPECT_FALSE(conn->broken());
  admin_->rollback();
  conn->query("INSERT INTO t (id, v) VALUES (5, 'x')");
  if (test::kTimingAsserted) {
    EXPECT_GE(by_timeout, 250ms);
    EXPECT_LT(by_timeout, 1000ms);
    EXPECT_LT(by_deadline, 250ms) << "the 100 ms deadline comes before the 300 ms lock timeout";
  }
}

// keel_pooler=transaction: no named statement is prepared on the session, and the timeouts are
// set inside each transaction, so that nothing of keel's outlives it on a server session that a
// pooler hands to the next client.
TEST_F(PostgresBounds, BehindATransactionPoolerNothingOutlivesTheTransaction) {
  const DatabaseUrl pooled = url("keel_pooler=transaction");
  EXPECT_TRUE(pooled.transaction_pooler);
  EXPECT_EQ(pooled.target.find("keel_pooler"), std::string::npos) << "not passed to libpq";
  auto conn = open_database(pooled, {.busy_timeout = 1500ms, .statement_timeout = 2500ms});
  conn->query("INSERT INTO t (id, v) VALUES ($1, $2)", {6, "pooled"});
  conn->begin();
  EXPECT_EQ(conn->query("SHOW lock_timeout").text(0, 0), "1500ms");
  EXPECT_EQ(conn->query("SHOW statement_timeout").text(0, 0), "2500ms");
  conn->commit();
  EXPECT_EQ(conn->query("SELECT COUNT(*) FROM pg_prepared_statements").integer(0, 0), 0);
  // A direct session carries the timeouts from its start instead (they end with it), and
  // prepares its statements once.
  auto direct = open_database(url(), {.busy_timeout = 1500ms});
  EXPECT_EQ(direct->query("SHOW lock_timeout").text(0, 0), "1500ms");
  EXPECT_GT(direct->query("SELECT COUNT(*) FROM pg_prepared_statements").integer(0, 0), 0);
}

// The exchanges that send several statements in one pipeline keep their results in order when
// the bounds' set_config goes with them: behind a pooler (every transaction) and directly with a
// deadline tighter than the session's timeouts.
TEST_F(PostgresBounds, EveryPipelinedExchangeCarriesItsBoundsInOrder) {
  for (const bool pooled : {true, false}) {
    SCOPED_TRACE(pooled ? "keel_pooler=transaction" : "direct, with a deadline");
    auto conn = open_database(url(pooled ? "keel_pooler=transaction" : ""),
                              {.busy_timeout = 4000ms, .statement_timeout = 4000ms});
    if (!pooled) conn->set_deadline(Deadline::after(steady_clock(), 2000ms));
    admin_->execute("DELETE FROM t");
    // A statement, then BEGIN: two implicit transactions, two bounds.
    const Rows first = conn->query_then_begin("INSERT INTO t (id, v) VALUES (10, 'a') RETURNING id",
                                              std::vector<Value>{});
    EXPECT_EQ(first.integer(0, 0), 10);
    ASSERT_TRUE(conn->in_transaction());
    const std::string in_tx = conn->query("SHOW statement_timeout").text(0, 0);
    EXPECT_EQ(in_tx, pooled ? "4s" : conn->query("SHOW statement_timeout").text(0, 0));
    if (!pooled) {
      EXPECT_NE(in_tx, "4s") << "the deadline, tighter than the session's 4 s, was sent";
    }
    // The last statement with COMMIT.
    const Rows last = conn->query_then_commit("INSERT INTO t (id, v) VALUES (11, 'b') RETURNING v",
                                              std::vector<Value>{});
    EXPECT_EQ(last.text(0, 0), "b");
    EXPECT_FALSE(conn->in_transaction());
    // BEGIN and statements together.
    const Value id = 12;
    const Statement statements[] = {
        {"INSERT INTO t (id, v) VALUES ($1, 'c')", {&id, 1}},
        {"SELECT COUNT(*) FROM t", {}},
    };
    const std::vector<Rows> rows = conn->begin_then_query(Isolation::kReadCommitted, statements);
    ASSERT_EQ(rows.size(), 2u);
    EXPECT_EQ(rows[1].integer(0, 0), 3);
    conn->commit();
    EXPECT_EQ(admin_->query("SELECT COUNT(*) FROM t").integer(0, 0), 3);
    EXPECT_FALSE(conn->broken());
  }
}

TEST(PostgresUrl, KeelsPoolerParameterIsReadAndRemovedAndBadValuesAreRefused) {
  const auto url = parse_database_url(
      "postgresql://u:pw@h1:5432,h2:5433/db?keel_pooler=transaction&sslmode=disable");
  ASSERT_TRUE(url);
  EXPECT_TRUE(url->transaction_pooler);
  EXPECT_EQ(url->target, "postgresql://u:pw@h1:5432,h2:5433/db?sslmode=disable");
  EXPECT_EQ(url->redacted.find("pw"), std::string::npos) << url->redacted;
  EXPECT_FALSE(parse_database_url("postgresql://h/db?keel_pooler=session")->transaction_pooler);
  const auto bad = parse_database_url("postgresql://h/db?keel_pooler=yes");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message().find("keel_pooler=yes"), std::string::npos)
      << bad.error().message();
  // A password given as a parameter is not shown either.
  const auto param = parse_database_url("postgresql://h/db?user=u&password=s3cret");
  ASSERT_TRUE(param);
  EXPECT_EQ(param->redacted, "postgresql://h/db?user=u&password=***");
  const auto refused = parse_database_url("postgresql://h/db?password=s3cret&bogus_option=1");
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().message().find("s3cret"), std::string::npos)
      << refused.error().message();
}

}  // namespace
}  // namespace keel::store
