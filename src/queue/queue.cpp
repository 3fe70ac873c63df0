// The durable job queue's shared part: the names of states and statuses, queue-name and key
// checks, construction, the schema and its migrations (written once for SQLite and PostgreSQL),
// and reading one job with its history. Each role of JobQueue has a file of its own (see the map
// at the top of include/keel/queue/queue.hpp): queue_producer.cpp, queue_lease.cpp,
// queue_complete.cpp, queue_dead_letters.cpp, queue_stats.cpp; what they share is
// detail/queue_sql.hpp.
#include "keel/queue/queue.hpp"

#include <algorithm>
#include <array>
#include <stdexcept>
#include <utility>

#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "keel/core/idempotency_key.hpp"
#include "keel/core/random.hpp"
#include "keel/core/text.hpp"
#include "keel/detail/secure_random.hpp"
#include "queue/detail/queue_sql.hpp"

namespace keel::store {

using detail::kJobColumns;
using detail::read_job;
using detail::to_ms;

namespace {

// Version 1 of the schema, written once: the backends differ only in how an id is generated.
// clang-format off
#define KEEL_QUEUE_SCHEMA_V1(KEEL_ID_COLUMN) \
  "CREATE TABLE keel_queues (" \
  " name TEXT PRIMARY KEY," \
  " created_ms BIGINT NOT NULL);" \
  "CREATE TABLE keel_jobs (" \
  " id " KEEL_ID_COLUMN "," \
  " queue TEXT NOT NULL REFERENCES keel_queues (name)," \
  " payload TEXT NOT NULL," \
  " idem_key TEXT NOT NULL," \
  " state TEXT NOT NULL CHECK (state IN" \
  "  ('ready', 'running', 'retry_scheduled', 'done', 'dead'))," \
  " attempts INTEGER NOT NULL," \
  " max_attempts INTEGER NOT NULL," \
  " run_at_ms BIGINT NOT NULL," \
  " lease_owner TEXT," \
  " leased_ms BIGINT," \
  " lease_expires_ms BIGINT," \
  " fence BIGINT NOT NULL," \
  " dead_reason TEXT," \
  " last_error TEXT," \
  " replays INTEGER NOT NULL," \
  " created_ms BIGINT NOT NULL," \
  " updated_ms BIGINT NOT NULL," \
  " finished_ms BIGINT);" \
  "CREATE UNIQUE INDEX keel_jobs_key ON keel_jobs (queue, idem_key);" \
  "CREATE INDEX keel_jobs_due ON keel_jobs (queue, state, run_at_ms);" \
  "CREATE TABLE keel_job_attempts (" \
  " id " KEEL_ID_COLUMN "," \
  " job_id BIGINT NOT NULL REFERENCES keel_jobs (id) ON DELETE CASCADE," \
  " round INTEGER NOT NULL," \
  " attempt INTEGER NOT NULL," \
  " started_ms BIGINT NOT NULL," \
  " finished_ms BIGINT NOT NULL," \
  " outcome TEXT NOT NULL," \
  " error TEXT," \
  " delay_ms BIGINT," \
  " worker TEXT);" \
  "CREATE INDEX keel_job_attempts_job ON keel_job_attempts (job_id);"

// keel_jobs_notify_new, as migrations 7 and 10 write it: a new job notifies unless a job of its
// queue due no later than it waits already; KEEL_DUE_SINCE bounds how far back that looks.
#define KEEL_NOTIFY_NEW_FUNCTION(KEEL_DUE_SINCE) \
  "CREATE OR REPLACE FUNCTION keel_jobs_notify_new() RETURNS trigger LANGUAGE plpgsql AS $$" \
  "DECLARE seen text := coalesce(current_setting('keel.notified', true), '');" \
  " BEGIN" \
  " IF position('|' || NEW.queue || '|' IN seen) > 0 THEN RETURN NULL; END IF;" \
  " PERFORM set_config('keel.notified', seen || '|' || NEW.queue || '|', true);" \
  " IF NOT EXISTS (SELECT 1 FROM keel_jobs j WHERE j.queue = NEW.queue" \
  " AND j.state IN ('ready', 'retry_scheduled') AND j.run_at_ms <= NEW.created_ms" \
  KEEL_DUE_SINCE \
  " AND j.xmin <> pg_current_xact_id()::xid) THEN" \
  " PERFORM pg_notify('keel_jobs', TG_TABLE_SCHEMA || '.' || NEW.queue);" \
  " END IF;" \
  " RETURN NULL; END$$;"

// Version 9, written once; PostgreSQL adds its storage parameter.
// How far back a new job's check for a due job waiting looks (migration 10), in ms.
#define KEEL_NOTIFY_LOOKBACK_MS "250"

#define KEEL_QUEUE_SCHEMA_V9(KEEL_STORAGE) \
  "CREATE INDEX keel_jobs_running ON keel_jobs (queue, run_at_ms) WHERE state = 'running';" \
  "CREATE INDEX keel_jobs_dead ON keel_jobs (queue, id) WHERE state = 'dead';" \
  "DROP INDEX keel_jobs_due;" KEEL_STORAGE
// clang-format on

constexpr Migration kMigrations[] = {
    {KEEL_QUEUE_SCHEMA_V1("INTEGER PRIMARY KEY AUTOINCREMENT"),
     KEEL_QUEUE_SCHEMA_V1("BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY")},
    // 2: what core's decide_retry needs between attempts, and deferrals (a refusal is not an
    // attempt).
    {"ALTER TABLE keel_jobs ADD COLUMN limited_retries INTEGER NOT NULL DEFAULT 0;"
     "ALTER TABLE keel_jobs ADD COLUMN prev_delay_ms BIGINT NOT NULL DEFAULT 0;"
     "ALTER TABLE keel_jobs ADD COLUMN deferred_reason TEXT;"
     "ALTER TABLE keel_jobs ADD COLUMN deferrals INTEGER NOT NULL DEFAULT 0;"},
    // 3: the due jobs in lease order. keel_jobs_due has the state between the queue and the time,
    // so a lease's "state IN (ready, retry_scheduled) ORDER BY run_at_ms" scanned every done job
    // of the queue (PostgreSQL's plan); this partial index holds only the leasable rows.
    {"CREATE INDEX keel_jobs_ready ON keel_jobs (queue, run_at_ms, id)"
     " WHERE state IN ('ready', 'retry_scheduled');"},
    // 4, SQLite only: the CHECK on state as comparisons joined by OR. SQLite checks a list of
    // more than two values with a temporary b-tree, whose page cache every write to keel_jobs
    // then allocated and freed (docs/queue.md). Its CHECKs cannot be altered, and a rebuild of
    // keel_jobs would fire the history's ON DELETE CASCADE, so the stored definition is edited
    // as SQLite documents for a change that leaves the stored rows valid (both forms accept the
    // same five values). writable_schema=RESET rereads the schema on this connection; creating
    // and dropping a table changes the schema cookie, so every other connection rereads it too.
    {"PRAGMA writable_schema = ON;"
     "UPDATE sqlite_master SET sql = replace(sql,"
     " 'CHECK (state IN  (''ready'', ''running'', ''retry_scheduled'', ''done'', ''dead''))',"
     " 'CHECK (state = ''ready'' OR state = ''running'' OR state = ''retry_scheduled''"
     " OR state = ''done'' OR state = ''dead'')')"
     " WHERE type = 'table' AND name = 'keel_jobs';"
     "PRAGMA writable_schema = RESET;"
     "CREATE TABLE keel_schema_reread (x INTEGER);"
     "DROP TABLE keel_schema_reread;",
     // PostgreSQL checks the list without a temporary structure: nothing to do.
     "SELECT 1"},
    // 5: an attempt is charged when its handler starts, not when its job is leased. started_ms
    // is set by the start (a lease that starts the job, or JobQueue::start) and is NULL for a job
    // leased in a batch and not started yet, which a sweep or a release gives back uncharged.
    // Jobs running under the old rules were charged at their lease: they count as started.
    {"ALTER TABLE keel_jobs ADD COLUMN started_ms BIGINT;"
     "UPDATE keel_jobs SET started_ms = COALESCE(leased_ms, updated_ms) WHERE state = 'running';"},
    // 6, PostgreSQL only: wakeups. Every job that becomes ready (inserted, replayed, released
    // before it started) notifies channel keel_jobs with "SCHEMA.QUEUE" (the schema of its
    // keel_jobs table, as channels are per database), whoever wrote it (keel's producers, older
    // keel versions, plain SQL), so idle workers listening there lease at once instead of
    // polling. A NOTIFY is delivered when its transaction commits, and
    // repeats of one (channel, payload) in a transaction are delivered once. The triggers'
    // WHEN clauses are evaluated without calling the function, so a lease or an outcome, which
    // never makes a job ready, costs nothing. SQLite has no notifications.
    {"SELECT 1",
     "CREATE OR REPLACE FUNCTION keel_jobs_notify() RETURNS trigger LANGUAGE plpgsql AS"
     " $$BEGIN PERFORM pg_notify('keel_jobs', TG_TABLE_SCHEMA || '.' || NEW.queue); RETURN NULL; "
     "END$$;"
     "CREATE TRIGGER keel_jobs_notify_insert AFTER INSERT ON keel_jobs FOR EACH ROW"
     " WHEN (NEW.state = 'ready') EXECUTE FUNCTION keel_jobs_notify();"
     "CREATE TRIGGER keel_jobs_notify_ready AFTER UPDATE OF state ON keel_jobs FOR EACH ROW"
     " WHEN (NEW.state = 'ready' AND OLD.state <> 'ready') EXECUTE FUNCTION keel_jobs_notify();"},
    // 7, PostgreSQL only: a new job notifies only when it is the queue's first due job, checked
    // when its transaction commits. A busy queue has due jobs waiting, and its workers lease the
    // next ones as they record each success; a notification then only made every listening
    // backend read it (a transaction each) and every idle worker lease for nothing (docs/queue.md,
    // "Wakeups"). The trigger is a deferred constraint trigger, so the check runs at COMMIT, and
    // the transaction's first job of a queue decides for the others (keel.notified, a setting
    // local to the transaction). Jobs of the same transaction do not count as waiting; a job due
    // later notifies when no job is due (idle workers sleep until the earliest due time).
    // Replays and releases still notify (keel_jobs_notify_ready).
    // clang-format off
    {"SELECT 1",
     KEEL_NOTIFY_NEW_FUNCTION("")
     "DROP TRIGGER keel_jobs_notify_insert ON keel_jobs;"
     "CREATE CONSTRAINT TRIGGER keel_jobs_notify_insert AFTER INSERT ON keel_jobs"
     " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.state = 'ready')"
     " EXECUTE FUNCTION keel_jobs_notify_new();"},
    // clang-format on
    // 8: the dead-letter kind as a column (DeadReason's name), so that operators filter dead jobs
    // by kind rather than by a substring of their reason. Jobs that died before it get the kind
    // their stored reason says (its text has always started with it); a reason that says none
    // leaves the kind NULL.
    {"ALTER TABLE keel_jobs ADD COLUMN dead_kind TEXT;"
     "UPDATE keel_jobs SET dead_kind = CASE"
     " WHEN dead_reason LIKE 'permanent:%' THEN 'permanent'"
     " WHEN dead_reason LIKE 'max age %' THEN 'max_age'"
     " WHEN dead_reason LIKE 'attempts exhausted%: the worker died while running it%'"
     " THEN 'crashed'"
     " WHEN dead_reason LIKE 'attempts exhausted%' THEN 'attempts_exhausted'"
     " END WHERE state = 'dead';"},
    // 9: fewer index entries per job. keel_jobs_due (queue, state, run_at_ms) took an entry at
    // each of a job's transitions (insert, lease, outcome), besides keel_jobs_ready's at insert:
    // its readers want only the running jobs (expired leases, the earliest expiry) and the dead
    // ones (dead letters), each a partial index of its own, so a job that succeeds takes 8 index
    // entries where it took 10 (2 beyond its primary key and key, where it took 4). Done jobs are
    // pruned in id order along the primary key. On PostgreSQL, room on each page of keel_jobs for
    // the versions a job's life writes (start, heartbeats): a version that fits on its row's page
    // and changes no indexed column is a HOT update, with no index entry and pruned without VACUUM;
    // pages filled to 100% made about 1 start in 10 a full update. Pages written before keep their
    // fill until their rows leave. SQLite updates rows in place.
    {KEEL_QUEUE_SCHEMA_V9(""),
     KEEL_QUEUE_SCHEMA_V9("ALTER TABLE keel_jobs SET (fillfactor = 70);")},
    // 10, PostgreSQL only: a new job's check for a due job waiting (7) looks at the due times
    // of the last KEEL_NOTIFY_LOOKBACK_MS (250 ms) before its own. It scanned keel_jobs_ready from
    // the queue's first entry, and while a snapshot is held VACUUM removes no entry: each enqueue
    // stepped over every job leased since the hold began, and the producer of scripts/bench-soak.sh
    // fell from 2,000 to about 350 jobs/s in four minutes. A queue with jobs waiting has waiting
    // jobs among its newest (a lease takes the oldest first), so the shorter look still finds one;
    // a job that waits alone, older than that, lets a new one notify (an idle worker leases once
    // more for nothing).
    {"SELECT 1",
     KEEL_NOTIFY_NEW_FUNCTION(" AND j.run_at_ms >= NEW.created_ms - " KEEL_NOTIFY_LOOKBACK_MS)},
    // 11: the crashed batches a job was in without an outcome. A worker leasing a batch starts
    // none of its jobs (no statement per job before its handler): a dead worker's batch comes
    // back uncharged, each job counted here, and a job counted runs alone, its start committed
    // before its handler, so that a crash then is charged to it and to no other (docs/queue.md,
    // "What a crash costs").
    {"ALTER TABLE keel_jobs ADD COLUMN crashed_batches INTEGER NOT NULL DEFAULT 0;"},
    // 12: the key index holds only the keys callers gave. A key keel makes (EnqueueRequest::key
    // empty) is a UUID from the CSPRNG, unique without an index, so its job (key_made = 1) takes
    // no entry there: on PostgreSQL none at its insert, none at its lease and none at its
    // outcome, where each non-HOT update wrote one (about 400 of the batched drain's 1,760 WAL
    // bytes per job, docs/queue.md). Rows written before, or by a writer that does not name the
    // column (an older keel, plain SQL), count as given and stay unique.
    {"ALTER TABLE keel_jobs ADD COLUMN key_made INTEGER NOT NULL DEFAULT 0;"
     "CREATE UNIQUE INDEX keel_jobs_given_key ON keel_jobs (queue, idem_key) WHERE key_made = 0;"
     "DROP INDEX keel_jobs_key;"},
};

#undef KEEL_QUEUE_SCHEMA_V1
#undef KEEL_QUEUE_SCHEMA_V9
#undef KEEL_NOTIFY_LOOKBACK_MS
#undef KEEL_NOTIFY_NEW_FUNCTION

// Each value of an enum with its name, as stored and as the command line gives it: the one list
// that both to_string and the parse function read.
template <class Enum, std::size_t N>
using Names = std::array<std::pair<Enum, std::string_view>, N>;

constexpr Names<JobState, 5> kJobStateNames{{
    {JobState::kReady, "ready"},
    {JobState::kRunning, "running"},
    {JobState::kRetryScheduled, "retry_scheduled"},
    {JobState::kDone, "done"},
    {JobState::kDead, "dead"},
}};

constexpr Names<DeadReason, 4> kDeadReasonNames{{
    {DeadReason::kPermanent, "permanent"},
    {DeadReason::kAttemptsExhausted, "attempts_exhausted"},
    {DeadReason::kMaxAge, "max_age"},
    {DeadReason::kCrashed, "crashed"},
}};

// The name of `value`; `fallback` for a value outside the enum.
template <class Enum, std::size_t N>
std::string_view name_of(const Names<Enum, N>& names, Enum value,
                         std::string_view fallback) noexcept {
  for (const auto& [v, name] : names) {
    if (v == value) return name;
  }
  return fallback;
}

// The value named `text`, or nullopt.
template <class Enum, std::size_t N>
std::optional<Enum> value_named(const Names<Enum, N>& names, std::string_view text) noexcept {
  for (const auto& [v, name] : names) {
    if (name == text) return v;
  }
  return std::nullopt;
}

}  // namespace

std::string_view to_string(JobState state) noexcept {
  return name_of(kJobStateNames, state, "ready");
}

std::optional<JobState> parse_job_state(std::string_view text) noexcept {
  return value_named(kJobStateNames, text);
}

std::string_view to_string(DeadReason reason) noexcept {
  return name_of(kDeadReasonNames, reason, "attempts_exhausted");
}

std::optional<DeadReason> parse_dead_reason(std::string_view text) noexcept {
  if (const std::optional<DeadReason> r = value_named(kDeadReasonNames, text)) return r;
  if (text == "exhausted") return DeadReason::kAttemptsExhausted;
  if (text == "max-age") return DeadReason::kMaxAge;
  return std::nullopt;
}

std::string_view to_string(CompleteStatus status) noexcept {
  switch (status) {
    case CompleteStatus::kDone:
      return "done";
    case CompleteStatus::kRetryScheduled:
      return "retry_scheduled";
    case CompleteStatus::kDeferred:
      return "deferred";
    case CompleteStatus::kDead:
      return "dead";
    case CompleteStatus::kStale:
      return "stale";
  }
  return "stale";
}

Expected<void> check_queue_name(std::string_view name) { return check_name("queue name", name); }

std::string new_job_key() { return keel::detail::random_idempotency_key("keel::store"); }

namespace {

constexpr std::string_view kOptions = "keel::store::QueueOptions";

RetryPolicy queue_policy(const QueueOptions& o) {
  if (o.max_attempts < 1) {
    throw_invalid({.context = std::string(kOptions),
                   .field = "max_attempts",
                   .problem = "must be >= 1",
                   .got = std::to_string(o.max_attempts)});
  }
  if (o.retry_after_cap < Duration::zero()) {
    throw_invalid({.context = std::string(kOptions),
                   .field = "retry_after_cap",
                   .problem = "must be >= 0",
                   .got = format_duration(o.retry_after_cap)});
  }
  if (o.max_age <= Duration::zero()) {
    throw_invalid({.context = std::string(kOptions),
                   .field = "max_age",
                   .problem = "must be > 0",
                   .got = format_duration(o.max_age)});
  }
  if (o.dead_letter_retention <= Duration::zero()) {
    throw_invalid({.context = std::string(kOptions),
                   .field = "dead_letter_retention",
                   .problem = "must be > 0",
                   .got = format_duration(o.dead_letter_retention)});
  }
  if (o.dead_letter_warning && *o.dead_letter_warning < Duration::zero()) {
    throw_invalid({.context = std::string(kOptions),
                   .field = "dead_letter_warning",
                   .problem = "must be >= 0",
                   .got = format_duration(*o.dead_letter_warning)});
  }
  if (o.dead_letter_warning && o.dead_letter_retention < kInfinite &&
      *o.dead_letter_warning >= o.dead_letter_retention) {
    throw_invalid({.context = std::string(kOptions),
                   .field = "dead_letter_warning",
                   .problem = "must be shorter than dead_letter_retention (" +
                              format_duration(o.dead_letter_retention) +
                              "), or dead jobs are pruned before it can warn",
                   .got = format_duration(*o.dead_letter_warning)});
  }
  RetryOptions r;
  r.max_attempts = o.max_attempts;
  r.backoff = o.backoff;
  r.retry_after_cap = o.retry_after_cap;
  r.min_attempt_time = Duration::zero();
  return RetryPolicy(std::move(r));
}

}  // namespace

JobQueue::JobQueue(QueueOptions options)
    : options_(std::move(options)),
      policy_(queue_policy(options_)),
      clock_(options_.clock != nullptr ? options_.clock : &steady_clock()),
      rng_(options_.seed != 0 ? options_.seed : random_seed()) {
  if (options_.lease <= Duration::zero()) {
    throw_invalid({.context = std::string(kOptions),
                   .field = "lease",
                   .problem = "must be > 0",
                   .got = format_duration(options_.lease)});
  }
  if (options_.lease < std::chrono::milliseconds(1)) {
    // Lease expiries are stored in whole milliseconds: a shorter lease is one that has expired
    // when it is taken, and its job would run again while it runs.
    throw_invalid({.context = std::string(kOptions),
                   .field = "lease",
                   .problem = "must be >= 1ms (lease expiries are stored in whole milliseconds)",
                   .got = format_duration(options_.lease)});
  }
  if (!options_.dead_letter_warning) {
    options_.dead_letter_warning =
        std::min<Duration>(std::chrono::hours(24), options_.dead_letter_retention / 2);
  }
}

void JobQueue::migrate(Connection& connection) {
  (void)store::migrate(connection, "queue",
                       std::span<const Migration>(std::begin(kMigrations), std::end(kMigrations)));
}

SchemaComponent JobQueue::schema() noexcept {
  return schema_component("queue", kMigrations, &JobQueue::migrate);
}

std::int64_t JobQueue::now_ms() const noexcept { return wall_ms(*clock_); }

std::optional<Job> JobQueue::get(Connection& connection, std::int64_t job_id) const {
  const Rows r = connection.query("SELECT " + std::string(kJobColumns) +
                                      ", lease_owner, COALESCE(started_ms, leased_ms), finished_ms"
                                      " FROM keel_jobs WHERE id = $1",
                                  {job_id});
  if (r.empty()) return std::nullopt;
  RowCursor row(r, 0);
  Job job = read_job(row);
  const std::string success_worker = row.text_or_empty();
  const std::optional<std::int64_t> success_started_ms = row.optional_integer();
  const std::optional<std::int64_t> success_finished_ms = row.optional_integer();
  const Rows h = connection.query(
      "SELECT round, attempt, started_ms, finished_ms, outcome, error, delay_ms, worker"
      " FROM keel_job_attempts WHERE job_id = $1 ORDER BY id",
      {job_id});
  job.history = read_rows(h, [](RowCursor& c) {
    JobAttempt a;
    a.round = static_cast<int>(c.integer());
    a.attempt = static_cast<int>(c.integer());
    a.started_ms = c.integer();
    a.finished_ms = c.integer();
    a.outcome = c.text();
    a.error = c.text_or_empty();
    a.delay_ms = c.optional_integer();
    a.worker = c.text_or_empty();
    return a;
  });
  // The success that made the job done is its row, not a history row (detail::kMarkDone). A job
  // done before that change has its success row already.
  if (job.state == JobState::kDone &&
      (job.history.empty() || job.history.back().outcome != "success")) {
    JobAttempt a;
    a.round = job.replays;
    a.attempt = job.attempts;
    a.finished_ms = success_finished_ms.value_or(job.updated_ms);
    a.started_ms = success_started_ms.value_or(a.finished_ms);
    a.outcome = "success";
    a.worker = success_worker;
    job.history.push_back(std::move(a));
  }
  return job;
}

}  // namespace keel::store
