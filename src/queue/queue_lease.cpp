// JobQueue's worker protocol, the lease side: lease, complete_and_lease (a busy worker's step),
// heartbeat and release, and the sweep that takes expired leases back (a dead worker's jobs).
// Recording an attempt's outcome is queue_complete.cpp.
#include <algorithm>
#include <limits>
#include <stdexcept>

#include "keel/core/expected.hpp"
#include "keel/db/dialect.hpp"
#include "keel/queue/queue.hpp"
#include "queue/detail/queue_sql.hpp"

namespace keel::store {

using detail::in_statement;
using detail::in_transaction;
using detail::to_ms;

namespace {

constexpr int kReapBatch = 100;

// The start of job $1 under fence $3 at $2 (now): its attempt counts from now, and a crash
// charges it. The lease is not extended: the worker heartbeats the jobs of its batch from their
// lease on, and leaving lease_expires_ms and run_at_ms alone keeps the start off every index
// (keel_jobs_running holds run_at_ms), so PostgreSQL can update the row in place (a HOT update,
// which keel_jobs' fillfactor leaves room for).
const std::string kStart =
    "UPDATE keel_jobs SET attempts = attempts + CASE WHEN started_ms IS NULL THEN 1 ELSE 0 END,"
    " started_ms = COALESCE(started_ms, $2), updated_ms = $2 WHERE " +
    detail::held_by("$1", "$3");

// A job leased and never started, given back (a release, a sweep of its expired lease): ready
// again at the time it was leased ($2: now, when it has none), so it keeps its place in the
// queue; nothing is charged, and the new fence locks the old worker out. $1: the job's id.
#define KEEL_GIVE_BACK(KEEL_MORE)                                                          \
  "UPDATE keel_jobs SET state = 'ready', fence = fence + 1, lease_owner = NULL," KEEL_MORE \
  " lease_expires_ms = NULL, run_at_ms = COALESCE(leased_ms, $2), updated_ms = $2"         \
  " WHERE id = $1"
constexpr std::string_view kGiveBack = KEEL_GIVE_BACK("");
// The same from a sweep: its batch's worker died (or lost its database) before the job's outcome
// was recorded, and the job may have run, or crashed it: counted (LeasedJob::crashed_batches).
constexpr std::string_view kGiveBackAfterCrash =
    KEEL_GIVE_BACK(" crashed_batches = crashed_batches + 1,");
#undef KEEL_GIVE_BACK

// How long a lease floor stands before a lease scans the whole queue again (see lease_floor).
constexpr std::int64_t kLeaseFloorForMs = 1000;
// How far below its own now a lease that took every due job it saw sets the floor (see
// note_lease): a job committed this long after its run_at_ms (its enqueue's transaction still
// open) is still seen by the next lease; a later one by the next full scan.
constexpr std::int64_t kShortLeaseLagMs = 100;

// How often a JobQueue's leases look for an expired lease of a queue, and how long the check's
// floor stands before one looks from the start again (see expiry_plan).
constexpr std::int64_t kExpiryCheckEveryMs = 1000;
constexpr std::int64_t kExpiryFloorForMs = 60'000;

}  // namespace

// A lease on PostgreSQL scans keel_jobs_ready from the queue's first entry. Each job leased since
// the last VACUUM left an entry there (an UPDATE adds a version; the old one's entry stays,
// marked dead once no snapshot needs it), and the scan steps over every one of them: 112 index
// pages per lease after 15,000 jobs, a third of the lease's time, growing until autovacuum runs.
// So a lease that took as many jobs as it asked for leaves a floor, the earliest run_at_ms it
// took, and the next lease of that queue scans from there. A job made due below the floor by
// this JobQueue (a release, a sweep of expired leases) clears the floors once its transaction has
// committed, and a lease whose scan began before then leaves no floor (it may not have seen the
// job: the floors' generation, forget_lease_floors); one made due below it
// by another process (its release or sweep, or a producer whose clock is behind) is found by the
// next full scan, at least every kLeaseFloorForMs. Every other way a job becomes due (enqueue,
// retry, replay) gives it a time at or after the lease's own now.
// A lease short of jobs took every due job it saw, so it leaves a floor too, at its own now less
// kShortLeaseLagMs. Without it a worker that keeps up (its leases short) scanned from the queue's
// first entry at each lease and at each look for the next due time; while a snapshot is held,
// VACUUM removes no entry, and each scan stepped over every job done since (1,340 buffers and
// 4.4 ms a lease after 60 s at 500 jobs/s; scripts/bench-soak.sh). A job that becomes due below
// the floor some other way (its enqueue's transaction open longer than kShortLeaseLagMs, another
// process's release or sweep, a producer whose clock is behind) waits for the next full scan: at
// most kLeaseFloorForMs.
// SQLite removes an updated row's old index entry at once: its leases take no floor.
std::optional<JobQueue::LeaseFloor> JobQueue::lease_floor(std::string_view queue,
                                                          std::int64_t now) const {
  std::lock_guard lock(floor_mu_);
  for (const LeaseFloor& f : floors_) {
    if (f.queue == queue) {
      if (now - f.full_scan_ms >= kLeaseFloorForMs || now < f.full_scan_ms) return std::nullopt;
      return f;
    }
  }
  return std::nullopt;
}

// A look for the next due time from a floor: what it found, or the floor's end when sooner, so
// that a job below the floor waits no longer than kLeaseFloorForMs for an idle worker either.
std::optional<std::int64_t> JobQueue::due_within_floor(std::optional<std::int64_t> found,
                                                       const std::optional<LeaseFloor>& floor) {
  if (!floor) return found;
  const std::int64_t end = floor->full_scan_ms + kLeaseFloorForMs;
  return found ? std::min(*found, end) : end;
}

std::uint64_t JobQueue::floor_generation() const {
  std::lock_guard lock(floor_mu_);
  return floor_generation_;
}

void JobQueue::note_lease(std::string_view queue, std::int64_t now, bool full_scan, bool filled,
                          std::optional<std::int64_t> earliest, std::uint64_t generation) const {
  std::lock_guard lock(floor_mu_);
  // A release or a sweep committed since this lease read the floors: its scan may not have seen
  // the job given back, which a floor from it could put out of the next leases' reach.
  if (generation != floor_generation_) return;
  const auto it = std::find_if(floors_.begin(), floors_.end(),
                               [&](const LeaseFloor& f) { return f.queue == queue; });
  if (!filled && !earliest) {
    // Nothing taken. A full scan saw the whole queue: no floor, so that an idle worker's looks
    // read it all (and it sleeps until a wakeup). Under a floor: the floor stays as it is, to
    // its end.
    if (full_scan && it != floors_.end()) floors_.erase(it);
    return;
  }
  // A full lease: the earliest job it took. A short one took every due job it saw: its now, less
  // the lag a commit may take.
  const std::int64_t floor = filled ? earliest.value_or(now) : now - kShortLeaseLagMs;
  if (it == floors_.end()) {
    // Only a full scan starts a floor.
    if (full_scan) floors_.push_back({std::string(queue), floor, now});
    return;
  }
  it->run_at_ms = floor;
  if (full_scan) it->full_scan_ms = now;
}

void JobQueue::forget_lease_floors() const {
  std::lock_guard lock(floor_mu_);
  floors_.clear();
  ++floor_generation_;
}

// The check for an expired lease reads keel_jobs_running from the queue's earliest run_at_ms.
// Every job that finished leaves a dead entry there (its old running version), which VACUUM
// removes only once no snapshot needs it: while a session holds an old snapshot, a check from
// the start steps over every job finished since (30 ms and 84,000 heap fetches per lease after a
// few minutes at 2,000 jobs/s). So a JobQueue looks at most once per kExpiryCheckEveryMs per
// queue, and from where its last check found none: a check at T that found no running job with
// run_at_ms <= T leaves none behind it, since a lease or a heartbeat sets run_at_ms to its own
// now plus the lease, after T (unless the process's clock is more than a lease behind, which a
// check from the start finds, at least every kExpiryFloorForMs). An expired lease is therefore
// swept up to a second later than it expired.
JobQueue::ExpiryPlan JobQueue::expiry_plan(std::string_view queue, std::int64_t now) const {
  std::lock_guard lock(floor_mu_);
  for (const ExpiryCheck& e : expiry_) {
    if (e.queue != queue) continue;
    ExpiryPlan plan;
    plan.check = now - e.last_ms >= kExpiryCheckEveryMs || now < e.last_ms;
    if (e.clear_to && now >= e.chain_ms && now - e.chain_ms < kExpiryFloorForMs) {
      plan.above = e.clear_to;
    }
    return plan;
  }
  return {.check = true};
}

void JobQueue::note_expiry_check(std::string_view queue, std::int64_t now, const ExpiryPlan& plan,
                                 bool found) const {
  std::lock_guard lock(floor_mu_);
  auto it = std::find_if(expiry_.begin(), expiry_.end(),
                         [&](const ExpiryCheck& e) { return e.queue == queue; });
  if (it == expiry_.end()) it = expiry_.insert(expiry_.end(), ExpiryCheck{std::string(queue)});
  it->last_ms = now;
  if (found) return;  // the floor stays where it was, below the expired lease
  if (!plan.above) it->chain_ms = now;
  it->clear_to = now;
}

std::int64_t JobQueue::reap_expired(Connection& connection, std::string_view queue) const {
  std::int64_t reaped = 0;
  bool given_back = false;
  std::vector<std::pair<std::int64_t, CompleteResult>> dead;
  std::int64_t returned = 0;
  in_transaction(deadlocks_, connection, [&](Connection& tx) {
    reaped = 0;
    returned = 0;
    given_back = false;
    dead.clear();
    std::vector<detail::SettleWrite> writes;
    const std::int64_t now = now_ms();
    // Leases that expired: the worker died or stalled. Rows are taken in id order, as every
    // statement of the queue that locks several rows takes them, so sweeps never deadlock.
    const ExpiryPlan plan = expiry_plan(queue, now);
    std::vector<Value> params = {queue, now, kReapBatch};
    std::string above;
    if (plan.above) {
      params.emplace_back(*plan.above);
      above = " AND run_at_ms > $4";
    }
    const Rows expired = tx.query(
        std::string("SELECT ") + std::string(detail::kSettleColumns) +
            " FROM keel_jobs WHERE queue = $1 AND state = 'running' AND run_at_ms <= $2" + above +
            " ORDER BY id LIMIT $3" + std::string(connection.dialect().lock_rows_skip_locked()),
        params);
    for (std::size_t i = 0; i < expired.size(); ++i) {
      const detail::SettleRow job = detail::read_settle_row(expired, i);
      const std::int64_t id = job.id;
      ++reaped;
      if (!job.started_ms) {
        // Leased in a batch, never started: nothing is charged; the job comes back counted as
        // in a crashed batch, and its next run is alone (kGiveBackAfterCrash).
        given_back = true;
        ++returned;
        tx.query(kGiveBackAfterCrash, {id, now});
        continue;
      }
      // Its handler had started: the attempt is charged, its outcome unknown, and core decides
      // what follows, as for any failed attempt.
      const std::string& owner = job.lease_owner;
      const AttemptReport crash{.outcome = Outcome::ambiguous(),
                                .error =
                                    "the worker died while running it, or lost its "
                                    "database for longer than its lease (the lease held "
                                    "by " +
                                    owner + " expired without a heartbeat)"};
      const CompleteResult r = decide_settle(job, crash, "lease_expired", now, writes);
      if (r.status == CompleteStatus::kDead) dead.emplace_back(id, r);
    }
    // The charged ones written together (two statements, whatever their number).
    detail::apply_settles(tx, writes, now);
    return true;
  });
  returned_after_crash_.fetch_add(returned);
  // The jobs given back are due at their lease's time, before a lease floor (lease_floor).
  if (given_back) forget_lease_floors();
  if (options_.on_dead_letter) {
    for (const auto& [id, r] : dead) {
      options_.on_dead_letter(id, DeadLetterReason{r.dead_kind, r.dead_reason});
    }
  }
  return reaped;
}

namespace {

// The due jobs of queue $1 at time $2: the condition, then the lease order.
constexpr std::string_view kDueWhere =
    " FROM keel_jobs WHERE queue = $1 AND state IN ('ready', 'retry_scheduled')"
    " AND run_at_ms <= $2";
constexpr std::string_view kDueOrder = " ORDER BY run_at_ms, id";
// What a lease does to a job: $2 is now, $3 the worker, $5 the lease's expiry. Whether it starts
// the attempt (counts it, started_ms set) is added per statement.
constexpr std::string_view kSetRunning =
    " SET state = 'running', fence = fence + 1, lease_owner = $3,"
    " leased_ms = $2, lease_expires_ms = $5, run_at_ms = $5, updated_ms = $2";

// An expired lease waiting, from the floor named by `above` (an SQL parameter, or empty: all).
std::string expired_check(const std::string& above) {
  return "SELECT 1 FROM keel_jobs WHERE queue = $1 AND state = 'running' AND run_at_ms <= $2" +
         (above.empty() ? std::string() : " AND run_at_ms > " + above) + " LIMIT 1";
}

// A leased job from the columns id, payload, idem_key, attempt, max_attempts, fence,
// crashed_batches at `c`.
LeasedJob leased_job(RowCursor& c, std::string_view queue, std::int64_t expires) {
  LeasedJob job;
  job.id = c.integer();
  job.queue = std::string(queue);
  job.payload = c.text();
  job.idempotency_key = c.text();
  job.attempt = static_cast<int>(c.integer());
  job.max_attempts = static_cast<int>(c.integer());
  job.fence = c.integer();
  job.crashed_batches = static_cast<int>(c.integer());
  job.lease_expires_ms = expires;
  return job;
}

}  // namespace

// One statement when WITH may hold the writes (PostgreSQL); otherwise a transaction that reads
// the due rows, then updates them one by one (SQLite). Both look for an expired lease as the
// queue's expiry plan says.
DoneAndLeased JobQueue::finish_and_lease_due(
    Connection& connection, const std::vector<std::pair<std::int64_t, std::int64_t>>& done,
    std::string_view queue, std::string_view worker, int limit, int start,
    bool* expired_waiting) const {
  const std::int64_t now = now_ms();
  const LeaseAsk ask{.queue = queue,
                     .worker = worker,
                     .limit = limit,
                     .start = start,
                     .now = now,
                     .expires = now + to_ms(options_.lease),
                     .expiry = expiry_plan(queue, now)};
  *expired_waiting = false;
  DoneAndLeased out = connection.dialect().data_modifying_ctes()
                          ? lease_in_one_statement(connection, done, ask, expired_waiting)
                          : lease_in_transaction(connection, done, ask, expired_waiting);
  if (ask.expiry.check) note_expiry_check(queue, now, ask.expiry, *expired_waiting);
  return out;
}

// One statement, atomic on its own: no BEGIN/COMMIT round trips on the hot path; the leased rows
// say themselves whether the lease started them. Its rows: kind 1 = a leased job (then the job's
// columns and whether the lease started it), kind 0 = how many successes were current, kind 2 =
// an expired lease is waiting, kind 3 = when the earliest job comes due, kind 4 = the earliest
// due time leased (lease_floor).
DoneAndLeased JobQueue::lease_in_one_statement(
    Connection& connection, const std::vector<std::pair<std::int64_t, std::int64_t>>& done,
    const LeaseAsk& ask, bool* expired_waiting) const {
  std::vector<Value> params = {ask.queue, ask.now, ask.worker, ask.limit, ask.expires};
  const auto param = [&params](Value v) {
    params.push_back(std::move(v));
    return "$" + std::to_string(params.size());
  };
  // The started jobs: all, or the `start` lowest ids of those picked.
  const std::string started = ask.start >= ask.limit ? std::string("TRUE")
                                                     : "j.id IN (SELECT id FROM picked ORDER BY "
                                                       "id LIMIT " +
                                                           param(ask.start) + ")";
  // The successes first, then the lease. A lease's scan can lock a row that another worker
  // leased after the statement began (FOR UPDATE locks the row's newest version, then finds it
  // running and leaves it, still locked, until the statement ends): a success waiting for such a
  // row waits for a statement that waits for nothing, as long as no statement records its
  // successes after leasing (two did, and deadlocked, at 8 and 16 threads).
  std::string sql = "WITH ";
  std::string due(kDueWhere);
  if (!done.empty()) {
    sql += detail::done_ctes(done, params, options_.keep_done) + ", ";
    due += " AND (SELECT count(*) FROM done) >= 0";
  }
  const std::uint64_t generation = floor_generation();
  const std::optional<LeaseFloor> floor = lease_floor(ask.queue, ask.now);
  std::size_t floor_param = 0;
  if (floor) {
    due += " AND run_at_ms >= " + param(floor->run_at_ms);
    floor_param = params.size();
  }
  due += kDueOrder;
  sql += "picked AS (SELECT id, run_at_ms" + due + " LIMIT $4" +
         std::string(connection.dialect().lock_rows_skip_locked()) +
         "), leased AS (UPDATE keel_jobs j" + std::string(kSetRunning) +
         ", attempts = attempts + CASE WHEN " + started +
         " THEN 1 ELSE 0 END, started_ms = CASE WHEN " + started +
         " THEN $2::bigint END FROM picked WHERE j.id = picked.id"
         " RETURNING j.id, j.payload, j.idem_key, j.attempts, j.max_attempts, j.fence,"
         " j.crashed_batches, j.started_ms)";
  sql +=
      " SELECT 1, id, payload, idem_key,"
      " attempts + CASE WHEN started_ms IS NULL THEN 1 ELSE 0 END, max_attempts, fence,"
      " crashed_batches, CASE WHEN started_ms IS NULL THEN 0 ELSE 1 END FROM leased";
  if (!done.empty()) {
    sql += " UNION ALL SELECT 0, id, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM done";
  }
  sql +=
      " UNION ALL SELECT 4, min(run_at_ms), NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM picked";
  const std::string above = ask.expiry.above ? param(*ask.expiry.above) : std::string();
  if (ask.expiry.check) {
    sql += " UNION ALL SELECT 2, 0, NULL, NULL, NULL, NULL, NULL, NULL, NULL WHERE EXISTS (" +
           expired_check(above) + ")";
  }
  // Short of work: when the queue's earliest job comes due, for the worker that goes idle
  // (next_due's two index reads; no running job is below the expiry floor).
  sql +=
      " UNION ALL SELECT 3, LEAST((SELECT min(run_at_ms) FROM keel_jobs WHERE queue = $1"
      " AND state IN ('ready', 'retry_scheduled')" +
      (floor ? " AND run_at_ms >= $" + std::to_string(floor_param) : std::string()) +
      "), (SELECT min(run_at_ms) FROM keel_jobs"
      " WHERE queue = $1 AND state = 'running'" +
      (above.empty() ? std::string() : " AND run_at_ms > " + above) +
      ")), NULL, NULL, NULL, NULL, NULL, NULL, NULL WHERE (SELECT count(*) FROM leased) < $4";
  Rows rows;
  in_statement(deadlocks_, connection, [&](Connection& c) {
    rows = c.query(sql, params);
    return true;
  });
  DoneAndLeased out;
  std::optional<std::int64_t> earliest;
  out.leased.reserve(rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    RowCursor c(rows, i);
    const std::int64_t kind = c.integer();
    if (kind == 0) {
      out.current_ids.push_back(c.integer());
      ++out.current;
    }
    if (kind == 2) *expired_waiting = true;
    if (kind == 4) earliest = c.optional_integer();
    if (kind == 3) {
      out.next_due_known = true;
      out.next_due_ms = due_within_floor(c.optional_integer(), floor);
    }
    if (kind != 1) continue;
    LeasedJob job = leased_job(c, ask.queue, ask.expires);
    job.started = c.integer() == 1;
    out.leased.push_back(std::move(job));
  }
  note_lease(ask.queue, ask.now, !floor, static_cast<int>(out.leased.size()) >= ask.limit, earliest,
             generation);
  return out;
}

// The due rows are read, then updated one by one, in one write transaction: the same effect as
// the UPDATE ... WHERE id IN (SELECT ...) RETURNING that PostgreSQL runs, without the two
// temporary b-trees SQLite builds for those (docs/queue.md). The rows read show the job before
// kSetRunning: the lease's attempt and fence are one more.
DoneAndLeased JobQueue::lease_in_transaction(
    Connection& connection, const std::vector<std::pair<std::int64_t, std::int64_t>>& done,
    const LeaseAsk& ask, bool* expired_waiting) const {
  static const std::string pick =
      "SELECT id, payload, idem_key, attempts + 1, max_attempts,"
      " fence + 1, crashed_batches" +
      std::string(kDueWhere) + std::string(kDueOrder) + " LIMIT $3";
  // $6: started_ms (NULL: not started), $7: 1 when the lease starts the attempt.
  static const std::string set_running = "UPDATE keel_jobs" + std::string(kSetRunning) +
                                         ", started_ms = $6, attempts = attempts + $7"
                                         " WHERE id = $4 AND queue = $1";
  DoneAndLeased out;
  Rows rows;
  std::int64_t last_started = 0;  // the highest id the lease started
  in_transaction(deadlocks_, connection, [&](Connection& tx) {
    out.current = 0;
    out.current_ids.clear();
    for (const auto& [id, fence] : done) {
      if (!detail::mark_done(tx, id, fence, ask.now, options_.keep_done)) continue;
      ++out.current;
      out.current_ids.push_back(id);
    }
    rows = tx.query(pick, {ask.queue, ask.now, ask.limit});
    // The started ones are the `start` lowest ids, as on PostgreSQL.
    std::vector<std::int64_t> ids;
    for (std::size_t i = 0; i < rows.size(); ++i) ids.push_back(RowCursor(rows, i).integer());
    std::sort(ids.begin(), ids.end());
    last_started = ask.start >= ask.limit || ids.empty() ? std::numeric_limits<std::int64_t>::max()
                   : ask.start == 0                      ? std::numeric_limits<std::int64_t>::min()
                                    : ids[std::min<std::size_t>(ids.size(), ask.start) - 1];
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const std::int64_t id = RowCursor(rows, i).integer();
      const bool starts = id <= last_started;
      tx.query(set_running, {ask.queue, ask.now, ask.worker, id, ask.expires,
                             starts ? Value(ask.now) : Value(), starts ? 1 : 0});
    }
    if (ask.expiry.check) {
      std::vector<Value> check_params = {ask.queue, ask.now};
      if (ask.expiry.above) check_params.emplace_back(*ask.expiry.above);
      *expired_waiting =
          !tx.query(expired_check(ask.expiry.above ? "$3" : ""), check_params).empty();
    }
    return true;
  });
  out.leased = read_rows(rows, [&](RowCursor& c) {
    LeasedJob job = leased_job(c, ask.queue, ask.expires);
    job.started = job.id <= last_started;
    return job;
  });
  return out;
}

