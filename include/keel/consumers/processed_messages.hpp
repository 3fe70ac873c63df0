// Processed-message records: deduplication at a consumer. A consumer that receives messages at
// least once (a webhook its sender retries, a queue that redelivers after a crash, a replay from
// a dead-letter queue) wraps each message's effect in process(). The message id is claimed with a
// unique insert (INSERT ... ON CONFLICT DO NOTHING, and the rows it inserted counted; never a
// read-then-insert) as the FIRST statement of the transaction that then runs the effect, so the
// record and the effect commit together or not at all:
//
//   - a new id: the record is inserted, the effect runs, both commit (kProcessed);
//   - an id already recorded: nothing is inserted, the effect does not run, the transaction is
//     rolled back, and the result says kDuplicate ("already processed");
//   - the effect fails or chooses to roll back: the record goes with it, so the id is free again
//     and the next delivery runs the effect (kFailed, kRolledBack);
//   - two deliveries of one id at once: the second insert waits on the unique index until the
//     first transaction ends (PostgreSQL), or on the write lock (SQLite's BEGIN IMMEDIATE); it
//     then finds the id recorded (the first committed: kDuplicate) or free (the first rolled
//     back: it runs the effect). Because the claim is the transaction's first statement, the
//     waiter holds no lock of its own. Lost races (40001, 40P01, SQLITE_BUSY) run the whole
//     transaction again, claim included, as with_transaction_retry does
//     (keel/db/transaction.hpp).
//
// The effect must write through the Connection it is given (the transaction); writes elsewhere
// (another database, an HTTP call) are not covered by the record and need their own idempotency.
//
// Ids are opaque byte strings of 1 to 255 bytes (kMaxMessageIdBytes), NUL and non-UTF-8 bytes
// included. They are stored as bytea on PostgreSQL and as lowercase hex text on SQLite (Value has
// no blob type, and SQLite's unhex() needs 3.41); both are passed to the database as hex text, so
// no byte of an id reaches the database's text handling. An id outside that range is refused with
// an Error, and nothing is written.
//
// Retention: records are kept until prune() deletes those older than a retention, in batches.
// A redelivery after its record was pruned runs the effect again: choose a retention longer
// than the longest time a sender may redeliver (its retry schedule, plus a dead-letter replay).
//
// Counts: the records keep what process() and prune() did (counts()); keel/metrics/
// processed_messages.hpp exports them through keel::metrics.
//
// Thread-safety: ProcessedMessages is immutable after construction except for its counters
// (atomics); it is safe for concurrent use. Each call uses the Connection it is given (one thread
// per connection).
//
// Example:
//   keel::store::ProcessedMessages records({.consumer = "billing"});
//   keel::store::ProcessedMessages::migrate(*conn);
//   auto r = records.process(*conn, event_id, [&](keel::store::Connection& tx) {
//     tx.query("INSERT INTO charges (account, cents) VALUES ($1, $2)", {account, cents});
//     return true;                                  // commit; false rolls back (id not recorded)
//   });
//   if (!r) return bad_request(r.error().message());    // an invalid id
//   if (r->status == keel::store::ProcessStatus::kDuplicate) return ok("already processed");
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "keel/core/clock.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "keel/core/retry.hpp"
#include "keel/db/database.hpp"
#include "keel/db/transaction.hpp"

