// The idempotency-key store: fingerprints, key parsing, and claim / complete / release / purge
// written once for SQLite and PostgreSQL (see include/keel/idempotency/idempotency.hpp for
// the flow).
#include "keel/idempotency/idempotency.hpp"

#include <openssl/evp.h>

#include <algorithm>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>

#include "db/detail/options_refusal.hpp"
#include "db/detail/process.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "keel/core/idempotency_key.hpp"
#include "keel/db/dialect.hpp"
#include "keel/db/row_cursor.hpp"
#include "keel/json/json_check.hpp"

namespace keel::store {
namespace {

std::string to_hex(const unsigned char* data, std::size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(n * 2);
  for (std::size_t i = 0; i < n; ++i) {
    out += kDigits[data[i] >> 4];
    out += kDigits[data[i] & 0xf];
  }
  return out;
}

std::string new_token() {
  unsigned char bytes[16];
  detail::secure_random_bytes(bytes, sizeof bytes);
  return to_hex(bytes, sizeof bytes);
}

std::string encode_headers(const std::vector<std::pair<std::string, std::string>>& headers) {
  nlohmann::json array = nlohmann::json::array();
  for (const auto& [name, value] : headers) array.push_back({name, value});
  return array.dump();
}

std::vector<std::pair<std::string, std::string>> decode_headers(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> out;
  const nlohmann::json array = nlohmann::json::parse(text, nullptr, false);
  if (!array.is_array()) return out;
  for (const auto& pair : array) {
    if (pair.is_array() && pair.size() == 2 && pair[0].is_string() && pair[1].is_string()) {
      out.emplace_back(pair[0].get<std::string>(), pair[1].get<std::string>());
    }
  }
  return out;
}

constexpr Migration kMigrations[] = {
    {"CREATE TABLE keel_idempotency ("
     " scope TEXT NOT NULL,"
     " idem_key TEXT NOT NULL,"
     " fingerprint TEXT NOT NULL,"
     " status TEXT NOT NULL CHECK (status IN ('in_progress', 'completed')),"
     " lock_token TEXT NOT NULL,"
     " lock_expires_ms BIGINT NOT NULL,"
     " response_status INTEGER,"
     " response_headers TEXT,"
     " response_body TEXT,"
     " created_ms BIGINT NOT NULL,"
     " PRIMARY KEY (scope, idem_key));"
     "CREATE INDEX keel_idempotency_created ON keel_idempotency (created_ms);"},
};

constexpr std::string_view kClaimInsert =
    "INSERT INTO keel_idempotency (scope, idem_key, fingerprint, status, lock_token,"
    " lock_expires_ms, created_ms) VALUES ($1, $2, $3, 'in_progress', $4, $5, $6)"
    " ON CONFLICT (scope, idem_key) DO NOTHING";

// The same insert, run as its own transaction on PostgreSQL with synchronous_commit off for that
// transaction alone (set_config(..., true) lasts until its commit): the commit returns before
// its WAL is flushed, which saves one of the request's two WAL flushes. Safe because a claim that
// a crash loses is harmless: the WAL is flushed in order, so the durable commit of the handler's
// transaction (which completes the claim) also makes the claim durable; a crash before that
// commit loses the handler's writes with the claim, and a retry then finds no record and runs
// afresh, as after release(). docs/idempotency.md has the whole argument.
constexpr std::string_view kAsyncClaimInsert =
    "INSERT INTO keel_idempotency (scope, idem_key, fingerprint, status, lock_token,"
    " lock_expires_ms, created_ms)"
    " SELECT $1::text, $2::text, $3::text, 'in_progress', $4::text, $5::bigint, $6::bigint"
    " FROM (SELECT set_config('synchronous_commit', 'off', true)) AS async_claim"
    " ON CONFLICT (scope, idem_key) DO NOTHING";

constexpr std::string_view kRecordSelect =
    "SELECT fingerprint, status, lock_token, lock_expires_ms, response_status,"
    " response_headers, response_body, created_ms FROM keel_idempotency"
    " WHERE scope = $1 AND idem_key = $2";

// A key's record, as kRecordSelect reads it (read_record).
struct Record {
  std::string fingerprint;
  std::string status;  // "in_progress" or "completed"
  std::string lock_token;
  std::int64_t lock_expires_ms = 0;
  std::optional<std::int64_t> response_status;  // a completed record's
  std::optional<std::string> response_headers;
  std::optional<std::string> response_body;
  std::int64_t created_ms = 0;
};

// The row of a kRecordSelect that found the record.
Record read_record(const Rows& rows) {
  RowCursor c(rows, 0);
  Record r;
  r.fingerprint = c.text();
  r.status = c.text();
  r.lock_token = c.text();
  r.lock_expires_ms = c.integer();
  r.response_status = c.optional_integer();
  r.response_headers = c.cell();
  r.response_body = c.cell();
  r.created_ms = c.integer();
  return r;
}

// hold()'s completion: the completed record inserted, or written over the record hold() read
// (past its TTL, or a claim whose lock expired), fenced by that record's token ($10, "" when
// hold() read none: no token is empty, so a record that appeared since matches nothing).
constexpr std::string_view kHeldCompletion =
    "INSERT INTO keel_idempotency (scope, idem_key, fingerprint, status, lock_token,"
    " lock_expires_ms, response_status, response_headers, response_body, created_ms)"
    " VALUES ($1, $2, $3, 'completed', $4, $5, $6, $7, $8, $9)"
    " ON CONFLICT (scope, idem_key) DO UPDATE SET fingerprint = excluded.fingerprint,"
    " status = excluded.status, lock_token = excluded.lock_token,"
    " lock_expires_ms = excluded.lock_expires_ms, response_status = excluded.response_status,"
    " response_headers = excluded.response_headers, response_body = excluded.response_body,"
    " created_ms = excluded.created_ms"
    " WHERE keel_idempotency.lock_token = $10";

// The 64-bit name of the transaction lock that holds a key (Dialect::try_transaction_lock):
// FNV-1a over the table, the scope and the key. Two keys that share a name only ever answer each
// other 409 while both are in flight.
std::int64_t key_lock_name(std::string_view scope, std::string_view key) {
  std::uint64_t h = 14695981039346656037ULL;
  const auto mix = [&](std::string_view part) {
    for (const char c : part) {
      h ^= static_cast<unsigned char>(c);
      h *= 1099511628211ULL;
    }
    h ^= 0xff;  // a separator no key or scope byte can be
    h *= 1099511628211ULL;
  };
  mix("keel_idempotency");
  mix(scope);
  mix(key);
  return static_cast<std::int64_t>(h);
}

// What a key's record means for a request with `fingerprint` at `now`: replaced (past its TTL),
// taken over (a claim whose lock expired), or decided, with `out` set to the answer (replay, 422,
// 409).
enum class RecordFate : unsigned char { kReplace, kTakeOver, kDecided };

RecordFate judge(const Record& record, std::string_view fingerprint, std::int64_t now,
                 std::int64_t ttl_ms, Claim& out) {
  const bool expired = record.created_ms + ttl_ms <= now;
  const bool lock_expired = record.lock_expires_ms <= now;
  const bool completed = record.status == "completed";
  if (expired && (completed || lock_expired)) return RecordFate::kReplace;
  if (record.fingerprint == fingerprint && !completed && lock_expired) {
    return RecordFate::kTakeOver;
  }
  out.token.clear();
  if (record.fingerprint != fingerprint) {
    out.status = ClaimStatus::kMismatch;
    return RecordFate::kDecided;
  }
  if (completed) {
    if (!record.response_status) {
      throw DatabaseError("keel_idempotency: a completed record without its response_status", {});
    }
    out.status = ClaimStatus::kReplay;
    out.response.status = static_cast<int>(*record.response_status);
    if (record.response_headers) out.response.headers = decode_headers(*record.response_headers);
    if (record.response_body) out.response.body = *record.response_body;
    return RecordFate::kDecided;
  }
  out.status = ClaimStatus::kInProgress;
  const Duration left = std::chrono::milliseconds(record.lock_expires_ms - now);
  out.retry_after =
      std::max<Duration>(std::chrono::seconds(1), std::chrono::ceil<std::chrono::seconds>(left));
  return RecordFate::kDecided;
}

// Fenced by the claim's token: a claim taken over (or purged) meanwhile matches no row.
constexpr std::string_view kCompletion =
    "UPDATE keel_idempotency SET status = 'completed', response_status = $4,"
    " response_headers = $5, response_body = $6"
    " WHERE scope = $1 AND idem_key = $2 AND lock_token = $3 AND status = 'in_progress'";

}  // namespace

std::string request_fingerprint(std::string_view method, std::string_view path,
                                std::string_view body, const JsonLimits& limits) {
  return request_fingerprint(method, path, body, check_json(body, limits));
}

std::string request_fingerprint(std::string_view method, std::string_view path,
                                std::string_view body, const JsonCheck& checked) {
  std::string canonical;
  if (checked.ok()) {
    canonical = "json:" + checked.canonical;
  } else {
    canonical = "raw:";
    canonical += body;
  }
  std::string input;
  input.reserve(method.size() + path.size() + canonical.size() + 2);
  input += method;
  input += '\n';
  input += path;
  input += '\n';
  input += canonical;
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_Digest(input.data(), input.size(), digest, &len, EVP_sha256(), nullptr) != 1) {
    throw std::runtime_error("SHA-256 failed");
  }
  return to_hex(digest, len);
}