std::vector<LeasedJob> JobQueue::lease_due(Connection& connection, std::string_view queue,
                                           std::string_view worker, int limit, int start) const {
  bool expired_waiting = false;
  return finish_and_lease_due(connection, {}, queue, worker, limit, start, &expired_waiting).leased;
}

DoneAndLeased JobQueue::complete_and_lease(
    Connection& connection, const std::vector<std::pair<std::int64_t, std::int64_t>>& done,
    std::string_view queue, std::string_view worker, int limit, int start) const {
  if (limit < 1) {
    throw_invalid({.context = "keel::store::JobQueue::complete_and_lease",
                   .field = "limit",
                   .problem = "must be >= 1",
                   .got = std::to_string(limit)});
  }
  if (start < 0) {
    throw_invalid({.context = "keel::store::JobQueue::complete_and_lease",
                   .field = "start",
                   .problem = "must be >= 0",
                   .got = std::to_string(start)});
  }
  bool expired_waiting = false;
  DoneAndLeased out =
      finish_and_lease_due(connection, done, queue, worker, limit, start, &expired_waiting);
  // Expired leases are reaped when one is waiting and the due jobs did not fill the request, or
  // at most every quarter lease while they do (so a busy queue still reclaims them promptly).
  // The statement above said whether one is waiting: no reaping transaction when none is.
  const std::int64_t now = now_ms();
  const bool short_of_work = static_cast<int>(out.leased.size()) < limit;
  if (expired_waiting &&
      (short_of_work || now - last_reap_ms_.load() >= to_ms(options_.lease) / 4)) {
    last_reap_ms_.store(now);
    if (reap_expired(connection, queue) > 0 && short_of_work) {
      out.next_due_known = false;  // the sweep made jobs ready since
      int started = 0;
      for (const LeasedJob& job : out.leased) started += job.started ? 1 : 0;
      auto more = lease_due(connection, queue, worker, limit - static_cast<int>(out.leased.size()),
                            std::max(0, std::min(start, kStartAll) - started));
      for (auto& job : more) out.leased.push_back(std::move(job));
    }
  }
  // Started jobs first (a worker runs them in this order, and a started job charged for an
  // attempt should not wait behind jobs that may crash its worker), then by id.
  std::sort(out.leased.begin(), out.leased.end(), [](const LeasedJob& x, const LeasedJob& y) {
    return x.started != y.started ? x.started : x.id < y.id;
  });
  return out;
}

