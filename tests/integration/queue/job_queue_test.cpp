// keel::store::JobQueue and Worker on real SQLite files and a real PostgreSQL server: keys and
// the unique index, leases, heartbeats and fencing, backoff and dead letters, all in virtual time
// (ManualClock); concurrent leasing with real threads; graceful shutdown of a Worker.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "build_kind.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/text.hpp"
#include "keel/queue/dead_letters.hpp"
#include "keel/queue/queue.hpp"
#include "keel/queue/queue_worker.hpp"
#include "support/counting_connection.hpp"
#include "support/test_support.hpp"

namespace keel::store {
namespace {

using namespace std::chrono_literals;

// A connection that hands every call to `inner`: the wrappers below change one.
class ForwardingConnection : public Connection {
 public:
  explicit ForwardingConnection(Connection& inner) : inner_(inner) {}
  [[nodiscard]] Backend backend() const noexcept override { return inner_.backend(); }
  void execute(std::string_view sql) override { inner_.execute(sql); }
  Rows query(std::string_view sql, std::span<const Value> params) override {
    return inner_.query(sql, params);
  }
  void begin(Isolation isolation) override { inner_.begin(isolation); }
  void commit() override { inner_.commit(); }
  void rollback() noexcept override { inner_.rollback(); }
  [[nodiscard]] bool in_transaction() const noexcept override { return inner_.in_transaction(); }
  [[nodiscard]] bool broken() const noexcept override { return inner_.broken(); }
  [[nodiscard]] std::string database_identity() const override {
    return inner_.database_identity();
  }

 private:
  Connection& inner_;
};

// Records every statement a connection runs, with its parameters.
class RecordingConnection final : public ForwardingConnection {
 public:
  using ForwardingConnection::ForwardingConnection;
  Rows query(std::string_view sql, std::span<const Value> params) override {
    statements.emplace_back(std::string(sql), std::vector<Value>(params.begin(), params.end()));
    return ForwardingConnection::query(sql, params);
  }
  std::vector<std::pair<std::string, std::vector<Value>>> statements;
};

// Runs `after` once, when its first statement has returned: what happens between a statement and
// the code that acts on its rows.
class AfterFirstStatement final : public ForwardingConnection {
 public:
  AfterFirstStatement(Connection& inner, std::function<void()> after)
      : ForwardingConnection(inner), after_(std::move(after)) {}
  Rows query(std::string_view sql, std::span<const Value> params) override {
    Rows rows = ForwardingConnection::query(sql, params);
    if (after_) std::exchange(after_, nullptr)();
    return rows;
  }

 private:
  std::function<void()> after_;
};

class JobQueueTest : public test::BackendTest {
 protected:
  void SetUp() override {
    test::BackendTest::SetUp();
    if (IsSkipped()) return;
    conn_ = open_database(url());
    JobQueue::migrate(*conn_);
  }

  [[nodiscard]] JobQueue make_queue(QueueOptions o = {}) {
    o.clock = &clock_;
    if (o.seed == 0) o.seed = 42;
    return JobQueue(o);
  }

  [[nodiscard]] std::int64_t count(const std::string& sql) {
    return conn_->query(sql).integer(0, 0);
  }

  // One figure of PostgreSQL's statistics (sql reads one integer), after this session's counts
  // are flushed to them: the flush request is carried out when the session goes idle after it.
  [[nodiscard]] std::int64_t flushed_statistic(const std::string& sql) {
    conn_->query("SELECT pg_stat_force_next_flush()");
    return count(sql);
  }

  ManualClock clock_;
  std::unique_ptr<Connection> conn_;
};

TEST_P(JobQueueTest, SameKeyOnSameQueueReturnsTheExistingJob) {
  JobQueue q = make_queue();
  const auto a = q.enqueue(*conn_, {.queue = "mail", .payload = R"({"n":1})", .key = "k-1"});
  const auto b = q.enqueue(*conn_, {.queue = "mail", .payload = R"({"n":2})", .key = "k-1"});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(a.created);
  EXPECT_FALSE(b.created);
  EXPECT_EQ(a.id, b.id);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs"), 1);
  EXPECT_EQ(q.get(*conn_, a.id)->payload, R"({"n":1})");
  // The same key on another queue is another job.
  const auto c = q.enqueue(*conn_, {.queue = "sms", .payload = "{}", .key = "k-1"});
  EXPECT_TRUE(c.created);
  EXPECT_NE(c.id, a.id);
  // The unique index itself refuses a second row, whatever the code path.
  EXPECT_THROW(conn_->query("INSERT INTO keel_jobs (queue, payload, idem_key, state, attempts,"
                            " max_attempts, run_at_ms, fence, replays, created_ms, updated_ms)"
                            " VALUES ('mail', '{}', 'k-1', 'ready', 0, 1, 0, 0, 0, 0, 0)"),
               DatabaseError);
}

TEST_P(JobQueueTest, GeneratedKeyIsAUuidStoredOnceAndKeptAcrossAttempts) {
  JobQueue q = make_queue({.backoff = {.base = 1s, .cap = 1s}});
  const auto a = q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  const auto b = q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  ASSERT_EQ(a.idempotency_key.size(), 36u);
  EXPECT_EQ(a.idempotency_key[14], '4');
  EXPECT_NE(a.idempotency_key, b.idempotency_key);
  auto first = q.lease(*conn_, "q", "w", 1);
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(first[0].idempotency_key, a.idempotency_key);
  ASSERT_EQ(
      q.complete(*conn_, first[0].id, first[0].fence, {.outcome = Outcome::transient()}).status,
      CompleteStatus::kRetryScheduled);
  clock_.advance(2s);
  auto leased = q.lease(*conn_, "q", "w", 2);
  ASSERT_EQ(leased.size(), 2u);
  EXPECT_EQ(leased[0].idempotency_key, a.idempotency_key);
  EXPECT_EQ(leased[0].attempt, 2);
}

TEST_P(JobQueueTest, EnqueueManyKeepsKeysUniqueWithinAndAcrossBatches) {
  JobQueue q = make_queue();
  const auto old = q.enqueue(*conn_, {.queue = "q", .payload = R"({"n":0})", .key = "k-0"});
  const auto r = q.enqueue_many(*conn_, {{.queue = "q", .payload = R"({"n":1})", .key = "k-1"},
                                         {.queue = "q", .payload = R"({"n":2})", .key = "k-0"},
                                         {.queue = "q", .payload = R"({"n":3})", .key = "k-1"},
                                         {.queue = "other", .payload = "{}", .key = "k-1"},
                                         {.queue = "q", .payload = "{}"}});
  ASSERT_EQ(r.size(), 5u);
  for (const auto& e : r) ASSERT_TRUE(e.ok()) << e.error;
  EXPECT_TRUE(r[0].created);
  EXPECT_FALSE(r[1].created);
  EXPECT_EQ(r[1].id, old.id);
  EXPECT_FALSE(r[2].created);
  EXPECT_EQ(r[2].id, r[0].id);
  EXPECT_TRUE(r[3].created);
  EXPECT_NE(r[3].id, r[0].id);
  EXPECT_TRUE(r[4].created);
  EXPECT_EQ(r[4].idempotency_key.size(), 36u);
  EXPECT_EQ(q.get(*conn_, r[0].id)->payload, R"({"n":1})");
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs"), 4);
}

TEST_P(JobQueueTest, EnqueueManyWritesGivenAndMadeKeysInTheRequestsOrder) {
  // Runs of made keys (plain INSERTs) and of given keys (ON CONFLICT) alternate; the ids follow
  // the requests, and a given key already stored, or repeated, is the existing job.
  JobQueue q = make_queue();
  const auto old = q.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = "k-old"});
  std::vector<EnqueueRequest> reqs;
  for (int i = 0; i < 1200; ++i) {
    EnqueueRequest r{.queue = "q", .payload = "{\"n\":" + std::to_string(i) + "}"};
    if (i % 7 == 3) r.key = "k-" + std::to_string(i);
    if (i == 500) r.key = "k-old";
    if (i == 501) r.key = "k-3";
    reqs.push_back(r);
  }
  const auto out = q.enqueue_many(*conn_, reqs);
  ASSERT_EQ(out.size(), reqs.size());
  std::int64_t last = old.id;
  for (std::size_t i = 0; i < out.size(); ++i) {
    ASSERT_TRUE(out[i].ok()) << i << ": " << out[i].error;
    if (i == 500) {
      EXPECT_FALSE(out[i].created);
      EXPECT_EQ(out[i].id, old.id);
      continue;
    }
    if (i == 501) {
      EXPECT_FALSE(out[i].created);
      EXPECT_EQ(out[i].id, out[3].id);
      continue;
    }
    EXPECT_TRUE(out[i].created) << i;
    EXPECT_GT(out[i].id, last) << "request " << i << " was written out of order";
    last = out[i].id;
    EXPECT_EQ(q.get(*conn_, out[i].id)->payload, reqs[i].payload);
    if (!reqs[i].key.empty()) {
      EXPECT_EQ(out[i].idempotency_key, reqs[i].key);
    }
  }
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs"), 1 + 1200 - 2);
  // A given key is held unique by the index whatever writes it (a writer that does not name
  // key_made writes a given key).
  EXPECT_THROW(conn_->query("INSERT INTO keel_jobs (queue, payload, idem_key, state, attempts,"
                            " max_attempts, run_at_ms, fence, replays, created_ms, updated_ms)"
                            " VALUES ('q', '{}', 'k-3', 'ready', 0, 1, 0, 0, 0, 0, 0)"),
               DatabaseError);
}

TEST_P(JobQueueTest, AKeyKeelMadeTakesNoEntryInTheKeyIndex) {
  // Schema 12: the key index holds the keys callers gave; a key keel made is a random UUID,
  // unique without it, so its job's insert, lease and outcome write no entry there.
  JobQueue q = make_queue();
  const auto given = q.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = "k-given"});
  const auto made = q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  ASSERT_TRUE(given.ok() && made.ok());
  EXPECT_EQ(count("SELECT key_made FROM keel_jobs WHERE id = " + std::to_string(given.id)), 0);
  EXPECT_EQ(count("SELECT key_made FROM keel_jobs WHERE id = " + std::to_string(made.id)), 1);
  const std::string index_sql =
      GetParam() == Backend::kPostgres
          ? "SELECT indexdef FROM pg_indexes WHERE indexname = 'keel_jobs_given_key'"
          : "SELECT sql FROM sqlite_master WHERE name = 'keel_jobs_given_key'";
  const std::string index = conn_->query(index_sql).text(0, 0);
  EXPECT_NE(index.find("UNIQUE"), std::string::npos) << index;
  EXPECT_NE(index.find("key_made = 0"), std::string::npos) << index;

  // The rule's one consequence: a made key given back as a request's key is a new job (a caller
  // that wants one job per operation gives its own key from the first enqueue).
  const auto again =
      q.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = made.idempotency_key});
  ASSERT_TRUE(again.ok()) << again.error;
  EXPECT_TRUE(again.created);
  EXPECT_NE(again.id, made.id);
  // ... and from then on that key is given: it is one job.
  const auto twice =
      q.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = made.idempotency_key});
  EXPECT_FALSE(twice.created);
  EXPECT_EQ(twice.id, again.id);

  if (GetParam() != Backend::kPostgres) return;
  // 2,000 jobs with made keys through enqueue, lease and success leave the index as it was.
  const auto index_pages = [&] { return count("SELECT pg_relation_size('keel_jobs_given_key')"); };
  const std::int64_t before = index_pages();
  std::vector<EnqueueRequest> reqs(2000, EnqueueRequest{.queue = "bulk", .payload = "{}"});
  for (const auto& r : q.enqueue_many(*conn_, reqs)) ASSERT_TRUE(r.ok()) << r.error;
  for (;;) {
    const auto leased = q.lease(*conn_, "bulk", "w", 100);
    if (leased.empty()) break;
    for (const auto& j : leased) {
      ASSERT_EQ(q.complete(*conn_, j.id, j.fence, {.outcome = Outcome::success()}).status,
                CompleteStatus::kDone);
    }
  }
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE queue = 'bulk' AND state = 'done'"), 2000);
  EXPECT_EQ(index_pages(), before);
}

TEST_P(JobQueueTest, AQueueThatKeepsNoDoneJobDeletesEachWithTheStatementOfItsSuccess) {
  // QueueOptions::keep_done false (keel jobs work --retain-done 0s): every way a success is
  // recorded deletes its job and the job's history; failures are kept as ever.
  QueueOptions o;
  o.keep_done = false;
  o.backoff = {.base = 1s, .cap = 1s};
  JobQueue q = make_queue(o);
  std::vector<EnqueueRequest> reqs;
  for (int i = 0; i < 8; ++i) {
    reqs.push_back({.queue = "q", .payload = "{}", .key = "k-" + std::to_string(i)});
  }
  std::vector<std::int64_t> ids;
  for (const auto& r : q.enqueue_many(*conn_, reqs)) ids.push_back(r.id);
  const auto gone = [&](std::int64_t id) {
    return !q.get(*conn_, id) && count("SELECT COUNT(*) FROM keel_job_attempts WHERE job_id = " +
                                       std::to_string(id)) == 0;
  };
  // complete(): a job with a failure in its history first (a queue of its own).
  const auto h = q.enqueue(*conn_, {.queue = "h", .payload = "{}"});
  auto one = q.lease(*conn_, "h", "w", 1);
  ASSERT_EQ(one.size(), 1u);
  ASSERT_EQ(q.complete(*conn_, one[0].id, one[0].fence, {.outcome = Outcome::transient()}).status,
            CompleteStatus::kRetryScheduled);
  EXPECT_EQ(q.get(*conn_, h.id)->history.size(), 1u);
  clock_.advance(2s);
  one = q.lease(*conn_, "h", "w", 1);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(q.complete(*conn_, one[0].id, one[0].fence, {.outcome = Outcome::success()}).status,
            CompleteStatus::kDone);
  EXPECT_TRUE(gone(h.id));
  // A stale fence deletes nothing.
  auto two = q.lease(*conn_, "q", "w", 2);
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(q.complete(*conn_, two[0].id, two[0].fence + 1, {.outcome = Outcome::success()}).status,
            CompleteStatus::kStale);
  EXPECT_TRUE(q.get(*conn_, two[0].id));
  // complete_and_lease: two successes with the next lease.
  const DoneAndLeased next = q.complete_and_lease(
      *conn_, {{two[0].id, two[0].fence}, {two[1].id, two[1].fence}}, "q", "w", 3);
  EXPECT_EQ(next.current, 2);
  EXPECT_TRUE(gone(two[0].id));
  EXPECT_TRUE(gone(two[1].id));
  ASSERT_EQ(next.leased.size(), 3u);
  // complete_batch: two successes and a failure; the failure's job stays, retry scheduled.
  const auto results = q.complete_batch(*conn_, {{.job_id = next.leased[0].id,
                                                  .fence = next.leased[0].fence,
                                                  .report = {.outcome = Outcome::success()}},
                                                 {.job_id = next.leased[1].id,
                                                  .fence = next.leased[1].fence,
                                                  .report = {.outcome = Outcome::transient()}},
                                                 {.job_id = next.leased[2].id,
                                                  .fence = next.leased[2].fence,
                                                  .report = {.outcome = Outcome::success()}}});
  ASSERT_EQ(results.size(), 3u);
  EXPECT_EQ(results[0].status, CompleteStatus::kDone);
  EXPECT_EQ(results[1].status, CompleteStatus::kRetryScheduled);
  EXPECT_EQ(results[2].status, CompleteStatus::kDone);
  EXPECT_TRUE(gone(next.leased[0].id));
  EXPECT_TRUE(gone(next.leased[2].id));
  EXPECT_EQ(q.get(*conn_, next.leased[1].id)->state, JobState::kRetryScheduled);
  // complete_in: deleted when the caller's transaction commits, kept when it rolls back.
  auto last = q.lease(*conn_, "q", "w", 2);
  ASSERT_EQ(last.size(), 2u);
  conn_->begin();
  EXPECT_TRUE(q.complete_in(*conn_, last[0].id, last[0].fence));
  conn_->rollback();
  EXPECT_EQ(q.get(*conn_, last[0].id)->state, JobState::kRunning);
  conn_->begin();
  EXPECT_TRUE(q.complete_in(*conn_, last[0].id, last[0].fence));
  conn_->commit();
  EXPECT_TRUE(gone(last[0].id));
  // Nothing done is counted, and a key whose job was deleted makes a new job.
  for (const QueueStats& st : q.stats(*conn_)) EXPECT_EQ(st.done, 0) << st.queue;
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'"), 0);
  ASSERT_TRUE(gone(ids[0]));
  const auto again = q.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = "k-0"});
  EXPECT_TRUE(again.created);
  EXPECT_NE(again.id, ids[0]);
}

