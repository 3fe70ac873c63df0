// Runs a function in one transaction, retrying lost races (SQLITE_BUSY, 40001, 40P01), for the
// store's own statements: a commit or a rollback the function chose returns; anything else
// throws DatabaseError naming `what`. Private to keel::store.
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include "keel/store/database.hpp"
#include "keel/store/transaction.hpp"

namespace keel::store::detail {

inline void commit_or_throw(Connection& conn, std::string_view what,
                            const std::function<bool(Connection&)>& fn) {
  const TransactionResult r = with_transaction_retry(conn, fn);
  if (r.status == TransactionStatus::kCommitted || r.status == TransactionStatus::kRolledBack) {
    return;
  }
  DatabaseError::Details details;
  details.backend = conn.backend();
  details.sqlstate = r.sqlstate;
  details.during_commit = r.status == TransactionStatus::kCommitInDoubt;
  throw DatabaseError(
      std::string(what) + " transaction " + std::string(to_string(r.status)) + ": " + r.error,
      details);
}

}  // namespace keel::store::detail