std::vector<LeasedJob> JobQueue::lease(Connection& connection, std::string_view queue,
                                       std::string_view worker, int limit, int start) const {
  if (limit < 1) {
    throw_invalid({.context = "keel::store::JobQueue::lease",
                   .field = "limit",
                   .problem = "must be >= 1",
                   .got = std::to_string(limit)});
  }
  return complete_and_lease(connection, {}, queue, worker, limit, start).leased;
}

std::vector<LeasedJob> JobQueue::leases_of(Connection& connection, std::string_view queue,
                                           std::string_view worker) const {
  const Rows r = connection.query(
      "SELECT id, fence, CASE WHEN started_ms IS NULL THEN 0 ELSE 1 END FROM keel_jobs"
      " WHERE queue = $1 AND state = 'running' AND lease_owner = $2 ORDER BY id",
      {queue, worker});
  return read_rows(r, [&](RowCursor& c) {
    LeasedJob job;
    job.id = c.integer();
    job.queue = std::string(queue);
    job.fence = c.integer();
    job.started = c.integer() == 1;
    return job;
  });
}

std::optional<std::int64_t> JobQueue::next_due(Connection& connection,
                                               std::string_view queue) const {
  // Two index reads: the first row of keel_jobs_ready and of keel_jobs_running (each predicate
  // spelled as in its index, so the planner takes it).
  // No running job is below the expiry floor (expiry_plan): the read of keel_jobs_running starts
  // there, past the entries of the jobs finished before it.
  // The read of keel_jobs_ready starts at the lease floor, as the next lease will.
  const std::int64_t now = now_ms();
  const ExpiryPlan plan = expiry_plan(queue, now);
  const std::optional<LeaseFloor> floor = lease_floor(queue, now);
  std::vector<Value> params = {queue};
  std::string above_floor;
  if (floor) {
    params.emplace_back(floor->run_at_ms);
    above_floor = " AND run_at_ms >= $" + std::to_string(params.size());
  }
  std::string above_expiry;
  if (plan.above) {
    params.emplace_back(*plan.above);
    above_expiry = " AND run_at_ms > $" + std::to_string(params.size());
  }
  const Rows r = connection.query(
      "SELECT (SELECT min(run_at_ms) FROM keel_jobs WHERE queue = $1"
      " AND state IN ('ready', 'retry_scheduled')" +
          above_floor +
          "), (SELECT min(run_at_ms) FROM keel_jobs WHERE queue = $1 AND state = 'running'" +
          above_expiry + ")",
      params);
  RowCursor c(r, 0);
  const std::optional<std::int64_t> ready = c.optional_integer();
  const std::optional<std::int64_t> running = c.optional_integer();
  if (ready && running) return due_within_floor(std::min(*ready, *running), floor);
  return due_within_floor(ready ? ready : running, floor);
}

