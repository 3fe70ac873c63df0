// The durable job queue: enqueue, lease, heartbeat, complete, dead letters and statistics written
// once for SQLite and PostgreSQL (see include/keel/store/queue.hpp for the life of a job).
#include "keel/store/queue.hpp"

#include <openssl/rand.h>
#include <sqlite3.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>

#include "detail/commit.hpp"
#include "keel/duration.hpp"
#include "keel/store/transaction.hpp"

namespace keel::store {
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
};

#undef KEEL_QUEUE_SCHEMA_V1

constexpr int kReapBatch = 100;
// Jobs per multi-row INSERT in enqueue_many (6 parameters each, under both backends' limits).
constexpr std::size_t kEnqueueChunk = 500;
constexpr std::size_t kMaxErrorText = 2000;

std::int64_t to_ms(Duration d) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
}

std::string clip(std::string_view s) {
  return std::string(s.substr(0, std::min(s.size(), kMaxErrorText)));
}

// Runs fn in one transaction, retrying lost races; throws DatabaseError when it cannot commit.
void in_transaction(Connection& conn, const std::function<bool(Connection&)>& fn) {
  detail::commit_or_throw(conn, "job queue", fn);
}

std::string optional_text(const Rows& rows, std::size_t row, std::size_t col) {
  const auto& cell = rows.cell(row, col);
  return cell ? *cell : std::string();
}

std::string_view outcome_name(OutcomeKind kind) { return to_string(kind); }

void insert_attempt(Connection& tx, std::int64_t job_id, std::int64_t round, std::int64_t attempt,
                    std::int64_t started_ms, std::int64_t finished_ms, std::string_view outcome,
                    std::string_view error, std::optional<std::int64_t> delay_ms,
                    std::string_view worker) {
  tx.query(
      "INSERT INTO keel_job_attempts (job_id, round, attempt, started_ms, finished_ms, outcome, "
      "error, delay_ms, worker) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
      {job_id, round, attempt, started_ms, finished_ms, outcome,
       error.empty() ? Value() : Value(clip(error)), delay_ms ? Value(*delay_ms) : Value(),
       worker.empty() ? Value() : Value(worker)});
}

// " AND queue = $N" or nothing, for the commands that take an optional queue.
std::string queue_filter(std::string_view queue, int param) {
  return queue.empty() ? std::string() : " AND queue = $" + std::to_string(param);
}

}  // namespace

std::string_view to_string(JobState state) noexcept {
  switch (state) {
    case JobState::kReady:
      return "ready";
    case JobState::kRunning:
      return "running";
    case JobState::kRetryScheduled:
      return "retry_scheduled";
    case JobState::kDone:
      return "done";
    case JobState::kDead:
      return "dead";
  }
  return "ready";
}

std::optional<JobState> parse_job_state(std::string_view text) noexcept {
  for (JobState s : {JobState::kReady, JobState::kRunning, JobState::kRetryScheduled,
                     JobState::kDone, JobState::kDead}) {
    if (to_string(s) == text) return s;
  }
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

std::string check_queue_name(std::string_view name) {
  if (name.empty()) return "queue name is empty";
  if (name.size() > 64) return "queue name is longer than 64 characters";
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == '-';
    if (!ok) {
      return "queue name '" + std::string(name) +
             "' may only contain letters, digits, '_', '.' and '-'";
    }
  }
  return {};
}

std::string new_job_key() {
  unsigned char b[16];
  if (RAND_bytes(b, sizeof b) != 1) throw std::runtime_error("RAND_bytes failed");
  b[6] = static_cast<unsigned char>((b[6] & 0x0f) | 0x40);  // version 4
  b[8] = static_cast<unsigned char>((b[8] & 0x3f) | 0x80);  // RFC 4122 variant
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(36);
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    out += kDigits[b[i] >> 4];
    out += kDigits[b[i] & 0xf];
  }
  return out;
}