TEST_P(JobQueueTest, ALeaseStepsOverNoneOfTheJobsLeasedBeforeItOnPostgres) {
  // Every job leased since the last VACUUM leaves an entry in keel_jobs_ready; a lease that
  // scanned from the queue's first entry stepped over all of them. A lease that took what it
  // asked for leaves a floor, and the next one scans from there (JobQueue::lease_floor).
  if (GetParam() != Backend::kPostgres) GTEST_SKIP() << "SQLite leaves no old index entries";
  conn_->execute("ALTER TABLE keel_jobs SET (autovacuum_enabled = false)");
  JobQueue q = make_queue();
  for (int chunk = 0; chunk < 40; ++chunk) {
    std::vector<EnqueueRequest> reqs(100, EnqueueRequest{.queue = "deep", .payload = "{}"});
    ASSERT_TRUE(q.enqueue_many(*conn_, reqs).front().ok());
    clock_.advance(1ms);
  }
  std::vector<std::pair<std::int64_t, std::int64_t>> done;
  for (int i = 0; i < 39; ++i) {
    const auto step = q.complete_and_lease(*conn_, done, "deep", "w", 100, JobQueue::kStartAll);
    ASSERT_EQ(step.leased.size(), 100u);
    done.clear();
    for (const auto& j : step.leased) done.emplace_back(j.id, j.fence);
  }
  EXPECT_EQ(q.complete_done(*conn_, done), 100);
  const auto index_pages = [&] {
    return flushed_statistic(
        "SELECT idx_blks_hit + idx_blks_read FROM pg_statio_user_indexes"
        " WHERE indexrelname = 'keel_jobs_ready' AND schemaname = current_schema()");
  };
  const std::int64_t before = index_pages();
  for (int i = 0; i < 20; ++i) {
    const auto one = q.lease(*conn_, "deep", "w", 1);
    ASSERT_EQ(one.size(), 1u);
    EXPECT_EQ(q.complete_done(*conn_, {{one[0].id, one[0].fence}}), 1);
  }
  // 3,900 entries behind the floor fill dozens of leaf pages; from the floor a lease reads the
  // path down and a page or two.
  EXPECT_LE(index_pages() - before, 20 * 5) << "index pages read by 20 leases";
}

TEST_P(JobQueueTest, AShortLeaseLeavesAFloorAtItsNowAndAnIdleLookEndsWithIt) {
  // A lease short of jobs took every due job it saw: it leaves a floor at its now less 100 ms, so
  // that a worker keeping up does not scan the queue from its first entry at each lease (while a
  // snapshot is held, over every job done since). A job that comes due below it (its enqueue's
  // transaction committed late) is found by the full scan at most a second later, and an idle
  // worker's look for the next due time says to look again then. A lease that took nothing after
  // a full scan leaves no floor. SQLite takes no floor.
  const bool pg = GetParam() == Backend::kPostgres;
  JobQueue q = make_queue();
  for (int i = 0; i < 2; ++i) (void)q.enqueue(*conn_, {.queue = "s", .payload = "{}"});
  ASSERT_EQ(q.lease(*conn_, "s", "w", 5).size(), 2u);  // short: a floor at now - 100 ms
  const std::int64_t now = q.now_ms();
  const auto late = q.enqueue(*conn_, {.queue = "s", .payload = R"({"late":1})"});
  conn_->query("UPDATE keel_jobs SET run_at_ms = $1 WHERE id = $2", {now - 500, late.id});
  if (pg) {
    EXPECT_TRUE(q.lease(*conn_, "s", "w", 5).empty()) << "a lease from the floor";
    const std::optional<std::int64_t> due = q.next_due(*conn_, "s");
    ASSERT_TRUE(due.has_value()) << "an idle look ends at the floor's end";
    EXPECT_GT(*due, now);
    EXPECT_LE(*due, now + 1000);
    clock_.advance(1s);
  }
  const auto found = q.lease(*conn_, "s", "w", 5);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].id, late.id);
  // The full scan that found it was short too: a floor again. One that takes nothing clears it.
  clock_.advance(1s);
  EXPECT_TRUE(q.lease(*conn_, "s", "w", 5).empty());  // a full scan, nothing: no floor
  const auto below = q.enqueue(*conn_, {.queue = "s", .payload = R"({"below":1})"});
  conn_->query("UPDATE keel_jobs SET run_at_ms = $1 WHERE id = $2", {q.now_ms() - 500, below.id});
  const auto at_once = q.lease(*conn_, "s", "w", 5);
  ASSERT_EQ(at_once.size(), 1u);
  EXPECT_EQ(at_once[0].id, below.id);
}

TEST_P(JobQueueTest, AJobMadeDueBeforeTheLeaseFloorByAnotherProcessWaitsAtMostASecond) {
  // Another process's release gives a job back due at its lease's time, before this process's
  // floor: a busy queue's leases from the floor miss it, and the full scan a second later finds
  // it first. A release in this process clears the floor at once. SQLite takes no floor.
  const bool pg = GetParam() == Backend::kPostgres;
  JobQueue mine = make_queue();
  JobQueue other = make_queue();
  const auto first = mine.enqueue(*conn_, {.queue = "f", .payload = R"({"n":0})"});
  const auto held = other.lease(*conn_, "f", "other", 1, 0);  // leased, not started
  ASSERT_EQ(held.size(), 1u);
  ASSERT_EQ(held[0].id, first.id);
  for (int i = 1; i <= 8; ++i) {
    clock_.advance(1ms);
    (void)mine.enqueue(*conn_, {.queue = "f", .payload = "{\"n\":" + std::to_string(i) + "}"});
  }
  ASSERT_EQ(mine.lease(*conn_, "f", "mine", 3).size(), 3u);  // a full lease: a floor on PostgreSQL
  ASSERT_TRUE(other.release(*conn_, held[0].id, held[0].fence, "given back"));
  const auto next = mine.lease(*conn_, "f", "mine", 1);
  ASSERT_EQ(next.size(), 1u);
  if (pg) {
    EXPECT_NE(next[0].id, first.id) << "a lease from the floor does not reach back";
    clock_.advance(1s);
  }
  const auto after = mine.lease(*conn_, "f", "mine", 1);
  ASSERT_EQ(after.size(), 1u);
  EXPECT_EQ(pg ? after[0].id : next[0].id, first.id) << "the earliest due job comes first";
  // This process's own release clears its floor: the job it gives back is leased next.
  const auto mine_first = mine.enqueue(*conn_, {.queue = "g", .payload = R"({"n":0})"});
  const auto kept = mine.lease(*conn_, "g", "mine", 1, 0);
  ASSERT_EQ(kept.size(), 1u);
  ASSERT_EQ(kept[0].id, mine_first.id);
  for (int i = 1; i <= 8; ++i) {
    clock_.advance(1ms);
    (void)mine.enqueue(*conn_, {.queue = "g", .payload = "{\"n\":" + std::to_string(i) + "}"});
  }
  ASSERT_EQ(mine.lease(*conn_, "g", "mine", 3).size(), 3u);
  ASSERT_TRUE(mine.release(*conn_, kept[0].id, kept[0].fence, "given back"));
  const auto back = mine.lease(*conn_, "g", "mine", 1);
  ASSERT_EQ(back.size(), 1u);
  EXPECT_EQ(back[0].id, mine_first.id);
}

TEST_P(JobQueueTest, ALeaseThatRanWhileThisProcessGaveAJobBackLeavesNoFloorAboveIt) {
  // This JobQueue gives back a job it leased and never started: due again at its lease's time,
  // below the floor a lease running meanwhile would leave (that lease's scan began before the
  // release committed and did not see the job). Here the release commits, and clears the floors,
  // after the lease's statement and before the lease notes its floor: a lease that began before
  // the release leaves no floor, and the next lease takes the job at once, not a second later.
  if (GetParam() != Backend::kPostgres) GTEST_SKIP() << "SQLite takes no floor";
  constexpr std::int64_t kLock = 73'190'431;  // this test's own advisory lock
  JobQueue q = make_queue();
  const auto given = q.enqueue(*conn_, {.queue = "r", .payload = R"({"n":0})"});
  const auto held = q.lease(*conn_, "r", "w", 1, 0);  // leased, not started
  ASSERT_EQ(held.size(), 1u);
  ASSERT_EQ(held[0].id, given.id);
  // The floor that lease left has ended: the lease below is a full scan, which starts a floor.
  clock_.advance(1500ms);
  for (int i = 1; i <= 2; ++i) {
    (void)q.enqueue(*conn_, {.queue = "r", .payload = "{\"n\":" + std::to_string(i) + "}"});
  }
  // The release waits, after its update and before its commit, for a lock this test holds.
  conn_->query(
      "CREATE FUNCTION keel_test_hold_release() RETURNS trigger LANGUAGE plpgsql AS"
      " $$ BEGIN PERFORM pg_advisory_xact_lock(" +
      std::to_string(kLock) + "); RETURN NEW; END $$");
  conn_->query(
      "CREATE TRIGGER keel_test_hold_release BEFORE UPDATE ON keel_jobs FOR EACH ROW"
      " WHEN (OLD.state = 'running' AND NEW.state = 'ready')"
      " EXECUTE FUNCTION keel_test_hold_release()");
  const std::unique_ptr<Connection> gate = open_database(url());
  gate->query("SELECT pg_advisory_lock($1)", {kLock});
  const std::unique_ptr<Connection> releasing = open_database(url());
  const std::int64_t releasing_pid = releasing->query("SELECT pg_backend_pid()").integer(0, 0);
  std::atomic<bool> released{false};
  std::thread release(
      [&] { released = q.release(*releasing, held[0].id, held[0].fence, "given back"); });
  const auto let_it_commit = [&] {
    if (!release.joinable()) return;
    gate->query("SELECT pg_advisory_unlock($1)", {kLock});
    release.join();
  };
  struct Joined {
    std::function<void()> join;
    ~Joined() { join(); }
  } joined{let_it_commit};  // on every way out, an assertion's included
  const std::string waiting =
      "SELECT COUNT(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = " +
      std::to_string(kLock) + " AND pid = " + std::to_string(releasing_pid) + " AND NOT granted";
  // wait: bound: 10 s for the release to reach the lock (a condition polled, not a time passing)
  for (int i = 0; i < 1000 && count(waiting) == 0; ++i) std::this_thread::sleep_for(10ms);
  ASSERT_EQ(count(waiting), 1) << "the release is waiting before its commit";
  // A lease while the release is not committed: its statement takes the other two; the release
  // commits before the lease notes its floor (at its now less 100 ms, above the time the job
  // given back is due at).
  const std::unique_ptr<Connection> leasing = open_database(url());
  AfterFirstStatement lease_then_commit(*leasing, let_it_commit);
  EXPECT_EQ(q.lease(lease_then_commit, "r", "w", 5).size(), 2u);
  EXPECT_FALSE(release.joinable()) << "the release committed between the lease's statement and "
                                      "its floor";
  EXPECT_TRUE(released.load());
  const auto next = q.lease(*leasing, "r", "w", 5);
  ASSERT_EQ(next.size(), 1u) << "the job given back is leased next";
  EXPECT_EQ(next[0].id, given.id);
}

TEST_P(JobQueueTest, TheWorkersReadsOfABusyQueueScanNoTableOnPostgres) {
  // With thousands of done jobs beside a few running and dead ones, the worker's statements (the
  // lease with its expired-lease check and next due time, the sweep, heartbeat, leases_of) and
  // the dead-letter reads each take an index (keel_jobs_ready, keel_jobs_running, keel_jobs_dead
  // or the primary key): none scans keel_jobs.
  if (GetParam() != Backend::kPostgres) GTEST_SKIP() << "PostgreSQL's plans and statistics";
  JobQueue q = make_queue({.lease = 30s});
  std::vector<EnqueueRequest> reqs(3000, EnqueueRequest{.queue = "busy", .payload = "{}"});
  ASSERT_TRUE(q.enqueue_many(*conn_, reqs).front().ok());
  std::vector<std::pair<std::int64_t, std::int64_t>> done;
  for (;;) {
    const auto step = q.complete_and_lease(*conn_, done, "busy", "w", 100, JobQueue::kStartAll);
    done.clear();
    for (const auto& j : step.leased) done.emplace_back(j.id, j.fence);
    if (step.leased.empty()) break;
  }
  (void)q.enqueue_many(
      *conn_, std::vector<EnqueueRequest>(5, EnqueueRequest{.queue = "busy", .payload = "{}"}));
  const auto running = q.lease(*conn_, "busy", "w", 3);
  ASSERT_EQ(running.size(), 3u);
  ASSERT_EQ(
      q.complete(*conn_, running[0].id, running[0].fence, {.outcome = Outcome::permanent()}).status,
      CompleteStatus::kDead);
  conn_->execute("ANALYZE keel_jobs");
  const auto seq_scans = [&] {
    return flushed_statistic(
        "SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'keel_jobs'"
        " AND schemaname = current_schema()");
  };
  const std::int64_t before = seq_scans();
  (void)q.lease(*conn_, "busy", "w", 1);
  (void)q.complete_and_lease(*conn_, {}, "busy", "w", 100);
  EXPECT_TRUE(q.heartbeat(*conn_, running[1].id, running[1].fence));
  EXPECT_EQ(q.leases_of(*conn_, "busy", "w").size(), 4u);
  EXPECT_TRUE(q.next_due(*conn_, "busy").has_value());
  EXPECT_EQ(q.list_dead(*conn_, "busy").size(), 1u);
  EXPECT_EQ(q.dead_depth(*conn_, "busy"), 1);
  clock_.advance(31s);  // the leases expire: the next lease sweeps them
  (void)q.complete_and_lease(*conn_, {}, "busy", "w", 100);
  EXPECT_TRUE(q.leases_of(*conn_, "busy", "w").empty()) << "the sweep took the leases back";
  EXPECT_EQ(seq_scans(), before);
}