bool JobQueue::start(Connection& connection, std::int64_t job_id, std::int64_t fence) const {
  return complete_and_start(connection, {}, job_id, fence).started;
}

DoneAndStarted JobQueue::complete_and_start(
    Connection& connection, const std::vector<std::pair<std::int64_t, std::int64_t>>& done,
    std::int64_t job_id, std::int64_t fence) const {
  DoneAndStarted out;
  const std::int64_t now = now_ms();
  if (done.empty()) {
    in_statement(deadlocks_, connection, [&](Connection& c) {
      out.started = c.query(std::string(kStart), {job_id, now, fence}).affected() == 1;
      return true;
    });
    return out;
  }
  if (connection.dialect().data_modifying_ctes()) {
    // One statement: the successes and the start, each UPDATE counted by the row it returns.
    std::vector<Value> params = {job_id, now, fence};
    // The successes (earlier jobs of the batch, lower ids) first, then the start.
    // Its rows: each success recorded (0, id), and the start (1, id) when it was current.
    const std::string sql = "WITH " + detail::done_ctes(done, params, options_.keep_done) +
                            ", started AS (" + std::string(kStart) +
                            " AND (SELECT count(*) FROM done) >= 0"
                            " RETURNING id) SELECT 0, id FROM done UNION ALL"
                            " SELECT 1, id FROM started";
    in_statement(deadlocks_, connection, [&](Connection& c) {
      const Rows r = c.query(sql, params);
      out = {};
      for (std::size_t i = 0; i < r.size(); ++i) {
        RowCursor row(r, i);
        if (row.integer() == 1) {
          out.started = true;
          continue;
        }
        out.current_ids.push_back(row.integer());
        ++out.current;
      }
      return true;
    });
    return out;
  }
  in_transaction(deadlocks_, connection, [&](Connection& tx) {
    out = {};
    for (const auto& [id, f] : done) {
      if (!detail::mark_done(tx, id, f, now, options_.keep_done)) continue;
      ++out.current;
      out.current_ids.push_back(id);
    }
    out.started = tx.query(std::string(kStart), {job_id, now, fence}).affected() == 1;
    return true;
  });
  return out;
}

