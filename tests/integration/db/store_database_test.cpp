// keel::store's database layer against real SQLite files and a real PostgreSQL server: URL
// parsing, parameters and NULLs, transactions, error classification, migrations, the pool.
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "keel/db/database.hpp"
#include "keel/db/dialect.hpp"
#include "support/test_support.hpp"

namespace keel::store {
namespace {

using test::BackendTest;

TEST(DatabaseUrl, SqlitePathAndDefault) {
  auto url = parse_database_url("sqlite:data/keel.db");
  ASSERT_TRUE(url);
  EXPECT_EQ(url->backend, Backend::kSqlite);
  EXPECT_EQ(url->target, "data/keel.db");
  auto def = parse_database_url(kDefaultDatabaseUrl);
  ASSERT_TRUE(def);
  EXPECT_EQ(def->target, "keel.db");
  auto abs = parse_database_url("sqlite:///var/lib/keel.db");
  ASSERT_TRUE(abs);
  EXPECT_EQ(abs->target, "/var/lib/keel.db");
}

TEST(DatabaseUrl, PostgresUriIsKeptAndPasswordRedacted) {
  auto url = parse_database_url("postgresql://app:s3cret@127.0.0.1:5432/pay?sslmode=disable");
  ASSERT_TRUE(url);
  EXPECT_EQ(url->backend, Backend::kPostgres);
  EXPECT_EQ(url->target, "postgresql://app:s3cret@127.0.0.1:5432/pay?sslmode=disable");
  EXPECT_EQ(url->redacted, "postgresql://app:***@127.0.0.1:5432/pay?sslmode=disable");
  EXPECT_TRUE(parse_database_url("postgres://localhost/db"));
}

TEST(DatabaseUrl, MalformedUrlsNameTheProblem) {
  const auto says = [](std::string_view text) {
    const auto url = parse_database_url(text);
    EXPECT_FALSE(url) << text;
    return url ? std::string() : url.error().message();
  };
  EXPECT_NE(says("").find("database URL is empty"), std::string::npos);
  EXPECT_NE(says("sqlite:").find("empty path"), std::string::npos);
  EXPECT_NE(says("mysql://x/y").find("scheme 'mysql'"), std::string::npos);
  EXPECT_NE(says("keel.db").find("no scheme"), std::string::npos);
  EXPECT_NE(says("postgresql://h/db?bogus_option=1").find("bogus_option"), std::string::npos);
  EXPECT_NE(says("sqlite:a\nb").find("control character"), std::string::npos);
  // The value is quoted, never with its password.
  const std::string bad = says("postgresql://u:s3cret@h/db?bogus_option=1");
  EXPECT_EQ(bad.find("s3cret"), std::string::npos) << bad;
  EXPECT_NE(bad.find("(got 'postgresql://u:***@h/db?bogus_option=1')"), std::string::npos) << bad;
}

TEST(DatabaseOpen, UnreachablePostgresIsAConnectionError) {
  // Port 1 on loopback: nothing listens there.
  auto url = parse_database_url("postgresql://postgres@127.0.0.1:1/x?connect_timeout=2").value();
  try {
    (void)open_database(url);
    FAIL() << "connected to port 1";
  } catch (const DatabaseError& e) {
    EXPECT_EQ(e.details().sqlstate, "08001");
    EXPECT_EQ(e.outcome().kind, OutcomeKind::kTransient);
  }
}

class Database : public BackendTest {};

TEST_P(Database, ParametersNullsAndAffectedRows) {
  auto conn = open_database(url());
  EXPECT_EQ(conn->backend(), GetParam());
  conn->execute("CREATE TABLE t (id BIGINT PRIMARY KEY, name TEXT, note TEXT)");
  Rows ins = conn->query("INSERT INTO t (id, name, note) VALUES ($1, $2, $3)",
                         {Value(std::int64_t{1} << 40), "it's; DROP TABLE t; --", nullptr});
  EXPECT_EQ(ins.affected(), 1);
  conn->query("INSERT INTO t (id, name, note) VALUES ($1, $2, $3)", {2, "b", "x"});
  Rows rows =
      conn->query("SELECT id, name, note FROM t WHERE id = $1 OR name = $2 ORDER BY id DESC",
                  {2, "it's; DROP TABLE t; --"});
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows.integer(0, 0), std::int64_t{1} << 40);
  EXPECT_EQ(rows.text(0, 1), "it's; DROP TABLE t; --");
  EXPECT_FALSE(rows.cell(0, 2).has_value());
  EXPECT_THROW((void)rows.text(0, 2), DatabaseError);
  EXPECT_EQ(rows.text(1, 2), "x");
  Rows upd = conn->query("UPDATE t SET note = $1", {"y"});
  EXPECT_EQ(upd.affected(), 2);
  // A parameter used twice.
  Rows twice = conn->query("SELECT id FROM t WHERE id = $1 OR id + 0 = $1", {2});
  EXPECT_EQ(twice.size(), 1u);
}

TEST_P(Database, RollbackDiscardsAndCommitKeeps) {
  auto conn = open_database(url());
  conn->execute("CREATE TABLE t (id INTEGER PRIMARY KEY)");
  conn->begin();
  EXPECT_TRUE(conn->in_transaction());
  conn->query("INSERT INTO t (id) VALUES ($1)", {1});
  conn->rollback();
  EXPECT_FALSE(conn->in_transaction());
  conn->begin(Isolation::kSerializable);
  conn->query("INSERT INTO t (id) VALUES ($1)", {2});
  conn->commit();
  auto other = open_database(url());
  Rows rows = other->query("SELECT id FROM t");
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows.integer(0, 0), 2);
}

