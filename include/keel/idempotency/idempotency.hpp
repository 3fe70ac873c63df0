// The receiver's half of safe retries: an idempotency-key store on SQLite or PostgreSQL.
//
// A request carrying an Idempotency-Key is an operation identified by (scope, key), where scope
// is the authenticated principal. The flow (what keel::store's HTTP middleware does):
//   1. claim(): insert an in_progress record with a lock expiry. Where writers lock rows
//      (PostgreSQL) it is committed on its own, without waiting for the WAL flush (a claim a
//      crash loses is harmless, see docs/idempotency.md), and claim_then_begin() sends it with
//      the handler's BEGIN; where every writer takes the one write lock (SQLite) the flow makes
//      it in the handler's transaction. The database's primary key on (scope, key) decides who
//      wins a race, never a read-then-insert.
//   2. run the handler inside a transaction on the same connection;
//   3. complete() in that same transaction stores the response with the handler's business
//      writes, and the transaction commits once: both happen or neither does
//      (complete_then_commit() sends the completion with the COMMIT).
//   4. if the handler fails before committing, release() deletes a claim committed on its own:
//      a retry runs afresh.
// A repeated key then gets, from claim():
//   kReplay      completed with the same fingerprint: the stored status, headers and body;
//   kMismatch    a different fingerprint (completed or in progress): answer 422;
//   kInProgress  in progress and its lock not expired: answer 409 with Retry-After;
//   kClaimed     absent, expired past the TTL, or in progress with an expired lock (the first
//                handler died; nothing of it was committed): this request runs, took_over says
//                whether it took over a dead claim. complete() is fenced by the claim's token, so
//                a handler that lost its claim cannot store its response.
// Records older than the TTL are deleted by purge_expired(), a bounded sweep; a key reused after
// its TTL starts a new operation even before the sweep ran.
//
// Thread-safety: IdempotencyStore is immutable and safe for concurrent use; each call uses the
// Connection it is given (one thread per connection).
//
// Example:
//   keel::store::IdempotencyStore store({.ttl = 24h, .lock_timeout = 30s});
//   keel::store::IdempotencyStore::migrate(conn);
//   auto fp = keel::store::request_fingerprint("POST", "/v1/charges", body);
//   auto claim = store.claim(conn, "alice", key, fp);
//   if (claim.status == keel::store::ClaimStatus::kClaimed) {
//     conn.begin();
//     ... business writes ...
//     if (store.complete(conn, "alice", key, claim.token, response)) conn.commit();
//   }
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "keel/core/clock.hpp"
#include "keel/core/idempotency_key.hpp"
#include "keel/db/database.hpp"
#include "keel/json/json_check.hpp"