bool JobQueue::heartbeat(Connection& connection, std::int64_t job_id, std::int64_t fence) const {
  bool current = false;
  in_statement(deadlocks_, connection, [&](Connection& c) {
    const std::int64_t now = now_ms();
    const std::int64_t expires = now + to_ms(options_.lease);
    const Rows r = c.query(
        "UPDATE keel_jobs SET lease_expires_ms = $3, run_at_ms = $3, updated_ms = $4 WHERE " +
            detail::held_by("$1", "$2"),
        {job_id, fence, expires, now});
    current = r.affected() == 1;
    return true;
  });
  return current;
}

bool JobQueue::release(Connection& connection, std::int64_t job_id, std::int64_t fence,
                       std::string_view why) const {
  bool released = false;
  bool given_back = false;
  CompleteResult result;
  in_transaction(deadlocks_, connection, [&](Connection& tx) {
    released = false;
    given_back = false;
    result = CompleteResult{};
    const std::int64_t now = now_ms();
    const Rows row = tx.query(std::string("SELECT ") + std::string(detail::kSettleColumns) +
                                  " FROM keel_jobs WHERE " + detail::held_by("$1", "$2") +
                                  std::string(connection.dialect().lock_rows()),
                              {job_id, fence});
    if (row.empty()) return false;
    released = true;
    if (!detail::read_settle_row(row, 0).started_ms) {
      // Never started: ready again at once, in its place, not charged (before any lease floor).
      given_back = true;
      tx.query(kGiveBack, {job_id, now});
      return true;
    }
    // Its handler ran and may have had an effect: charged as a crash is.
    result = settle(tx, row, 0, {.outcome = Outcome::ambiguous(), .error = std::string(why)},
                    "released", now);
    return true;
  });
  if (given_back) forget_lease_floors();  // once the job is visible to the next lease
  if (result.status == CompleteStatus::kDead && options_.on_dead_letter) {
    options_.on_dead_letter(job_id, DeadLetterReason{result.dead_kind, result.dead_reason});
  }
  return released;
}

}  // namespace keel::store