TEST_P(Database, UniqueViolationIsPermanentAndRecognised) {
  auto conn = open_database(url());
  conn->execute("CREATE TABLE t (id INTEGER PRIMARY KEY)");
  conn->query("INSERT INTO t (id) VALUES ($1)", {1});
  try {
    conn->query("INSERT INTO t (id) VALUES ($1)", {1});
    FAIL() << "duplicate accepted";
  } catch (const DatabaseError& e) {
    EXPECT_TRUE(e.is_unique_violation()) << e.what();
    EXPECT_EQ(e.outcome().kind, OutcomeKind::kPermanent);
    if (GetParam() == Backend::kPostgres) {
      EXPECT_EQ(e.details().sqlstate, "23505");
      EXPECT_EQ(e.outcome().source, OutcomeSource::kSqlstate);
    }
  }
}

TEST_P(Database, SyntaxErrorAndWrongParameterCountAreErrors) {
  auto conn = open_database(url());
  EXPECT_THROW(conn->execute("SELEC 1"), DatabaseError);
  EXPECT_THROW(conn->query("SELECT $1 + $2", {1}), DatabaseError);
  // The connection stays usable.
  EXPECT_EQ(conn->query("SELECT 1 + $1", {1}).integer(0, 0), 2);
}

TEST_P(Database, FailedStatementInsideTransactionFailsTheCommitOrIsRolledBack) {
  auto conn = open_database(url());
  conn->execute("CREATE TABLE t (id INTEGER PRIMARY KEY)");
  conn->begin();
  conn->query("INSERT INTO t (id) VALUES ($1)", {1});
  EXPECT_THROW(conn->query("INSERT INTO t (id) VALUES ($1)", {1}), DatabaseError);
  if (GetParam() == Backend::kPostgres) {
    // PostgreSQL aborts the whole transaction; COMMIT must not pretend it worked.
    EXPECT_THROW(conn->commit(), DatabaseError);
  } else {
    conn->rollback();
  }
  conn->rollback();
  EXPECT_FALSE(conn->in_transaction());
  EXPECT_TRUE(open_database(url())->query("SELECT id FROM t").empty());
}

std::vector<std::int64_t> ids(Connection& conn) {
  std::vector<std::int64_t> out;
  const Rows rows = conn.query("SELECT id FROM t ORDER BY id");
  for (std::size_t i = 0; i < rows.size(); ++i) out.push_back(rows.integer(i, 0));
  return out;
}

TEST_P(Database, AStatementThenBeginCommitsTheStatementAndOpensATransaction) {
  auto conn = open_database(url());
  auto other = open_database(url());
  conn->execute("CREATE TABLE t (id INTEGER PRIMARY KEY)");
  const Value one[] = {1};
  EXPECT_EQ(conn->query_then_begin("INSERT INTO t (id) VALUES ($1)", one).affected(), 1);
  EXPECT_TRUE(conn->in_transaction());
  conn->query("INSERT INTO t (id) VALUES ($1)", {2});
  conn->rollback();
  EXPECT_EQ(ids(*other), std::vector<std::int64_t>{1});  // the statement alone committed
  // A failed statement leaves no transaction open, and the connection usable.
  EXPECT_THROW(
      (void)conn->query_then_begin("INSERT INTO t (id) VALUES ($1)", one, Isolation::kSerializable),
      DatabaseError);
  EXPECT_FALSE(conn->in_transaction());
  EXPECT_FALSE(conn->broken());
  const Value three[] = {3};
  (void)conn->query_then_begin("INSERT INTO t (id) VALUES ($1)", three, Isolation::kSerializable);
  conn->commit();
  EXPECT_EQ(ids(*other), (std::vector<std::int64_t>{1, 3}));
}