ParsedKey parse_idempotency_key(std::optional<std::string_view> header, std::size_t max_bytes) {
  ParsedKey out;
  if (!header) {
    out.error = KeyError::kMissing;
    out.detail = "this request requires an Idempotency-Key header";
    return out;
  }
  // The rule is keel's one rule (keel/core/idempotency_key.hpp); max_bytes can only lower its
  // limit.
  IdempotencyKeyCheck checked = check_idempotency_key(*header);
  const std::size_t limit = std::min(max_bytes, kMaxIdempotencyKeyBytes);
  if (checked.ok() && checked.key.size() > limit) {
    out.error = KeyError::kTooLong;
    out.detail = "Idempotency-Key is " + std::to_string(checked.key.size()) +
                 " bytes long; the limit is " + std::to_string(limit) + " bytes";
    return out;
  }
  if (checked.ok()) {
    out.key = std::move(checked.key);
    return out;
  }
  switch (checked.problem) {
    case IdempotencyKeyProblem::kEmpty:
      out.error = KeyError::kEmpty;
      break;
    case IdempotencyKeyProblem::kTooLong:
      out.error = KeyError::kTooLong;
      break;
    case IdempotencyKeyProblem::kControlCharacter:
      out.error = KeyError::kControlCharacter;
      break;
    default:  // a space, a non-ASCII byte, '"', ',' or '%', a malformed quoted string
      out.error = KeyError::kMalformed;
      break;
  }
  // The problem without the value: the detail goes back to a client that may log it.
  out.detail = "Idempotency-Key " + checked.error.problem;
  return out;
}