TEST_P(JobQueueTest, AStatementOnOneLeasedJobIsNeverPlannedOnTheRunningIndexOnPostgres) {
  // The statements that name a job by its lease (a start, a heartbeat, a success alone or with
  // others, a failure's settle, a release) read it by its primary key. keel_jobs_running is
  // partial on state = 'running' and nearly empty by its statistics, and while a snapshot is held
  // it keeps a dead entry for every job finished since: a plan on it steps over all of them for
  // one row. Shown with the primary key dropped inside a transaction and sequential scans
  // disabled: the running index is then the cheapest plan left, and no statement may take it.
  if (GetParam() != Backend::kPostgres) GTEST_SKIP() << "PostgreSQL's plans";
  JobQueue q = make_queue({.lease = 30s});
  std::vector<EnqueueRequest> reqs(8, EnqueueRequest{.queue = "q", .payload = "{}"});
  ASSERT_TRUE(q.enqueue_many(*conn_, reqs).front().ok());
  RecordingConnection rec(*conn_);
  const auto batch = q.lease(rec, "q", "w", 4, 1);
  ASSERT_EQ(batch.size(), 4u);
  EXPECT_TRUE(q.start(rec, batch[1].id, batch[1].fence));
  EXPECT_TRUE(q.heartbeat(rec, batch[1].id, batch[1].fence));
  EXPECT_TRUE(
      q.complete_and_start(rec, {{batch[0].id, batch[0].fence}}, batch[2].id, batch[2].fence)
          .started);
  EXPECT_EQ(q.complete(rec, batch[1].id, batch[1].fence, {.outcome = Outcome::success()}).status,
            CompleteStatus::kDone);
  EXPECT_TRUE(q.release(rec, batch[3].id, batch[3].fence, "stopping"));
  const auto more = q.lease(rec, "q", "w", 3, 0);
  ASSERT_EQ(more.size(), 3u);
  EXPECT_EQ(q.complete_and_start(rec, {{batch[2].id, batch[2].fence}, {more[0].id, more[0].fence}},
                                 more[1].id, more[1].fence)
                .current,
            2);
  EXPECT_EQ(q.complete(rec, more[1].id, more[1].fence, {.outcome = Outcome::permanent()}).status,
            CompleteStatus::kDead);
  // The statements on one job by its lease: those that compare a fence and lease nothing.
  std::vector<std::pair<std::string, std::vector<Value>>> per_job;
  for (const auto& st : rec.statements) {
    const bool by_fence = st.first.find("fence = $") != std::string::npos ||
                          st.first.find("fence = v.fence") != std::string::npos;
    const bool leases = st.first.find("run_at_ms <=") != std::string::npos;
    if (by_fence && !leases) per_job.push_back(st);
  }
  ASSERT_GE(per_job.size(), 6u);
  conn_->begin(Isolation::kReadCommitted);
  conn_->execute("ALTER TABLE keel_jobs DROP CONSTRAINT keel_jobs_pkey CASCADE");
  conn_->execute("SET LOCAL enable_seqscan = off");
  for (const auto& [sql, params] : per_job) {
    const Rows plan = conn_->query("EXPLAIN " + sql, params);
    std::string text;
    for (std::size_t i = 0; i < plan.size(); ++i) text += plan.text(i, 0) + "\n";
    EXPECT_EQ(text.find("keel_jobs_running"), std::string::npos) << sql << "\n" << text;
  }
  conn_->rollback();
}

TEST_P(JobQueueTest, ExpiredLeasesAreLookedForOnceASecondFromWhereTheLastLookFoundNone) {
  // A lease looks for expired leases at most once a second per queue, and from where the last
  // look found none; at least once a minute it looks from the start (a lease written by a
  // process whose clock is more than a lease behind).
  JobQueue q = make_queue({.lease = 10s});
  const auto a = q.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = "a"});
  // Leased by a worker that died before starting it: swept, it is ready again at once.
  const auto held = q.lease(*conn_, "q", "dead", 1, 0);
  ASSERT_EQ(held.size(), 1u);
  clock_.advance(1s);
  EXPECT_TRUE(q.lease(*conn_, "q", "w", 1).empty());  // looks: none expired
  clock_.advance(9500ms);                             // a's lease expired 500 ms ago
  const auto taken = q.lease(*conn_, "q", "w", 1);
  ASSERT_EQ(taken.size(), 1u) << "the look from the floor finds the lease that expired after it";
  EXPECT_EQ(taken[0].id, a.id);
  ASSERT_EQ(q.complete(*conn_, a.id, taken[0].fence, {.outcome = Outcome::success()}).status,
            CompleteStatus::kDone);
  // A lease that expires 300 ms after a look waits for the next look, a second after it.
  const auto b = q.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = "b"});
  ASSERT_EQ(q.lease(*conn_, "q", "dead", 1, 0).size(), 1u);
  clock_.advance(9700ms);
  EXPECT_TRUE(q.lease(*conn_, "q", "w", 1).empty());  // looks: b's lease has 300 ms left
  clock_.advance(600ms);
  EXPECT_TRUE(q.lease(*conn_, "q", "w", 1).empty()) << "looked again within the second";
  clock_.advance(400ms);
  const auto again = q.lease(*conn_, "q", "w", 1);
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].id, b.id);
  ASSERT_EQ(q.complete(*conn_, b.id, again[0].fence, {.outcome = Outcome::success()}).status,
            CompleteStatus::kDone);
  // A running job below the floor (leased by a process whose clock is far behind) is found by
  // the look from the start, within a minute.
  const auto c = q.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = "c"});
  ASSERT_EQ(q.lease(*conn_, "q", "skewed", 1, 0).size(), 1u);
  clock_.advance(1s);
  EXPECT_TRUE(q.lease(*conn_, "q", "w", 1).empty());  // a look sets the floor at now
  const std::int64_t now_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(clock_.now().time_since_epoch())
          .count();
  conn_->query("UPDATE keel_jobs SET run_at_ms = $1, lease_expires_ms = $1 WHERE id = $2",
               {now_ms - 30'000, c.id});
  int seconds = 0;
  for (; seconds <= 61; ++seconds) {
    clock_.advance(1s);
    if (!q.lease(*conn_, "q", "w", 1).empty()) break;
  }
  EXPECT_LE(seconds, 60) << "the lease below the floor was never found";
  EXPECT_GE(seconds, 10) << "found by a look from the floor";
}

TEST_P(JobQueueTest, TheJobsTableLeavesRoomOnEachPageForARowsNextVersionsOnPostgres) {
  // Schema 9: keel_jobs' pages are filled to 70%, so that a start or a heartbeat (which change no
  // indexed column) fits on its row's page as a HOT update, with no index entry. Whether one does
  // also depends on other sessions (a version is pruned only once no snapshot needs it), so the
  // share of HOT starts is a benchmark figure (docs/queue.md), and this checks the setting.
  if (GetParam() != Backend::kPostgres) GTEST_SKIP() << "SQLite updates rows in place";
  const Rows r = conn_->query(
      "SELECT array_to_string(reloptions, ',') FROM pg_class c JOIN pg_namespace n"
      " ON n.oid = c.relnamespace WHERE c.relname = 'keel_jobs' AND n.nspname = current_schema()");
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r.text(0, 0), "fillfactor=70");
}

TEST_P(JobQueueTest, CompleteAndLeaseRecordsTheSuccessAndLeasesTheNextJobs) {
  JobQueue q = make_queue();
  const auto a = q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  const auto b = q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  const auto c = q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  const auto first = q.complete_and_lease(*conn_, {}, "q", "w", 1);
  EXPECT_EQ(first.current, 0);
  ASSERT_EQ(first.leased.size(), 1u);
  EXPECT_EQ(first.leased[0].id, a.id);
  clock_.advance(1s);
  const auto next = q.complete_and_lease(*conn_, {{a.id, first.leased[0].fence}}, "q", "w", 2);
  EXPECT_EQ(next.current, 1);
  ASSERT_EQ(next.leased.size(), 2u);
  EXPECT_EQ(next.leased[0].id, b.id);
  EXPECT_EQ(next.leased[1].id, c.id);
  const auto done = q.get(*conn_, a.id);
  ASSERT_TRUE(done);
  EXPECT_EQ(done->state, JobState::kDone);
  ASSERT_EQ(done->history.size(), 1u);
  EXPECT_EQ(done->history[0].outcome, "success");
  EXPECT_EQ(done->history[0].worker, "w");
  // A stale token records nothing; the jobs still leased are untouched.
  const auto stale = q.complete_and_lease(*conn_, {{b.id, next.leased[0].fence + 1}}, "q", "w", 1);
  EXPECT_EQ(stale.current, 0);
  EXPECT_TRUE(stale.leased.empty());
  EXPECT_EQ(q.get(*conn_, b.id)->state, JobState::kRunning);
  EXPECT_EQ(q.get(*conn_, b.id)->history.size(), 0u);
}

// complete_batch records what complete() would, outcome by outcome, whatever the mix: two
// sets of jobs get the same reports, one through complete() and one through complete_batch(),
// and end with the same rows and history (no jitter, so the delays are the same too).
TEST_P(JobQueueTest, ABatchOfOutcomesIsRecordedAsCompleteRecordsEachOne) {
  std::vector<std::int64_t> dead_letters;
  JobQueue q = make_queue(
      {.max_attempts = 2,
       .backoff = {.base = 1s, .cap = 4s, .jitter = Jitter::kNone},
       .on_dead_letter = [&](std::int64_t id, std::string_view) { dead_letters.push_back(id); }});
  const std::vector<AttemptReport> reports = {
      AttemptReport::success(),
      {.outcome = Outcome::transient(), .error = "HTTP 503"},
      {.outcome = Outcome::permanent(), .error = "HTTP 400"},
      {.outcome = Outcome::not_attempted(3s), .error = "breaker open"},
      {.outcome = Outcome::throttled(2s), .error = "HTTP 429"},
      {.outcome = Outcome::transient(), .error = ""},
      AttemptReport::success(),
  };
  const auto run = [&](bool batched) {
    std::vector<std::int64_t> ids;
    for (std::size_t i = 0; i < reports.size(); ++i) {
      ids.push_back(q.enqueue(*conn_, {.queue = batched ? "b" : "a", .payload = "{}"}).id);
    }
    // A second attempt for the last transient failure's job, so that it is exhausted.
    const auto leased = q.lease(*conn_, batched ? "b" : "a", "w", static_cast<int>(ids.size()));
    EXPECT_EQ(leased.size(), ids.size());
    std::vector<CompleteResult> results;
    if (batched) {
      std::vector<BatchOutcome> outcomes;
      for (std::size_t i = 0; i < leased.size(); ++i) {
        outcomes.push_back({leased[i].id, leased[i].fence, reports[i]});
      }
      // A stale lease among them is skipped, as complete() skips it.
      outcomes.push_back({leased[0].id, leased[0].fence + 1, {.outcome = Outcome::transient()}});
      results = q.complete_batch(*conn_, outcomes);
      EXPECT_EQ(results.back().status, CompleteStatus::kStale);
      results.pop_back();
    } else {
      for (std::size_t i = 0; i < leased.size(); ++i) {
        results.push_back(q.complete(*conn_, leased[i].id, leased[i].fence, reports[i]));
      }
    }
    return std::make_pair(ids, results);
  };
  // Plain variables, not structured bindings: a lambda below captures them.
  const auto single_run = run(false);
  const auto batch_run = run(true);
  const std::vector<std::int64_t>& single_ids = single_run.first;
  const std::vector<CompleteResult>& single = single_run.second;
  const std::vector<std::int64_t>& batch_ids = batch_run.first;
  const std::vector<CompleteResult>& batch = batch_run.second;
  ASSERT_EQ(single.size(), batch.size());
  const std::vector<CompleteStatus> expected = {
      CompleteStatus::kDone,     CompleteStatus::kRetryScheduled, CompleteStatus::kDead,
      CompleteStatus::kDeferred, CompleteStatus::kRetryScheduled, CompleteStatus::kRetryScheduled,
      CompleteStatus::kDone};
  for (std::size_t i = 0; i < single.size(); ++i) {
    SCOPED_TRACE("outcome " + std::to_string(i));
    EXPECT_EQ(to_string(batch[i].status), to_string(expected[i]));
    EXPECT_EQ(to_string(batch[i].status), to_string(single[i].status));
    EXPECT_EQ(batch[i].delay, single[i].delay);
    EXPECT_EQ(batch[i].retry_at_ms, single[i].retry_at_ms);
    EXPECT_EQ(batch[i].dead_reason, single[i].dead_reason);
    const auto a = q.get(*conn_, single_ids[i]);
    const auto b = q.get(*conn_, batch_ids[i]);
    ASSERT_TRUE(a && b);
    EXPECT_EQ(to_string(b->state), to_string(a->state));
    EXPECT_EQ(b->attempts, a->attempts);
    EXPECT_EQ(b->run_at_ms, a->run_at_ms);
    EXPECT_EQ(b->last_error, a->last_error);
    EXPECT_EQ(b->deferred_reason, a->deferred_reason);
    EXPECT_EQ(b->deferrals, a->deferrals);
    EXPECT_EQ(b->dead_reason, a->dead_reason);
    EXPECT_EQ(b->dead_kind.has_value(), a->dead_kind.has_value());
    EXPECT_EQ(b->lease_owner, a->lease_owner);
    ASSERT_EQ(b->history.size(), a->history.size());
    for (std::size_t h = 0; h < a->history.size(); ++h) {
      EXPECT_EQ(b->history[h].outcome, a->history[h].outcome);
      EXPECT_EQ(b->history[h].attempt, a->history[h].attempt);
      EXPECT_EQ(b->history[h].error, a->history[h].error);
      EXPECT_EQ(b->history[h].delay_ms, a->history[h].delay_ms);
      EXPECT_EQ(b->history[h].worker, a->history[h].worker);
    }
  }
  // And what each is, on its own terms.
  const auto row = [&](std::size_t i) { return *q.get(*conn_, batch_ids[i]); };
  EXPECT_EQ(row(1).last_error, "HTTP 503");
  EXPECT_EQ(row(1).attempts, 1);
  EXPECT_EQ(row(1).run_at_ms, q.now_ms() + 1000);
  EXPECT_EQ(row(2).dead_kind, DeadReason::kPermanent);
  EXPECT_EQ(row(2).dead_reason, "permanent: HTTP 400");
  EXPECT_EQ(row(3).attempts, 0) << "a deferral is not charged";
  EXPECT_EQ(row(3).deferrals, 1);
  EXPECT_EQ(row(3).deferred_reason, "breaker open");
  EXPECT_EQ(row(3).last_error, "");
  EXPECT_EQ(row(4).run_at_ms, q.now_ms() + 2000) << "the server's delay";
  EXPECT_EQ(row(5).history.back().error, describe(Outcome::transient()));
  EXPECT_EQ(row(6).state, JobState::kDone);
  EXPECT_EQ(dead_letters, (std::vector<std::int64_t>{single_ids[2], batch_ids[2]}));

  // The retried jobs' second attempts, exhausted (max_attempts 2), both ways again.
  clock_.advance(10s);
  const auto again_a = q.lease(*conn_, "a", "w", 10);
  const auto again_b = q.lease(*conn_, "b", "w", 10);
  ASSERT_EQ(again_a.size(), again_b.size());
  std::vector<BatchOutcome> outcomes;
  for (const LeasedJob& j : again_b) {
    outcomes.push_back({j.id, j.fence, {.outcome = Outcome::transient(), .error = "again"}});
  }
  const auto results = q.complete_batch(*conn_, outcomes);
  for (std::size_t i = 0; i < again_a.size(); ++i) {
    const CompleteResult one = q.complete(*conn_, again_a[i].id, again_a[i].fence,
                                          {.outcome = Outcome::transient(), .error = "again"});
    EXPECT_EQ(to_string(results[i].status), to_string(one.status));
    EXPECT_EQ(results[i].dead_reason, one.dead_reason);
    EXPECT_EQ(q.get(*conn_, again_b[i].id)->attempts, q.get(*conn_, again_a[i].id)->attempts);
  }
}

