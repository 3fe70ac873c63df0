// What the idempotency flow answers once a request's transaction has ended, as a pure function:
// decide_flow_answer takes what happened (the transaction's status, the last claim, what the
// handler and the deadline did) and returns the outcome to give, whether the claim must be
// released first and whether a commit in doubt must be settled by reading the key's record.
// IdempotentRequestFlow::run drives it (keel/idempotency/idempotency_flow.hpp); the
// decision is tested by table without a database, as core's decide_retry is.
//
// Thread-safety: both functions are pure.
#pragma once

#include <string_view>

#include "keel/core/classify.hpp"
#include "keel/db/transaction.hpp"
#include "keel/idempotency/idempotency.hpp"
#include "keel/idempotency/idempotency_flow.hpp"

namespace keel::store {

/// What the flow knows when the handler's transaction has ended. The flags are set by the
/// transaction's body and its commit; each names one way a request ends without its answer
/// stored.
struct FlowFacts {
  TransactionStatus transaction = TransactionStatus::kCommitted;
  /// The last claim of the key: kClaimed unless another request holds it or completed it.
  ClaimStatus claim = ClaimStatus::kClaimed;
  /// The claim took over one whose lock had expired.
  bool took_over = false;
  /// The transaction itself holds the key, so nothing was written to release (false where the
  /// claim commits on its own before the handler runs: PostgreSQL at SERIALIZABLE).
  bool held = true;
  /// The handler threw something other than a database error.
  bool handler_threw = false;
  /// The deadline had passed once the key was claimed: the handler did not run.
  bool expired_after_claim = false;
  /// Completing the record found the claim taken over by another request.
  bool lost_claim = false;
  /// The deadline had passed at the last check before COMMIT: nothing committed.
  bool expired_before_commit = false;
  /// The handler answered 4xx or 5xx: answered, not stored.
  bool declined = false;
  /// The deadline has passed (or the caller has gone) now, after the transaction.
  bool expired_now = false;
  /// kFailed: the last error's classification (TransactionResult::failure).
  DatabaseFailure failure = DatabaseFailure::kUnavailable;
};

/// What to answer. When `settle_first` is set, the key's record is read on a new connection
/// first (the COMMIT's answer was lost): what it says is the answer, and `outcome` only when it
/// does not say by the request's bound.
struct FlowDecision {
  FlowOutcome outcome = FlowOutcome::kExecuted;
  /// Release the claim before answering, so that a retry with the key runs afresh.
  bool release_claim = false;
  bool settle_first = false;
  /// kDeadlineExceeded: when the deadline was found passed ("while it claimed its
  /// Idempotency-Key", ...), for the answer's detail.
  std::string_view when;
};

[[nodiscard]] FlowDecision decide_flow_answer(const FlowFacts& facts) noexcept;

/// The answer to a database failure, by core's classification: kInDoubt is kCommitInDoubt (500
/// with Retry-After), kPermanent kDatabaseError (500 without), every other kDatabaseUnavailable
/// (503 with Retry-After).
[[nodiscard]] FlowOutcome database_failure_outcome(DatabaseFailure failure) noexcept;

}  // namespace keel::store
