// What the job queue's source files share (src/queue*.cpp, one file per role of
// JobQueue): time and text conversions, the transaction wrapper, the attempt-history insert,
// the optional-queue filter and the column lists a Job and a job being settled are read from,
// each with the one function that reads its row (RowCursor). Private to keel::store_queue;
// the schema itself lives only in queue.cpp. Stateless functions: safe from any thread, each
// call on the Connection it is given.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "db/detail/commit.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/text.hpp"
#include "keel/db/database.hpp"
#include "keel/db/row_cursor.hpp"
#include "keel/queue/queue.hpp"

namespace keel::store::detail {

// The longest error text stored with a job or an attempt, in bytes.
inline constexpr std::size_t kMaxErrorText = 2000;

using keel::to_ms;  // keel/core/duration.hpp: whole milliseconds, truncated

// An error, reason or history text as the queue stores it: valid UTF-8 without NUL within
// kMaxErrorText bytes (keel::storable_text), whatever bytes a handler reported, so that an
// outcome is recorded on every backend (PostgreSQL's TEXT refuses the others).
[[nodiscard]] inline std::string clip(std::string_view s) {
  return storable_text(s, kMaxErrorText);
}

// Runs fn in one transaction, retrying lost races; throws DatabaseError when it cannot commit.
inline void in_transaction(Connection& conn, const std::function<bool(Connection&)>& fn) {
  commit_or_throw(conn, "job queue", fn);
}

// Runs fn, one statement atomic on its own, retried as a transaction is (statement_or_throw).
inline void in_statement(Connection& conn, const std::function<bool(Connection&)>& fn) {
  statement_or_throw(conn, "job queue", fn);
}

// fn, counting in `deadlocks` each deadlock PostgreSQL reported to it (40P01; the retry runs it
// again).
[[nodiscard]] inline std::function<bool(Connection&)> counting_deadlocks(
    std::atomic<std::int64_t>& deadlocks, const std::function<bool(Connection&)>& fn) {
  return [&deadlocks, &fn](Connection& c) {
    try {
      return fn(c);
    } catch (const DatabaseError& e) {
      if (e.details().sqlstate == "40P01") deadlocks.fetch_add(1);
      throw;
    }
  };
}

// in_transaction and in_statement, counting deadlocks (JobQueue::deadlocks()).
inline void in_transaction(std::atomic<std::int64_t>& deadlocks, Connection& conn,
                           const std::function<bool(Connection&)>& fn) {
  commit_or_throw(conn, "job queue", counting_deadlocks(deadlocks, fn));
}
inline void in_statement(std::atomic<std::int64_t>& deadlocks, Connection& conn,
                         const std::function<bool(Connection&)>& fn) {
  statement_or_throw(conn, "job queue", counting_deadlocks(deadlocks, fn));
}

// One row of a job's history (keel_job_attempts).
struct AttemptRow {
  std::int64_t job_id = 0;
  std::int64_t round = 0;
  std::int64_t attempt = 0;
  std::int64_t started_ms = 0;
  std::int64_t finished_ms = 0;
  std::string outcome;
  std::string error;  // empty: none
  std::optional<std::int64_t> delay_ms;
  std::string worker;  // empty: none
};

// Rows of history in one statement.
inline void insert_attempts(Connection& tx, const std::vector<AttemptRow>& rows) {
  if (rows.empty()) return;
  std::string sql =
      "INSERT INTO keel_job_attempts (job_id, round, attempt, started_ms, finished_ms, outcome, "
      "error, delay_ms, worker) VALUES ";
  std::vector<Value> params;
  params.reserve(rows.size() * 9);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const AttemptRow& r = rows[i];
    sql += i ? ", (" : "(";
    for (int k = 0; k < 9; ++k) {
      sql += (k ? ", $" : "$") + std::to_string(params.size() + 1 + static_cast<std::size_t>(k));
    }
    sql += ")";
    params.insert(params.end(), {r.job_id, r.round, r.attempt, r.started_ms, r.finished_ms,
                                 r.outcome, r.error.empty() ? Value() : Value(clip(r.error)),
                                 r.delay_ms ? Value(*r.delay_ms) : Value(),
                                 r.worker.empty() ? Value() : Value(r.worker)});
  }
  tx.query(sql, params);
}

inline void insert_attempt(Connection& tx, std::int64_t job_id, std::int64_t round,
                           std::int64_t attempt, std::int64_t started_ms, std::int64_t finished_ms,
                           std::string_view outcome, std::string_view error,
                           std::optional<std::int64_t> delay_ms, std::string_view worker) {
  insert_attempts(tx, {{.job_id = job_id,
                        .round = round,
                        .attempt = attempt,
                        .started_ms = started_ms,
                        .finished_ms = finished_ms,
                        .outcome = std::string(outcome),
                        .error = std::string(error),
                        .delay_ms = delay_ms,
                        .worker = std::string(worker)}});
}

