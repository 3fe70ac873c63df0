// keel's schema as an explicit step (`keel migrate`, run by a role that may create tables), and
// every other program over a migrated database run by a role that may only read and write rows:
// keel jobs enqueue and work, keel dlq replay, the idempotency flow and the consumer records. An
// older schema is named to that role with the command that fixes it; `keel migrate` prints its
// plan before and the versions after.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "keel/consumers/processed_messages.hpp"
#include "keel/db/database.hpp"
#include "keel/idempotency/idempotency_flow.hpp"
#include "keel/queue/queue.hpp"
#include "support/jobs_process_support.hpp"
#include "support/test_support.hpp"

namespace keel::store::test_jobs {
namespace {

class KeelMigrate : public JobsHarness<test::BackendTest> {};

TEST_P(KeelMigrate, PrintsThePlanAppliesItAndIsCurrentTheSecondTime) {
  const CmdResult dry = keel({"migrate", "--db", url_text(), "--dry-run"});
  ASSERT_EQ(dry.status, 0) << dry.err;
  EXPECT_NE(dry.out.find("queue        version 0 -> "), std::string::npos) << dry.out;
  EXPECT_NE(dry.out.find("(created)"), std::string::npos) << dry.out;
  EXPECT_NE(dry.out.find("nothing changed"), std::string::npos) << dry.out;
  {
    auto conn = open_database(url());
    EXPECT_EQ(schema_version(*conn, "queue"), 0) << "--dry-run changed nothing";
  }
  const CmdResult run = keel({"migrate", "--db", url_text()});
  ASSERT_EQ(run.status, 0) << run.err;
  const std::string queue_version = std::to_string(JobQueue::schema().version);
  EXPECT_NE(run.out.find("done: queue " + queue_version), std::string::npos) << run.out;
  const CmdResult again = keel({"migrate", "--db", url_text(), "--component", "queue"});
  ASSERT_EQ(again.status, 0) << again.err;
  EXPECT_NE(again.out.find("current (version " + queue_version + ")"), std::string::npos)
      << again.out;
  EXPECT_EQ(again.out.find("idempotency"), std::string::npos) << "only the component asked for";

  const CmdResult unknown = keel({"migrate", "--db", url_text(), "--component", "nope"});
  EXPECT_EQ(unknown.status, 2);
  EXPECT_NE(unknown.err.find("--component"), std::string::npos) << unknown.err;
  // A schema newer than this program: refused, named, nothing changed.
  {
    auto conn = open_database(url());
    conn->query("UPDATE keel_schema SET version = version + 1 WHERE component = 'queue'");
  }
  const CmdResult newer = keel({"migrate", "--db", url_text()});
  EXPECT_EQ(newer.status, 1);
  EXPECT_NE(newer.out.find("is newer than this program's"), std::string::npos) << newer.out;
}

INSTANTIATE_TEST_SUITE_P(Backends, KeelMigrate,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

// PostgreSQL: the owner migrates; a role with SELECT, INSERT, UPDATE and DELETE on the tables
// (and USAGE on the schema and its sequences, nothing else) runs the programs.
class LeastPrivilege : public JobsHarness<test::BackendTest> {
 protected:
  void SetUp() override {
    JobsHarness<test::BackendTest>::SetUp();
    if (IsSkipped()) return;
    const CmdResult migrated = keel({"migrate", "--db", url_text()});
    ASSERT_EQ(migrated.status, 0) << migrated.err;
    auto owner = open_database(url());
    schema_ = owner->query("SELECT current_schema()").text(0, 0);
    role_ = "keel_dml_" + std::to_string(std::random_device{}() % 1000000);
    owner->execute("CREATE ROLE " + role_ + " LOGIN");
    owner->execute("GRANT USAGE ON SCHEMA " + schema_ + " TO " + role_);
    owner->execute("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA " + schema_ +
                   " TO " + role_);
    owner->execute("GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA " + schema_ + " TO " + role_);
    // The same database and schema, as that role.
    dml_url_ = url_text();
    const std::size_t at = dml_url_.find("://") + 3;
    dml_url_.replace(at, dml_url_.find('@') - at, role_);
  }
  void TearDown() override {
    if (role_.empty()) return;
    auto owner = open_database(url());
    owner->execute("DROP OWNED BY " + role_ + "; DROP ROLE " + role_);
  }

  std::string schema_;
  std::string role_;
  std::string dml_url_;
};

TEST_P(LeastPrivilege, ARoleWithDmlRightsOnlyRunsEveryProgramOverAMigratedDatabase) {
  // It may not create tables, as a DBA set it up.
  {
    auto dml = open_database(parse_database_url(dml_url_).value());
    EXPECT_THROW(dml->execute("CREATE TABLE probe (id INTEGER)"), DatabaseError);
  }
  const CmdResult enqueued = keel({"jobs", "--db", dml_url_, "enqueue", "--queue", "q", "--payload",
                                   "{}", "--max-attempts", "1"});
  ASSERT_EQ(enqueued.status, 0) << enqueued.err;
  const CmdResult worked = keel({"jobs", "--db", dml_url_, "work", "--queue", "q", "--exec",
                                 "exit 1", "--poll", "10ms", "--exit-when-idle"});
  ASSERT_EQ(worked.status, 0) << worked.err;
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'dead'"), 1);
  const CmdResult replayed = keel({"dlq", "--db", dml_url_, "replay", "--all"});
  ASSERT_EQ(replayed.status, 0) << replayed.err;
  const CmdResult again = keel({"jobs", "--db", dml_url_, "work", "--queue", "q", "--exec",
                                "exit 0", "--poll", "10ms", "--exit-when-idle"});
  ASSERT_EQ(again.status, 0) << again.err;
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'"), 1);

  // The libraries too: the idempotency flow and the consumer records only read the version.
  ConnectionPool pool(parse_database_url(dml_url_).value(), {.max_connections = 2});
  {
    auto conn = pool.acquire();
    EXPECT_NO_THROW(IdempotencyStore::migrate(*conn));
    EXPECT_NO_THROW(ProcessedMessages::migrate(*conn));
  }
  const IdempotencyStore store;
  const IdempotentRequestFlow flow({.store = &store,
                                    .pool = &pool,
                                    .scope_secret = "0123456789abcdef0123456789abcdef",
                                    .log = [](std::string_view) {}});
  const FlowResponse r = flow.run(
      {.method = "POST", .path = "/x", .idempotency_key = "k1", .body = "{}"}, [](Connection&) {
        return StoredResponse{201, {}, "{}"};
      });
  EXPECT_EQ(r.outcome, FlowOutcome::kExecuted) << r.error;
}

// An older schema is migrated by whoever may; a role that may not is told what to run.
TEST_P(LeastPrivilege, AnOlderSchemaTellsARoleThatMayNotMigrateToRunKeelMigrate) {
  {
    auto owner = open_database(url());
    owner->query("UPDATE keel_schema SET version = version - 1 WHERE component = 'queue'");
  }
  const CmdResult refused =
      keel({"jobs", "--db", dml_url_, "enqueue", "--queue", "q", "--payload", "{}"});
  EXPECT_EQ(refused.status, 1) << refused.err;
  EXPECT_NE(refused.err.find("keel migrate"), std::string::npos) << refused.err;
  EXPECT_NE(refused.err.find("may not change the schema"), std::string::npos) << refused.err;
}

INSTANTIATE_TEST_SUITE_P(Backends, LeastPrivilege, ::testing::Values(Backend::kPostgres),
                         test::backend_name);

}  // namespace
}  // namespace keel::store::test_jobs