TEST_P(JobQueueTest, ASuccessIsReadFromTheDoneRowAndWritesNoHistoryRow) {
  JobQueue q = make_queue({.backoff = {.base = 1s, .cap = 1s}});
  const auto attempt_rows = [&](std::int64_t id) {
    return count("SELECT COUNT(*) FROM keel_job_attempts WHERE job_id = " + std::to_string(id));
  };
  // A first-try success, through complete().
  const auto a = q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  const std::int64_t leased_at = q.now_ms();
  const auto first = q.lease(*conn_, "q", "worker-a", 1);
  ASSERT_EQ(first.size(), 1u);
  clock_.advance(2s);
  ASSERT_EQ(q.complete(*conn_, a.id, first[0].fence, AttemptReport::success()).status,
            CompleteStatus::kDone);
  EXPECT_EQ(attempt_rows(a.id), 0);
  const auto done = q.get(*conn_, a.id);
  ASSERT_TRUE(done);
  EXPECT_EQ(done->state, JobState::kDone);
  EXPECT_EQ(done->lease_owner, "") << "a done job holds no lease";
  ASSERT_EQ(done->history.size(), 1u);
  EXPECT_EQ(done->history[0].outcome, "success");
  EXPECT_EQ(done->history[0].worker, "worker-a");
  EXPECT_EQ(done->history[0].round, 0);
  EXPECT_EQ(done->history[0].attempt, 1);
  EXPECT_EQ(done->history[0].started_ms, leased_at);
  EXPECT_EQ(done->history[0].finished_ms, leased_at + 2000);
  EXPECT_EQ(done->history[0].error, "");
  EXPECT_FALSE(done->history[0].delay_ms.has_value());

  // A success after a failure, through complete_done(): the failure's row, then the success.
  const auto b = q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  const auto try1 = q.lease(*conn_, "q", "worker-a", 1);
  ASSERT_EQ(try1.size(), 1u);
  ASSERT_EQ(q.complete(*conn_, b.id, try1[0].fence, {.outcome = Outcome::transient()}).status,
            CompleteStatus::kRetryScheduled);
  clock_.advance(1s);
  const auto try2 = q.lease(*conn_, "q", "worker-b", 1);
  ASSERT_EQ(try2.size(), 1u);
  EXPECT_EQ(q.complete_done(*conn_, {{b.id, try2[0].fence}}), 1);
  EXPECT_EQ(attempt_rows(b.id), 1);
  const auto retried = q.get(*conn_, b.id);
  ASSERT_EQ(retried->history.size(), 2u);
  EXPECT_EQ(retried->history[0].outcome, "transient");
  EXPECT_EQ(retried->history[1].outcome, "success");
  EXPECT_EQ(retried->history[1].attempt, 2);
  EXPECT_EQ(retried->history[1].worker, "worker-b");

  // A job done before the success was read from its row has the success's history row, and the
  // row's lease owner cleared: it is not reported twice.
  conn_->query(
      "INSERT INTO keel_job_attempts (job_id, round, attempt, started_ms, finished_ms, outcome,"
      " worker) VALUES ($1, 0, 1, $2, $3, 'success', 'worker-a')",
      {a.id, leased_at, leased_at + 2000});
  conn_->query("UPDATE keel_jobs SET lease_owner = NULL WHERE id = $1", {a.id});
  const auto older = q.get(*conn_, a.id);
  ASSERT_EQ(older->history.size(), 1u);
  EXPECT_EQ(older->history[0].worker, "worker-a");
}

TEST_P(JobQueueTest, CompleteAndLeaseReapsAnExpiredLeaseWhenShortOfWork) {
  JobQueue q = make_queue({.lease = 10s});
  const auto a = q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  const auto b = q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  const auto la = q.lease(*conn_, "q", "worker-a", 1);
  const auto lb = q.lease(*conn_, "q", "worker-b", 1);
  ASSERT_EQ(la.size(), 1u);
  ASSERT_EQ(lb.size(), 1u);
  clock_.advance(5s);
  ASSERT_TRUE(q.heartbeat(*conn_, lb[0].id, lb[0].fence));
  clock_.advance(6s);  // a's lease has expired, b's has not
  const auto r = q.complete_and_lease(*conn_, {{b.id, lb[0].fence}}, "q", "worker-b", 1);
  EXPECT_EQ(r.current, 1);
  // a's worker died while running it: the attempt is charged and a backoff scheduled, as for
  // any failed attempt (full jitter under the 1 s base).
  const auto stored = q.get(*conn_, a.id);
  ASSERT_EQ(stored->history.size(), 1u);
  EXPECT_EQ(stored->history[0].outcome, "lease_expired");
  ASSERT_TRUE(stored->history[0].delay_ms.has_value());
  EXPECT_LT(*stored->history[0].delay_ms, 1000);
  EXPECT_EQ(stored->state, r.leased.empty() ? JobState::kRetryScheduled : JobState::kRunning);
  clock_.advance(1s);
  const auto again = r.leased.empty() ? q.lease(*conn_, "q", "worker-b", 1) : r.leased;
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].id, a.id);
  EXPECT_EQ(again[0].attempt, 2);
}

TEST_P(JobQueueTest, InvalidRequestsAreRefusedAndWriteNothing) {
  JobQueue q = make_queue();
  EXPECT_NE(q.enqueue(*conn_, {.queue = "q", .payload = "{not json"}).error.find("JSON"),
            std::string::npos);
  EXPECT_FALSE(q.enqueue(*conn_, {.queue = "bad name!", .payload = "{}"}).ok());
  EXPECT_FALSE(q.enqueue(*conn_, {.queue = "", .payload = "{}"}).ok());
  EXPECT_FALSE(q.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = "a\nb"}).ok());
  EXPECT_FALSE(q.enqueue(*conn_, {.queue = "q", .payload = "{}", .max_attempts = -1}).ok());
  const auto batch =
      q.enqueue_many(*conn_, {{.queue = "q", .payload = "{}"}, {.queue = "q", .payload = "nope"}});
  EXPECT_FALSE(batch[0].ok());
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs"), 0);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_queues"), 0);
  EXPECT_THROW(JobQueue({.max_attempts = 0}), std::invalid_argument);
  EXPECT_THROW(JobQueue({.lease = 0s}), std::invalid_argument);
}

// The queue checks a payload as a receiver does (check_json, default limits): a job whose body a
// receiver refuses would be dead at its first delivery.
TEST_P(JobQueueTest, PayloadsPastTheReceiversNestingLimitAreRefusedNamingIt) {
  JobQueue q = make_queue();
  const auto nested = [](int depth) {
    return std::string(static_cast<std::size_t>(depth), '[') +
           std::string(static_cast<std::size_t>(depth), ']');
  };
  EXPECT_TRUE(q.enqueue(*conn_, {.queue = "q", .payload = nested(64)}).ok());
  const EnqueueResult deep = q.enqueue(*conn_, {.queue = "q", .payload = nested(65)});
  EXPECT_FALSE(deep.ok());
  EXPECT_NE(deep.error.find("payload nests arrays or objects deeper than the limit of 64 levels"),
            std::string::npos)
      << deep.error;
  EXPECT_FALSE(q.enqueue(*conn_, {.queue = "q", .payload = nested(100000)}).ok());
  const auto batch = q.enqueue_many(
      *conn_, {{.queue = "q", .payload = "{}"}, {.queue = "q", .payload = nested(65)}});
  EXPECT_NE(batch[0].error.find("64 levels"), std::string::npos);
  const EnqueueResult twice = q.enqueue(*conn_, {.queue = "q", .payload = R"({"a":1,"a":2})"});
  EXPECT_NE(twice.error.find("member \"a\" more than once"), std::string::npos) << twice.error;
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs"), 1);
}