TEST_P(Database, AStatementThenCommitCommitsOnlyWhenTheStatementSucceeded) {
  auto conn = open_database(url());
  auto other = open_database(url());
  conn->execute("CREATE TABLE t (id INTEGER PRIMARY KEY)");
  conn->begin();
  conn->query("INSERT INTO t (id) VALUES ($1)", {1});
  const Value two[] = {2};
  EXPECT_EQ(conn->query_then_commit("INSERT INTO t (id) VALUES ($1)", two).affected(), 1);
  EXPECT_FALSE(conn->in_transaction());
  EXPECT_EQ(ids(*other), (std::vector<std::int64_t>{1, 2}));
  // The statement fails: the transaction's earlier writes are rolled back, none is open.
  conn->begin();
  conn->query("INSERT INTO t (id) VALUES ($1)", {3});
  try {
    (void)conn->query_then_commit("INSERT INTO t (id) VALUES ($1)", two);
    FAIL() << "a duplicate committed";
  } catch (const DatabaseError& e) {
    EXPECT_TRUE(e.is_unique_violation()) << e.what();
    EXPECT_FALSE(e.details().during_commit);
  }
  EXPECT_FALSE(conn->in_transaction());
  EXPECT_FALSE(conn->broken());
  EXPECT_EQ(ids(*other), (std::vector<std::int64_t>{1, 2}));
  EXPECT_EQ(ids(*conn), (std::vector<std::int64_t>{1, 2}));
}

TEST_P(Database, AnUpdateThatMustChangeOneRowRefusesNoneAndTheCommitBehindIt) {
  auto conn = open_database(url());
  auto other = open_database(url());
  conn->execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)");
  conn->query("INSERT INTO t (id, v) VALUES ($1, $2)", {1, "open"});
  const Dialect& dialect = conn->dialect();
  const std::string checked =
      dialect.update_exactly_one_row("UPDATE t SET v = $1 WHERE id = $2 AND v = 'open'");
  if (checked.empty()) {
    GTEST_SKIP() << to_string(GetParam()) << " counts the UPDATE's rows before COMMIT instead";
  }
  conn->begin();
  conn->query("INSERT INTO t (id, v) VALUES ($1, $2)", {2, "written before"});
  const Value missing[] = {"done", 99};
  try {
    (void)conn->query_then_commit(checked, missing);
    FAIL() << "an UPDATE of no row committed";
  } catch (const DatabaseError& e) {
    EXPECT_TRUE(dialect.is_row_count_refusal(e.details())) << e.what();
    EXPECT_FALSE(e.details().during_commit);
  }
  EXPECT_FALSE(conn->in_transaction());
  EXPECT_EQ(ids(*other), std::vector<std::int64_t>{1});  // the insert before it rolled back
  conn->begin();
  conn->query("INSERT INTO t (id, v) VALUES ($1, $2)", {2, "written before"});
  const Value first[] = {"done", 1};
  (void)conn->query_then_commit(checked, first);
  EXPECT_EQ(ids(*other), (std::vector<std::int64_t>{1, 2}));
  EXPECT_EQ(other->query("SELECT v FROM t WHERE id = 1").text(0, 0), "done");
  // Another error is not the refusal.
  try {
    conn->query("INSERT INTO t (id, v) VALUES ($1, $2)", {1, "again"});
    FAIL() << "a duplicate was accepted";
  } catch (const DatabaseError& e) {
    EXPECT_FALSE(dialect.is_row_count_refusal(e.details()));
  }
}