namespace keel::store {

/// SHA-256 (lower-case hex) over the method, the path and the body's canonical form: a body that
/// is valid JSON within `limits` (check_json, keel/json/json_check.hpp) is re-serialised with
/// sorted keys and no whitespace (so key order and spacing do not matter); any other body (not
/// JSON, too deep, a duplicate member) is taken byte for byte and never parsed past the depth
/// pre-scan. See docs/idempotency.md.
[[nodiscard]] std::string request_fingerprint(std::string_view method, std::string_view path,
                                              std::string_view body, const JsonLimits& limits = {});

/// The same fingerprint from a check_json() result already computed for `body` (saves a parse).
[[nodiscard]] std::string request_fingerprint(std::string_view method, std::string_view path,
                                              std::string_view body, const JsonCheck& checked);

/// Why an Idempotency-Key header was refused.
enum class KeyError : unsigned char { kMissing, kEmpty, kTooLong, kControlCharacter, kMalformed };

/// A parsed key or the reason it was refused, with a sentence for the problem+json detail.
struct ParsedKey {
  std::optional<std::string> key;
  KeyError error = KeyError::kMissing;
  std::string detail;
};

/// The default longest key, in bytes: keel's one limit (keel::kMaxIdempotencyKeyBytes).
inline constexpr std::size_t kMaxKeyLength = kMaxIdempotencyKeyBytes;

/// Parses an Idempotency-Key header value (nullopt: the header is absent) under keel's one key
/// rule (keel::check_idempotency_key, keel/core/idempotency_key.hpp): a bare key or an RFC 8941
/// sf-string ("..." with \" and \\ escapes) of 1 to 255 bytes of visible ASCII without '"',
/// ',' or '%', read as its canonical (bare) form, so "k" and k are one key. The value is taken
/// as the server hands it over (without the whitespace around a field value); nothing more is
/// trimmed. Refuses: absent (kMissing), empty (kEmpty), longer than `max_bytes` bytes or than
/// 255 (kTooLong: a max_bytes above 255 does not raise the rule's limit), a control character
/// (kControlCharacter), anything else the rule refuses (kMalformed); `detail` says which, without
/// quoting the value. Requires: max_bytes >= 1.
[[nodiscard]] ParsedKey parse_idempotency_key(std::optional<std::string_view> header,
                                              std::size_t max_bytes = kMaxKeyLength);

/// What is replayed: the handler's status, the headers worth replaying, the body.
struct StoredResponse {
  int status = 200;
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
};

enum class ClaimStatus : unsigned char { kClaimed, kReplay, kInProgress, kMismatch };

/// "claimed", "replay", "in_progress", "mismatch".
[[nodiscard]] std::string_view to_string(ClaimStatus status) noexcept;

struct Claim {
  ClaimStatus status = ClaimStatus::kClaimed;
  /// kClaimed: the fencing token to pass to complete() or release().
  std::string token;
  /// kClaimed: the previous claim's lock had expired and this request took it over.
  bool took_over = false;
  /// kReplay: the stored response.
  StoredResponse response;
  /// kInProgress: how long until the lock expires (at least 1 s), for Retry-After.
  Duration retry_after{};
  /// hold()'s kClaimed: the lock token of the record complete_held_then_commit() writes over
  /// (one past its TTL, or a claim whose lock expired); "" when there was none.
  std::string replaces;
  /// hold()'s kClaimed: the creation time the completed record keeps (the taken-over claim's,
  /// else now), in milliseconds since the epoch.
  std::int64_t created_ms = 0;
};

struct IdempotencyOptions {
  /// How long a record is kept (and a key means "the same operation"). Requires: > 0.
  /// Default 24 h.
  Duration ttl = std::chrono::hours(24);
  /// How long a claim holds the key before another request may take it over (the longest a
  /// handler may run). Requires: > 0. Default 30 s.
  Duration lock_timeout = std::chrono::seconds(30);
  /// Most records one purge_expired() call deletes. Requires: >= 1. Default 1000.
  int purge_batch = 1000;
  /// Calendar time source (wall_now) for expiry and locks. Default keel::steady_clock().
  Clock* clock = nullptr;
};

class IdempotencyStore {
 public:
  /// Throws std::invalid_argument naming the field and value when a Requires line is broken.
  explicit IdempotencyStore(IdempotencyOptions options = {});

  /// Creates or upgrades the tables (component "idempotency" in keel_schema). Throws
  /// DatabaseError.
  static void migrate(Connection& connection);
  /// The records' schema component ("idempotency"), for a program that migrates every component
  /// (its `migrate` applies it).
  [[nodiscard]] static SchemaComponent schema() noexcept;

  /// Step 1 of the flow. Outside a transaction each statement commits on its own (a new claim on
  /// PostgreSQL without waiting for its WAL flush: docs/idempotency.md); inside the caller's
  /// transaction the claim commits or rolls back with it. Throws DatabaseError.
  [[nodiscard]] Claim claim(Connection& connection, std::string_view scope, std::string_view key,
                            std::string_view fingerprint) const;

  /// claim(), and when it returns kClaimed, a transaction opened at `isolation` on `connection`
  /// for the handler, the claim's INSERT and BEGIN sent together (Connection::query_then_begin).
  /// Any other status leaves no transaction open. Requires: no transaction open on `connection`.
  /// Throws DatabaseError (no transaction left open).
  [[nodiscard]] Claim claim_then_begin(Connection& connection, std::string_view scope,
                                       std::string_view key, std::string_view fingerprint,
                                       Isolation isolation) const;