// Invalid configuration is refused with "CONTEXT: FIELD PROBLEM (got VALUE)", the context being
// the fully qualified type or function.
TEST_P(JobQueueTest, InvalidConfigurationNamesTheTypeTheFieldAndTheValue) {
  const auto what = [](const auto& make) -> std::string {
    try {
      make();
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "(nothing thrown)";
  };
  const std::string attempts = what([] { (void)JobQueue({.max_attempts = 0}); });
  EXPECT_EQ(attempts.rfind("keel::store::QueueOptions: max_attempts must be", 0), 0u) << attempts;
  EXPECT_NE(attempts.find("(got 0)"), std::string::npos) << attempts;
  EXPECT_EQ(what([] { (void)JobQueue({.lease = -5s}); }),
            "keel::store::QueueOptions: lease must be > 0 (got -5s)");
  // A lease shorter than the millisecond its expiry is stored in has expired when it is taken.
  for (const Duration lease : {Duration(1ns), Duration(999us)}) {
    EXPECT_EQ(what([&] { (void)JobQueue({.lease = lease}); }),
              "keel::store::QueueOptions: lease must be >= 1ms (lease expiries are stored in whole "
              "milliseconds) (got " +
                  format_duration(lease) + ")");
  }
  EXPECT_NO_THROW((void)JobQueue({.lease = 1ms}));

  JobQueue q = make_queue();
  EXPECT_EQ(what([&] { (void)q.lease(*conn_, "q", "w", 0); }),
            "keel::store::JobQueue::lease: limit must be >= 1 (got 0)");

  ConnectionPool pool(url(), {.max_connections = 1});
  const JobHandler ok = [](const LeasedJob&, const std::atomic<bool>&) {
    return AttemptReport::success();
  };
  const std::string queue = what([&] { Worker w(pool, q, {.queue = "bad name!"}, ok); });
  EXPECT_EQ(queue.rfind("keel::store::WorkerOptions: queue may only contain", 0), 0u) << queue;
  EXPECT_NE(queue.find("(got 'bad name!')"), std::string::npos) << queue;
  EXPECT_EQ(what([&] { Worker w(pool, q, {.queue = "q", .concurrency = 0}, ok); }),
            "keel::store::WorkerOptions: concurrency must be >= 1 (got 0)");
  EXPECT_EQ(what([&] { Worker w(pool, q, {.queue = "q"}, JobHandler{}); }),
            "keel::store::Worker: handler must not be empty");

  const Expected<void> name = check_queue_name("no spaces");
  ASSERT_FALSE(name);
  EXPECT_EQ(name.error().field, "queue name");
  EXPECT_EQ(name.error().got, "'no spaces'");
  EXPECT_EQ(check_queue_name("").error().message(), "queue name must not be empty");
  EXPECT_TRUE(check_queue_name("emails.v2-high_priority"));
  EXPECT_EQ(q.enqueue(*conn_, {.queue = "q", .payload = "{}", .max_attempts = -1}).error,
            "max_attempts must be >= 1, or 0 for the queue's default (got -1)");
}

TEST_P(JobQueueTest, ExpiredLeaseIsTakenOverAndTheStaleWorkerIsFencedOut) {
  JobQueue q = make_queue({.lease = 30s});
  const auto job = q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  auto a = q.lease(*conn_, "q", "worker-a", 1);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_TRUE(q.lease(*conn_, "q", "worker-b", 1).empty()) << "leased twice";
  clock_.advance(29s);
  EXPECT_TRUE(q.lease(*conn_, "q", "worker-b", 1).empty()) << "lease ended early";
  clock_.advance(2s);                            // worker-a died: no heartbeat
  auto b = q.lease(*conn_, "q", "worker-b", 1);  // sweeps the lease: a backoff before the retry
  if (b.empty()) {
    clock_.advance(1s);
    b = q.lease(*conn_, "q", "worker-b", 1);
  }
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(b[0].id, job.id);
  EXPECT_GT(b[0].fence, a[0].fence);
  EXPECT_EQ(b[0].attempt, 2);
  // worker-a comes back late: its outcome and heartbeat are refused.
  EXPECT_EQ(q.complete(*conn_, a[0].id, a[0].fence, AttemptReport::success()).status,
            CompleteStatus::kStale);
  EXPECT_FALSE(q.heartbeat(*conn_, a[0].id, a[0].fence));
  EXPECT_EQ(q.complete(*conn_, b[0].id, b[0].fence, AttemptReport::success()).status,
            CompleteStatus::kDone);
  const auto stored = q.get(*conn_, job.id);
  ASSERT_EQ(stored->history.size(), 2u);
  EXPECT_EQ(stored->history[0].outcome, "lease_expired");
  EXPECT_EQ(stored->history[0].worker, "worker-a");
  EXPECT_EQ(stored->history[1].outcome, "success");
  EXPECT_EQ(stored->state, JobState::kDone);
}

TEST_P(JobQueueTest, HeartbeatsKeepTheLease) {
  JobQueue q = make_queue({.lease = 30s});
  (void)q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  auto a = q.lease(*conn_, "q", "a", 1);
  ASSERT_EQ(a.size(), 1u);
  for (int i = 0; i < 5; ++i) {
    clock_.advance(20s);
    ASSERT_TRUE(q.heartbeat(*conn_, a[0].id, a[0].fence));
    EXPECT_TRUE(q.lease(*conn_, "q", "b", 1).empty()) << "after " << (i + 1) * 20 << "s";
  }
  EXPECT_EQ(q.complete(*conn_, a[0].id, a[0].fence, AttemptReport::success()).status,
            CompleteStatus::kDone);
}

TEST_P(JobQueueTest, TransientFailuresBackOffWithFullJitterThenDieWhenExhausted) {
  JobQueue q = make_queue({.backoff = {.base = 1s, .cap = 8s}});
  const auto job = q.enqueue(*conn_, {.queue = "q", .payload = "{}", .max_attempts = 5});
  for (int attempt = 1; attempt <= 5; ++attempt) {
    auto leased = q.lease(*conn_, "q", "w", 1);
    ASSERT_EQ(leased.size(), 1u) << "attempt " << attempt;
    EXPECT_EQ(leased[0].attempt, attempt);
    const auto r = q.complete(*conn_, leased[0].id, leased[0].fence,
                              {.outcome = Outcome::transient(), .error = "HTTP 503"});
    if (attempt < 5) {
      ASSERT_EQ(r.status, CompleteStatus::kRetryScheduled);
      const Duration ceiling = std::min<Duration>(8s, Duration(1s) * (1 << (attempt - 1)));
      EXPECT_GE(r.delay, Duration::zero());
      EXPECT_LT(r.delay, ceiling);
      // Not due before its time (the clock moves in whole milliseconds here).
      const std::int64_t wait_ms = r.retry_at_ms - q.now_ms();
      if (wait_ms >= 1) {
        clock_.advance(std::chrono::milliseconds(wait_ms - 1));
        EXPECT_TRUE(q.lease(*conn_, "q", "w", 1).empty());
      }
      clock_.advance(1ms);
    } else {
      EXPECT_EQ(r.status, CompleteStatus::kDead);
      EXPECT_NE(r.dead_reason.find("attempts exhausted (5 of 5): HTTP 503"), std::string::npos);
    }
  }
  const auto stored = q.get(*conn_, job.id);
  EXPECT_EQ(stored->state, JobState::kDead);
  ASSERT_EQ(stored->history.size(), 5u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(stored->history[i].outcome, "transient");
    EXPECT_EQ(stored->history[i].error, "HTTP 503");
    EXPECT_TRUE(stored->history[i].delay_ms.has_value());
  }
  EXPECT_FALSE(stored->history[4].delay_ms.has_value());
  EXPECT_EQ(q.dead_depth(*conn_, "q"), 1);
}

TEST_P(JobQueueTest, DefaultsAreBase1sCap1hAnd25Attempts) {
  JobQueue q(QueueOptions{});
  EXPECT_EQ(q.options().max_attempts, 25);
  EXPECT_EQ(q.options().backoff.base, Duration(1s));
  EXPECT_EQ(q.options().backoff.cap, Duration(1h));
  EXPECT_EQ(q.options().backoff.jitter, Jitter::kFull);
}

TEST_P(JobQueueTest, RetryAfterIsHonouredUpToTheCap) {
  JobQueue q = make_queue({.backoff = {.base = 10ms, .cap = 1min}});
  (void)q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  auto l = q.lease(*conn_, "q", "w", 1);
  const auto r = q.complete(*conn_, l[0].id, l[0].fence, {.outcome = Outcome::throttled(30s)});
  EXPECT_EQ(r.status, CompleteStatus::kRetryScheduled);
  EXPECT_GE(r.delay, Duration(30s));
  clock_.advance(29s);
  EXPECT_TRUE(q.lease(*conn_, "q", "w", 1).empty());
}

TEST_P(JobQueueTest, PermanentFailureIsDeadAtOnceWithTheReason) {
  JobQueue q = make_queue();
  const auto job = q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  auto l = q.lease(*conn_, "q", "w", 1);
  const auto r = q.complete(*conn_, l[0].id, l[0].fence,
                            {.outcome = Outcome::permanent(), .error = "HTTP 400: bad field"});
  EXPECT_EQ(r.status, CompleteStatus::kDead);
  const auto dead = q.list_dead(*conn_);
  ASSERT_EQ(dead.size(), 1u);
  EXPECT_EQ(dead[0].id, job.id);
  EXPECT_EQ(dead[0].attempts, 1);
  EXPECT_EQ(dead[0].dead_reason, "permanent: HTTP 400: bad field");
}

// What a handler reports may be any bytes (a receiver's body, a command's stderr). Each outcome
// is recorded, on both backends, as valid UTF-8 within the queue's 2000 bytes: PostgreSQL's TEXT
// refuses the rest, and an outcome that cannot be recorded runs its job again.
TEST_P(JobQueueTest, AnOutcomeIsRecordedWhateverTheBytesOfItsError) {
  std::string long_text;
  for (int i = 0; i < 1500; ++i) long_text += "\xC3\xA9";  // 3000 bytes of "é"
  const std::pair<const char*, std::string> errors[] = {
      {"Latin-1", "HTTP 400: Fehler: ung\xFCltig"},
      {"a character cut", "HTTP 400: " + std::string(189, 'x') + "\xC3"},
      {"a 4-byte character cut", "HTTP 400: \xF0\x9F\x98"},
      {"NUL", std::string("exit status 1: a\0b", 18)},
      {"overlong and surrogate", "exit status 1: \xC0\xAF \xED\xA0\x80"},
      {"above U+10FFFF", "exit status 1: \xF4\x90\x80\x80"},
      {"lone continuation bytes", "\x80\x81\x82"},
      {"too long, cut inside a character", "x" + long_text},
  };
  JobQueue q = make_queue({.max_attempts = 2});
  int n = 0;
  for (const auto& [name, error] : errors) {
    SCOPED_TRACE(name);
    for (const OutcomeKind kind :
         {OutcomeKind::kNotAttempted, OutcomeKind::kTransient, OutcomeKind::kPermanent}) {
      SCOPED_TRACE(to_string(kind));
      const std::string queue = "q" + std::to_string(++n);
      const auto job = q.enqueue(*conn_, {.queue = queue, .payload = "{}"});
      ASSERT_TRUE(job.ok()) << job.error;
      auto l = q.lease(*conn_, queue, "w", 1);
      ASSERT_EQ(l.size(), 1u);
      Outcome outcome;
      outcome.kind = kind;
      CompleteResult r;
      ASSERT_NO_THROW(
          r = q.complete(*conn_, l[0].id, l[0].fence, {.outcome = outcome, .error = error}));
      const std::optional<Job> stored = q.get(*conn_, job.id);
      ASSERT_TRUE(stored.has_value());
      ASSERT_FALSE(stored->history.empty());
      const std::string& recorded = stored->history.back().error;
      EXPECT_TRUE(is_storable_text(recorded)) << recorded;
      EXPECT_LE(recorded.size(), 2000u);
      if (kind == OutcomeKind::kPermanent) {
        EXPECT_EQ(r.status, CompleteStatus::kDead);
        EXPECT_EQ(stored->state, JobState::kDead);
        EXPECT_TRUE(stored->dead_reason.starts_with("permanent: ")) << stored->dead_reason;
        EXPECT_TRUE(is_storable_text(stored->dead_reason));
        EXPECT_LE(stored->dead_reason.size(), 2000u);
        EXPECT_EQ(r.dead_reason, stored->dead_reason);
        EXPECT_EQ(stored->last_error, recorded);
      } else {
        EXPECT_EQ(r.status, kind == OutcomeKind::kTransient ? CompleteStatus::kRetryScheduled
                                                            : CompleteStatus::kDeferred);
        EXPECT_TRUE(is_storable_text(kind == OutcomeKind::kTransient ? stored->last_error
                                                                     : stored->deferred_reason));
      }
    }
  }
  // A valid text is stored as it was; one that is not says how many bytes were replaced.
  const auto job = q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  auto l = q.lease(*conn_, "q", "w", 1);
  ASSERT_EQ(l.size(), 1u);
  (void)q.complete(*conn_, l[0].id, l[0].fence,
                   {.outcome = Outcome::permanent(), .error = "HTTP 400: ung\xFCltig"});
  EXPECT_EQ(q.get(*conn_, job.id)->dead_reason,
            "permanent: HTTP 400: ung\xEF\xBF\xBDltig [1 byte that was not UTF-8 text replaced]");
}

// A payload is the user's data: one that is not UTF-8 is refused when it is enqueued, on both
// backends, never stored to fail later.
TEST_P(JobQueueTest, APayloadThatIsNotUtf8IsRefusedAtEnqueue) {
  JobQueue q = make_queue();
  for (const std::string& payload :
       {std::string("{\"name\":\"M\xFCller\"}"), std::string("{\"a\":\"x\xC3\"}"),
        std::string("{\"a\":\"\0\"}", 8)}) {
    SCOPED_TRACE(payload);
    const EnqueueResult r = q.enqueue(*conn_, {.queue = "q", .payload = payload});
    EXPECT_FALSE(r.ok());
    EXPECT_EQ(r.error.rfind("payload is not UTF-8 text", 0), 0u) << r.error;
  }
  const auto batch = q.enqueue_many(
      *conn_, {{.queue = "q", .payload = "{}"}, {.queue = "q", .payload = "[\"\xFF\"]"}});
  EXPECT_FALSE(batch[0].ok());
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs"), 0);
  // JSON's own escapes stay text: "\u0000" and "\u00fc" are stored as written.
  const auto escaped = q.enqueue(*conn_, {.queue = "q", .payload = R"({"a":"\u0000\u00fc"})"});
  ASSERT_TRUE(escaped.ok()) << escaped.error;
  EXPECT_EQ(q.get(*conn_, escaped.id)->payload, R"({"a":"\u0000\u00fc"})");
}

TEST_P(JobQueueTest, ReplayKeepsTheKeyAndResetsAttemptsDiscardRemoves) {
  JobQueue q = make_queue();
  const auto a = q.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = "same"});
  const auto b = q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  for (int i = 0; i < 2; ++i) {
    auto l = q.lease(*conn_, "q", "w", 1);
    ASSERT_EQ(l.size(), 1u);
    (void)q.complete(*conn_, l[0].id, l[0].fence, {.outcome = Outcome::permanent()});
  }
  EXPECT_EQ(q.dead_depth(*conn_), 2);
  EXPECT_EQ(q.replay(*conn_, {a.id, 999999}), std::vector<std::int64_t>{a.id});
  auto again = q.lease(*conn_, "q", "w", 1);
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].idempotency_key, "same");
  EXPECT_EQ(again[0].attempt, 1);
  EXPECT_EQ(q.complete(*conn_, again[0].id, again[0].fence, AttemptReport::success()).status,
            CompleteStatus::kDone);
  const auto replayed = q.get(*conn_, a.id);
  EXPECT_EQ(replayed->replays, 1);
  ASSERT_EQ(replayed->history.size(), 2u);
  EXPECT_EQ(replayed->history[1].round, 1);
  EXPECT_EQ(q.discard(*conn_, {a.id}), std::vector<std::int64_t>{}) << "done is not dead";
  EXPECT_EQ(q.discard(*conn_, {b.id}), std::vector<std::int64_t>{b.id});
  EXPECT_FALSE(q.get(*conn_, b.id).has_value());
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_job_attempts WHERE job_id = " + std::to_string(b.id)),
            0);
  EXPECT_EQ(q.dead_depth(*conn_), 0);
}

TEST_P(JobQueueTest, DoneJobsArePrunedOnlyPastAnExplicitRetention) {
  JobQueue q = make_queue();
  (void)q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  auto l = q.lease(*conn_, "q", "w", 1);
  (void)q.complete(*conn_, l[0].id, l[0].fence, AttemptReport::success());
  clock_.advance(30min);
  EXPECT_EQ(q.prune_done(*conn_, "q", 1h), 0);
  clock_.advance(31min);
  EXPECT_EQ(q.prune_done(*conn_, "q", 1h), 1);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs"), 0);
}

TEST_P(JobQueueTest, StatsCountStatesAndTheOldestReadyAge) {
  JobQueue q = make_queue();
  (void)q.enqueue(*conn_, {.queue = "a", .payload = "{}"});
  clock_.advance(5s);
  (void)q.enqueue(*conn_, {.queue = "a", .payload = "{}"});
  (void)q.enqueue(*conn_, {.queue = "a", .payload = "{}", .delay = 1h});
  (void)q.enqueue(*conn_, {.queue = "b", .payload = "{}"});
  auto l = q.lease(*conn_, "b", "w", 1);
  (void)q.complete(*conn_, l[0].id, l[0].fence, {.outcome = Outcome::permanent()});
  clock_.advance(5s);
  const auto stats = q.stats(*conn_);
  ASSERT_EQ(stats.size(), 2u);
  EXPECT_EQ(stats[0].queue, "a");
  EXPECT_EQ(stats[0].ready, 3);
  EXPECT_EQ(stats[0].oldest_ready_age, Duration(10s));
  EXPECT_EQ(stats[1].dead, 1);
  EXPECT_EQ(stats[1].oldest_ready_age, Duration::zero());
  EXPECT_FALSE(q.idle(*conn_, "a"));
  EXPECT_TRUE(q.idle(*conn_, "b"));
  EXPECT_TRUE(q.queue_exists(*conn_, "b"));
  EXPECT_FALSE(q.queue_exists(*conn_, "c"));
}

TEST_P(JobQueueTest, ConcurrentWorkersNeverLeaseOneJobTwice) {
  JobQueue q = make_queue({.lease = 1h});
  std::vector<EnqueueRequest> batch(300, EnqueueRequest{.queue = "q", .payload = "{}"});
  for (const auto& r : q.enqueue_many(*conn_, batch)) ASSERT_TRUE(r.ok());
  std::mutex mu;
  std::multiset<std::int64_t> seen;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto conn = open_database(url());
      for (;;) {
        auto jobs = q.lease(*conn, "q", "w" + std::to_string(t), 1 + t % 3);
        if (jobs.empty()) break;
        std::vector<std::pair<std::int64_t, std::int64_t>> done;
        for (const auto& j : jobs) done.emplace_back(j.id, j.fence);
        {
          std::lock_guard lock(mu);
          for (const auto& j : jobs) seen.insert(j.id);
        }
        EXPECT_EQ(q.complete_done(*conn, done), static_cast<int>(done.size()));
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(seen.size(), 300u);
  EXPECT_EQ(std::set<std::int64_t>(seen.begin(), seen.end()).size(), 300u);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'"), 300);
}

TEST_P(JobQueueTest, WorkerReleasesJobsStillRunningAfterTheGracePeriod) {
  ConnectionPool pool(url(), {.max_connections = 4});
  JobQueue q({.lease = 30s, .seed = 1});
  (void)q.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = "fast"});
  (void)q.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = "slow"});
  std::atomic<int> started{0};
  std::atomic<bool> slow_cancelled{false};
  Worker* self = nullptr;
  Worker worker(pool, q, {.queue = "q", .concurrency = 1, .poll_interval = 5ms, .grace = 50ms},
                [&](const LeasedJob& job, const std::atomic<bool>& cancel) {
                  started.fetch_add(1);
                  if (job.idempotency_key == "fast") return AttemptReport::success();
                  self->stop();  // SIGTERM arrives while the slow job runs
                  while (!cancel.load()) std::this_thread::yield();
                  slow_cancelled = true;
                  // Ignores the cancel until its lease is released (a second later).
                  while (self->released() == 0) std::this_thread::sleep_for(1ms);
                  return AttemptReport::success();
                });
  self = &worker;
  (void)worker.run();
  EXPECT_TRUE(slow_cancelled.load());
  EXPECT_EQ(worker.released(), 1);
  const auto rows =
      conn_->query("SELECT idem_key, state, attempts, id FROM keel_jobs ORDER BY idem_key");
  // The slow job's handler ran past the grace: its attempt is charged as a crash's is, and it is
  // scheduled for a retry by another worker; its late success was refused (fenced).
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows.text(1, 0), "slow");
  EXPECT_EQ(rows.text(1, 1), "retry_scheduled");
  EXPECT_EQ(rows.integer(1, 2), 1);
  const auto slow = q.get(*conn_, rows.integer(1, 3));
  ASSERT_EQ(slow->history.size(), 1u);
  EXPECT_EQ(slow->history[0].outcome, "released");
  EXPECT_EQ(slow->history[0].error, "worker stopped; grace period over");
  // The fast one (leased first: due at the same time, ids in order) finished before the stop.
  EXPECT_EQ(rows.text(0, 1), "done");
  EXPECT_EQ(started.load(), 2);
}

TEST_P(JobQueueTest, WorkerDrainsTheQueueAndExitsWhenIdle) {
  ConnectionPool pool(url(), {.max_connections = 6});
  JobQueue q({.backoff = {.base = 1ms, .cap = 2ms}, .seed = 3});
  std::vector<EnqueueRequest> batch(60, EnqueueRequest{.queue = "q", .payload = "{}"});
  (void)q.enqueue_many(*conn_, batch);
  std::mutex mu;
  std::map<std::string, int> calls;
  Worker worker(
      pool, q,
      {.queue = "q", .concurrency = 3, .batch = 2, .poll_interval = 1ms, .exit_when_idle = true},
      [&](const LeasedJob& job, const std::atomic<bool>&) {
        std::lock_guard lock(mu);
        // Every job fails transiently once, then succeeds.
        return ++calls[job.idempotency_key] == 1
                   ? AttemptReport{.outcome = Outcome::transient(), .error = "flaky"}
                   : AttemptReport::success();
      });
  EXPECT_EQ(worker.run(), 120);
  EXPECT_EQ(calls.size(), 60u);
  for (const auto& [key, n] : calls) EXPECT_EQ(n, 2) << key;
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'"), 60);
}