// What settling a running job writes (JobQueue::decide_settle): its row's new state, and its
// history row. A value left empty keeps the row's.
struct SettleWrite {
  std::int64_t id = 0;
  std::string state;  // "retry_scheduled" (a retry or a deferral) or "dead"
  int charge = 0;     // added to attempts
  std::int64_t run_at_ms = 0;
  std::optional<std::string> last_error;
  // A deferral's reason; a retry clears it, a death keeps it.
  std::optional<std::string> deferred_reason;
  int deferral = 0;  // added to deferrals
  std::optional<std::int64_t> limited_retries;
  std::optional<std::int64_t> prev_delay_ms;
  std::optional<std::string> dead_reason;
  std::optional<std::string> dead_kind;
  std::optional<std::int64_t> finished_ms;
  AttemptRow history;
};

// Writes `writes` (ascending ids, rows the caller's transaction holds) at `now`: one UPDATE for
// all of them, from a derived table of their values, and one INSERT of their history.
inline void apply_settles(Connection& tx, const std::vector<SettleWrite>& writes,
                          std::int64_t now) {
  if (writes.empty()) return;
  std::vector<Value> params = {now};
  const auto param = [&](Value v, std::string_view type) {
    params.push_back(std::move(v));
    return "CAST($" + std::to_string(params.size()) + " AS " + std::string(type) + ")";
  };
  const auto opt_int = [](const std::optional<std::int64_t>& v) { return v ? Value(*v) : Value(); };
  const auto opt_text = [](const std::optional<std::string>& v) { return v ? Value(*v) : Value(); };
  std::string rows;
  std::vector<AttemptRow> history;
  history.reserve(writes.size());
  for (std::size_t i = 0; i < writes.size(); ++i) {
    const SettleWrite& w = writes[i];
    rows += i ? " UNION ALL SELECT " : "SELECT ";
    rows += param(w.id, "BIGINT") + " AS id, " + param(w.state, "TEXT") + " AS state, " +
            param(std::int64_t{w.charge}, "BIGINT") + " AS charge, " +
            param(w.run_at_ms, "BIGINT") + " AS run_at_ms, " +
            param(opt_text(w.last_error), "TEXT") + " AS last_error, " +
            param(opt_text(w.deferred_reason), "TEXT") + " AS deferred_reason, " +
            param(std::int64_t{w.deferral}, "BIGINT") + " AS deferral, " +
            param(opt_int(w.limited_retries), "BIGINT") + " AS limited_retries, " +
            param(opt_int(w.prev_delay_ms), "BIGINT") + " AS prev_delay_ms, " +
            param(opt_text(w.dead_reason), "TEXT") + " AS dead_reason, " +
            param(opt_text(w.dead_kind), "TEXT") + " AS dead_kind, " +
            param(opt_int(w.finished_ms), "BIGINT") + " AS finished_ms";
    history.push_back(w.history);
  }
  tx.query(
      "UPDATE keel_jobs SET state = v.state, attempts = keel_jobs.attempts + v.charge,"
      " lease_owner = NULL, lease_expires_ms = NULL, run_at_ms = v.run_at_ms,"
      " last_error = COALESCE(v.last_error, keel_jobs.last_error),"
      " deferred_reason = CASE WHEN v.state = 'dead' THEN keel_jobs.deferred_reason"
      " ELSE v.deferred_reason END,"
      " deferrals = keel_jobs.deferrals + v.deferral,"
      " limited_retries = COALESCE(v.limited_retries, keel_jobs.limited_retries),"
      " prev_delay_ms = COALESCE(v.prev_delay_ms, keel_jobs.prev_delay_ms),"
      " dead_reason = COALESCE(v.dead_reason, keel_jobs.dead_reason),"
      " dead_kind = COALESCE(v.dead_kind, keel_jobs.dead_kind), updated_ms = $1,"
      " finished_ms = COALESCE(v.finished_ms, keel_jobs.finished_ms)"
      " FROM (" +
          rows + ") AS v WHERE keel_jobs.id = v.id",
      params);
  insert_attempts(tx, history);
}