TEST_P(Database, MigrationsRunOncePerVersionAndRefuseDowngrade) {
  auto conn = open_database(url());
  const Migration v1[] = {{"CREATE TABLE a (id INTEGER PRIMARY KEY)"}};
  const Migration v2[] = {{"CREATE TABLE a (id INTEGER PRIMARY KEY)"},
                          {"CREATE TABLE b (id INTEGER PRIMARY KEY); "
                           "INSERT INTO b (id) VALUES (7)"}};
  EXPECT_EQ(schema_version(*conn, "demo"), 0);
  EXPECT_EQ(migrate(*conn, "demo", v1), 0);
  EXPECT_EQ(schema_version(*conn, "demo"), 1);
  EXPECT_EQ(migrate(*conn, "demo", v1), 1);  // nothing to do
  EXPECT_EQ(migrate(*conn, "demo", v2), 1);
  EXPECT_EQ(schema_version(*conn, "demo"), 2);
  EXPECT_EQ(conn->query("SELECT id FROM b").integer(0, 0), 7);
  EXPECT_EQ(schema_version(*conn, "other"), 0);  // versions are per component
  EXPECT_THROW(migrate(*conn, "demo", v1), std::runtime_error);
  EXPECT_FALSE(conn->in_transaction());
}

TEST_P(Database, FailedMigrationLeavesNothingBehind) {
  auto conn = open_database(url());
  const Migration bad[] = {{"CREATE TABLE ok (id INTEGER)"}, {"CREATE TABLE broken ("}};
  EXPECT_THROW(migrate(*conn, "demo", bad), DatabaseError);
  EXPECT_EQ(schema_version(*conn, "demo"), 0);
  EXPECT_THROW(conn->query("SELECT * FROM ok"), DatabaseError);
}

TEST_P(Database, ConcurrentMigrationsFromManyConnectionsAgree) {
  const Migration steps[] = {{"CREATE TABLE a (id INTEGER PRIMARY KEY)"},
                             {"INSERT INTO a (id) VALUES (1)"}};
  const std::string errors = test::run_at_once(4, [&] {
    auto conn = open_database(url());
    migrate(*conn, "demo", steps);
  });
  EXPECT_EQ(errors, "");
  auto conn = open_database(url());
  EXPECT_EQ(conn->query("SELECT COUNT(*) FROM a").integer(0, 0), 1);
}

TEST_P(Database, PoolReusesConnectionsAndBoundsThem) {
  ConnectionPool pool(url(), {.max_connections = 2});
  {
    auto a = pool.acquire();
    a->execute("CREATE TABLE t (id INTEGER)");
    auto b = pool.acquire();
    std::atomic<bool> got_third{false};
    std::thread waiter([&] {
      auto c = pool.acquire();
      got_third = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_FALSE(got_third.load());  // both connections are lent
    { auto released = std::move(b); }
    waiter.join();
    EXPECT_TRUE(got_third.load());
  }
  auto d = pool.acquire();
  d->begin();
  d->query("INSERT INTO t (id) VALUES ($1)", {1});
  // Returned mid-transaction: rolled back by the pool.
  { auto returned = std::move(d); }
  EXPECT_EQ(pool.acquire()->query("SELECT COUNT(*) FROM t").integer(0, 0), 0);
  EXPECT_THROW(ConnectionPool(url(), {.max_connections = 0}), std::invalid_argument);
}

// Switching a new file to WAL takes an exclusive lock, and SQLite answers SQLITE_BUSY at once,
// without its busy handler, to a connection that loses that race: opening waits and tries again.
TEST(SqliteBusy, ManyConnectionsOpeningOneNewFileAtOnceAllOpen) {
  test::TempDir dir;
  for (int file = 0; file < 40; ++file) {
    const auto url =
        parse_database_url("sqlite:" + (dir.path() / (std::to_string(file) + ".db")).string())
            .value();
    const std::string errors = test::run_at_once(8, [&] {
      auto conn = open_database(url);
      EXPECT_EQ(conn->query("PRAGMA journal_mode").text(0, 0), "wal");
    });
    ASSERT_EQ(errors, "") << "file " << file;
  }
}

TEST(SqliteBusy, SecondWriterGetsTransientBusyAfterTimeout) {
  test::TempDir dir;
  auto url = parse_database_url("sqlite:" + (dir.path() / "busy.db").string()).value();
  auto first = open_database(url);
  first->execute("CREATE TABLE t (id INTEGER)");
  auto second = open_database(url, {.busy_timeout = std::chrono::milliseconds(20)});
  first->begin();
  first->query("INSERT INTO t (id) VALUES ($1)", {1});
  try {
    second->begin();
    FAIL() << "second writer was let in";
  } catch (const DatabaseError& e) {
    EXPECT_EQ(e.details().sqlite_code & 0xff, 5) << e.what();
    EXPECT_EQ(e.outcome().kind, OutcomeKind::kTransient);
  }
  first->commit();
  second->begin();
  second->rollback();
}

INSTANTIATE_TEST_SUITE_P(Backends, Database,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

}  // namespace
}  // namespace keel::store