std::string_view to_string(ClaimStatus status) noexcept {
  switch (status) {
    case ClaimStatus::kClaimed:
      return "claimed";
    case ClaimStatus::kReplay:
      return "replay";
    case ClaimStatus::kInProgress:
      return "in_progress";
    case ClaimStatus::kMismatch:
      return "mismatch";
  }
  return "unknown";
}

IdempotencyStore::IdempotencyStore(IdempotencyOptions options)
    : options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : &steady_clock()) {
  constexpr std::string_view kOptions = "keel::store::IdempotencyOptions";
  const detail::OptionsRefusal reject(kOptions);
  if (options_.ttl <= Duration::zero()) reject("ttl", "must be > 0", format_duration(options_.ttl));
  if (options_.lock_timeout <= Duration::zero()) {
    reject("lock_timeout", "must be > 0", format_duration(options_.lock_timeout));
  }
  if (options_.purge_batch < 1) {
    reject("purge_batch", "must be >= 1", std::to_string(options_.purge_batch));
  }
}

void IdempotencyStore::migrate(Connection& connection) {
  store::migrate(connection, "idempotency", kMigrations);
}

SchemaComponent IdempotencyStore::schema() noexcept {
  return schema_component("idempotency", kMigrations, &IdempotencyStore::migrate);
}

std::int64_t IdempotencyStore::now_ms() const noexcept { return wall_ms(*clock_); }

Claim IdempotencyStore::claim(Connection& connection, std::string_view scope, std::string_view key,
                              std::string_view fingerprint) const {
  return claim(connection, scope, key, fingerprint, std::nullopt);
}