// A success: the job is done. No history row is written for it: the done row keeps what that
// row would hold (the lease's owner and start, finished_ms, the round and attempt numbers), and
// JobQueue::get() reads the success from it. lease_owner stays set on a done row for that
// reason; read_job reports it only while the job runs. $2 is now.
// A success reported for a job whose attempt was not started (JobQueue::start) starts and
// charges it here.
// The condition that a job's row is still held under a lease: its id and fence are `id` and
// `fence` (parameters or columns), and it is running; `alias` prefixes the columns ("j." or none).
// The state is compared as an expression that no index predicate implies, so that a statement on
// one job is planned on the primary key and never on keel_jobs_running (partial on state =
// 'running'): while a snapshot is held, that index holds a dead entry for every job finished
// since, and a plan on it stepped over all of them for one row (137 ms, 66,000 buffers).
[[nodiscard]] inline std::string held_by(std::string_view id, std::string_view fence,
                                         std::string_view alias = {}) {
  const std::string a(alias);
  return a + "id = " + std::string(id) + " AND " + a + "fence = " + std::string(fence) + " AND " +
         a + "state || '' = 'running'";
}

// The UPDATE that replays dead jobs: ready again at `run_at`, at `now`, with a new round of
// attempts (replays + 1, attempts and the limits' counts reset, the death forgotten), for the rows
// `where` selects among the dead. The one statement of JobQueue::replay, replay_all and
// dead_letters::replay.
[[nodiscard]] inline std::string replay_update(std::string_view run_at, std::string_view now,
                                               std::string_view where) {
  return "UPDATE keel_jobs SET state = 'ready', attempts = 0, fence = fence + 1,"
         " replays = replays + 1, run_at_ms = " +
         std::string(run_at) +
         ", dead_reason = NULL, dead_kind = NULL, updated_ms = " + std::string(now) +
         ", limited_retries = 0, prev_delay_ms = 0, deferred_reason = NULL, deferrals = 0,"
         " finished_ms = NULL WHERE state = 'dead'" +
         (where.empty() ? std::string() : " AND " + std::string(where));
}

// Removes dead job `id` and its attempts' history, in the caller's transaction: whether it was
// dead (and is gone). The one removal of JobQueue::discard and dead_letters::discard.
inline bool discard_dead(Connection& tx, std::int64_t id) {
  tx.query(
      "DELETE FROM keel_job_attempts WHERE job_id = $1 AND EXISTS (SELECT 1 FROM keel_jobs"
      " WHERE id = $1 AND state = 'dead')",
      {id});
  return tx.query("DELETE FROM keel_jobs WHERE id = $1 AND state = 'dead'", {id}).affected() == 1;
}

inline constexpr std::string_view kMarkDone =
    " SET state = 'done', attempts = attempts + CASE WHEN started_ms IS NULL THEN 1 ELSE 0 END,"
    " started_ms = COALESCE(started_ms, $2), lease_expires_ms = NULL, run_at_ms = $2,"
    " last_error = NULL, deferred_reason = NULL, updated_ms = $2, finished_ms = $2";

// The columns JobQueue::settle reads of a running job: a SettleRow, read by read_settle_row.
inline constexpr std::string_view kSettleColumns =
    "id, attempts, max_attempts, leased_ms, lease_owner, replays, limited_retries, prev_delay_ms,"
    " created_ms, started_ms";

// A running job as JobQueue::settle reads it (kSettleColumns).
struct SettleRow {
  std::int64_t id = 0;
  std::int64_t attempts = 0;
  std::int64_t max_attempts = 0;
  std::optional<std::int64_t> leased_ms;  // none: leased before the column was kept
  std::string lease_owner;                // empty: none
  std::int64_t replays = 0;               // the round of its attempts
  std::int64_t limited_retries = 0;
  std::int64_t prev_delay_ms = 0;
  std::int64_t created_ms = 0;
  std::optional<std::int64_t> started_ms;  // none: leased, its attempt not started
};

// Row i of a SELECT of kSettleColumns.
[[nodiscard]] inline SettleRow read_settle_row(const Rows& rows, std::size_t i) {
  RowCursor c(rows, i);
  SettleRow r;
  r.id = c.integer();
  r.attempts = c.integer();
  r.max_attempts = c.integer();
  r.leased_ms = c.optional_integer();
  r.lease_owner = c.text_or_empty();
  r.replays = c.integer();
  r.limited_retries = c.integer();
  r.prev_delay_ms = c.integer();
  r.created_ms = c.integer();
  r.started_ms = c.optional_integer();
  return r;
}

// Records the success of the lease (job_id, fence) in one statement, atomic on its own; false
// when the fence is stale (the lease was lost). `keep` false (QueueOptions::keep_done): the
// success deletes the job, its history with it (ON DELETE CASCADE).
[[nodiscard]] inline bool mark_done(Connection& conn, std::int64_t job_id, std::int64_t fence,
                                    std::int64_t now, bool keep) {
  if (!keep) {
    return conn.query("DELETE FROM keel_jobs WHERE " + held_by("$1", "$2"), {job_id, fence})
               .affected() == 1;
  }
  const Rows r =
      conn.query("UPDATE keel_jobs" + std::string(kMarkDone) + " WHERE " + held_by("$1", "$3"),
                 {job_id, now, fence});
  return r.affected() == 1;
}