TEST_P(JobQueueTest, ARefusalIsDeferredUntilTheBrakeAdmitsAndCostsNoAttempt) {
  JobQueue q = make_queue({.max_attempts = 2});
  const auto job = q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  for (int i = 0; i < 5; ++i) {  // far more refusals than attempts: none is charged
    auto l = q.lease(*conn_, "q", "w", 1);
    ASSERT_EQ(l.size(), 1u) << i;
    EXPECT_EQ(l[0].attempt, 1);
    const auto r = q.complete(*conn_, l[0].id, l[0].fence,
                              {.outcome = Outcome::not_attempted(4s),
                               .error = "circuit open for api:443, next probe in 4s"});
    EXPECT_EQ(r.status, CompleteStatus::kDeferred);
    EXPECT_EQ(r.delay, Duration(4s));
    clock_.advance(3s);
    EXPECT_TRUE(q.lease(*conn_, "q", "w", 1).empty()) << "due only when the brake admits";
    clock_.advance(1s);
  }
  const auto stored = q.get(*conn_, job.id);
  ASSERT_TRUE(stored);
  EXPECT_EQ(stored->attempts, 0);
  EXPECT_EQ(stored->deferrals, 5);
  EXPECT_EQ(stored->deferred_reason, "circuit open for api:443, next probe in 4s");
  ASSERT_EQ(stored->history.size(), 5u);
  EXPECT_EQ(stored->history[0].outcome, "deferred");
  EXPECT_EQ(stored->history[0].delay_ms, 4000);
  const auto stats = q.stats(*conn_);
  ASSERT_EQ(stats.size(), 1u);
  EXPECT_EQ(stats[0].deferred, 1);
  // Its real attempts are still both there.
  auto l = q.lease(*conn_, "q", "w", 1);
  EXPECT_EQ(q.complete(*conn_, l[0].id, l[0].fence, {.outcome = Outcome::transient()}).status,
            CompleteStatus::kRetryScheduled);
  EXPECT_EQ(q.stats(*conn_)[0].deferred, 0);
}

TEST_P(JobQueueTest, MaxAgeEndsTheWaitOfADeferredJob) {
  JobQueue q = make_queue({.max_age = 10s});
  (void)q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  auto l = q.lease(*conn_, "q", "w", 1);
  EXPECT_EQ(q.complete(*conn_, l[0].id, l[0].fence, {.outcome = Outcome::not_attempted(6s)}).status,
            CompleteStatus::kDeferred);
  clock_.advance(6s);
  l = q.lease(*conn_, "q", "w", 1);
  ASSERT_EQ(l.size(), 1u);
  const auto r = q.complete(*conn_, l[0].id, l[0].fence, {.outcome = Outcome::not_attempted(6s)});
  EXPECT_EQ(r.status, CompleteStatus::kDead);
  EXPECT_NE(r.dead_reason.find("max age 10s reached"), std::string::npos) << r.dead_reason;
}

TEST_P(JobQueueTest, TheQueueAppliesCoresRulesRetryLimitAndRetryAfterReplacingTheBackoff) {
  JobQueue q = make_queue({.backoff = {.base = 10s, .cap = 1h}});
  (void)q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  // Retry-After replaces the backoff draw (base 10 s): exactly the server's 20 ms.
  auto l = q.lease(*conn_, "q", "w", 1);
  auto r = q.complete(*conn_, l[0].id, l[0].fence, {.outcome = Outcome::throttled(20ms)});
  EXPECT_EQ(r.delay, Duration(20ms));
  // A 500 carries retry_limit 1: one retry, then dead, with 23 attempts still left.
  const Outcome five_hundred = classify_http_status(500, {Method::kPost, true});
  clock_.advance(20ms);
  l = q.lease(*conn_, "q", "w", 1);
  r = q.complete(*conn_, l[0].id, l[0].fence, {.outcome = five_hundred});
  EXPECT_EQ(r.status, CompleteStatus::kRetryScheduled);
  clock_.advance(r.delay);
  l = q.lease(*conn_, "q", "w", 1);
  ASSERT_EQ(l.size(), 1u);
  r = q.complete(*conn_, l[0].id, l[0].fence, {.outcome = five_hundred});
  EXPECT_EQ(r.status, CompleteStatus::kDead);
  EXPECT_NE(r.dead_reason.find("attempts exhausted (3 of 25, at most 1 retries"), std::string::npos)
      << r.dead_reason;
}

TEST_P(JobQueueTest, EveryMoveToTheDeadLetterQueueIsReportedIncludingAnExpiredLastLease) {
  std::vector<std::string> reasons;
  JobQueue q = make_queue(
      {.max_attempts = 1, .lease = 10s, .on_dead_letter = [&](std::int64_t, std::string_view why) {
         reasons.emplace_back(why);
       }});
  (void)q.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = "killed-worker"});
  (void)q.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = "poison"});
  auto l = q.lease(*conn_, "q", "w", 2);
  ASSERT_EQ(l.size(), 2u);
  (void)q.complete(*conn_, l[1].id, l[1].fence, {.outcome = Outcome::permanent(), .error = "400"});
  clock_.advance(11s);  // the first job's worker died holding its only attempt
  EXPECT_TRUE(q.lease(*conn_, "q", "w", 1).empty());
  ASSERT_EQ(reasons.size(), 2u);
  EXPECT_EQ(reasons[0], "permanent: 400");
  EXPECT_NE(reasons[1].find("attempts exhausted (1 of 1): the worker died while running it"),
            std::string::npos)
      << reasons[1];
}

TEST_P(JobQueueTest, TheDeadLetterCallbackReceivesTheReasonsKindWithItsText) {
  std::vector<std::pair<DeadReason, std::string>> dead;
  JobQueue q = make_queue({.max_attempts = 1,
                           .lease = 10s,
                           .max_age = 10s,
                           .on_dead_letter = [&](std::int64_t, const DeadLetterReason& d) {
                             dead.emplace_back(d.reason, std::string(d.text));
                           }});
  (void)q.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = "poison"});
  (void)q.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = "flaky"});
  (void)q.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = "old"});
  auto l = q.lease(*conn_, "q", "w", 3);
  ASSERT_EQ(l.size(), 3u);
  const auto r =
      q.complete(*conn_, l[0].id, l[0].fence, {.outcome = Outcome::permanent(), .error = "400"});
  EXPECT_EQ(r.dead_kind, DeadReason::kPermanent);
  (void)q.complete(*conn_, l[1].id, l[1].fence, {.outcome = Outcome::transient(), .error = "503"});
  (void)q.complete(*conn_, l[2].id, l[2].fence, {.outcome = Outcome::not_attempted(6s)});
  clock_.advance(6s);
  l = q.lease(*conn_, "q", "w", 1);
  ASSERT_EQ(l.size(), 1u);
  (void)q.complete(*conn_, l[0].id, l[0].fence, {.outcome = Outcome::not_attempted(6s)});
  ASSERT_EQ(dead.size(), 3u);
  EXPECT_EQ(dead[0].first, DeadReason::kPermanent);
  EXPECT_EQ(dead[0].second, "permanent: 400");
  EXPECT_EQ(dead[1].first, DeadReason::kAttemptsExhausted);
  EXPECT_NE(dead[1].second.find("attempts exhausted (1 of 1): 503"), std::string::npos)
      << dead[1].second;
  EXPECT_EQ(dead[2].first, DeadReason::kMaxAge);
  EXPECT_NE(dead[2].second.find("max age 10s reached"), std::string::npos) << dead[2].second;
  EXPECT_EQ(to_string(DeadReason::kPermanent), "permanent");
  EXPECT_EQ(to_string(DeadReason::kAttemptsExhausted), "attempts_exhausted");
  EXPECT_EQ(to_string(DeadReason::kMaxAge), "max_age");
}

TEST_P(JobQueueTest, EachDeadJobStoresItsKindAndTheFilterSelectsByIt) {
  JobQueue q = make_queue({.max_attempts = 1, .lease = 10s, .max_age = 30s});
  const auto enqueue = [&](const char* key) {
    return q.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = key}).id;
  };
  const std::int64_t permanent = enqueue("permanent");
  const std::int64_t exhausted = enqueue("exhausted");
  const std::int64_t crashed = enqueue("crashed");
  auto l = q.lease(*conn_, "q", "w", 3, 3);
  ASSERT_EQ(l.size(), 3u);
  (void)q.complete(*conn_, l[0].id, l[0].fence, {.outcome = Outcome::permanent(), .error = "400"});
  (void)q.complete(*conn_, l[1].id, l[1].fence, {.outcome = Outcome::transient(), .error = "503"});
  clock_.advance(11s);  // the third job's worker died holding its only attempt
  EXPECT_TRUE(q.lease(*conn_, "q", "w", 1).empty());
  const std::int64_t old = enqueue("old");
  l = q.lease(*conn_, "q", "w", 1);
  ASSERT_EQ(l.size(), 1u);
  // A deferral past its max age: dead of age, nothing charged.
  (void)q.complete(*conn_, l[0].id, l[0].fence, {.outcome = Outcome::not_attempted(40s)});

  const std::pair<std::int64_t, DeadReason> expected[] = {
      {permanent, DeadReason::kPermanent},
      {exhausted, DeadReason::kAttemptsExhausted},
      {crashed, DeadReason::kCrashed},
      {old, DeadReason::kMaxAge}};
  for (const auto& [id, kind] : expected) {
    const auto job = q.get(*conn_, id);
    ASSERT_TRUE(job) << id;
    ASSERT_EQ(job->state, JobState::kDead) << id;
    EXPECT_EQ(job->dead_kind, kind) << id << " " << job->dead_reason;
    const auto selected = dead_letters::select(*conn_, {.kind = kind});
    ASSERT_EQ(selected.size(), 1u) << to_string(kind);
    EXPECT_EQ(selected[0].id, id);
    EXPECT_EQ(selected[0].kind, kind);
  }
  EXPECT_EQ(dead_letters::select(*conn_, {}).size(), 4u) << "no kind: every dead job";
  // A replay clears the kind with the reason; the job's next death stores its own.
  ASSERT_EQ(q.replay(*conn_, {crashed}), std::vector<std::int64_t>{crashed});
  EXPECT_FALSE(q.get(*conn_, crashed)->dead_kind);
  EXPECT_TRUE(dead_letters::select(*conn_, {.kind = DeadReason::kCrashed}).empty());
  // The names the command line takes.
  EXPECT_EQ(parse_dead_reason("exhausted"), DeadReason::kAttemptsExhausted);
  EXPECT_EQ(parse_dead_reason("max-age"), DeadReason::kMaxAge);
  EXPECT_EQ(parse_dead_reason("crashed"), DeadReason::kCrashed);
  EXPECT_FALSE(parse_dead_reason("Permanent"));
  EXPECT_FALSE(parse_dead_reason(""));
}

TEST_P(JobQueueTest, ACrashChargesOnlyTheJobsWhoseAttemptStarted) {
  JobQueue q = make_queue({.lease = 10s});
  std::vector<std::int64_t> ids;
  for (int i = 0; i < 4; ++i) {
    ids.push_back(q.enqueue(*conn_, {.queue = "q", .payload = "{}"}).id);
  }
  // A batch of 4 of which the lease starts 1; the worker starts the second, then dies.
  const auto batch = q.lease(*conn_, "q", "w1", 4, 1);
  ASSERT_EQ(batch.size(), 4u);
  EXPECT_TRUE(batch[0].started);
  for (std::size_t i = 1; i < 4; ++i) {
    EXPECT_FALSE(batch[i].started) << i;
    EXPECT_EQ(batch[i].attempt, 1) << "the attempt it will be when it starts";
  }
  EXPECT_EQ(count("SELECT SUM(attempts) FROM keel_jobs"), 1);
  ASSERT_TRUE(q.start(*conn_, batch[1].id, batch[1].fence));
  ASSERT_TRUE(q.start(*conn_, batch[1].id, batch[1].fence)) << "start is idempotent";
  EXPECT_EQ(count("SELECT SUM(attempts) FROM keel_jobs"), 2);
  clock_.advance(11s);
  const auto next = q.lease(*conn_, "q", "w2", 4);
  // The two unstarted jobs are ready again as they were, and leased at once; the two started
  // ones are charged and wait for their backoff.
  ASSERT_EQ(next.size(), 2u);
  EXPECT_EQ(next[0].id, ids[2]);
  EXPECT_EQ(next[1].id, ids[3]);
  EXPECT_EQ(next[0].attempt, 1);
  EXPECT_EQ(next[1].attempt, 1);
  for (int i = 0; i < 2; ++i) {
    const auto job = q.get(*conn_, ids[i]);
    EXPECT_EQ(job->state, JobState::kRetryScheduled) << i;
    EXPECT_EQ(job->attempts, 1) << i;
    ASSERT_EQ(job->history.size(), 1u) << i;
    EXPECT_EQ(job->history[0].outcome, "lease_expired");
    EXPECT_NE(job->history[0].error.find("the worker died while running it"), std::string::npos);
  }
  EXPECT_TRUE(q.get(*conn_, ids[2])->history.empty()) << "an unstarted job has no lost attempt";
  // The first worker comes back: its lease is gone and it may not start the job.
  EXPECT_FALSE(q.start(*conn_, batch[2].id, batch[2].fence));
}

TEST_P(JobQueueTest, ASuccessIsRecordedWithTheStartOfTheNextJobOfTheBatch) {
  JobQueue q = make_queue({.lease = 10s});
  std::vector<EnqueueRequest> reqs(3, EnqueueRequest{.queue = "q", .payload = "{}"});
  (void)q.enqueue_many(*conn_, reqs);
  const auto batch = q.lease(*conn_, "q", "w1", 3, 1);
  ASSERT_EQ(batch.size(), 3u);
  // The first job succeeded: its success and the second job's start in one step.
  const DoneAndStarted step =
      q.complete_and_start(*conn_, {{batch[0].id, batch[0].fence}}, batch[1].id, batch[1].fence);
  EXPECT_EQ(step.current, 1);
  EXPECT_TRUE(step.started);
  EXPECT_EQ(q.get(*conn_, batch[0].id)->state, JobState::kDone);
  EXPECT_EQ(q.get(*conn_, batch[0].id)->attempts, 1);
  EXPECT_EQ(count("SELECT SUM(attempts) FROM keel_jobs"), 2);
  // The worker dies running the second: it alone is charged, the first stays done and the third
  // comes back uncharged.
  clock_.advance(11s);
  const auto next = q.lease(*conn_, "q", "w2", 3);
  ASSERT_EQ(next.size(), 1u);
  EXPECT_EQ(next[0].id, batch[2].id);
  EXPECT_EQ(next[0].attempt, 1);
  EXPECT_EQ(q.get(*conn_, batch[0].id)->state, JobState::kDone);
  EXPECT_EQ(q.get(*conn_, batch[1].id)->state, JobState::kRetryScheduled);
  // The first worker comes back: nothing of it is current any more, and nothing changes.
  const DoneAndStarted late =
      q.complete_and_start(*conn_, {{batch[1].id, batch[1].fence}}, batch[2].id, batch[2].fence);
  EXPECT_EQ(late.current, 0);
  EXPECT_FALSE(late.started);
  EXPECT_EQ(q.get(*conn_, batch[1].id)->state, JobState::kRetryScheduled);
  EXPECT_EQ(q.get(*conn_, batch[2].id)->fence, next[0].fence);
}

