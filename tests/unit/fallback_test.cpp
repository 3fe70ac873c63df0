// keel::choose_fallback, the rule of which failed operations may serve a stale answer or be
// queued for later (keel/core/fallback.hpp): every stop reason against every outcome kind.
#include "keel/core/fallback.hpp"

#include <gtest/gtest.h>

#include <vector>

using keel::choose_fallback;
using keel::FallbackKind;
using keel::Outcome;
using keel::OutcomeKind;
using keel::StopReason;

namespace {

Outcome of(OutcomeKind kind) {
  Outcome o;
  o.kind = kind;
  return o;
}

const std::vector<OutcomeKind> kAllKinds = {OutcomeKind::kNotAttempted, OutcomeKind::kSuccess,
                                            OutcomeKind::kTransient,    OutcomeKind::kThrottled,
                                            OutcomeKind::kPermanent,    OutcomeKind::kAmbiguous};

constexpr keel::FallbackOperation kRead{.read = true};
constexpr keel::FallbackOperation kKeyedWrite{.has_idempotency_key = true};
constexpr keel::FallbackOperation kWriteWithoutKey{};

TEST(Fallback, AnOpenBreakerFallsBackWhateverTheLastOutcome) {
  for (const OutcomeKind kind : kAllKinds) {
    EXPECT_EQ(choose_fallback(StopReason::kCircuitOpen, of(kind), kRead), FallbackKind::kServeStale)
        << keel::to_string(kind);
    EXPECT_EQ(choose_fallback(StopReason::kCircuitOpen, of(kind), kKeyedWrite),
              FallbackKind::kDefer);
    EXPECT_EQ(choose_fallback(StopReason::kCircuitOpen, of(kind), kWriteWithoutKey),
              FallbackKind::kNone)
        << "a write without a key is never queued";
  }
}

TEST(Fallback, GivingUpOnADependencyFailureQueuesAKeyedWrite) {
  for (const StopReason reason :
       {StopReason::kAttemptsExhausted, StopReason::kDeadline, StopReason::kBudgetExhausted}) {
    for (const OutcomeKind kind :
         {OutcomeKind::kTransient, OutcomeKind::kThrottled, OutcomeKind::kAmbiguous}) {
      EXPECT_TRUE(keel::dependency_unavailable(reason, of(kind)));
      EXPECT_EQ(choose_fallback(reason, of(kind), kKeyedWrite), FallbackKind::kDefer)
          << keel::to_string(reason) << " after " << keel::to_string(kind);
      EXPECT_EQ(choose_fallback(reason, of(kind), kWriteWithoutKey), FallbackKind::kNone);
      EXPECT_EQ(choose_fallback(reason, of(kind), kRead), FallbackKind::kNone)
          << "a read that failed its retries is reported as it is: the host was just heard from";
    }
  }
}

TEST(Fallback, APermanentLastOutcomeNeverFallsBack) {
  for (const StopReason reason :
       {StopReason::kAttemptsExhausted, StopReason::kDeadline, StopReason::kBudgetExhausted}) {
    EXPECT_EQ(choose_fallback(reason, of(OutcomeKind::kPermanent), kKeyedWrite),
              FallbackKind::kNone);
  }
}

TEST(Fallback, ABudgetRefusalBeforeAnythingWasSentFallsBackButAPassedDeadlineDoesNot) {
  EXPECT_EQ(
      choose_fallback(StopReason::kBudgetExhausted, of(OutcomeKind::kNotAttempted), kKeyedWrite),
      FallbackKind::kDefer);
  EXPECT_EQ(choose_fallback(StopReason::kDeadline, of(OutcomeKind::kNotAttempted), kKeyedWrite),
            FallbackKind::kNone)
      << "the caller's time ran out before any attempt: nothing says the host is down";
  EXPECT_EQ(
      choose_fallback(StopReason::kAttemptsExhausted, of(OutcomeKind::kNotAttempted), kKeyedWrite),
      FallbackKind::kNone);
}

TEST(Fallback, OtherStopsNeverFallBack) {
  for (const StopReason reason :
       {StopReason::kSuccess, StopReason::kPermanent, StopReason::kNotSafeToRetry,
        StopReason::kCancelled, StopReason::kQueued}) {
    for (const OutcomeKind kind : kAllKinds) {
      EXPECT_FALSE(keel::dependency_unavailable(reason, of(kind)));
      for (const auto& op : {kRead, kKeyedWrite, kWriteWithoutKey}) {
        EXPECT_EQ(choose_fallback(reason, of(kind), op), FallbackKind::kNone)
            << keel::to_string(reason);
      }
    }
  }
}

TEST(Fallback, NamesAndTheQueuedStopReason) {
  EXPECT_EQ(keel::to_string(StopReason::kQueued), "queued");
  EXPECT_EQ(keel::to_string(FallbackKind::kNone), "none");
  EXPECT_EQ(keel::to_string(FallbackKind::kServeStale), "serve stale");
  EXPECT_EQ(keel::to_string(FallbackKind::kDefer), "defer");
  keel::GiveUpEvent e{.attempts = 3, .reason = StopReason::kQueued};
  EXPECT_NE(keel::format_give_up(e).find(": queued"), std::string::npos);
}

}  // namespace
