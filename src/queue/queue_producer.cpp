// JobQueue's producer side: enqueue and enqueue_many (one statement for a single job where the
// backend allows it, multi-row INSERTs for a batch), deduplicated by the (queue, key) index.
// A key the caller gave may repeat one already stored: its job is inserted ON CONFLICT DO NOTHING
// and the existing id looked up. A key made here (new_job_key, 122 random bits from the CSPRNG)
// cannot, so its job is a plain INSERT: no conflict probe before the row and no speculative
// insertion record after it (the unique index still refuses a repeat, as an error).

#include <algorithm>
#include <optional>
#include <span>
#include <unordered_map>

#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "keel/core/idempotency_key.hpp"
#include "keel/core/text.hpp"
#include "keel/db/dialect.hpp"
#include "keel/json/json_check.hpp"
#include "keel/queue/queue.hpp"
#include "queue/detail/queue_sql.hpp"
#include "queue/detail/queue_wakeup.hpp"

namespace keel::store {

using detail::in_transaction;
using detail::to_ms;

namespace {

// Jobs per multi-row INSERT in enqueue_many (6 parameters each, under both backends' limits).
constexpr std::size_t kEnqueueChunk = 500;

// Nothing when the payload may be stored: UTF-8 text (RFC 8259's JSON, and what PostgreSQL's
// TEXT stores) that passes the receiver's check_json with its default limits (nesting depth 64,
// no member named twice in one object), so that a job is not dead at its first delivery for a
// body the receiver refuses, and never refused by the database after it was accepted here.
Expected<void> check_payload(const std::string& payload) {
  if (!is_storable_text(payload)) {
    return Error{.field = "payload",
                 .problem =
                     "is not UTF-8 text (JSON is UTF-8; send other bytes in a string, "
                     "e.g. base64)",
                 .got = quote_value(payload)};
  }
  const JsonLimits limits;
  const JsonCheck checked = check_json(payload, limits);
  switch (checked.status) {
    case JsonStatus::kValid:
      return {};
    case JsonStatus::kNotJson:
      return Error{.field = "payload", .problem = "is not valid JSON", .got = quote_value(payload)};
    case JsonStatus::kTooDeep:
      return Error{.field = "payload",
                   .problem = "nests arrays or objects deeper than the limit of " +
                              std::to_string(limits.max_depth) +
                              " levels (keel::store::JsonLimits::max_depth, a receiver's check)",
                   .got = quote_value(payload)};
    case JsonStatus::kDuplicateKey:
      break;
  }
  return Error{
      .field = "payload", .problem = "is refused: " + checked.detail, .got = quote_value(payload)};
}

// The request's key in its canonical form (keel/core/idempotency_key.hpp; empty: none given, a UUID
// is made) when the request may be written, else what is wrong with it.
Expected<std::string> check_request(const EnqueueRequest& request) {
  if (auto queue = check_queue_name(request.queue); !queue) return std::move(queue).error();
  if (auto payload = check_payload(request.payload); !payload) return std::move(payload).error();
  std::string key;
  if (!request.key.empty()) {
    // The rule every client and the receiver apply: a key stored here is sent, and read at the
    // receiver, as this same key; "k" and k are one job.
    IdempotencyKeyCheck checked = check_idempotency_key(request.key);
    if (!checked.ok()) return std::move(checked.error).in("idempotency key");
    key = std::move(checked.key);
  }
  if (request.max_attempts < 0) {
    return Error{.field = "max_attempts",
                 .problem = "must be >= 1, or 0 for the queue's default",
                 .got = std::to_string(request.max_attempts)};
  }
  if (request.delay < Duration::zero()) {
    return Error{
        .field = "delay", .problem = "must be >= 0", .got = format_duration(request.delay)};
  }
  return key;
}

// The columns of a new job row, and its values after queue, payload and key: $4 max attempts,
// $5 run at, $6 now. key_made says whether keel made the key (schema 12: only a key the caller
// gave is in the key index, keel_jobs_given_key).
constexpr std::string_view kInsertColumns =
    "INSERT INTO keel_jobs (queue, payload, idem_key, state, attempts, max_attempts, run_at_ms,"
    " fence, replays, created_ms, updated_ms, key_made)";
// A key the caller gave may be stored already; the index of given keys decides.
constexpr std::string_view kOnConflict =
    " ON CONFLICT (queue, idem_key) WHERE key_made = 0 DO NOTHING";
// The job of a key the caller gave, along that index.
constexpr std::string_view kGivenKeyIs = "queue = $1 AND idem_key = $2 AND key_made = 0";

// key_made's value for a request.
std::string_view key_made(const EnqueueRequest& request) { return request.key.empty() ? "1" : "0"; }

// The INSERT of one job ($1 queue, $2 payload, $3 key, then kInsertColumns' parameters): a key
// the caller gave may be stored already (kOnConflict); a key made here is new.
std::string insert_job_sql(const EnqueueRequest& request) {
  std::string sql(kInsertColumns);
  sql += " VALUES ($1, $2, $3, 'ready', 0, $4, $5, 0, 0, $6, $6, ";
  sql += key_made(request);
  sql += ")";
  if (!request.key.empty()) sql += kOnConflict;
  return sql;
}

// Inserts one job row with insert_job_sql's parameters: its id, or nullopt when the (queue, key)
// was already there. SQLite reads the id from the connection rather than by RETURNING, whose
// temporary b-tree costs a single job a page cache allocated and freed (docs/queue.md).
std::optional<std::int64_t> insert_job_row(Connection& conn, const EnqueueRequest& request,
                                           std::span<const Value> params) {
  const std::string_view inserted_id = conn.dialect().inserted_id_query();
  if (inserted_id.empty()) {
    const Rows r = conn.query(insert_job_sql(request) + " RETURNING id", params);
    if (r.empty()) return std::nullopt;
    return RowCursor(r, 0).integer();
  }
  if (conn.query(insert_job_sql(request), params).affected() == 0) return std::nullopt;
  const Rows r = conn.query(inserted_id);
  return RowCursor(r, 0).integer();
}

// The id of the job already enqueued under (queue, key): the request was a repeat.
void find_existing(Connection& conn, const std::string& queue, const std::string& key,
                   EnqueueResult& out) {
  const Rows existing =
      conn.query("SELECT id FROM keel_jobs WHERE " + std::string(kGivenKeyIs), {queue, key});
  if (existing.empty()) {
    throw DatabaseError("enqueue: the job with key '" + key + "' vanished",
                        {.backend = conn.backend()});
  }
  out.id = RowCursor(existing, 0).integer();
  out.created = false;
}

// Inserts one checked request inside an open transaction whose queue row exists.
void insert_job(Connection& tx, const EnqueueRequest& request, const std::string& key,
                int max_attempts, std::int64_t now, EnqueueResult& out) {
  const std::int64_t run_at = now + to_ms(request.delay);
  const Value params[] = {request.queue, request.payload, key, max_attempts, run_at, now};
  if (const auto id = insert_job_row(tx, request, params)) {
    out.id = *id;
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
  const Value params[] = {request.queue, request.payload, key, max_attempts, run_at, now};
  if (conn.dialect().data_modifying_ctes()) {
    // The foreign key is checked at the end of the statement, after the queue CTE's insert.
    std::string sql =
        "WITH q AS (INSERT INTO keel_queues (name, created_ms) VALUES ($1, $6)"
        " ON CONFLICT (name) DO NOTHING),"
        " ins AS (" +
        insert_job_sql(request) + " RETURNING id) SELECT id, 1 FROM ins";
    if (!request.key.empty()) {
      sql +=
          " UNION ALL SELECT id, 0 FROM keel_jobs"
          " WHERE queue = $1 AND idem_key = $3 AND key_made = 0"
          " AND NOT EXISTS (SELECT 1 FROM ins)";
    }
    const Rows r = conn.query(sql, params);
    if (r.empty()) {
      // A concurrent enqueue of the same key committed after this statement's snapshot.
      find_existing(conn, request.queue, key, out);
      return true;
    }
    RowCursor c(r, 0);
    out.id = c.integer();
    out.created = c.integer() == 1;
    return true;
  }
  std::optional<std::int64_t> id;
  try {
    id = insert_job_row(conn, request, params);
  } catch (const DatabaseError& e) {
    if (conn.dialect().is_foreign_key_violation(e.details())) return false;
    throw;
  }
  if (id) {
    out.id = *id;
    out.created = true;
    return true;
  }
  find_existing(conn, request.queue, key, out);
  return true;
}

// Inserts requests [from, to) in one multi-row INSERT, with ON CONFLICT when their keys were
// given (all or none of them), and fills their results; max_attempts[i] is request i's.
void insert_run(Connection& tx, const std::vector<EnqueueRequest>& requests,
                const std::vector<std::string>& keys, const std::vector<int>& max_attempts,
                std::size_t from, std::size_t to, std::int64_t now,
                std::vector<EnqueueResult>& out) {
  // The keys of a run are all given or all made (the caller splits them).
  const std::string made(key_made(requests[from]));
  std::string sql = std::string(kInsertColumns) + " VALUES ";
  std::vector<Value> params;
  params.reserve((to - from) * 6);
  for (std::size_t i = from; i < to; ++i) {
    const auto p = [&](int k) { return "$" + std::to_string(params.size() + k); };
    sql += (i > from ? ", (" : "(") + p(1) + ", " + p(2) + ", " + p(3) + ", 'ready', 0, " + p(4) +
           ", " + p(5) + ", 0, 0, " + p(6) + ", " + p(6) + ", " + made + ")";
    params.emplace_back(requests[i].queue);
    params.emplace_back(requests[i].payload);
    params.emplace_back(keys[i]);
    params.emplace_back(max_attempts[i]);
    params.emplace_back(now + to_ms(requests[i].delay));
    params.emplace_back(now);
  }
  if (!requests[from].key.empty()) sql += kOnConflict;
  sql += " RETURNING id, queue, idem_key";
  const Rows inserted = tx.query(sql, params);
  // queue + '\n' + key -> the id of the job this statement created under it.
  std::unordered_map<std::string, std::int64_t> created;
  created.reserve(inserted.size());
  for (std::size_t r = 0; r < inserted.size(); ++r) {
    RowCursor c(inserted, r);
    const std::int64_t id = c.integer();
    std::string name = c.text() + '\n';
    name += c.text();
    created.emplace(std::move(name), id);
  }
  for (std::size_t i = from; i < to; ++i) {
    out[i].idempotency_key = keys[i];
    const auto hit = created.find(requests[i].queue + '\n' + keys[i]);
    if (hit != created.end()) {
      // The first request with this key created the job; a repeat in the batch gets its id.
      out[i].id = hit->second;
      out[i].created = true;
      created.erase(hit);
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

}  // namespace

EnqueueResult JobQueue::enqueue(Connection& connection, const EnqueueRequest& request) const {
  std::vector<EnqueueResult> r = enqueue_many(connection, {request});
  return std::move(r.front());
}

namespace {

// The message of a request refused because of the connection's transaction state.
std::vector<EnqueueResult> refused(std::size_t n, std::string why) {
  std::vector<EnqueueResult> out(n);
  for (EnqueueResult& r : out) r.error = why;
  return out;
}

}  // namespace

std::vector<EnqueueResult> JobQueue::enqueue_many(
    Connection& connection, const std::vector<EnqueueRequest>& requests) const {
  if (connection.in_transaction()) {
    // Its own BEGIN would fail (SQLite) or only warn and then COMMIT the caller's work early
    // (PostgreSQL).
    return refused(requests.size(),
                   "keel::store::JobQueue::enqueue: connection has a transaction open; enqueue "
                   "inside it with enqueue_in, or commit it first");
  }
  std::vector<EnqueueResult> out(requests.size());
  std::vector<std::string> keys;
  if (!check_requests(requests, keys, out)) return out;
  const std::int64_t now = now_ms();
  if (requests.size() == 1) {
    out[0].idempotency_key = keys[0];
    if (enqueue_one_statement(connection, requests[0], keys[0], max_attempts_of(requests[0]), now,
                              out[0])) {
      detail::wake_local_workers(connection, requests);  // this process's idle workers look now
      return out;
    }
  }
  in_transaction(connection, [&](Connection& tx) {
    write_jobs(tx, requests, keys, now, out);
    return true;
  });
  detail::wake_local_workers(connection, requests);  // this process's idle workers look now
  return out;
}

EnqueueResult JobQueue::enqueue_in(Connection& tx, const EnqueueRequest& request) const {
  std::vector<EnqueueResult> r = enqueue_many_in(tx, {request});
  return std::move(r.front());
}

std::vector<EnqueueResult> JobQueue::enqueue_many_in(
    Connection& tx, const std::vector<EnqueueRequest>& requests) const {
  if (!tx.in_transaction()) {
    return refused(requests.size(),
                   "keel::store::JobQueue::enqueue_in: connection has no transaction open; "
                   "begin the transaction the jobs belong to, or use enqueue");
  }
  std::vector<EnqueueResult> out(requests.size());
  std::vector<std::string> keys;
  if (!check_requests(requests, keys, out)) return out;
  write_jobs(tx, requests, keys, now_ms(), out);
  return out;
}

bool JobQueue::check_requests(const std::vector<EnqueueRequest>& requests,
                              std::vector<std::string>& keys,
                              std::vector<EnqueueResult>& out) const {
  keys.reserve(requests.size());
  for (const EnqueueRequest& request : requests) {
    auto checked = check_request(request);
    if (!checked) {
      const std::string why = checked.error().message();
      for (EnqueueResult& r : out) r.error = why;
      return false;
    }
    keys.push_back(checked->empty() ? new_job_key() : std::move(*checked));
  }
  return true;
}

int JobQueue::max_attempts_of(const EnqueueRequest& request) const noexcept {
  return request.max_attempts > 0 ? request.max_attempts : options_.max_attempts;
}

void JobQueue::write_jobs(Connection& tx, const std::vector<EnqueueRequest>& requests,
                          const std::vector<std::string>& keys, std::int64_t now,
                          std::vector<EnqueueResult>& out) const {
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
    return;
  }
  // The jobs in multi-row INSERTs, one statement per run of at most kEnqueueChunk requests whose
  // keys were all given or all made here (so that ids follow the requests' order); a given key
  // that was already there is looked up.
  std::vector<int> max_attempts;
  max_attempts.reserve(requests.size());
  for (const EnqueueRequest& r : requests) max_attempts.push_back(max_attempts_of(r));
  for (std::size_t from = 0; from < requests.size();) {
    const bool made_here = requests[from].key.empty();
    std::size_t to = from + 1;
    while (to < requests.size() && to - from < kEnqueueChunk &&
           requests[to].key.empty() == made_here) {
      ++to;
    }
    insert_run(tx, requests, keys, max_attempts, from, to, now, out);
    from = to;
  }
}

}  // namespace keel::store
