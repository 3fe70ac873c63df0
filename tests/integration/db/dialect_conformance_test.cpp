// The dialect conformance suite: every backend's Dialect answers each question so that the SQL
// the rooms above the database layer write with it does what dialect.hpp promises, on a real
// database. A new backend is checked by adding it to kBackends and running this suite; a
// question it answers with "" (not needed here) or false is checked for what the callers then do
// instead.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "keel/core/classify.hpp"
#include "keel/db/database.hpp"
#include "keel/db/dialect.hpp"
#include "support/test_support.hpp"

namespace keel::store {
namespace {

// Every Backend value.
const Backend kBackends[] = {Backend::kSqlite, Backend::kPostgres};

class DialectConformance : public test::BackendTest {
 protected:
  void SetUp() override {
    test::BackendTest::SetUp();
    if (IsSkipped()) return;
    conn_ = open_database(url());
    other_ = open_database(url());
    conn_->execute("CREATE TABLE conf_jobs (id INTEGER PRIMARY KEY, v TEXT NOT NULL)");
    conn_->execute(
        "CREATE TABLE conf_children (id INTEGER PRIMARY KEY, job INTEGER NOT NULL REFERENCES "
        "conf_jobs (id))");
    for (int i = 1; i <= 3; ++i) {
      conn_->query("INSERT INTO conf_jobs (id, v) VALUES ($1, $2)", {i, "v" + std::to_string(i)});
    }
  }
  [[nodiscard]] const Dialect& dialect() const { return conn_->dialect(); }
  std::unique_ptr<Connection> conn_;
  std::unique_ptr<Connection> other_;
};

TEST_P(DialectConformance, EveryBackendHasItsDialectAndItIsTheConnectionsDialect) {
  EXPECT_EQ(&dialect_of(GetParam()), &conn_->dialect());
}

TEST_P(DialectConformance, LockRowsIsASuffixOfASelectInATransaction) {
  conn_->begin();
  const Rows rows = conn_->query(
      "SELECT id FROM conf_jobs WHERE id = $1" + std::string(dialect().lock_rows()), {2});
  ASSERT_EQ(rows.size(), 1u);
  conn_->commit();
}

TEST_P(DialectConformance, SkipLockedSkipsTheRowsAnotherTransactionHolds) {
  const std::string skip(dialect().lock_rows_skip_locked());
  const std::string sql = "SELECT id FROM conf_jobs ORDER BY id LIMIT 2" + skip;
  if (skip.empty()) {
    // No two writers ever hold rows at once: the statement is plain, and a second writer
    // cannot begin while the first holds the database's write lock.
    EXPECT_FALSE(dialect().row_level_locks());
    conn_->begin();
    EXPECT_EQ(conn_->query(sql).size(), 2u);
    conn_->commit();
    return;
  }
  ASSERT_TRUE(dialect().row_level_locks());
  conn_->begin();
  const Rows held = conn_->query(sql);
  ASSERT_EQ(held.size(), 2u);
  other_->begin();
  const Rows rest = other_->query(sql);  // does not wait
  ASSERT_EQ(rest.size(), 1u);
  EXPECT_EQ(rest.integer(0, 0), 3);
  other_->commit();
  conn_->commit();
}

TEST_P(DialectConformance, TryTransactionLockIsTakenOnceUntilTheTransactionEnds) {
  const std::string lock(dialect().try_transaction_lock());
  if (lock.empty()) {
    GTEST_SKIP() << to_string(GetParam()) << ": BEGIN's write lock excludes every other writer";
  }
  conn_->begin();
  EXPECT_EQ(conn_->query(lock, {std::int64_t{4242}}).integer(0, 0), 1);
  other_->begin();
  EXPECT_EQ(other_->query(lock, {std::int64_t{4242}}).integer(0, 0), 0);
  EXPECT_EQ(other_->query(lock, {std::int64_t{4343}}).integer(0, 0), 1) << "another name";
  other_->commit();
  conn_->commit();
  other_->begin();
  EXPECT_EQ(other_->query(lock, {std::int64_t{4242}}).integer(0, 0), 1) << "released at COMMIT";
  other_->commit();
}

TEST_P(DialectConformance, DataModifyingCtesWriteAndReadInOneStatement) {
  const std::string sql =
      "WITH u AS (UPDATE conf_jobs SET v = 'cte' WHERE id <= 2 RETURNING id) SELECT count(*) "
      "FROM u";
  if (!dialect().data_modifying_ctes()) {
    EXPECT_THROW((void)conn_->query(sql), DatabaseError) << "the callers take the other path";
    return;
  }
  EXPECT_EQ(conn_->query(sql).integer(0, 0), 2);
  EXPECT_EQ(other_->query("SELECT count(*) FROM conf_jobs WHERE v = 'cte'").integer(0, 0), 2);
}

TEST_P(DialectConformance, TheInsertedIdIsTheNewRowsOrTheInsertReturnsIt) {
  const std::string query(dialect().inserted_id_query());
  if (query.empty()) {
    const Rows r = conn_->query("INSERT INTO conf_jobs (id, v) VALUES (7, 'x') RETURNING id");
    EXPECT_EQ(r.integer(0, 0), 7);
    return;
  }
  conn_->query("INSERT INTO conf_jobs (id, v) VALUES (8, 'x')");
  EXPECT_EQ(conn_->query(query).integer(0, 0), 8);
}

TEST_P(DialectConformance, UpdateExactlyOneRowRefusesZeroRowsAndPassesOne) {
  const std::string checked =
      dialect().update_exactly_one_row("UPDATE conf_jobs SET v = $1 WHERE id = $2");
  if (checked.empty()) GTEST_SKIP() << "the caller counts the UPDATE's rows instead";
  EXPECT_EQ(conn_->query(checked, {"one", 1}).affected(), 1);
  try {
    (void)conn_->query(checked, {"none", 99});
    FAIL() << "an UPDATE of no row passed";
  } catch (const DatabaseError& e) {
    EXPECT_TRUE(dialect().is_row_count_refusal(e.details())) << e.what();
    EXPECT_FALSE(dialect().is_unique_violation(e.details()));
  }
}

TEST_P(DialectConformance, SubstringPositionIsPlainAndOneBased) {
  const std::string sql = "SELECT " + dialect().substring_position("$1", "$2");
  const auto pos = [&](const std::string& haystack, const std::string& needle) {
    return conn_->query(sql, {haystack, needle}).integer(0, 0);
  };
  EXPECT_EQ(pos("connection refused", "refused"), 12);
  EXPECT_EQ(pos("abc", "a"), 1);
  EXPECT_EQ(pos("abc", "zz"), 0);
  EXPECT_EQ(pos("50% off", "%"), 3) << "no pattern characters";
  EXPECT_EQ(pos("a_b", "_"), 2);
  EXPECT_EQ(pos("abc", "%"), 0);
}

TEST_P(DialectConformance, BytesFromHexRoundTripsThroughHex) {
  const std::string from = dialect().bytes_from_hex("$1");
  const Rows r =
      conn_->query("SELECT CASE WHEN " + from + " = " + from + " THEN 1 ELSE 0 END, CASE WHEN " +
                       from + " = " + dialect().bytes_from_hex("$2") + " THEN 1 ELSE 0 END",
                   {"00ff10", "00ff11"});
  EXPECT_EQ(r.integer(0, 0), 1);
  EXPECT_EQ(r.integer(0, 1), 0);
}

TEST_P(DialectConformance, TableExistsFindsTablesAndOnlyThem) {
  const std::string query(dialect().table_exists_query());
  EXPECT_EQ(conn_->query(query, {"conf_jobs"}).size(), 1u);
  EXPECT_TRUE(conn_->query(query, {"conf_nothing"}).empty());
}

TEST_P(DialectConformance, TheMigrationLockRunsFirstInATransaction) {
  conn_->begin();
  if (const std::string lock(dialect().migration_lock()); !lock.empty()) (void)conn_->query(lock);
  conn_->query("CREATE TABLE conf_migrated (id INTEGER)");
  conn_->commit();
  EXPECT_EQ(other_->query(std::string(dialect().table_exists_query()), {"conf_migrated"}).size(),
            1u);
}

TEST_P(DialectConformance, MigrationSqlIsTheBackendsTextOfAStep) {
  const Migration step{.sql = "SELECT 1", .postgres = "SELECT 2"};
  const std::string_view sql = dialect().migration_sql(step);
  EXPECT_TRUE(sql == step.sql || sql == step.postgres);
  EXPECT_EQ(conn_->query(std::string(sql)).size(), 1u);
  const Migration same{.sql = "SELECT 1"};
  EXPECT_EQ(dialect().migration_sql(same), "SELECT 1") << "one text for all when none differs";
}

TEST_P(DialectConformance, ConstraintErrorsAreRecognisedAndPermanent) {
  try {
    conn_->query("INSERT INTO conf_jobs (id, v) VALUES (1, 'again')");
    FAIL() << "a duplicate key was inserted";
  } catch (const DatabaseError& e) {
    EXPECT_TRUE(dialect().is_unique_violation(e.details())) << e.what();
    EXPECT_FALSE(dialect().is_foreign_key_violation(e.details()));
    EXPECT_FALSE(dialect().is_row_count_refusal(e.details()));
    EXPECT_EQ(dialect().classify(e.details()).kind, OutcomeKind::kPermanent) << e.what();
  }
  try {
    conn_->query("INSERT INTO conf_children (id, job) VALUES (1, 99)");
    FAIL() << "a child without its parent was inserted";
  } catch (const DatabaseError& e) {
    EXPECT_TRUE(dialect().is_foreign_key_violation(e.details())) << e.what();
    EXPECT_FALSE(dialect().is_unique_violation(e.details()));
    EXPECT_EQ(dialect().failure(e.details()), DatabaseFailure::kPermanent) << e.what();
  }
  try {
    conn_->query("SELECT * FROM conf_nothing");
    FAIL();
  } catch (const DatabaseError& e) {
    EXPECT_FALSE(dialect().is_unique_violation(e.details()));
    EXPECT_FALSE(dialect().is_foreign_key_violation(e.details()));
  }
}

TEST_P(DialectConformance, CommitWithoutFlushIsATransactionSetting) {
  if (!dialect().commit_without_flush()) GTEST_SKIP() << "no such setting";
  conn_->begin();
  (void)conn_->query("SELECT set_config('synchronous_commit', 'off', true)");
  conn_->query("UPDATE conf_jobs SET v = 'async' WHERE id = 1");
  conn_->commit();
  EXPECT_EQ(other_->query("SELECT v FROM conf_jobs WHERE id = 1").text(0, 0), "async");
}

INSTANTIATE_TEST_SUITE_P(Backends, DialectConformance, ::testing::ValuesIn(kBackends),
                         test::backend_name);

}  // namespace
}  // namespace keel::store