  /// Step 1 inside the handler's transaction, writing nothing (the flow's way on SQLite, and on
  /// PostgreSQL at READ COMMITTED): the transaction holds the key (SQLite: the write lock every
  /// transaction takes at BEGIN IMMEDIATE; PostgreSQL: a transaction-scoped advisory lock named
  /// by the scope and key, Dialect::try_transaction_lock, never waited for), then the record is
  /// read. kClaimed when there is none, or one past its TTL, or a claim whose lock expired
  /// (took_over); kInProgress when another transaction holds the key (retry_after 1 s) or a
  /// claim's lock is live; kReplay and kMismatch as claim(). The record is written once, by
  /// complete_held_then_commit(); a rollback or a crash before it leaves nothing behind. With
  /// `begin`, the transaction is opened first, BEGIN, the lock and the read sent together
  /// (Connection::begin_then_query); it is left open whatever the status. Requires: without
  /// `begin`, a transaction open on `connection`; on PostgreSQL at READ COMMITTED (a snapshot
  /// taken before the lock could miss the record of the transaction that held it before).
  /// Throws DatabaseError (with `begin`, no transaction left open).
  [[nodiscard]] Claim hold(Connection& connection, std::string_view scope, std::string_view key,
                           std::string_view fingerprint,
                           std::optional<Isolation> begin = std::nullopt) const;

  /// Step 3 after hold(): writes the completed record (inserted, or over the record hold() read,
  /// fenced by its token) and COMMITs, sent together where the dialect can. Returns true when
  /// committed; false when a record appeared or changed since hold() (a claim made without
  /// holding the key): the transaction is rolled back. Requires: hold()'s transaction open.
  /// Throws DatabaseError as COMMIT does; the transaction is then not open.
  [[nodiscard]] bool complete_held_then_commit(Connection& connection, std::string_view scope,
                                               std::string_view key, std::string_view fingerprint,
                                               const Claim& claim,
                                               const StoredResponse& response) const;

  /// Stores the response and marks the record completed. Requires: a transaction open on
  /// `connection` (the handler's). Returns false when the claim was lost (taken over after its
  /// lock expired, or purged): the caller must roll back. Throws DatabaseError.
  [[nodiscard]] bool complete(Connection& connection, std::string_view scope, std::string_view key,
                              std::string_view token, const StoredResponse& response) const;

  /// complete() and COMMIT, sent together where the dialect can refuse an UPDATE that changed
  /// no row (Dialect::update_exactly_one_row, Connection::query_then_commit). Returns true when
  /// committed, false when the claim was lost and the transaction rolled back. Requires: a
  /// transaction open on `connection` (the handler's). Throws DatabaseError as COMMIT does
  /// (during_commit set when the outcome is unknown); the transaction is then not open.
  [[nodiscard]] bool complete_then_commit(Connection& connection, std::string_view scope,
                                          std::string_view key, std::string_view token,
                                          const StoredResponse& response) const;

  /// Deletes an in_progress claim (the handler failed). Safe to call after losing the claim.
  /// Throws DatabaseError.
  void release(Connection& connection, std::string_view scope, std::string_view key,
               std::string_view token) const;

  /// Deletes at most purge_batch records older than the TTL (never a live claim); returns how
  /// many. Call it periodically until it returns less than purge_batch. Throws DatabaseError.
  int purge_expired(Connection& connection) const;

  [[nodiscard]] const IdempotencyOptions& options() const noexcept { return options_; }

 private:
  [[nodiscard]] std::int64_t now_ms() const noexcept;
  [[nodiscard]] Claim claim(Connection& connection, std::string_view scope, std::string_view key,
                            std::string_view fingerprint,
                            std::optional<Isolation> then_begin) const;

  IdempotencyOptions options_;
  Clock* clock_;
};

}  // namespace keel::store
