// keel::store::decide_flow_answer, the idempotency flow's answer once its transaction has ended,
// by table: every transaction status against every claim, flag and hold, with no database. The
// flow's own tests (tests/integration/idempotency/idempotency_flow_test.cpp) drive the same answers
// through SQLite and PostgreSQL.
#include "keel/idempotency/flow_decision.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

using keel::DatabaseFailure;
using keel::store::ClaimStatus;
using keel::store::decide_flow_answer;
using keel::store::FlowDecision;
using keel::store::FlowFacts;
using keel::store::FlowOutcome;
using keel::store::TransactionStatus;

namespace {

struct Row {
  std::string name;
  FlowFacts facts;
  FlowOutcome outcome;
  bool release;  // when the claim is not held; held, nothing is ever released
  bool settle;   // when held; not held, a commit in doubt is never settled by reading
  std::string when = {};
};

FlowFacts with(TransactionStatus status, FlowFacts facts = {}) {
  facts.transaction = status;
  return facts;
}

const std::vector<Row>& table() {
  using enum TransactionStatus;
  static const std::vector<Row> rows = {
      {"committed", with(kCommitted), FlowOutcome::kExecuted, false, false},
      {"committed over an expired claim", with(kCommitted, {.took_over = true}),
       FlowOutcome::kTookOver, false, false},
      // A flag left by an earlier attempt of the transaction's loop does not undo a commit.
      {"committed after a declined attempt", with(kCommitted, {.declined = true}),
       FlowOutcome::kExecuted, false, false},
      {"another request completed the key", with(kRolledBack, {.claim = ClaimStatus::kReplay}),
       FlowOutcome::kReplayed, false, false},
      {"the key used with another request", with(kRolledBack, {.claim = ClaimStatus::kMismatch}),
       FlowOutcome::kMismatch, false, false},
      {"another request holds the key", with(kRolledBack, {.claim = ClaimStatus::kInProgress}),
       FlowOutcome::kInProgress, false, false},
      // Another's claim comes before this request's own flags: they are about a key it never had.
      {"held elsewhere while the deadline passed",
       with(kRolledBack, {.claim = ClaimStatus::kInProgress, .expired_before_commit = true}),
       FlowOutcome::kInProgress, false, false},
      {"the deadline passed once claimed", with(kRolledBack, {.expired_after_claim = true}),
       FlowOutcome::kDeadlineExceeded, false, false, "while it claimed its Idempotency-Key"},
      {"the claim was taken over", with(kRolledBack, {.lost_claim = true}), FlowOutcome::kClaimLost,
       false, false},
      {"the claim was taken over and the deadline passed",
       with(kRolledBack, {.lost_claim = true, .expired_now = true}), FlowOutcome::kClaimLost, false,
       false},
      {"the deadline passed before COMMIT", with(kRolledBack, {.expired_before_commit = true}),
       FlowOutcome::kDeadlineExceeded, true, false, "before its transaction committed"},
      {"the handler declined", with(kRolledBack, {.declined = true}), FlowOutcome::kNotStored, true,
       false},
      {"the handler declined and the deadline passed before COMMIT",
       with(kRolledBack, {.expired_before_commit = true, .declined = true}),
       FlowOutcome::kDeadlineExceeded, true, false, "before its transaction committed"},
      {"the handler threw", with(kCommitted, {.handler_threw = true}), FlowOutcome::kHandlerError,
       true, false},
      {"the handler threw on another's claim",
       with(kRolledBack, {.claim = ClaimStatus::kReplay, .handler_threw = true}),
       FlowOutcome::kHandlerError, true, false},
      {"failed, retry may fix it", with(kFailed, {.failure = DatabaseFailure::kUnavailable}),
       FlowOutcome::kDatabaseUnavailable, true, false},
      {"failed busy", with(kFailed, {.failure = DatabaseFailure::kBusy}),
       FlowOutcome::kDatabaseUnavailable, true, false},
      {"failed on conflicts", with(kFailed, {.failure = DatabaseFailure::kConflict}),
       FlowOutcome::kDatabaseUnavailable, true, false},
      {"failed on the wrong node", with(kFailed, {.failure = DatabaseFailure::kWrongNode}),
       FlowOutcome::kDatabaseUnavailable, true, false},
      {"failed for good", with(kFailed, {.failure = DatabaseFailure::kPermanent}),
       FlowOutcome::kDatabaseError, true, false},
      {"failed past the deadline",
       with(kFailed, {.expired_now = true, .failure = DatabaseFailure::kPermanent}),
       FlowOutcome::kDeadlineExceeded, true, false, "while its transaction ran"},
      // Flags of a rolled-back attempt before the failure that ended the loop do not apply.
      {"failed after a declined attempt",
       with(kFailed, {.declined = true, .failure = DatabaseFailure::kBusy}),
       FlowOutcome::kDatabaseUnavailable, true, false},
      {"commit in doubt", with(kCommitInDoubt, {.failure = DatabaseFailure::kInDoubt}),
       FlowOutcome::kCommitInDoubt, true, true},
      // In doubt, the caller's deadline does not make the answer a refusal: the work may be done.
      {"commit in doubt past the deadline",
       with(kCommitInDoubt, {.expired_now = true, .failure = DatabaseFailure::kInDoubt}),
       FlowOutcome::kCommitInDoubt, true, true},
  };
  return rows;
}

TEST(FlowDecision, EveryEndOfTheTransactionHasOneAnswer) {
  for (const Row& row : table()) {
    for (const bool held : {true, false}) {
      SCOPED_TRACE(row.name + (held ? " (held)" : " (claim committed on its own)"));
      FlowFacts facts = row.facts;
      facts.held = held;
      const FlowDecision d = decide_flow_answer(facts);
      EXPECT_EQ(keel::store::to_string(d.outcome), keel::store::to_string(row.outcome));
      EXPECT_EQ(d.release_claim, row.release && !held);
      EXPECT_EQ(d.settle_first, row.settle && held);
      EXPECT_EQ(d.when, row.when);
    }
  }
}

// The claim is released exactly when nothing was stored and the claim is this request's: never
// after a commit (the record is the answer) nor when another request holds or completed the key.
TEST(FlowDecision, OnlyAnUnstoredAnswerOnItsOwnClaimReleasesIt) {
  for (const Row& row : table()) {
    FlowFacts facts = row.facts;
    facts.held = false;
    const FlowDecision d = decide_flow_answer(facts);
    const bool stored = d.outcome == FlowOutcome::kExecuted || d.outcome == FlowOutcome::kTookOver;
    const bool someone_elses =
        d.outcome == FlowOutcome::kReplayed || d.outcome == FlowOutcome::kMismatch ||
        d.outcome == FlowOutcome::kInProgress || d.outcome == FlowOutcome::kClaimLost ||
        (d.outcome == FlowOutcome::kDeadlineExceeded && facts.expired_after_claim);
    EXPECT_EQ(d.release_claim, !stored && !someone_elses) << row.name;
  }
}

TEST(FlowDecision, DatabaseFailuresAnswerByCoresClassification) {
  using keel::store::database_failure_outcome;
  EXPECT_EQ(database_failure_outcome(DatabaseFailure::kInDoubt), FlowOutcome::kCommitInDoubt);
  EXPECT_EQ(database_failure_outcome(DatabaseFailure::kPermanent), FlowOutcome::kDatabaseError);
  for (const DatabaseFailure retryable :
       {DatabaseFailure::kConflict, DatabaseFailure::kBusy, DatabaseFailure::kUnavailable,
        DatabaseFailure::kWrongNode}) {
    EXPECT_EQ(database_failure_outcome(retryable), FlowOutcome::kDatabaseUnavailable)
        << keel::to_string(retryable);
  }
}

}  // namespace