namespace keel::store {

/// The longest message id, in bytes.
inline constexpr std::size_t kMaxMessageIdBytes = 255;

/// A message id is 1 to kMaxMessageIdBytes bytes, any bytes. Nothing when valid, else an Error
/// with the field "message id" and the length (the quoted value, control bytes escaped).
[[nodiscard]] Expected<void> check_message_id(std::string_view id);

/// A consumer name is 1-64 characters of [A-Za-z0-9_.-], as a queue name. Nothing when valid,
/// else an Error with the field "consumer" and the quoted name.
[[nodiscard]] Expected<void> check_consumer_name(std::string_view name);

enum class ProcessStatus : unsigned char {
  kProcessed,   // the id was new: the effect ran and committed with its record
  kDuplicate,   // the id was recorded already: the effect did not run, nothing was written
  kRolledBack,  // the effect returned false: rolled back with the record; the id is free again
  kFailed,      // a database error retries did not fix (or commit in doubt): see transaction
};

/// "processed", "duplicate", "rolled back", "failed".
[[nodiscard]] std::string_view to_string(ProcessStatus status) noexcept;

struct ProcessResult {
  ProcessStatus status = ProcessStatus::kProcessed;
  /// The transaction that settled it (attempts, the last error and its SQLSTATE). A duplicate's
  /// transaction is rolled back (kRolledBack): it wrote nothing.
  TransactionResult transaction;
  /// The effect is in place: it committed now (kProcessed) or before (kDuplicate).
  [[nodiscard]] bool done() const noexcept {
    return status == ProcessStatus::kProcessed || status == ProcessStatus::kDuplicate;
  }
};

/// What a ProcessedMessages did since it was built.
struct ProcessedCounts {
  /// Effects committed with their record.
  std::int64_t processed = 0;
  /// Deliveries of an id already recorded: effect skipped.
  std::int64_t duplicates = 0;
  /// Effects that chose to roll back.
  std::int64_t rolled_back = 0;
  /// Transactions that failed (kFailed).
  std::int64_t failed = 0;
  /// Records deleted by prune().
  std::int64_t pruned = 0;
};

struct ProcessedMessagesOptions {
  /// Whose records these are: ids are unique per consumer, so two consumers of one stream each
  /// apply every message once. Requires: a valid consumer name (check_consumer_name).
  std::string consumer;
  /// Time source (wall_now) for processed_ms and prune(). Default keel::steady_clock().
  Clock* clock = nullptr;
  /// How lost races are retried. Non-owning; Requires: outlives the records. Default
  /// default_transaction_retry_policy().
  const RetryPolicy* retry = nullptr;
  /// The isolation process() runs the effect at. Default kReadCommitted.
  Isolation isolation = Isolation::kReadCommitted;
};

class ProcessedMessages {
 public:
  /// Throws std::invalid_argument naming the field and value when a Requires line is broken.
  explicit ProcessedMessages(ProcessedMessagesOptions options);

  /// Creates or upgrades the table (component "processed" in keel_schema). Throws DatabaseError.
  static void migrate(Connection& connection);
  /// The records' schema component ("processed"), for a program that migrates every component (its
  /// `migrate` applies it).
  [[nodiscard]] static SchemaComponent schema() noexcept;

  /// Claims `message_id` and runs `effect` in one transaction, as described above: returns
  /// kProcessed, kDuplicate, kRolledBack or kFailed with the transaction's result; an Error
  /// (nothing written, effect not run) for an invalid id. Exceptions other than DatabaseError
  /// thrown by the effect roll back (the id stays free) and propagate. `call` bounds the retries
  /// (a deadline, a ceiling) as with_transaction_retry's does. Requires: no transaction open on
  /// `connection`; the table exists (migrate).
  [[nodiscard]] Expected<ProcessResult> process(Connection& connection, std::string_view message_id,
                                                const std::function<bool(Connection&)>& effect,
                                                const CallOptions& call = {});

  /// The claim alone, inside a transaction the caller runs (for a consumer that already has its
  /// own transaction, such as a job handler): true when the id was new and is now recorded in
  /// `tx`'s transaction (run the effect, then commit), false when it was recorded already (skip
  /// the effect). Waits on a concurrent claim of the same id as process() does. Not counted in
  /// counts(): whether the caller commits is not known here. Returns an Error for an invalid id.
  /// Requires: a transaction open on `tx`. Throws DatabaseError.
  [[nodiscard]] Expected<bool> claim(Connection& tx, std::string_view message_id) const;

  /// Whether `message_id` is recorded (committed, as the connection sees it). Returns an Error
  /// for an invalid id. Throws DatabaseError.
  [[nodiscard]] Expected<bool> contains(Connection& connection, std::string_view message_id) const;

  /// Deletes at most `batch` of this consumer's records processed more than `older_than` ago,
  /// oldest first; returns how many. Requires: older_than >= 0, batch >= 1 (else
  /// std::invalid_argument); no transaction open on `connection`. Throws DatabaseError.
  std::int64_t prune(Connection& connection, Duration older_than, int batch = 1000);

  /// What process() and prune() did so far.
  [[nodiscard]] ProcessedCounts counts() const noexcept;

  [[nodiscard]] const ProcessedMessagesOptions& options() const noexcept { return options_; }

 private:
  [[nodiscard]] std::int64_t now_ms() const noexcept;

  ProcessedMessagesOptions options_;
  Clock* clock_;
  const RetryPolicy* retry_;
  std::atomic<std::int64_t> processed_{0};
  std::atomic<std::int64_t> duplicates_{0};
  std::atomic<std::int64_t> rolled_back_{0};
  std::atomic<std::int64_t> failed_{0};
  std::atomic<std::int64_t> pruned_{0};
};

}  // namespace keel::store
