// keel jobs check-keys as a process: jobs stored before keel's one idempotency key rule (written
// here with SQL, as an older keel wrote them) are listed with their id, queue, quoted key and
// why, nothing is changed, and the exit status is 3 while there are any.
#include <gtest/gtest.h>

#include <string>

#include "keel/db/database.hpp"
#include "keel/queue/queue.hpp"
#include "run_keel.hpp"

namespace {

using keel::test::KeelRun;
using keel::test::run_keel;
using keel::test::TempDir;

// Inserts a job row with `key` on `queue` directly, bypassing the queue's checks; returns its id.
std::int64_t insert_legacy_job(keel::store::Connection& conn, const std::string& queue,
                               const std::string& key) {
  conn.query(
      "INSERT INTO keel_queues (name, created_ms) VALUES ($1, 0) ON CONFLICT (name) DO NOTHING",
      {queue});
  conn.query(
      "INSERT INTO keel_jobs (queue, payload, idem_key, state, attempts, max_attempts, run_at_ms,"
      " fence, replays, created_ms, updated_ms) VALUES ($1, '{}', $2, 'ready', 0, 25, 0, 0, 0, 0, "
      "0)",
      {queue, key});
  return conn.query("SELECT id FROM keel_jobs WHERE queue = $1 AND idem_key = $2", {queue, key})
      .integer(0, 0);
}

TEST(KeelJobsCheckKeys, ListsLegacyKeysTheRuleRefusesOrReadsAsAnotherJobsKey) {
  TempDir dir;
  const std::string db = "sqlite:" + dir.file("q.db");
  ASSERT_EQ(
      run_keel({"jobs", "enqueue", "--db", db, "--queue", "pay", "--payload", "{}", "--key", "abc"})
          .status,
      0);
  const KeelRun clean = run_keel({"jobs", "--db", db, "check-keys"});
  EXPECT_EQ(clean.status, 0) << clean.err;
  EXPECT_NE(clean.out.find("every job key follows the rule"), std::string::npos) << clean.out;

  std::int64_t spaced = 0, quoted = 0, alone = 0, utf8 = 0;
  {
    auto conn = keel::store::open_database(keel::store::parse_database_url(db).value());
    spaced = insert_legacy_job(*conn, "pay", " lead");
    quoted = insert_legacy_job(*conn, "pay", "\"abc\"");     // abc is job 1 on this queue
    alone = insert_legacy_job(*conn, "mail", "\"solo\"");    // no solo job: not canonical
    utf8 = insert_legacy_job(*conn, "mail", "caf\xc3\xa9");  // not ASCII
  }
  const KeelRun r = run_keel({"jobs", "--db", db, "check-keys"});
  EXPECT_EQ(r.status, 3) << r.err;
  for (const std::int64_t id : {spaced, quoted, alone, utf8}) {
    EXPECT_NE(r.out.find("\n" + std::to_string(id) + "  "), std::string::npos) << id << r.out;
  }
  EXPECT_EQ(r.out.find("\n1  "), std::string::npos) << "job 1's key is valid: " << r.out;
  EXPECT_NE(r.out.find("' lead'"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("contains a space"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("collides"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("the key of job 1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("not_canonical"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("non-ASCII"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("4 jobs"), std::string::npos) << r.out;

  const KeelRun json = run_keel({"jobs", "--db", db, "check-keys", "--queue", "pay", "--json"});
  EXPECT_EQ(json.status, 3) << json.err;
  EXPECT_NE(json.out.find("\"issue\": \"collides\""), std::string::npos) << json.out;
  EXPECT_NE(json.out.find("\"same_as\": 1"), std::string::npos) << json.out;
  EXPECT_NE(json.out.find("\"problem\": \"space\""), std::string::npos) << json.out;
  EXPECT_EQ(json.out.find("solo"), std::string::npos) << "--queue pay only: " << json.out;

  // Nothing was changed, and a bad flag is a usage error.
  EXPECT_EQ(run_keel({"jobs", "--db", db, "check-keys"}).status, 3);
  EXPECT_EQ(run_keel({"jobs", "--db", db, "check-keys", "--queue", "bad name"}).status, 2);
  // A queue without such jobs.
  ASSERT_EQ(run_keel({"jobs", "enqueue", "--db", db, "--queue", "other", "--payload", "{}"}).status,
            0);
  EXPECT_EQ(run_keel({"jobs", "--db", db, "check-keys", "--queue", "other"}).status, 0);
}

}  // namespace