Claim IdempotencyStore::claim_then_begin(Connection& connection, std::string_view scope,
                                         std::string_view key, std::string_view fingerprint,
                                         Isolation isolation) const {
  return claim(connection, scope, key, fingerprint, isolation);
}

Claim IdempotencyStore::claim(Connection& connection, std::string_view scope, std::string_view key,
                              std::string_view fingerprint,
                              std::optional<Isolation> then_begin) const {
  const std::int64_t lock_ms = keel::to_ms(options_.lock_timeout);
  const std::int64_t ttl_ms = keel::to_ms(options_.ttl);
  // PostgreSQL, outside a transaction: the claim's commit does not wait for its WAL flush (see
  // kAsyncClaimInsert). Inside the caller's transaction the setting would reach the caller's own
  // commit, so there the claim is an ordinary insert.
  const bool async_commit =
      connection.dialect().commit_without_flush() && !connection.in_transaction();
  // A claim that won opens the handler's transaction when asked to; the first pass's INSERT is
  // sent with that BEGIN, and a later pass (a takeover, a record past its TTL) begins after it.
  const auto claimed = [&](Claim out) {
    if (then_begin && !connection.in_transaction()) connection.begin(*then_begin);
    return out;
  };
  // Each pass either decides or sees the record change under it (taken over, purged); a few
  // passes settle any realistic race.
  for (int pass = 0; pass < 8; ++pass) {
    const std::int64_t now = now_ms();
    Claim out;
    out.token = new_token();
    const Value insert[] = {scope, key, fingerprint, out.token, now + lock_ms, now};
    const std::string_view insert_sql = async_commit ? kAsyncClaimInsert : kClaimInsert;
    const Rows inserted = then_begin && pass == 0
                              ? connection.query_then_begin(insert_sql, insert, *then_begin)
                              : connection.query(insert_sql, insert);
    if (inserted.affected() == 1) return claimed(std::move(out));
    // The key has a record: decide outside the transaction the INSERT's BEGIN opened.
    if (then_begin) connection.rollback();

    const Rows row = connection.query(kRecordSelect, {scope, key});
    if (row.empty()) continue;  // purged between the two statements
    const Record record = read_record(row);
    const std::string& old_token = record.lock_token;
    const RecordFate fate = judge(record, fingerprint, now, ttl_ms, out);
    if (fate == RecordFate::kDecided) return out;
    if (fate == RecordFate::kReplace) {
      // Past its TTL: the key names a new operation now.
      const Rows replaced = connection.query(
          "UPDATE keel_idempotency SET fingerprint = $3, status = 'in_progress', lock_token = $4,"
          " lock_expires_ms = $5, response_status = NULL, response_headers = NULL,"
          " response_body = NULL, created_ms = $6"
          " WHERE scope = $1 AND idem_key = $2 AND lock_token = $7",
          {scope, key, fingerprint, out.token, now + lock_ms, now, old_token});
      if (replaced.affected() == 1) return claimed(std::move(out));
      continue;
    }
    // The claimant died (or overran its lock): take over, fenced by its token.
    const Rows taken = connection.query(
        "UPDATE keel_idempotency SET lock_token = $3, lock_expires_ms = $4"
        " WHERE scope = $1 AND idem_key = $2 AND lock_token = $5 AND status = 'in_progress'",
        {scope, key, out.token, now + lock_ms, old_token});
    if (taken.affected() == 1) {
      out.took_over = true;
      return claimed(std::move(out));
    }
  }
  Claim busy;
  busy.status = ClaimStatus::kInProgress;
  busy.retry_after = std::chrono::seconds(1);
  return busy;
}

bool IdempotencyStore::complete(Connection& connection, std::string_view scope,
                                std::string_view key, std::string_view token,
                                const StoredResponse& response) const {
  const Rows updated = connection.query(
      kCompletion,
      {scope, key, token, response.status, encode_headers(response.headers), response.body});
  return updated.affected() == 1;
}

