// The idempotency flow's answer once its transaction has ended (keel/idempotency/
// flow_decision.hpp): the order of the checks below is the rule, and the table in
// tests/unit/flow_decision_test.cpp holds it.
#include "keel/idempotency/flow_decision.hpp"

namespace keel::store {

FlowOutcome database_failure_outcome(DatabaseFailure failure) noexcept {
  switch (failure) {
    case DatabaseFailure::kInDoubt:
      return FlowOutcome::kCommitInDoubt;
    case DatabaseFailure::kPermanent:
      return FlowOutcome::kDatabaseError;
    case DatabaseFailure::kConflict:
    case DatabaseFailure::kBusy:
    case DatabaseFailure::kUnavailable:
    case DatabaseFailure::kWrongNode:
      break;
  }
  return FlowOutcome::kDatabaseUnavailable;
}

FlowDecision decide_flow_answer(const FlowFacts& facts) noexcept {
  // Where the claim committed on its own (not held), every answer that stores nothing releases
  // it, so that a retry with the key runs afresh instead of waiting out the claim's lock.
  const bool release = !facts.held;
  if (facts.handler_threw) return {.outcome = FlowOutcome::kHandlerError, .release_claim = release};
  const bool rolled_back = facts.transaction == TransactionStatus::kRolledBack;
  switch (facts.transaction) {
    case TransactionStatus::kCommitted:
      return {.outcome = facts.took_over ? FlowOutcome::kTookOver : FlowOutcome::kExecuted};
    case TransactionStatus::kRolledBack:
      // Another request's claim, and this one never held the key: its claim is not ours to free.
      switch (facts.claim) {
        case ClaimStatus::kReplay:
          return {.outcome = FlowOutcome::kReplayed};
        case ClaimStatus::kMismatch:
          return {.outcome = FlowOutcome::kMismatch};
        case ClaimStatus::kInProgress:
          return {.outcome = FlowOutcome::kInProgress};
        case ClaimStatus::kClaimed:
          break;
      }
      if (facts.expired_after_claim) {
        return {.outcome = FlowOutcome::kDeadlineExceeded,
                .when = "while it claimed its Idempotency-Key"};
      }
      // Taken over while the handler ran: the claim is another request's now.
      if (facts.lost_claim) return {.outcome = FlowOutcome::kClaimLost};
      break;
    case TransactionStatus::kFailed:
    case TransactionStatus::kCommitInDoubt:
      break;
  }
  if (rolled_back && facts.expired_before_commit) {
    return {.outcome = FlowOutcome::kDeadlineExceeded,
            .release_claim = release,
            .when = "before its transaction committed"};
  }
  if (rolled_back && facts.declined) {
    return {.outcome = FlowOutcome::kNotStored, .release_claim = release};
  }
  if (facts.transaction == TransactionStatus::kFailed && facts.expired_now) {
    return {.outcome = FlowOutcome::kDeadlineExceeded,
            .release_claim = release,
            .when = "while its transaction ran"};
  }
  if (facts.transaction == TransactionStatus::kCommitInDoubt) {
    // Held, the key's record was written with the COMMIT, so reading it says whether it applied.
    // Not held, the release is harmless: it deletes only a record still in progress.
    return {.outcome = FlowOutcome::kCommitInDoubt,
            .release_claim = release,
            .settle_first = facts.held};
  }
  return {.outcome = database_failure_outcome(facts.failure), .release_claim = release};
}

}  // namespace keel::store