namespace {

RetryPolicy queue_policy(const QueueOptions& o) {
  if (o.max_attempts < 1) {
    throw std::invalid_argument("QueueOptions.max_attempts must be >= 1 (got " +
                                std::to_string(o.max_attempts) + ")");
  }
  if (o.retry_after_cap < Duration::zero()) {
    throw std::invalid_argument("QueueOptions.retry_after_cap must be >= 0 (got " +
                                std::to_string(to_ms(o.retry_after_cap)) + "ms)");
  }
  if (o.max_age <= Duration::zero()) {
    throw std::invalid_argument("QueueOptions.max_age must be > 0 (got " +
                                std::to_string(to_ms(o.max_age)) + "ms)");
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
      rng_(options_.seed != 0
               ? options_.seed
               : (std::uint64_t{std::random_device{}()} << 32) ^ std::random_device{}()) {
  if (options_.lease <= Duration::zero()) {
    throw std::invalid_argument("QueueOptions.lease must be > 0 (got " +
                                std::to_string(to_ms(options_.lease)) + "ms)");
  }
}

void JobQueue::migrate(Connection& connection) {
  (void)store::migrate(connection, "queue",
                       std::span<const Migration>(std::begin(kMigrations), std::end(kMigrations)));
}

std::int64_t JobQueue::now_ms() const noexcept {
  return to_ms(clock_->wall_now().time_since_epoch());
}

namespace {

// A sentence naming what is wrong with the request, or empty.
std::string check_request(const EnqueueRequest& request) {
  if (std::string why = check_queue_name(request.queue); !why.empty()) return why;
  if (nlohmann::json::parse(request.payload, nullptr, false).is_discarded()) {
    return "payload is not valid JSON";
  }
  if (request.key.size() > 255) return "idempotency key is longer than 255 characters";
  for (char c : request.key) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      return "idempotency key contains a control character";
    }
  }
  if (request.max_attempts < 0) {
    return "max attempts must be >= 1 (got " + std::to_string(request.max_attempts) + ")";
  }
  if (request.delay < Duration::zero()) return "delay must be >= 0";
  return {};
}

constexpr std::string_view kInsertJob =
    "INSERT INTO keel_jobs (queue, payload, idem_key, state, attempts, max_attempts, run_at_ms,"
    " fence, replays, created_ms, updated_ms)"
    " VALUES ($1, $2, $3, 'ready', 0, $4, $5, 0, 0, $6, $6)"
    " ON CONFLICT (queue, idem_key) DO NOTHING RETURNING id";

// The id of the job already enqueued under (queue, key): the request was a repeat.
void find_existing(Connection& conn, const std::string& queue, const std::string& key,
                   EnqueueResult& out) {
  const Rows existing =
      conn.query("SELECT id FROM keel_jobs WHERE queue = $1 AND idem_key = $2", {queue, key});
  if (existing.empty()) {
    throw DatabaseError("enqueue: the job with key '" + key + "' vanished",
                        {.backend = conn.backend()});
  }
  out.id = existing.integer(0, 0);
  out.created = false;
}

// Inserts one checked request inside an open transaction whose queue row exists.
void insert_job(Connection& tx, const EnqueueRequest& request, const std::string& key,
                int max_attempts, std::int64_t now, EnqueueResult& out) {
  const std::int64_t run_at = now + to_ms(request.delay);
  const Rows inserted =
      tx.query(kInsertJob, {request.queue, request.payload, key, max_attempts, run_at, now});
  if (!inserted.empty()) {
    out.id = inserted.integer(0, 0);
    out.created = true;
    return;
  }
  find_existing(tx, request.queue, key, out);
}

// One request in one statement, atomic on its own (no BEGIN/COMMIT): on PostgreSQL a CTE creates
// the queue's row if needed, inserts the job and, for a repeated key, returns the existing id;
// on SQLite (no data-modifying CTEs) the job insert alone, which fails on the foreign key only for
// a queue never used before. Returns false when that happened: the caller takes the transaction.
bool enqueue_one_statement(Connection& conn, const EnqueueRequest& request, const std::string& key,
                           int max_attempts, std::int64_t now, EnqueueResult& out) {
  const std::int64_t run_at = now + to_ms(request.delay);
  const std::initializer_list<Value> params = {request.queue, request.payload, key,
                                               max_attempts,  run_at,          now};
  if (conn.backend() == Backend::kPostgres) {
    // The foreign key is checked at the end of the statement, after the queue CTE's insert.
    const Rows r = conn.query(
        "WITH q AS (INSERT INTO keel_queues (name, created_ms) VALUES ($1, $6)"
        " ON CONFLICT (name) DO NOTHING),"
        " ins AS (" +
            std::string(kInsertJob) +
            ") SELECT id, 1 FROM ins UNION ALL SELECT id, 0 FROM keel_jobs"
            " WHERE queue = $1 AND idem_key = $3 AND NOT EXISTS (SELECT 1 FROM ins)",
        params);
    if (r.empty()) {
      // A concurrent enqueue of the same key committed after this statement's snapshot.
      find_existing(conn, request.queue, key, out);
      return true;
    }
    out.id = r.integer(0, 0);
    out.created = r.integer(0, 1) == 1;
    return true;
  }
  Rows inserted;
  try {
    inserted = conn.query(kInsertJob, params);
  } catch (const DatabaseError& e) {
    if (e.details().sqlite_code == SQLITE_CONSTRAINT_FOREIGNKEY) return false;
    throw;
  }
  if (!inserted.empty()) {
    out.id = inserted.integer(0, 0);
    out.created = true;
    return true;
  }
  find_existing(conn, request.queue, key, out);
  return true;
}

}  // namespace

EnqueueResult JobQueue::enqueue(Connection& connection, const EnqueueRequest& request) const {
  std::vector<EnqueueResult> r = enqueue_many(connection, {request});
  return std::move(r.front());
}

std::vector<EnqueueResult> JobQueue::enqueue_many(
    Connection& connection, const std::vector<EnqueueRequest>& requests) const {
  std::vector<EnqueueResult> out(requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    if (std::string why = check_request(requests[i]); !why.empty()) {
      for (EnqueueResult& r : out) r.error = why;
      return out;
    }
  }
  std::vector<std::string> keys;
  keys.reserve(requests.size());
  for (const EnqueueRequest& r : requests) keys.push_back(r.key.empty() ? new_job_key() : r.key);
  const std::int64_t now = now_ms();
  const auto max_attempts_of = [&](const EnqueueRequest& r) {
    return r.max_attempts > 0 ? r.max_attempts : options_.max_attempts;
  };
  if (requests.size() == 1 && !connection.in_transaction()) {
    out[0].idempotency_key = keys[0];
    if (enqueue_one_statement(connection, requests[0], keys[0], max_attempts_of(requests[0]), now,
                              out[0])) {
      return out;
    }
  }
  in_transaction(connection, [&](Connection& tx) {
    // Each queue's row once per batch, then the jobs.
    std::vector<std::string_view> queues;
    for (const EnqueueRequest& r : requests) {
      if (std::find(queues.begin(), queues.end(), r.queue) != queues.end()) continue;
      queues.push_back(r.queue);
      tx.query(
          "INSERT INTO keel_queues (name, created_ms) VALUES ($1, $2)"
          " ON CONFLICT (name) DO NOTHING",
          {r.queue, now});
    }
    if (requests.size() == 1) {
      insert_job(tx, requests[0], keys[0], max_attempts_of(requests[0]), now, out[0]);
      out[0].idempotency_key = keys[0];
      return true;
    }
    // The jobs in multi-row INSERTs (one statement per kEnqueueChunk jobs); a key that was
    // already there is looked up.
    for (std::size_t from = 0; from < requests.size(); from += kEnqueueChunk) {
      const std::size_t to = std::min(requests.size(), from + kEnqueueChunk);
      std::string sql =
          "INSERT INTO keel_jobs (queue, payload, idem_key, state, attempts, max_attempts,"
          " run_at_ms, fence, replays, created_ms, updated_ms) VALUES ";
      std::vector<Value> params;
      params.reserve((to - from) * 6);
      for (std::size_t i = from; i < to; ++i) {
        const auto p = [&](int k) { return "$" + std::to_string(params.size() + k); };
        sql += (i > from ? ", (" : "(") + p(1) + ", " + p(2) + ", " + p(3) + ", 'ready', 0, " +
               p(4) + ", " + p(5) + ", 0, 0, " + p(6) + ", " + p(6) + ")";
        params.emplace_back(requests[i].queue);
        params.emplace_back(requests[i].payload);
        params.emplace_back(keys[i]);
        params.emplace_back(max_attempts_of(requests[i]));
        params.emplace_back(now + to_ms(requests[i].delay));
        params.emplace_back(now);
      }
      sql += " ON CONFLICT (queue, idem_key) DO NOTHING RETURNING id, queue, idem_key";
      const Rows inserted = tx.query(sql, params);
      std::vector<std::pair<std::string, std::int64_t>> created;  // queue + '\n' + key, id
      created.reserve(inserted.size());
      for (std::size_t r = 0; r < inserted.size(); ++r) {
        created.emplace_back(inserted.text(r, 1) + '\n' + inserted.text(r, 2),
                             inserted.integer(r, 0));
      }
      for (std::size_t i = from; i < to; ++i) {
        out[i].idempotency_key = keys[i];
        const std::string name = requests[i].queue + '\n' + keys[i];
        const auto hit = std::find_if(created.begin(), created.end(),
                                      [&](const auto& c) { return c.first == name; });
        if (hit != created.end()) {
          // The first request with this key created the job; a repeat in the batch gets its id.
          out[i].id = hit->second;
          out[i].created = true;
          hit->first.clear();
          continue;
        }
        const auto earlier = std::find_if(
            out.begin() + static_cast<std::ptrdiff_t>(from),
            out.begin() + static_cast<std::ptrdiff_t>(i),
            [&](const EnqueueResult& e) { return e.idempotency_key == keys[i] && e.id != 0; });
        if (earlier != out.begin() + static_cast<std::ptrdiff_t>(i) &&
            requests[static_cast<std::size_t>(earlier - out.begin())].queue == requests[i].queue) {
          out[i].id = earlier->id;
          out[i].created = false;
          continue;
        }
        find_existing(tx, requests[i].queue, keys[i], out[i]);
      }
    }
    return true;
  });
  return out;
}

std::int64_t JobQueue::reap_expired(Connection& connection, std::string_view queue) const {
  const bool pg = connection.backend() == Backend::kPostgres;
  std::int64_t reaped = 0;
  std::vector<std::pair<std::int64_t, std::string>> dead;
  in_transaction(connection, [&](Connection& tx) {
    reaped = 0;
    dead.clear();
    const std::int64_t now = now_ms();
    // Leases that expired: the worker died or stalled. Record the lost attempt; the job is ready
    // again, or dead when that was its last attempt. The new fence locks the old worker out.
    const Rows expired = tx.query(
        std::string("SELECT id, attempts, max_attempts, leased_ms, lease_owner, replays"
                    " FROM keel_jobs WHERE queue = $1 AND state = 'running' AND run_at_ms <= $2"
                    " ORDER BY run_at_ms LIMIT $3") +
            (pg ? " FOR UPDATE SKIP LOCKED" : ""),
        {queue, now, kReapBatch});
    for (std::size_t i = 0; i < expired.size(); ++i) {
      const std::int64_t id = expired.integer(i, 0);
      const std::int64_t attempts = expired.integer(i, 1);
      const std::int64_t max_attempts = expired.integer(i, 2);
      const std::string owner = optional_text(expired, i, 4);
      const std::string error = "lease held by " + owner + " expired (no heartbeat)";
      const bool exhausted = attempts >= max_attempts;
      tx.query(
          "UPDATE keel_jobs SET state = $2, fence = fence + 1, lease_owner = NULL,"
          " lease_expires_ms = NULL, run_at_ms = $3, last_error = $4, dead_reason = $5,"
          " updated_ms = $3, finished_ms = $6 WHERE id = $1",
          {id, exhausted ? "dead" : "ready", now, error,
           exhausted ? Value("attempts exhausted: " + error) : Value(),
           exhausted ? Value(now) : Value()});
      insert_attempt(tx, id, expired.integer(i, 5), attempts,
                     expired.cell(i, 3) ? expired.integer(i, 3) : now, now, "lease_expired", error,
                     std::nullopt, owner);
      if (exhausted) dead.emplace_back(id, "attempts exhausted: " + error);
      ++reaped;
    }
    return true;
  });
  if (options_.on_dead_letter) {
    for (const auto& [id, reason] : dead) options_.on_dead_letter(id, reason);
  }
  return reaped;
}

DoneAndLeased JobQueue::finish_and_lease_due(
    Connection& connection, const std::vector<std::pair<std::int64_t, std::int64_t>>& done,
    std::string_view queue, std::string_view worker, int limit, bool* expired_waiting) const {
  const bool pg = connection.backend() == Backend::kPostgres;
  const std::int64_t now = now_ms();
  const std::int64_t expires = now + to_ms(options_.lease);
  DoneAndLeased out;
  const std::string pick =
      "SELECT id FROM keel_jobs WHERE queue = $1 AND state IN ('ready', 'retry_scheduled')"
      " AND run_at_ms <= $2 ORDER BY run_at_ms, id LIMIT $4";
  constexpr std::string_view kSetRunning =
      " SET state = 'running', attempts = attempts + 1, fence = fence + 1, lease_owner = $3,"
      " leased_ms = $2, lease_expires_ms = $5, run_at_ms = $5, updated_ms = $2";
  constexpr std::string_view kExpired =
      "SELECT 1 FROM keel_jobs WHERE queue = $1 AND state = 'running' AND run_at_ms <= $2 LIMIT 1";
  Rows leased;
  std::size_t first = 0;  // column of the leased rows' id
  if (pg) {
    // One statement, atomic on its own: no BEGIN/COMMIT round trips on the hot path. Its rows:
    // kind 1 = a leased job, kind 0 = how many successes were current, kind 2 = an expired
    // lease is waiting.
    std::vector<Value> params = {queue, now, worker, limit, expires};
    std::string sql = "WITH ";
    if (!done.empty()) {
      sql += "v (id, fence) AS (VALUES ";
      for (std::size_t i = 0; i < done.size(); ++i) {
        const std::string a = std::to_string(params.size() + 1);
        const std::string b = std::to_string(params.size() + 2);
        sql += (i ? ", ($" : "($") + a + "::bigint, $" + b + "::bigint)";
        params.emplace_back(done[i].first);
        params.emplace_back(done[i].second);
      }
      sql +=
          "), done AS (UPDATE keel_jobs j SET state = 'done', lease_owner = NULL,"
          " lease_expires_ms = NULL, run_at_ms = $2, last_error = NULL, deferred_reason = NULL,"
          " updated_ms = $2, finished_ms = $2 FROM v, keel_jobs old WHERE j.id = v.id"
          " AND j.fence = v.fence AND j.state = 'running' AND old.id = j.id"
          " RETURNING j.id, j.replays, j.attempts, j.leased_ms, old.lease_owner),"
          " hist AS (INSERT INTO keel_job_attempts (job_id, round, attempt, started_ms,"
          " finished_ms, outcome, worker) SELECT id, replays, attempts, COALESCE(leased_ms, $2),"
          " $2, 'success', lease_owner FROM done RETURNING job_id), ";
    }
    sql += "picked AS (" + pick + " FOR UPDATE SKIP LOCKED), leased AS (UPDATE keel_jobs j" +
           std::string(kSetRunning) +
           " FROM picked WHERE j.id = picked.id"
           " RETURNING j.id, j.payload, j.idem_key, j.attempts, j.max_attempts, j.fence)"
           " SELECT 1, id, payload, idem_key, attempts, max_attempts, fence FROM leased";
    if (!done.empty()) {
      sql += " UNION ALL SELECT 0, count(*), NULL, NULL, NULL, NULL, NULL FROM hist";
    }
    sql += " UNION ALL SELECT 2, 0, NULL, NULL, NULL, NULL, NULL WHERE EXISTS (" +
           std::string(kExpired) + ")";
    leased = connection.query(sql, params);
    first = 1;
  } else {
    const std::string lease_sql =
        "UPDATE keel_jobs" + std::string(kSetRunning) + " WHERE id IN (" + pick +
        ") RETURNING id, payload, idem_key, attempts, max_attempts, fence";
    const auto lease_and_probe = [&](Connection& c) {
      leased = c.query(lease_sql, {queue, now, worker, limit, expires});
      *expired_waiting = !c.query(kExpired, {queue, now}).empty();
    };
    if (done.empty()) {
      lease_and_probe(connection);
    } else {
      in_transaction(connection, [&](Connection& tx) {
        out.current = 0;
        for (const auto& [id, fence] : done) {
          // Read first: SQLite's RETURNING gives the new row, and the lease's owner is cleared.
          const Rows r = tx.query(
              "SELECT attempts, leased_ms, replays, lease_owner FROM keel_jobs"
              " WHERE id = $1 AND fence = $2 AND state = 'running'",
              {id, fence});
          if (r.empty()) continue;
          tx.query(
              "UPDATE keel_jobs SET state = 'done', lease_owner = NULL, lease_expires_ms = NULL,"
              " run_at_ms = $2, last_error = NULL, deferred_reason = NULL, updated_ms = $2,"
              " finished_ms = $2 WHERE id = $1",
              {id, now});
          ++out.current;
          insert_attempt(tx, id, r.integer(0, 2), r.integer(0, 0),
                         r.cell(0, 1) ? r.integer(0, 1) : now, now, "success", {}, std::nullopt,
                         optional_text(r, 0, 3));
        }
        lease_and_probe(tx);
        return true;
      });
    }
  }
  if (pg) *expired_waiting = false;
  out.leased.reserve(leased.size());
  for (std::size_t i = 0; i < leased.size(); ++i) {
    if (pg && leased.integer(i, 0) != 1) {
      if (leased.integer(i, 0) == 0) out.current = static_cast<int>(leased.integer(i, 1));
      if (leased.integer(i, 0) == 2) *expired_waiting = true;
      continue;
    }
    LeasedJob job;
    job.id = leased.integer(i, first + 0);
    job.queue = std::string(queue);
    job.payload = leased.text(i, first + 1);
    job.idempotency_key = leased.text(i, first + 2);
    job.attempt = static_cast<int>(leased.integer(i, first + 3));
    job.max_attempts = static_cast<int>(leased.integer(i, first + 4));
    job.fence = leased.integer(i, first + 5);
    job.lease_expires_ms = expires;
    out.leased.push_back(std::move(job));
  }
  return out;
}

std::vector<LeasedJob> JobQueue::lease_due(Connection& connection, std::string_view queue,
                                           std::string_view worker, int limit) const {
  bool expired_waiting = false;
  return finish_and_lease_due(connection, {}, queue, worker, limit, &expired_waiting).leased;
}

DoneAndLeased JobQueue::complete_and_lease(
    Connection& connection, const std::vector<std::pair<std::int64_t, std::int64_t>>& done,
    std::string_view queue, std::string_view worker, int limit) const {
  if (limit < 1) throw std::invalid_argument("complete_and_lease: limit must be >= 1");
  bool expired_waiting = false;
  DoneAndLeased out =
      finish_and_lease_due(connection, done, queue, worker, limit, &expired_waiting);
  // Expired leases are reaped when one is waiting and the due jobs did not fill the request, or
  // at most every quarter lease while they do (so a busy queue still reclaims them promptly).
  // The statement above said whether one is waiting: no reaping transaction when none is.
  const std::int64_t now = now_ms();
  const bool short_of_work = static_cast<int>(out.leased.size()) < limit;
  if (expired_waiting &&
      (short_of_work || now - last_reap_ms_.load() >= to_ms(options_.lease) / 4)) {
    last_reap_ms_.store(now);
    if (reap_expired(connection, queue) > 0 && short_of_work) {
      auto more = lease_due(connection, queue, worker, limit - static_cast<int>(out.leased.size()));
      for (auto& job : more) out.leased.push_back(std::move(job));
    }
  }
  std::sort(out.leased.begin(), out.leased.end(),
            [](const LeasedJob& x, const LeasedJob& y) { return x.id < y.id; });
  return out;
}

std::vector<LeasedJob> JobQueue::lease(Connection& connection, std::string_view queue,
                                       std::string_view worker, int limit) const {
  if (limit < 1) throw std::invalid_argument("lease: limit must be >= 1");
  return complete_and_lease(connection, {}, queue, worker, limit).leased;
}

bool JobQueue::heartbeat(Connection& connection, std::int64_t job_id, std::int64_t fence) const {
  const std::int64_t now = now_ms();
  const std::int64_t expires = now + to_ms(options_.lease);
  const Rows r = connection.query(
      "UPDATE keel_jobs SET lease_expires_ms = $3, run_at_ms = $3, updated_ms = $4"
      " WHERE id = $1 AND fence = $2 AND state = 'running'",
      {job_id, fence, expires, now});
  return r.affected() == 1;
}

namespace {

// PostgreSQL: a success recorded in one statement (the job's update and its history row), atomic
// on its own. Returns false when the fence is stale.
bool record_success_pg(Connection& conn, std::int64_t job_id, std::int64_t fence,
                       std::int64_t now) {
  const Rows r = conn.query(
      "WITH done AS (UPDATE keel_jobs SET state = 'done', lease_owner = NULL,"
      " lease_expires_ms = NULL, run_at_ms = $3, last_error = NULL, updated_ms = $3,"
      " finished_ms = $3 WHERE id = $1 AND fence = $2 AND state = 'running'"
      " RETURNING id, replays, attempts, leased_ms, lease_owner)"
      " INSERT INTO keel_job_attempts (job_id, round, attempt, started_ms, finished_ms, outcome,"
      " worker) SELECT id, replays, attempts, COALESCE(leased_ms, $3), $3, 'success', lease_owner"
      " FROM done RETURNING job_id",
      {job_id, fence, now});
  return !r.empty();
}

}  // namespace

CompleteResult JobQueue::complete(Connection& connection, std::int64_t job_id, std::int64_t fence,
                                  const AttemptReport& report) const {
  const bool pg = connection.backend() == Backend::kPostgres;
  CompleteResult out;
  if (pg && report.outcome.kind == OutcomeKind::kSuccess) {
    out.status = record_success_pg(connection, job_id, fence, now_ms()) ? CompleteStatus::kDone
                                                                        : CompleteStatus::kStale;
    return out;
  }
  in_transaction(connection, [&](Connection& tx) {
    out = CompleteResult{};
    const std::int64_t now = now_ms();
    const Rows row =
        tx.query(std::string("SELECT attempts, max_attempts, leased_ms, lease_owner, replays,"
                             " limited_retries, prev_delay_ms, created_ms FROM keel_jobs"
                             " WHERE id = $1 AND fence = $2 AND state = 'running'") +
                     (pg ? " FOR UPDATE" : ""),
                 {job_id, fence});
    if (row.empty()) {
      out.status = CompleteStatus::kStale;
      return false;
    }
    const std::int64_t attempts = row.integer(0, 0);
    const std::int64_t max_attempts = row.integer(0, 1);
    const std::int64_t started = row.cell(0, 2) ? row.integer(0, 2) : now;
    const std::string owner = optional_text(row, 0, 3);
    const std::int64_t round = row.integer(0, 4);
    const OutcomeKind kind = report.outcome.kind;
    std::string error = report.error;
    if (error.empty() && kind != OutcomeKind::kSuccess) error = describe(report.outcome);

    if (kind == OutcomeKind::kSuccess) {
      out.status = CompleteStatus::kDone;
      tx.query(
          "UPDATE keel_jobs SET state = 'done', lease_owner = NULL, lease_expires_ms = NULL,"
          " run_at_ms = $2, last_error = NULL, deferred_reason = NULL, updated_ms = $2,"
          " finished_ms = $2 WHERE id = $1",
          {job_id, now});
      insert_attempt(tx, job_id, round, attempts, started, now, outcome_name(kind), {},
                     std::nullopt, owner);
      return true;
    }

    // Every retry rule is keel::core's: the queue stores the progress and applies the verdict.
    RetryLimits limits;
    limits.max_attempts = static_cast<int>(std::max<std::int64_t>(1, max_attempts));
    limits.safe_to_repeat = true;  // a job carries its idempotency key on every attempt
    if (options_.max_age < kInfinite) {
      const Duration age = std::chrono::milliseconds(now - row.integer(0, 7));
      limits.time_left = options_.max_age - age;
    }
    RetryProgress progress;
    progress.attempts = static_cast<int>(std::max<std::int64_t>(1, attempts));
    progress.limited_retries = static_cast<int>(row.integer(0, 5));
    progress.previous_delay = std::chrono::milliseconds(row.integer(0, 6));
    RetryVerdict verdict;
    {
      std::lock_guard lock(rng_mu_);
      verdict = decide_retry(policy_, limits, progress, report.outcome, rng_);
    }

    if (verdict.retry && !verdict.counts_attempt) {
      // Nothing was sent: the lease's attempt is given back and the job waits for its brake.
      out.status = CompleteStatus::kDeferred;
      out.delay = verdict.delay;
      out.retry_at_ms = now + to_ms(verdict.delay);
      tx.query(
          "UPDATE keel_jobs SET state = 'retry_scheduled', attempts = attempts - 1,"
          " lease_owner = NULL, lease_expires_ms = NULL, run_at_ms = $3, deferred_reason = $4,"
          " deferrals = deferrals + 1, updated_ms = $2 WHERE id = $1",
          {job_id, now, out.retry_at_ms, clip(error)});
      insert_attempt(tx, job_id, round, attempts, started, now, "deferred", error,
                     to_ms(verdict.delay), owner);
      return true;
    }
    if (verdict.retry) {
      out.status = CompleteStatus::kRetryScheduled;
      out.delay = verdict.delay;
      out.retry_at_ms = now + to_ms(verdict.delay);
      tx.query(
          "UPDATE keel_jobs SET state = 'retry_scheduled', lease_owner = NULL,"
          " lease_expires_ms = NULL, run_at_ms = $3, last_error = $4, deferred_reason = NULL,"
          " limited_retries = $5, prev_delay_ms = $6, updated_ms = $2 WHERE id = $1",
          {job_id, now, out.retry_at_ms, clip(error), verdict.progress.limited_retries,
           to_ms(verdict.progress.previous_delay)});
      insert_attempt(tx, job_id, round, attempts, started, now, outcome_name(kind), error,
                     to_ms(verdict.delay), owner);
      return true;
    }
    out.status = CompleteStatus::kDead;
    switch (verdict.reason) {
      case StopReason::kPermanent:
        out.dead_reason = "permanent: " + error;
        break;
      case StopReason::kDeadline:
        out.dead_reason = "max age " + format_duration(options_.max_age) + " reached: " + error;
        break;
      default:
        out.dead_reason = "attempts exhausted (" + std::to_string(attempts) + " of " +
                          std::to_string(max_attempts) +
                          (report.outcome.retry_limit != Outcome::kNoRetryLimit
                               ? ", at most " + std::to_string(report.outcome.retry_limit) +
                                     " retries after this outcome"
                               : std::string()) +
                          "): " + error;
        break;
    }
    out.dead_reason = clip(out.dead_reason);
    // A deferral's attempt was not counted: record the history row under its own name.
    const bool attempted = report.outcome.attempted();
    tx.query(std::string("UPDATE keel_jobs SET state = 'dead', lease_owner = NULL,") +
                 (attempted ? "" : " attempts = attempts - 1,") +
                 " lease_expires_ms = NULL, run_at_ms = $2, last_error = $3, dead_reason = $4,"
                 " updated_ms = $2, finished_ms = $2 WHERE id = $1",
             {job_id, now, clip(error), out.dead_reason});
    insert_attempt(tx, job_id, round, attempts, started, now,
                   attempted ? outcome_name(kind) : std::string_view("deferred"), error,
                   std::nullopt, owner);
    return true;
  });
  if (out.status == CompleteStatus::kDead && options_.on_dead_letter) {
    options_.on_dead_letter(job_id, out.dead_reason);
  }
  return out;
}

int JobQueue::complete_done(
    Connection& connection,
    const std::vector<std::pair<std::int64_t, std::int64_t>>& id_and_fence) const {
  int current = 0;
  in_transaction(connection, [&](Connection& tx) {
    current = 0;
    const std::int64_t now = now_ms();
    for (const auto& [id, fence] : id_and_fence) {
      if (tx.backend() == Backend::kPostgres) {
        if (record_success_pg(tx, id, fence, now)) ++current;
        continue;
      }
      const Rows r = tx.query(
          "UPDATE keel_jobs SET state = 'done', lease_owner = NULL, lease_expires_ms = NULL,"
          " run_at_ms = $3, last_error = NULL, updated_ms = $3, finished_ms = $3"
          " WHERE id = $1 AND fence = $2 AND state = 'running'"
          " RETURNING attempts, leased_ms, replays",
          {id, fence, now});
      if (r.empty()) continue;
      ++current;
      insert_attempt(tx, id, r.integer(0, 2), r.integer(0, 0), r.cell(0, 1) ? r.integer(0, 1) : now,
                     now, "success", {}, std::nullopt, {});
    }
    return true;
  });
  return current;
}

bool JobQueue::release(Connection& connection, std::int64_t job_id, std::int64_t fence,
                       std::string_view why) const {
  bool released = false;
  in_transaction(connection, [&](Connection& tx) {
    const std::int64_t now = now_ms();
    const Rows r = tx.query(
        "UPDATE keel_jobs SET state = 'ready', fence = fence + 1, lease_owner = NULL,"
        " lease_expires_ms = NULL, run_at_ms = $3, last_error = $4, updated_ms = $3"
        " WHERE id = $1 AND fence = $2 AND state = 'running'"
        " RETURNING attempts, leased_ms, replays",
        {job_id, fence, now, clip(why)});
    released = !r.empty();
    if (released) {
      insert_attempt(tx, job_id, r.integer(0, 2), r.integer(0, 0),
                     r.cell(0, 1) ? r.integer(0, 1) : now, now, "released", why, std::nullopt, {});
    }
    return true;
  });
  return released;
}

namespace {

constexpr std::string_view kJobColumns =
    "id, queue, payload, idem_key, state, attempts, max_attempts, run_at_ms, lease_owner,"
    " lease_expires_ms, fence, dead_reason, last_error, replays, created_ms, updated_ms,"
    " deferred_reason, deferrals";

Job read_job(const Rows& r, std::size_t i) {
  Job j;
  j.id = r.integer(i, 0);
  j.queue = r.text(i, 1);
  j.payload = r.text(i, 2);
  j.idempotency_key = r.text(i, 3);
  j.state = parse_job_state(r.text(i, 4)).value_or(JobState::kReady);
  j.attempts = static_cast<int>(r.integer(i, 5));
  j.max_attempts = static_cast<int>(r.integer(i, 6));
  j.run_at_ms = r.integer(i, 7);
  j.lease_owner = optional_text(r, i, 8);
  if (r.cell(i, 9)) j.lease_expires_ms = r.integer(i, 9);
  j.fence = r.integer(i, 10);
  j.dead_reason = optional_text(r, i, 11);
  j.last_error = optional_text(r, i, 12);
  j.replays = static_cast<int>(r.integer(i, 13));
  j.created_ms = r.integer(i, 14);
  j.updated_ms = r.integer(i, 15);
  j.deferred_reason = optional_text(r, i, 16);
  j.deferrals = static_cast<int>(r.integer(i, 17));
  return j;
}

}  // namespace

std::optional<Job> JobQueue::get(Connection& connection, std::int64_t job_id) const {
  const Rows r = connection.query(
      "SELECT " + std::string(kJobColumns) + " FROM keel_jobs WHERE id = $1", {job_id});
  if (r.empty()) return std::nullopt;
  Job job = read_job(r, 0);
  const Rows h = connection.query(
      "SELECT round, attempt, started_ms, finished_ms, outcome, error, delay_ms, worker"
      " FROM keel_job_attempts WHERE job_id = $1 ORDER BY id",
      {job_id});
  for (std::size_t i = 0; i < h.size(); ++i) {
    JobAttempt a;
    a.round = static_cast<int>(h.integer(i, 0));
    a.attempt = static_cast<int>(h.integer(i, 1));
    a.started_ms = h.integer(i, 2);
    a.finished_ms = h.integer(i, 3);
    a.outcome = h.text(i, 4);
    a.error = optional_text(h, i, 5);
    if (h.cell(i, 6)) a.delay_ms = h.integer(i, 6);
    a.worker = optional_text(h, i, 7);
    job.history.push_back(std::move(a));
  }
  return job;
}

std::vector<Job> JobQueue::list_dead(Connection& connection, std::string_view queue,
                                     int limit) const {
  const std::string sql = "SELECT " + std::string(kJobColumns) +
                          " FROM keel_jobs WHERE state = 'dead'" + queue_filter(queue, 2) +
                          " ORDER BY updated_ms, id LIMIT $1";
  const Rows r =
      queue.empty() ? connection.query(sql, {limit}) : connection.query(sql, {limit, queue});
  std::vector<Job> out;
  out.reserve(r.size());
  for (std::size_t i = 0; i < r.size(); ++i) out.push_back(read_job(r, i));
  return out;
}

std::vector<std::int64_t> JobQueue::replay(Connection& connection,
                                           const std::vector<std::int64_t>& ids) const {
  std::vector<std::int64_t> out;
  in_transaction(connection, [&](Connection& tx) {
    out.clear();
    const std::int64_t now = now_ms();
    for (std::int64_t id : ids) {
      const Rows r = tx.query(
          "UPDATE keel_jobs SET state = 'ready', attempts = 0, fence = fence + 1,"
          " replays = replays + 1, run_at_ms = $2, dead_reason = NULL, updated_ms = $2,"
          " limited_retries = 0, prev_delay_ms = 0, deferred_reason = NULL, deferrals = 0,"
          " finished_ms = NULL WHERE id = $1 AND state = 'dead'",
          {id, now});
      if (r.affected() == 1) out.push_back(id);
    }
    return true;
  });
  return out;
}

std::int64_t JobQueue::replay_all(Connection& connection, std::string_view queue) const {
  std::int64_t n = 0;
  in_transaction(connection, [&](Connection& tx) {
    const std::int64_t now = now_ms();
    const std::string sql =
        "UPDATE keel_jobs SET state = 'ready', attempts = 0, fence = fence + 1,"
        " replays = replays + 1, run_at_ms = $1, dead_reason = NULL, updated_ms = $1,"
        " limited_retries = 0, prev_delay_ms = 0, deferred_reason = NULL, deferrals = 0,"
        " finished_ms = NULL WHERE state = 'dead'" +
        queue_filter(queue, 2);
    const Rows r = queue.empty() ? tx.query(sql, {now}) : tx.query(sql, {now, queue});
    n = r.affected();
    return true;
  });
  return n;
}

std::vector<std::int64_t> JobQueue::discard(Connection& connection,
                                            const std::vector<std::int64_t>& ids) const {
  std::vector<std::int64_t> out;
  in_transaction(connection, [&](Connection& tx) {
    out.clear();
    for (std::int64_t id : ids) {
      const Rows dead = tx.query("SELECT 1 FROM keel_jobs WHERE id = $1 AND state = 'dead'", {id});
      if (dead.empty()) continue;
      tx.query("DELETE FROM keel_job_attempts WHERE job_id = $1", {id});
      tx.query("DELETE FROM keel_jobs WHERE id = $1 AND state = 'dead'", {id});
      out.push_back(id);
    }
    return true;
  });
  return out;
}

std::int64_t JobQueue::discard_all(Connection& connection, std::string_view queue) const {
  std::int64_t n = 0;
  in_transaction(connection, [&](Connection& tx) {
    const std::string filter = queue_filter(queue, 1);
    const std::string attempts_sql =
        "DELETE FROM keel_job_attempts WHERE job_id IN (SELECT id FROM keel_jobs"
        " WHERE state = 'dead'" +
        filter + ")";
    const std::string jobs_sql = "DELETE FROM keel_jobs WHERE state = 'dead'" + filter;
    if (queue.empty()) {
      tx.query(attempts_sql);
      n = tx.query(jobs_sql).affected();
    } else {
      tx.query(attempts_sql, {queue});
      n = tx.query(jobs_sql, {queue}).affected();
    }
    return true;
  });
  return n;
}

std::int64_t JobQueue::dead_depth(Connection& connection, std::string_view queue) const {
  const std::string sql =
      "SELECT COUNT(*) FROM keel_jobs WHERE state = 'dead'" + queue_filter(queue, 1);
  const Rows r = queue.empty() ? connection.query(sql) : connection.query(sql, {queue});
  return r.integer(0, 0);
}

std::vector<QueueStats> JobQueue::stats(Connection& connection) const {
  const std::int64_t now = now_ms();
  std::vector<QueueStats> out;
  const Rows queues = connection.query("SELECT name FROM keel_queues ORDER BY name");
  for (std::size_t i = 0; i < queues.size(); ++i) {
    QueueStats s;
    s.queue = queues.text(i, 0);
    out.push_back(std::move(s));
  }
  const auto find = [&](const std::string& name) -> QueueStats* {
    for (QueueStats& s : out) {
      if (s.queue == name) return &s;
    }
    return nullptr;
  };
  const Rows counts =
      connection.query("SELECT queue, state, COUNT(*) FROM keel_jobs GROUP BY queue, state");
  for (std::size_t i = 0; i < counts.size(); ++i) {
    QueueStats* s = find(counts.text(i, 0));
    if (s == nullptr) continue;
    const std::int64_t n = counts.integer(i, 2);
    switch (parse_job_state(counts.text(i, 1)).value_or(JobState::kReady)) {
      case JobState::kReady:
        s->ready = n;
        break;
      case JobState::kRunning:
        s->running = n;
        break;
      case JobState::kRetryScheduled:
        s->retry_scheduled = n;
        break;
      case JobState::kDone:
        s->done = n;
        break;
      case JobState::kDead:
        s->dead = n;
        break;
    }
  }
  const Rows deferred = connection.query(
      "SELECT queue, COUNT(*) FROM keel_jobs WHERE state = 'retry_scheduled'"
      " AND deferred_reason IS NOT NULL GROUP BY queue");
  for (std::size_t i = 0; i < deferred.size(); ++i) {
    if (QueueStats* s = find(deferred.text(i, 0))) s->deferred = deferred.integer(i, 1);
  }
  const Rows oldest = connection.query(
      "SELECT queue, MIN(run_at_ms) FROM keel_jobs WHERE state IN ('ready', 'retry_scheduled')"
      " AND run_at_ms <= $1 GROUP BY queue",
      {now});
  for (std::size_t i = 0; i < oldest.size(); ++i) {
    QueueStats* s = find(oldest.text(i, 0));
    if (s == nullptr || !oldest.cell(i, 1)) continue;
    s->oldest_ready_age =
        std::chrono::milliseconds(std::max<std::int64_t>(0, now - oldest.integer(i, 1)));
  }
  return out;
}

bool JobQueue::queue_exists(Connection& connection, std::string_view queue) const {
  return !connection.query("SELECT 1 FROM keel_queues WHERE name = $1", {queue}).empty();
}

bool JobQueue::idle(Connection& connection, std::string_view queue) const {
  return connection
      .query(
          "SELECT 1 FROM keel_jobs WHERE queue = $1 AND state IN ('ready', 'running',"
          " 'retry_scheduled') LIMIT 1",
          {queue})
      .empty();
}

std::int64_t JobQueue::prune_done(Connection& connection, std::string_view queue,
                                  Duration retention, int batch) const {
  if (retention < Duration::zero()) throw std::invalid_argument("prune_done: retention < 0");
  if (batch < 1) throw std::invalid_argument("prune_done: batch must be >= 1");
  std::int64_t n = 0;
  in_transaction(connection, [&](Connection& tx) {
    const std::int64_t cutoff = now_ms() - to_ms(retention);
    const std::string pick =
        "SELECT id FROM keel_jobs WHERE queue = $1 AND state = 'done' AND finished_ms <= $2"
        " ORDER BY finished_ms LIMIT $3";
    tx.query("DELETE FROM keel_job_attempts WHERE job_id IN (" + pick + ")",
             {queue, cutoff, batch});
    n = tx.query("DELETE FROM keel_jobs WHERE id IN (" + pick + ")", {queue, cutoff, batch})
            .affected();
    return true;
  });
  return n;
}

}  // namespace keel::store