namespace {

// Runs `write`, which must change exactly one row, as the open transaction's last statement and
// commits, sent together where the dialect can refuse a write that changed none
// (Dialect::update_exactly_one_row). True when committed; false when it changed no row and the
// transaction was rolled back.
bool write_one_then_commit(Connection& connection, std::string_view write,
                           std::span<const Value> params) {
  const Dialect& dialect = connection.dialect();
  const std::string checked = dialect.update_exactly_one_row(write);
  if (checked.empty()) {
    if (connection.query(write, params).affected() != 1) {
      connection.rollback();
      return false;
    }
    connection.commit();
    return true;
  }
  try {
    (void)connection.query_then_commit(checked, params);
    return true;
  } catch (const DatabaseError& e) {
    if (dialect.is_row_count_refusal(e.details())) return false;  // rolled back
    throw;
  }
}

}  // namespace

bool IdempotencyStore::complete_then_commit(Connection& connection, std::string_view scope,
                                            std::string_view key, std::string_view token,
                                            const StoredResponse& response) const {
  const Value params[] = {
      scope, key, token, response.status, encode_headers(response.headers), response.body};
  return write_one_then_commit(connection, kCompletion, params);
}

Claim IdempotencyStore::hold(Connection& connection, std::string_view scope, std::string_view key,
                             std::string_view fingerprint, std::optional<Isolation> begin) const {
  const std::int64_t now = now_ms();
  const std::int64_t ttl_ms = keel::to_ms(options_.ttl);
  const std::string_view lock = connection.dialect().try_transaction_lock();
  const Value lock_params[] = {key_lock_name(scope, key)};
  const Value read_params[] = {scope, key};
  std::vector<Statement> statements;
  if (!lock.empty()) statements.push_back({lock, lock_params});
  // After the lock, in a statement of its own: at READ COMMITTED it then sees every record
  // committed by the transaction that held the key before.
  statements.push_back({kRecordSelect, read_params});
  std::vector<Rows> rows;
  if (begin) {
    rows = connection.begin_then_query(*begin, statements);
  } else {
    for (const Statement& statement : statements) {
      rows.push_back(connection.query(statement.sql, statement.params));
    }
  }
  Claim out;
  if (!lock.empty() && RowCursor(rows.front(), 0).integer() != 1) {
    // Another transaction holds the key: its handler is running now.
    out.status = ClaimStatus::kInProgress;
    out.retry_after = std::chrono::seconds(1);
    return out;
  }
  out.token = new_token();
  out.created_ms = now;
  if (rows.back().empty()) return out;
  const Record record = read_record(rows.back());
  switch (judge(record, fingerprint, now, ttl_ms, out)) {
    case RecordFate::kReplace:
      out.replaces = record.lock_token;
      return out;
    case RecordFate::kTakeOver:
      out.replaces = record.lock_token;
      out.took_over = true;
      out.created_ms = record.created_ms;
      return out;
    case RecordFate::kDecided:
      break;
  }
  return out;
}

bool IdempotencyStore::complete_held_then_commit(Connection& connection, std::string_view scope,
                                                 std::string_view key, std::string_view fingerprint,
                                                 const Claim& claim,
                                                 const StoredResponse& response) const {
  const Value params[] = {scope,
                          key,
                          fingerprint,
                          claim.token,
                          claim.created_ms,
                          response.status,
                          encode_headers(response.headers),
                          response.body,
                          claim.created_ms,
                          claim.replaces};
  return write_one_then_commit(connection, kHeldCompletion, params);
}

void IdempotencyStore::release(Connection& connection, std::string_view scope, std::string_view key,
                               std::string_view token) const {
  connection.query(
      "DELETE FROM keel_idempotency"
      " WHERE scope = $1 AND idem_key = $2 AND lock_token = $3 AND status = 'in_progress'",
      {scope, key, token});
}

int IdempotencyStore::purge_expired(Connection& connection) const {
  const std::int64_t now = now_ms();
  const std::int64_t ttl_ms = keel::to_ms(options_.ttl);
  const Rows deleted = connection.query(
      "DELETE FROM keel_idempotency WHERE (scope, idem_key) IN ("
      " SELECT scope, idem_key FROM keel_idempotency"
      " WHERE created_ms <= $1 AND (status = 'completed' OR lock_expires_ms <= $2)"
      " LIMIT $3)",
      {now - ttl_ms, now, options_.purge_batch});
  return static_cast<int>(deleted.affected());
}

}  // namespace keel::store
