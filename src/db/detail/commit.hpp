// Runs a function in one transaction, retrying lost races (SQLITE_BUSY, 40001, 40P01), for the
// store's own statements: a commit or a rollback the function chose returns; anything else
// throws DatabaseError naming `what`. Private to keel::store_db and the store's targets above it.
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include "keel/db/database.hpp"
#include "keel/db/dialect.hpp"
#include "keel/db/transaction.hpp"

namespace keel::store::detail {

// How with_transaction_retry's transactions start and end when the caller saves round trips on
// them: the first one opened already with the statement before it (Connection::query_then_begin),
// the commit sent with the transaction's last statement (Connection::query_then_commit).
struct TransactionEnds {
  /// The first attempt runs in the transaction the caller opened at the same isolation (rolled
  /// back when no attempt may start); a retry opens its own.
  bool begun = false;
  /// Ends a transaction whose fn returned true, in place of Connection::commit(): returns true
  /// when it committed, false when it rolled back on purpose (reported as kRolledBack, as when fn
  /// returns false); a DatabaseError it throws is handled as one from COMMIT or fn is.
  std::function<bool(Connection&)> commit;
};

// with_transaction_retry (transaction.hpp) with the transaction's ends as `ends` says.
TransactionResult with_transaction_retry(Connection& connection,
                                         const std::function<bool(Connection&)>& fn,
                                         const TransactionEnds& ends, const RetryPolicy& policy,
                                         Isolation isolation, const CallOptions& call);

// Runs fn, which runs ONE statement, atomic on its own, as with_transaction_retry runs a
// transaction: re-run whole on 40001/40P01 or a busy database, after core's jittered delay, and
// in doubt (never re-run) when the connection is lost mid-statement. Without BEGIN and COMMIT:
// one round trip. Implemented in transaction.cpp, beside the transaction's loop.
TransactionResult with_statement_retry(Connection& connection,
                                       const std::function<bool(Connection&)>& fn);

[[noreturn]] inline void throw_failed(Connection& conn, std::string_view what,
                                      const TransactionResult& r) {
  DatabaseError::Details details;
  details.backend = conn.backend();
  details.sqlstate = r.sqlstate;
  details.during_commit = r.status == TransactionStatus::kCommitInDoubt;
  throw DatabaseError(
      std::string(what) + " transaction " + std::string(to_string(r.status)) + ": " + r.error,
      details);
}

inline void commit_or_throw(Connection& conn, std::string_view what,
                            const std::function<bool(Connection&)>& fn) {
  const TransactionResult r = with_transaction_retry(conn, fn);
  if (r.status == TransactionStatus::kCommitted || r.status == TransactionStatus::kRolledBack) {
    return;
  }
  throw_failed(conn, what, r);
}

// Runs fn, which runs one statement, retried as a whole transaction is. On a backend with row-level
// locks (PostgreSQL) that is the statement alone, in autocommit; one whose writers take the
// database's write lock (SQLite) takes it at BEGIN IMMEDIATE, so there it runs in a transaction
// whose busy waits the retry covers. Throws DatabaseError naming `what` when it cannot commit.
inline void statement_or_throw(Connection& conn, std::string_view what,
                               const std::function<bool(Connection&)>& fn) {
  if (!conn.dialect().row_level_locks()) {
    commit_or_throw(conn, what, fn);
    return;
  }
  const TransactionResult r = with_statement_retry(conn, fn);
  if (r.status == TransactionStatus::kCommitted || r.status == TransactionStatus::kRolledBack) {
    return;
  }
  throw_failed(conn, what, r);
}

}  // namespace keel::store::detail
