// Transaction retry: run a function inside BEGIN ... COMMIT and, when the database says the
// transaction lost a race (PostgreSQL 40001 serialization_failure or 40P01 deadlock_detected;
// SQLite SQLITE_BUSY), roll back and run the WHOLE transaction again from BEGIN after a full-jitter
// delay, with the attempts capped by a keel::RetryPolicy.
//
// A connection lost during COMMIT is reported as kCommitInDoubt and never retried: the
// transaction may have been applied, and only an idempotent design (an idempotency key, a unique
// constraint) can make a second run harmless. A connection lost before COMMIT is reported as
// kFailed (the server rolled it back), for the caller to retry on a new connection.
//
// Thread-safety: the function is re-entrant; the Connection is used by the calling thread only.
//
// Example:
//   auto result = keel::store::with_transaction_retry(conn, [&](keel::store::Connection& tx) {
//     tx.query("UPDATE accounts SET balance = balance - $1 WHERE id = $2", {amount, from});
//     tx.query("UPDATE accounts SET balance = balance + $1 WHERE id = $2", {amount, to});
//     return true;                          // commit; false rolls back and stops
//   }, keel::store::default_transaction_retry_policy(), keel::store::Isolation::kSerializable);
//   if (!result.committed()) log(result.error);
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "keel/core/retry.hpp"
#include "keel/db/database.hpp"

namespace keel::store {

enum class TransactionStatus : unsigned char {
  kCommitted,      // fn returned true and COMMIT succeeded
  kRolledBack,     // fn returned false: rolled back on purpose, not retried
  kFailed,         // a database error that retries did not fix, or that no retry can fix
  kCommitInDoubt,  // the connection was lost during COMMIT: applied or not, nobody knows
};

/// "committed", "rolled back", "failed", "commit in doubt".
[[nodiscard]] std::string_view to_string(TransactionStatus status) noexcept;

struct TransactionResult {
  TransactionStatus status = TransactionStatus::kCommitted;
  /// Transactions started (1 when the first one settled it).
  int attempts = 0;
  /// The last error's classification (success when committed or rolled back).
  Outcome outcome;
  /// The last database error's message; empty when none.
  std::string error;
  /// The last error's SQLSTATE (PostgreSQL), empty otherwise.
  std::string sqlstate;
  /// What the last database error means (core's DatabaseFailure: retry later, on a new
  /// connection, or never); nullopt when committed, rolled back, or nothing ran.
  std::optional<DatabaseFailure> failure;
  [[nodiscard]] bool committed() const noexcept { return status == TransactionStatus::kCommitted; }
};

/// 5 attempts, full jitter with base 5 ms and cap 250 ms.
[[nodiscard]] const RetryPolicy& default_transaction_retry_policy();

/// Runs fn between BEGIN (at `isolation`) and COMMIT, retrying as described above. fn returns
/// true to commit, false to roll back. Exceptions other than DatabaseError thrown by fn roll the
/// transaction back and propagate. Requires: no transaction open on `connection`; the policy
/// outlives the call. `call` supplies the clock (sleeps between attempts) and random generator,
/// and may bound the retries with a deadline or a ceiling (a request handler passes
/// current_request_deadline()); when the first transaction cannot start (the deadline has passed,
/// or call.breaker is open) fn never runs and the result is kFailed with 0 attempts, an outcome
/// that is not attempted and an error naming the stop reason.
[[nodiscard]] TransactionResult with_transaction_retry(
    Connection& connection, const std::function<bool(Connection&)>& fn,
    const RetryPolicy& policy = default_transaction_retry_policy(),
    Isolation isolation = Isolation::kReadCommitted, const CallOptions& call = {});

}  // namespace keel::store