TEST_P(JobQueueTest, AWorkerRecordsEachSuccessOfABatchInOrderAndOnce) {
  ConnectionPool pool(url(), {.max_connections = 4});
  JobQueue q = make_queue();
  std::vector<EnqueueRequest> reqs(12, EnqueueRequest{.queue = "q", .payload = "{}"});
  (void)q.enqueue_many(*conn_, reqs);
  std::mutex mu;
  std::vector<std::pair<std::int64_t, CompleteStatus>> events;
  std::size_t runs = 0;
  Worker worker(pool, q,
                {.queue = "q",
                 .batch = 5,
                 .poll_interval = 1ms,
                 .exit_when_idle = true,
                 .on_event =
                     [&](const WorkerEvent& e) {
                       std::lock_guard lock(mu);
                       events.emplace_back(e.job.id, e.result.status);
                     }},
                [&](const LeasedJob& job, const std::atomic<bool>&) {
                  std::lock_guard lock(mu);
                  // A batch starts none of its jobs: a crash now would charge none of them.
                  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'running'"
                                  " AND started_ms IS NOT NULL"),
                            0)
                      << job.id;
                  ++runs;
                  return job.id % 4 == 0
                             ? AttemptReport{.outcome = Outcome::permanent(), .error = "no"}
                             : AttemptReport::success();
                });
  EXPECT_EQ(worker.run(), 12);
  ASSERT_EQ(events.size(), 12u);
  for (std::size_t i = 0; i < events.size(); ++i) {
    const auto [id, status] = events[i];
    if (i > 0) {
      EXPECT_LT(events[i - 1].first, id);
    }
    EXPECT_EQ(status, id % 4 == 0 ? CompleteStatus::kDead : CompleteStatus::kDone) << id;
  }
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done' AND attempts = 1"),
            count("SELECT COUNT(*) FROM keel_jobs WHERE id % 4 <> 0"));
}

// A batch's failures wait in the buffer with its successes and are recorded together, in one
// transaction a flush: a batch of failures costs about what a batch of successes does, not a
// transaction a job.
TEST_P(JobQueueTest, ABatchedWorkerRecordsItsFailuresTogetherNotOneTransactionEach) {
  std::atomic<std::int64_t> transactions{0};
  ConnectionPool pool(
      url(), {.max_connections = 4, .open = [&](const DatabaseUrl& u, const ConnectOptions& o) {
                return std::make_unique<test::CountingConnection>(open_database(u, o),
                                                                  transactions);
              }});
  std::vector<std::int64_t> dead;
  // One attempt a job, so that every job ends (a retry would wait for the manual clock).
  JobQueue q =
      make_queue({.max_attempts = 1, .on_dead_letter = [&](std::int64_t id, std::string_view) {
                    dead.push_back(id);
                  }});
  constexpr int kJobs = 60;
  constexpr int kBatch = 10;
  std::vector<EnqueueRequest> reqs(kJobs, EnqueueRequest{.queue = "q", .payload = "{}"});
  (void)q.enqueue_many(*conn_, reqs);
  std::vector<CompleteStatus> statuses;
  Worker worker(pool, q,
                // A flush window no run reaches: the flushes counted are the batches' own.
                {.queue = "q",
                 .batch = kBatch,
                 .flush_window = 1h,
                 .poll_interval = 1ms,
                 .exit_when_idle = true,
                 .on_event = [&](const WorkerEvent& e) { statuses.push_back(e.result.status); }},
                [&](const LeasedJob& job, const std::atomic<bool>&) {
                  // Every job fails, every third one permanently.
                  return job.id % 3 == 0
                             ? AttemptReport{.outcome = Outcome::permanent(), .error = "400"}
                             : AttemptReport{.outcome = Outcome::transient(), .error = "503"};
                });
  EXPECT_EQ(worker.run(), kJobs);
  ASSERT_EQ(statuses.size(), static_cast<std::size_t>(kJobs));
  for (const CompleteStatus s : statuses) EXPECT_EQ(s, CompleteStatus::kDead) << to_string(s);
  EXPECT_EQ(dead.size(), static_cast<std::size_t>(kJobs));
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'dead' AND attempts = 1 AND"
                  " ((id % 3 = 0 AND dead_kind = 'permanent' AND last_error = '400') OR"
                  " (id % 3 <> 0 AND dead_kind = 'attempts_exhausted' AND last_error = '503'))"),
            kJobs);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_job_attempts"), kJobs);
  // A lease and a flush a batch, and the worker's last looks; one failure recorded at a time
  // took a transaction each (60).
  EXPECT_LE(transactions.load(), 2 * kJobs / kBatch + 6) << transactions.load();
}

TEST_P(JobQueueTest, ABatchWhoseLeaseExpiresComesBackUnchargedAndCounted) {
  JobQueue q = make_queue({.lease = 10s});
  std::vector<EnqueueRequest> reqs(4, EnqueueRequest{.queue = "q", .payload = "{}"});
  (void)q.enqueue_many(*conn_, reqs);
  // A batch, none of it started (a Worker's lease of more than one job); one success recorded.
  const auto batch = q.lease(*conn_, "q", "w1", 4, 0);
  ASSERT_EQ(batch.size(), 4u);
  for (const LeasedJob& j : batch) {
    EXPECT_FALSE(j.started);
    EXPECT_EQ(j.crashed_batches, 0);
  }
  EXPECT_EQ(q.complete_done_ids(*conn_, {{batch[0].id, batch[0].fence}}),
            std::vector<std::int64_t>{batch[0].id});
  // The worker dies: the three without an outcome come back uncharged, each counted.
  clock_.advance(11s);
  const auto again = q.lease(*conn_, "q", "w2", 4, 0);
  ASSERT_EQ(again.size(), 3u);
  for (const LeasedJob& j : again) {
    EXPECT_EQ(j.attempt, 1) << j.id;
    EXPECT_EQ(j.crashed_batches, 1) << j.id;
  }
  EXPECT_EQ(q.returned_after_crash(), 3);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_job_attempts"), 0) << "a crash charged an attempt";
  EXPECT_EQ(q.get(*conn_, batch[0].id)->crashed_batches, 0);
  // A suspect started alone and killed is charged, as any started job.
  ASSERT_TRUE(q.start(*conn_, again[0].id, again[0].fence));
  clock_.advance(11s);
  (void)q.lease(*conn_, "q", "w3", 4, 0);
  const auto charged = q.get(*conn_, again[0].id);
  EXPECT_EQ(charged->state, JobState::kRetryScheduled);
  EXPECT_EQ(charged->attempts, 1);
  EXPECT_EQ(charged->crashed_batches, 1) << "a started job's crash is charged, not counted";
  EXPECT_EQ(q.get(*conn_, again[1].id)->crashed_batches, 2);
  EXPECT_EQ(q.returned_after_crash(), 5);
}

TEST_P(JobQueueTest, ABatchedWorkerRunsEachSuspectAloneWithItsStartCommitted) {
  ConnectionPool pool(url(), {.max_connections = 5});
  // The calendar clock: an idle worker's looks on PostgreSQL wait out a lease floor's second.
  JobQueue q;
  std::vector<EnqueueRequest> reqs(40, EnqueueRequest{.queue = "q", .payload = "{}"});
  (void)q.enqueue_many(*conn_, reqs);
  // Every fourth job was in a batch that crashed.
  conn_->query("UPDATE keel_jobs SET crashed_batches = 1 WHERE id % 4 = 0");
  const std::int64_t suspects = count("SELECT COUNT(*) FROM keel_jobs WHERE crashed_batches > 0");
  std::atomic<int> running{0};
  std::atomic<int> overlapped{0};
  std::atomic<int> suspects_run{0};
  Worker worker(
      pool, q,
      {.queue = "q", .concurrency = 3, .batch = 5, .poll_interval = 1ms, .exit_when_idle = true},
      [&](const LeasedJob& job, const std::atomic<bool>&) {
        const int now = running.fetch_add(1) + 1;
        if (job.crashed_batches > 0) {
          suspects_run.fetch_add(1);
          // Alone in its worker: a crash now is charged to it alone.
          if (now != 1) overlapped.fetch_add(1);
        }
        // A handler that takes a moment, so that the slots' runs overlap.
        std::this_thread::sleep_for(std::chrono::microseconds(300));
        if (job.crashed_batches > 0 && running.load() != 1) overlapped.fetch_add(1);
        running.fetch_sub(1);
        return AttemptReport::success();
      });
  EXPECT_EQ(worker.run(), 40);
  EXPECT_EQ(suspects_run.load(), suspects);
  EXPECT_EQ(overlapped.load(), 0) << "a suspect ran beside another handler of its worker";
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done' AND attempts = 1"), 40);
}

TEST_P(JobQueueTest, AStoppingBatchedWorkerRecordsItsBufferAndHandsBackTheRestUncharged) {
  ConnectionPool pool(url(), {.max_connections = 3});
  JobQueue q = make_queue();
  std::vector<EnqueueRequest> reqs(10, EnqueueRequest{.queue = "q", .payload = "{}"});
  (void)q.enqueue_many(*conn_, reqs);
  int ran = 0;
  Worker* self = nullptr;
  Worker worker(pool, q, {.queue = "q", .batch = 10, .poll_interval = 1ms},
                [&](const LeasedJob&, const std::atomic<bool>&) {
                  // SIGTERM arrives while the fifth job runs.
                  if (++ran == 5) self->stop();
                  return AttemptReport::success();
                });
  self = &worker;
  EXPECT_EQ(worker.run(), 5);
  EXPECT_EQ(ran, 5);
  // The five successes were in the buffer: recorded, each once; the five not run are ready,
  // uncharged, and not counted as in a crashed batch.
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done' AND attempts = 1"), 5);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'ready' AND attempts = 0"), 5);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE crashed_batches <> 0"), 0);
  EXPECT_EQ(worker.released(), 5);
}

TEST_P(JobQueueTest, TheDoneRetentionDeletesABacklogLargerThanABatchInOnePass) {
  ConnectionPool pool(url(), {.max_connections = 3});
  JobQueue q = make_queue({.lease = 10s});
  constexpr int kDone = 2500;  // two and a half of prune_done's batches
  std::vector<EnqueueRequest> reqs(kDone, EnqueueRequest{.queue = "q", .payload = "{}"});
  (void)q.enqueue_many(*conn_, reqs);
  std::vector<std::pair<std::int64_t, std::int64_t>> done;
  for (const LeasedJob& j : q.lease(*conn_, "q", "w", kDone)) done.emplace_back(j.id, j.fence);
  ASSERT_EQ(q.complete_done(*conn_, done), kDone);
  clock_.advance(2h);
  (void)q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  std::int64_t left = -1;
  Worker worker(pool, q,
                {.queue = "q",
                 .poll_interval = 1ms,
                 .heartbeat_interval = 5ms,
                 .exit_when_idle = true,
                 .done_retention = 1h},
                [&](const LeasedJob&, const std::atomic<bool>&) {
                  // The heartbeat thread's first pass prunes while this job runs.
                  const auto deadline = std::chrono::steady_clock::now() + 10s;
                  do {
                    left = count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'");
                    // wait: bound: the worker's first pruning pass, at most 10 s
                    std::this_thread::sleep_for(5ms);
                  } while (left > 0 && std::chrono::steady_clock::now() < deadline);
                  return AttemptReport::success();
                });
  EXPECT_EQ(worker.run(), 1);
  EXPECT_EQ(left, 0) << "one pass left done jobs older than the retention";
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_job_attempts"), 0);
}

TEST_P(JobQueueTest, AReleaseChargesAStartedJobSoNothingLoopsUnseen) {
  std::vector<std::string> reasons;
  JobQueue q = make_queue(
      {.max_attempts = 3,
       .backoff = {.base = 1ms, .cap = 1ms},
       .on_dead_letter = [&](std::int64_t, std::string_view why) { reasons.emplace_back(why); }});
  const auto job = q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  // Released before it started (a shutdown with the job still waiting in a batch): not charged,
  // however often it happens.
  for (int i = 0; i < 5; ++i) {
    const auto l = q.lease(*conn_, "q", "w", 1, 0);
    ASSERT_EQ(l.size(), 1u);
    ASSERT_TRUE(q.release(*conn_, l[0].id, l[0].fence, "worker stopping; not started"));
  }
  EXPECT_EQ(q.get(*conn_, job.id)->attempts, 0);
  EXPECT_EQ(q.get(*conn_, job.id)->state, JobState::kReady);
  // A handler that outlives the grace on every shutdown: each release is an attempt, and the
  // third is the last.
  for (int i = 0; i < 3; ++i) {
    clock_.advance(10ms);
    const auto l = q.lease(*conn_, "q", "w", 1);
    ASSERT_EQ(l.size(), 1u) << i;
    ASSERT_TRUE(q.release(*conn_, l[0].id, l[0].fence, "worker stopped; grace period over"));
  }
  const auto stored = q.get(*conn_, job.id);
  EXPECT_EQ(stored->state, JobState::kDead);
  EXPECT_EQ(stored->attempts, 3);
  ASSERT_EQ(reasons.size(), 1u);
  EXPECT_EQ(reasons[0], "attempts exhausted (3 of 3): worker stopped; grace period over");
}

// The lines of `log` from byte `from` on that say PostgreSQL broke a deadlock in one of the
// backends `pids` (its default log_line_prefix, "%m [%p] ", names the victim's pid).
std::vector<std::string> deadlocks_logged(const std::filesystem::path& log, std::streamoff from,
                                          const std::set<std::string>& pids) {
  std::ifstream in(log);
  in.seekg(from);
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) {
    if (line.find("deadlock detected") == std::string::npos) continue;
    const std::size_t open = line.find(" [");
    const std::size_t close = line.find(']', open == std::string::npos ? 0 : open);
    if (open == std::string::npos || close == std::string::npos) continue;
    if (pids.contains(line.substr(open + 2, close - open - 2))) out.push_back(line);
  }
  return out;
}