// The CTE "done" recording the successes of `done` in a statement whose $2 is now (with the CTEs
// it needs), their parameters appended to `params`; it returns the id of each success recorded.
// Every statement of the queue that writes several jobs takes them in one order, so that two
// never wait for each other (a deadlock, which PostgreSQL breaks only after deadlock_timeout):
// several successes are locked in ascending id order before any is written. A statement that
// also leases runs "done" first (docs/queue.md, "keel's own statements follow keel's rules").
// `keep` false (QueueOptions::keep_done): the successes delete their jobs (mark_done).
[[nodiscard]] inline std::string done_ctes(
    const std::vector<std::pair<std::int64_t, std::int64_t>>& done, std::vector<Value>& params,
    bool keep) {
  const auto param = [&](std::int64_t v) {
    params.emplace_back(v);
    return "$" + std::to_string(params.size()) + "::bigint";
  };
  // The success's history row is the done row itself (detail::kMarkDone).
  const std::string write =
      keep ? "UPDATE keel_jobs j" + std::string(detail::kMarkDone) : "DELETE FROM keel_jobs j";
  if (done.size() == 1) {
    const std::string id = param(done[0].first);
    const std::string fence = param(done[0].second);
    return "done AS (" + write + " WHERE " + held_by(id, fence, "j.") + " RETURNING j.id)";
  }
  std::string sql = "v (id, fence) AS (VALUES ";
  for (std::size_t i = 0; i < done.size(); ++i) {
    const std::string id = param(done[i].first);
    sql += (i ? ", (" : "(") + id + ", " + param(done[i].second) + ")";
  }
  // A delete locks its rows FOR UPDATE: they are locked so from the start rather than upgraded.
  return sql + "), lk AS (SELECT j.id FROM keel_jobs j JOIN v ON " +
         held_by("v.id", "v.fence", "j.") + " ORDER BY j.id " +
         (keep ? "FOR NO KEY UPDATE" : "FOR UPDATE") + " OF j), done AS (" + write +
         (keep ? " FROM lk" : " USING lk") +
         " WHERE j.id = lk.id AND j.state || '' = 'running' RETURNING j.id)";
}

// " AND queue = $N" or nothing, for the commands that take an optional queue.
[[nodiscard]] inline std::string queue_filter(std::string_view queue, int param) {
  return queue.empty() ? std::string() : " AND queue = $" + std::to_string(param);
}

// The columns read_job reads, in its order.
inline constexpr std::string_view kJobColumns =
    "id, queue, payload, idem_key, state, attempts, max_attempts, run_at_ms, lease_owner,"
    " lease_expires_ms, fence, dead_reason, last_error, replays, created_ms, updated_ms,"
    " deferred_reason, deferrals, dead_kind, crashed_batches";

// The row of a SELECT of kJobColumns under `c`, without its history; `c` is left at the first
// column after them (for a SELECT that names more).
[[nodiscard]] inline Job read_job(RowCursor& c) {
  Job j;
  j.id = c.integer();
  j.queue = c.text();
  j.payload = c.text();
  j.idempotency_key = c.text();
  j.state = parse_job_state(c.text()).value_or(JobState::kReady);
  j.attempts = static_cast<int>(c.integer());
  j.max_attempts = static_cast<int>(c.integer());
  j.run_at_ms = c.integer();
  // A done row keeps its last lease's owner for its history (kMarkDone); the job has no lease.
  std::string owner = c.text_or_empty();
  if (j.state == JobState::kRunning) j.lease_owner = std::move(owner);
  j.lease_expires_ms = c.optional_integer();
  j.fence = c.integer();
  j.dead_reason = c.text_or_empty();
  j.last_error = c.text_or_empty();
  j.replays = static_cast<int>(c.integer());
  j.created_ms = c.integer();
  j.updated_ms = c.integer();
  j.deferred_reason = c.text_or_empty();
  j.deferrals = static_cast<int>(c.integer());
  if (const auto& kind = c.cell()) j.dead_kind = parse_dead_reason(*kind);
  j.crashed_batches = static_cast<int>(c.integer());
  return j;
}

// Row i of a SELECT of kJobColumns, without its history.
[[nodiscard]] inline Job read_job(const Rows& r, std::size_t i) {
  RowCursor c(r, i);
  return read_job(c);
}

}  // namespace keel::store::detail