TEST_P(JobQueueTest, ManyWorkerThreadsDrainOneQueueWithoutDeadlocksOrLeaseExpiries) {
  // Real time: the worker's threads and the database decide the interleaving. The drill of
  // docs/queue.md: on PostgreSQL, 8 and 16 threads, unbatched and in batches of 10, and not one
  // deadlock in the server's log (each costs a deadlock_timeout) nor seen by the queue. The long
  // drill runs in the optimised build; the sanitizer builds drain fewer jobs.
  const bool pg = GetParam() == Backend::kPostgres;
  const int jobs = !pg ? 600 : test::kTimingAsserted ? 10000 : 1000;
  JobQueue q({.lease = 30s, .seed = 3});
  {
    std::vector<EnqueueRequest> batch;
    for (int i = 0; i < jobs; ++i) batch.push_back({.queue = "q", .payload = "{}"});
    for (const auto& r : q.enqueue_many(*conn_, batch)) ASSERT_TRUE(r.ok()) << r.error;
  }
  // The drill's connections are named, so that the server log's lines can be told from those of
  // tests running beside it.
  const std::string app = "keel_drill_" + std::to_string(getpid());
  const std::string drill_url = url_text() + "&application_name=" + app;
  const auto server_log = pg ? test::postgres_server_log() : std::nullopt;
  const std::streamoff log_from =
      server_log ? static_cast<std::streamoff>(std::filesystem::file_size(*server_log)) : 0;
  std::set<std::string> pids;
  bool first = true;
  for (const int batch : {1, 10}) {
    for (const int threads : {8, 16}) {
      if (!first) {
        conn_->execute(
            "UPDATE keel_jobs SET state = 'ready', attempts = 0, run_at_ms = 0,"
            " started_ms = NULL");
      }
      first = false;
      ConnectionPool pool(parse_database_url(pg ? drill_url : url_text()).value(),
                          {.max_connections = threads + 2});
      std::mutex mu;
      std::vector<std::string> lines;
      Worker worker(
          pool, q,
          {.queue = "q",
           .concurrency = threads,
           .batch = batch,
           .poll_interval = 5ms,
           .exit_when_idle = true,
           .log =
               [&](std::string_view line) {
                 std::lock_guard lock(mu);
                 lines.emplace_back(line);
               }},
          [](const LeasedJob&, const std::atomic<bool>&) { return AttemptReport::success(); });
      const std::string shape =
          std::to_string(threads) + " threads, batch " + std::to_string(batch);
      EXPECT_EQ(worker.run(), jobs) << shape;
      if (pg) {
        const Rows r = conn_->query(
            "SELECT pid::text FROM pg_stat_activity WHERE application_name = $1", {app});
        for (std::size_t i = 0; i < r.size(); ++i) pids.insert(*r.cell(i, 0));
      }
      std::string log;
      for (const auto& l : lines) log += l + "\n";
      EXPECT_EQ(log.find("40P01"), std::string::npos) << log;
      EXPECT_EQ(log.find("deadlock"), std::string::npos) << log;
      EXPECT_TRUE(lines.empty()) << log;
      EXPECT_EQ(q.deadlocks(), 0) << shape;
      EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done' AND attempts = 1"), jobs)
          << shape << ": a job ran more than once";
      EXPECT_EQ(count("SELECT COUNT(*) FROM keel_job_attempts"), 0) << shape;
    }
  }
  if (server_log) {
    EXPECT_FALSE(pids.empty()) << "no connection named " << app;
    const auto found = deadlocks_logged(*server_log, log_from, pids);
    std::string text;
    for (const auto& l : found) text += l + "\n";
    EXPECT_TRUE(found.empty()) << found.size() << " deadlock(s) in " << server_log->string()
                               << ":\n"
                               << text;
  }
}

TEST_P(JobQueueTest, ADeadlockIsRetriedCountedAndLoggedOnceByTheWorker) {
  // A real deadlock: another session holds job b and then asks for job a while the queue records
  // both successes (it locks a, then waits for b). PostgreSQL breaks it (this session detects it
  // first: its deadlock_timeout is the shorter); the queue retries, counts it, and the worker
  // built before says so in one line.
  if (GetParam() != Backend::kPostgres) GTEST_SKIP() << "SQLite has one writer: no deadlock";
  JobQueue q = make_queue();
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(q.enqueue(*conn_, {.queue = "q", .payload = "{}"}).ok());
  const auto leased = q.lease(*conn_, "q", "w", 2);
  ASSERT_EQ(leased.size(), 2u);
  const LeasedJob& a = leased[0].id < leased[1].id ? leased[0] : leased[1];
  const LeasedJob& b = leased[0].id < leased[1].id ? leased[1] : leased[0];
  ConnectionPool pool(url(), {.max_connections = 2});
  std::mutex mu;
  std::vector<std::string> lines;
  Worker worker(
      pool, q,
      {.queue = "q",
       .poll_interval = 5ms,
       .exit_when_idle = true,
       .log =
           [&](std::string_view line) {
             std::lock_guard lock(mu);
             lines.emplace_back(line);
           }},
      [](const LeasedJob&, const std::atomic<bool>&) { return AttemptReport::success(); });
  // The queue's session checks for a deadlock 3 s into its wait, once: the other session must
  // wait too by then (it asks at once; 1 s was missed once on a loaded machine, and PostgreSQL
  // then broke the deadlock on the other side, 10 s into its wait).
  auto keel_conn = open_database(url());
  keel_conn->execute("SET deadlock_timeout = '3s'");
  const std::int64_t keel_pid = keel_conn->query("SELECT pg_backend_pid()").integer(0, 0);
  auto other = open_database(url());
  other->execute("SET deadlock_timeout = '30s'");
  other->execute("BEGIN");
  other->query("SELECT id FROM keel_jobs WHERE id = $1 FOR UPDATE", {b.id});
  std::atomic<int> done{-1};
  std::thread recorder([&] {
    done = q.complete_done(*keel_conn, {{a.id, a.fence}, {b.id, b.fence}});
  });
  // Wait until the queue's statement holds a and waits for b, then ask for a.
  for (int i = 0; i < 500; ++i) {
    if (count("SELECT COUNT(*) FROM pg_locks WHERE NOT granted AND pid = " +
              std::to_string(keel_pid)) > 0) {
      break;
    }
    std::this_thread::sleep_for(10ms);
  }
  try {
    other->query("SELECT id FROM keel_jobs WHERE id = $1 FOR UPDATE", {a.id});
    other->execute("COMMIT");
  } catch (const std::exception&) {
    other->execute("ROLLBACK");
  }
  recorder.join();
  EXPECT_EQ(done.load(), 2);
  EXPECT_EQ(q.deadlocks(), 1);
  EXPECT_EQ(worker.run(), 0);
  std::string log;
  for (const auto& l : lines) log += l + "\n";
  ASSERT_EQ(lines.size(), 1u) << log;
  EXPECT_NE(lines[0].find("deadlock"), std::string::npos) << log;
  EXPECT_NE(lines[0].find("1 so far"), std::string::npos) << log;
}

TEST_P(JobQueueTest, AWorkerPausesLeasingWhileTheBrakeRefuses) {
  ConnectionPool pool(url(), {.max_connections = 4});
  JobQueue q = make_queue();
  std::vector<EnqueueRequest> batch(3, EnqueueRequest{.queue = "q", .payload = "{}"});
  (void)q.enqueue_many(*conn_, batch);
  std::atomic<int> calls{0};
  Worker worker(pool, q, {.queue = "q", .batch = 3, .poll_interval = 1ms, .exit_when_idle = true},
                [&](const LeasedJob&, const std::atomic<bool>&) {
                  // The first call finds the breaker open for 5 s (virtual time).
                  return calls.fetch_add(1) == 0
                             ? AttemptReport{.outcome = Outcome::not_attempted(5s),
                                             .error = "circuit open"}
                             : AttemptReport::success();
                });
  std::thread runner([&] { (void)worker.run(); });
  // The other two jobs of the batch are deferred without running, and nothing is leased while
  // the clock stands still.
  for (int i = 0; i < 2000 && count("SELECT COUNT(*) FROM keel_jobs WHERE deferrals > 0") < 3;
       ++i) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE deferrals > 0"), 3);
  EXPECT_GT(worker.paused_for(), Duration::zero());
  std::this_thread::sleep_for(50ms);  // 50 poll intervals: a worker that did not pause would run
  EXPECT_EQ(calls.load(), 1);
  clock_.advance(5s);
  runner.join();  // exits when idle: all three delivered after the pause
  EXPECT_EQ(calls.load(), 4);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done' AND attempts = 1"), 3);
}

TEST_P(JobQueueTest, TheStateCheckAcceptsTheFiveStatesAndNothingElse) {
  JobQueue q = make_queue();
  const auto job = q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  ASSERT_TRUE(job.ok());
  for (const char* state : {"ready", "running", "retry_scheduled", "done", "dead"}) {
    EXPECT_NO_THROW(conn_->query("UPDATE keel_jobs SET state = $1 WHERE id = $2", {state, job.id}))
        << state;
  }
  for (const char* state : {"bogus", "Ready", "", "done "}) {
    EXPECT_THROW(conn_->query("UPDATE keel_jobs SET state = $1 WHERE id = $2", {state, job.id}),
                 DatabaseError)
        << state;
  }
}

// How many temporary b-trees SQLite would build to run sql (EXPLAIN's OpenEphemeral), compiled
// against the connection's schema now: each call's text is new, so the connection's statement
// cache never hands back a listing compiled against a schema since replaced (SQLite checks a
// statement's schema when it runs, not when EXPLAIN lists it).
int temp_btrees(Connection& conn, const std::string& sql) {
  static int calls = 0;
  const Rows plan = conn.query("EXPLAIN " + sql + " -- " + std::to_string(++calls));
  int n = 0;
  for (std::size_t i = 0; i < plan.size(); ++i) n += plan.text(i, 1) == "OpenEphemeral";
  return n;
}

constexpr const char* kWriteJob = "UPDATE keel_jobs SET state = 'done' WHERE id = 1";
constexpr const char* kInsertJob =
    "INSERT INTO keel_jobs (queue, payload, idem_key, state, attempts, max_attempts, run_at_ms,"
    " fence, replays, created_ms, updated_ms) VALUES ('q', '{}', 'k', 'ready', 0, 1, 0, 0, 0, 0, "
    "0)";

TEST(SqliteJobQueueSchema, WritingAJobBuildsNoTemporaryBTree) {
  test::TempDir dir;
  auto conn = open_database(parse_database_url("sqlite:" + (dir.path() / "q.db").string()).value());
  JobQueue::migrate(*conn);
  EXPECT_EQ(temp_btrees(*conn, kWriteJob), 0);
  EXPECT_EQ(temp_btrees(*conn, kInsertJob), 0);
  // What the check used to cost: a five-value IN list is one.
  EXPECT_EQ(temp_btrees(*conn, "SELECT 1 WHERE 'a' IN ('a', 'b', 'c', 'd', 'e')"), 1);
}

// A database from before schema version 4 has the CHECK as an IN list: the migration rewrites it,
// keeps every job and its history, and connections open at the time reread the schema.
TEST(SqliteJobQueueSchema, AnOlderDatabaseGetsTheCheckRewrittenAndKeepsItsJobs) {
  test::TempDir dir;
  const auto url = parse_database_url("sqlite:" + (dir.path() / "q.db").string()).value();
  auto conn = open_database(url);
  JobQueue::migrate(*conn);
  ManualClock clock;
  JobQueue q({.clock = &clock, .seed = 1});
  const auto job = q.enqueue(*conn, {.queue = "q", .payload = R"({"n":1})", .key = "k-1"});
  auto leased = q.lease(*conn, "q", "w", 1);
  ASSERT_EQ(leased.size(), 1u);
  ASSERT_EQ(
      q.complete(*conn, leased[0].id, leased[0].fence, {.outcome = Outcome::transient()}).status,
      CompleteStatus::kRetryScheduled);
  // A job that died before version 8 has its kind read from its reason.
  const auto dies = q.enqueue(*conn, {.queue = "d", .payload = R"({"n":3})", .key = "k-3"});
  auto dying = q.lease(*conn, "d", "w", 1);
  ASSERT_EQ(dying.size(), 1u);
  ASSERT_EQ(
      q.complete(*conn, dying[0].id, dying[0].fence, {.outcome = Outcome::permanent()}).status,
      CompleteStatus::kDead);
  // A job running when the upgrade comes was charged at its lease under the old rules.
  (void)q.enqueue(*conn, {.queue = "q", .payload = R"({"n":2})", .key = "k-2"});
  ASSERT_EQ(q.lease(*conn, "q", "w", 1).size(), 1u);
  // Back to version 3's form, as an older keel left it.
  conn->execute(
      "DROP INDEX keel_jobs_running;"
      "DROP INDEX keel_jobs_dead;"
      "DROP INDEX keel_jobs_given_key;"
      "CREATE UNIQUE INDEX keel_jobs_key ON keel_jobs (queue, idem_key);"
      "ALTER TABLE keel_jobs DROP COLUMN key_made;"
      "CREATE INDEX keel_jobs_due ON keel_jobs (queue, state, run_at_ms);"
      "ALTER TABLE keel_jobs DROP COLUMN dead_kind;"
      "ALTER TABLE keel_jobs DROP COLUMN started_ms;"
      "ALTER TABLE keel_jobs DROP COLUMN crashed_batches;"
      "PRAGMA writable_schema = ON;"
      "UPDATE sqlite_master SET sql = replace(sql,"
      " 'CHECK (state = ''ready'' OR state = ''running'' OR state = ''retry_scheduled''"
      " OR state = ''done'' OR state = ''dead'')',"
      " 'CHECK (state IN  (''ready'', ''running'', ''retry_scheduled'', ''done'', ''dead''))')"
      " WHERE type = 'table' AND name = 'keel_jobs';"
      "PRAGMA writable_schema = RESET;"
      "UPDATE keel_schema SET version = 3 WHERE component = 'queue';");
  conn.reset();
  auto old = open_database(url);
  ASSERT_EQ(temp_btrees(*old, kWriteJob), 1) << "the test did not restore the older form";
  auto upgrading = open_database(url);
  JobQueue::migrate(*upgrading);
  EXPECT_EQ(schema_version(*upgrading, "queue"), 12);
  // Version 12: every job written before counts as given, its key in the key index.
  EXPECT_EQ(upgrading->query("SELECT COUNT(*) FROM keel_jobs WHERE key_made <> 0").integer(0, 0),
            0);
  // Version 11: no job was in a crashed batch.
  EXPECT_EQ(
      upgrading->query("SELECT COUNT(*) FROM keel_jobs WHERE crashed_batches <> 0").integer(0, 0),
      0);
  // Version 9: the running and dead jobs' partial indexes in place of keel_jobs_due.
  EXPECT_EQ(upgrading
                ->query("SELECT group_concat(name, ' ') FROM (SELECT name FROM sqlite_master"
                        " WHERE type = 'index' AND tbl_name = 'keel_jobs' AND sql IS NOT NULL"
                        " ORDER BY name)")
                .text(0, 0),
            "keel_jobs_dead keel_jobs_given_key keel_jobs_ready keel_jobs_running");
  // Version 8: the dead job's kind, from its reason.
  const auto dead = q.get(*upgrading, dies.id);
  ASSERT_TRUE(dead);
  EXPECT_EQ(dead->dead_kind, DeadReason::kPermanent);
  EXPECT_EQ(temp_btrees(*upgrading, kWriteJob), 0);
  // Version 5: the running job counts as started, so a crash now still charges it.
  EXPECT_EQ(upgrading
                ->query("SELECT COUNT(*) FROM keel_jobs WHERE state = 'running'"
                        " AND started_ms IS NOT NULL")
                .integer(0, 0),
            1);
  // A connection open during the migration sees the change at its next transaction.
  EXPECT_EQ(old->query("SELECT COUNT(*) FROM keel_jobs").integer(0, 0), 3);
  EXPECT_EQ(temp_btrees(*old, kWriteJob), 0) << "a connection open during the migration";
  const Rows sql =
      upgrading->query("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'keel_jobs'");
  EXPECT_NE(sql.text(0, 0).find("state = 'retry_scheduled' OR"), std::string::npos);
  EXPECT_EQ(sql.text(0, 0).find(" IN "), std::string::npos);
  EXPECT_THROW(old->query("UPDATE keel_jobs SET state = 'bogus'"), DatabaseError);
  const auto after = q.get(*upgrading, job.id);
  ASSERT_TRUE(after);
  EXPECT_EQ(after->state, JobState::kRetryScheduled);
  EXPECT_EQ(after->payload, R"({"n":1})");
  ASSERT_EQ(after->history.size(), 1u);
  EXPECT_EQ(upgrading->query("PRAGMA integrity_check").text(0, 0), "ok");
}

INSTANTIATE_TEST_SUITE_P(Backends, JobQueueTest,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

}  // namespace
}  // namespace keel::store
