// keel::HedgeState in virtual time: when a hedge is due and whether it may go (safe to repeat,
// one retrying layer, max_hedges, deadline, breaker, budget), which result ends a round, and how
// a round whose attempts all failed is retried.
#include "keel/core/hedge.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <stdexcept>

#include "keel/core/breaker.hpp"
#include "keel/core/budget.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/latency.hpp"
#include "keel/core/retry.hpp"

namespace {

using keel::AttemptStart;
using keel::HedgePolicy;
using keel::HedgeRefusal;
using keel::HedgeState;
using keel::Outcome;
using keel::StopReason;
using std::chrono::milliseconds;
using std::chrono::seconds;

struct Fixture {
  keel::ManualClock clock;
  keel::RetryPolicy policy{{.max_attempts = 3,
                            .per_try_timeout = seconds(2),
                            .overall_timeout = seconds(10),
                            .backoff = {.base = milliseconds(10), .cap = milliseconds(10)}}};
  HedgePolicy hedge{{.delay = milliseconds(100), .max_hedges = 1}};
  keel::CallOptions call() {
    keel::CallOptions c;
    c.clock = &clock;
    c.safe_to_repeat = true;
    return c;
  }
};

Outcome ok() { return Outcome::success(); }
Outcome unavailable() { return Outcome::transient(); }

TEST(HedgePolicy, RejectsInvalidOptionsNamingTheField) {
  EXPECT_THROW(HedgePolicy({.delay = milliseconds(-1)}), std::invalid_argument);
  EXPECT_THROW(HedgePolicy({.max_hedges = 0}), std::invalid_argument);
  EXPECT_THROW(HedgePolicy({.max_hedges = 11}), std::invalid_argument);
  EXPECT_THROW(HedgePolicy({.latency_quantile = 1.0}), std::invalid_argument);
  EXPECT_THROW(HedgePolicy({.min_samples = 0}), std::invalid_argument);
  try {
    HedgePolicy p({.max_hedges = 0});
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "keel::HedgePolicy: max_hedges must be in [1, 10] (got 0)");
  }
}

TEST(HedgePolicy, DelayIsTheLatencyQuantileOnceTheTrackerHoldsEnough) {
  keel::ManualClock clock;
  keel::LatencyTracker tracker;
  const HedgePolicy p({.delay = milliseconds(100), .latency_quantile = 0.9, .min_samples = 10});
  EXPECT_EQ(p.delay(nullptr, clock.now()), milliseconds(100));
  for (int i = 1; i <= 9; ++i) tracker.record(milliseconds(i), clock.now());
  EXPECT_EQ(p.delay(&tracker, clock.now()), milliseconds(100));  // 9 < min_samples
  tracker.record(milliseconds(10), clock.now());
  const auto d = p.delay(&tracker, clock.now());
  EXPECT_GE(d, milliseconds(8));
  EXPECT_LE(d, milliseconds(10));
  EXPECT_EQ(HedgePolicy({.delay = milliseconds(7)}).delay(&tracker, clock.now()), milliseconds(7));
}

TEST(HedgeState, AnOperationThatIsNotSafeToRepeatNeverHedges) {
  Fixture f;
  keel::CallOptions call = f.call();
  call.safe_to_repeat = false;
  keel::RetryState retry(f.policy, call);
  HedgeState hedge(&f.hedge, f.policy, call, retry);
  EXPECT_FALSE(hedge.enabled());
  const AttemptStart start = retry.start_attempt();
  (void)hedge.begin_round(start.attempt, milliseconds(100));
  EXPECT_FALSE(hedge.next_hedge_at().has_value());
  f.clock.advance(seconds(1));
  EXPECT_EQ(hedge.start_hedge().refusal, HedgeRefusal::kNotHedged);
}

TEST(HedgeState, WithoutAPolicyARoundIsItsOneAttempt) {
  Fixture f;
  const keel::CallOptions call = f.call();
  keel::RetryState retry(f.policy, call);
  HedgeState hedge(nullptr, f.policy, call, retry);
  EXPECT_FALSE(hedge.enabled());
  (void)hedge.begin_round(retry.start_attempt().attempt, milliseconds(100));
  const auto v = hedge.finish(0, unavailable());
  EXPECT_TRUE(v.done);
  EXPECT_TRUE(v.decision.retry);
}

TEST(HedgeState, OneLayerDownDoesNotHedge) {
  Fixture f;
  const keel::CallOptions call = f.call();
  const keel::RetryScope outer;  // an enclosing keel retry loop on this thread
  keel::RetryState retry(f.policy, call);
  HedgeState hedge(&f.hedge, f.policy, call, retry);
  EXPECT_TRUE(retry.nested());
  EXPECT_FALSE(hedge.enabled());
}

TEST(HedgeState, TheHedgeIsDueAfterTheDelayAndNumberedAsTheNextRequest) {
  Fixture f;
  const keel::CallOptions call = f.call();
  keel::RetryState retry(f.policy, call);
  HedgeState hedge(&f.hedge, f.policy, call, retry);
  ASSERT_TRUE(hedge.enabled());
  const AttemptStart start = retry.start_attempt();
  const keel::AttemptInfo first = hedge.begin_round(start.attempt, milliseconds(100));
  EXPECT_EQ(first.number, 1);
  ASSERT_TRUE(hedge.next_hedge_at().has_value());
  EXPECT_EQ(*hedge.next_hedge_at(), f.clock.now() + milliseconds(100));
  f.clock.advance(milliseconds(99));
  EXPECT_EQ(hedge.start_hedge().refusal, HedgeRefusal::kNotDue);
  f.clock.advance(milliseconds(1));
  const keel::HedgeStart h = hedge.start_hedge();
  ASSERT_TRUE(h.proceed);
  EXPECT_EQ(h.index, 1);
  EXPECT_EQ(h.attempt.number, 2);
  EXPECT_EQ(h.attempt.timeout, seconds(2));
  EXPECT_EQ(hedge.in_flight(), 2);
  // max_hedges 1: no third attempt.
  EXPECT_FALSE(hedge.next_hedge_at().has_value());
  f.clock.advance(seconds(1));
  EXPECT_EQ(hedge.start_hedge().refusal, HedgeRefusal::kLimit);
}

TEST(HedgeState, AtMostMaxHedgesInFlightEachDelayAfterTheLatest) {
  Fixture f;
  const HedgePolicy three({.delay = milliseconds(50), .max_hedges = 3});
  const keel::CallOptions call = f.call();
  keel::RetryState retry(f.policy, call);
  HedgeState hedge(&three, f.policy, call, retry);
  (void)hedge.begin_round(retry.start_attempt().attempt, milliseconds(50));
  for (int i = 1; i <= 3; ++i) {
    f.clock.advance(milliseconds(49));
    EXPECT_EQ(hedge.start_hedge().refusal, HedgeRefusal::kNotDue);
    f.clock.advance(milliseconds(1));
    const keel::HedgeStart h = hedge.start_hedge();
    ASSERT_TRUE(h.proceed) << i;
    EXPECT_EQ(h.index, i);
  }
  EXPECT_EQ(hedge.in_flight(), 4);
  EXPECT_EQ(hedge.hedges(), 3);
  f.clock.advance(seconds(1));
  EXPECT_EQ(hedge.start_hedge().refusal, HedgeRefusal::kLimit);
}

TEST(HedgeState, TheFirstGoodAnswerWinsAndTheOthersAreCancelled) {
  Fixture f;
  keel::CircuitBreaker breaker({.clock = &f.clock});
  keel::CallOptions call = f.call();
  call.breaker = &breaker;
  keel::RetryState retry(f.policy, call);
  HedgeState hedge(&f.hedge, f.policy, call, retry);
  (void)hedge.begin_round(retry.start_attempt().attempt, milliseconds(100));
  f.clock.advance(milliseconds(100));
  ASSERT_TRUE(hedge.start_hedge().proceed);
  const keel::HedgeVerdict v = hedge.finish(1, ok());
  EXPECT_TRUE(v.done);
  EXPECT_EQ(v.winner, 1);
  EXPECT_FALSE(v.decision.retry);
  EXPECT_EQ(v.decision.reason, StopReason::kSuccess);
  hedge.cancel(0);
  EXPECT_EQ(hedge.in_flight(), 0);
  EXPECT_EQ(retry.stop_reason(), StopReason::kSuccess);
  // The winner is counted once, the cancelled attempt not at all.
  EXPECT_EQ(breaker.snapshot().calls, 1);
  EXPECT_EQ(breaker.snapshot().failures, 0);
}

TEST(HedgeState, APermanentFailureIsAnAnswerToo) {
  Fixture f;
  const keel::CallOptions call = f.call();
  keel::RetryState retry(f.policy, call);
  HedgeState hedge(&f.hedge, f.policy, call, retry);
  (void)hedge.begin_round(retry.start_attempt().attempt, milliseconds(100));
  f.clock.advance(milliseconds(100));
  ASSERT_TRUE(hedge.start_hedge().proceed);
  const keel::HedgeVerdict v = hedge.finish(0, Outcome::permanent());
  EXPECT_TRUE(v.done);
  EXPECT_EQ(v.winner, 0);
  EXPECT_EQ(v.decision.reason, StopReason::kPermanent);
}

TEST(HedgeState, AFailureWaitsForTheAttemptStillInFlight) {
  Fixture f;
  keel::CircuitBreaker breaker({.clock = &f.clock});
  keel::CallOptions call = f.call();
  call.breaker = &breaker;
  keel::RetryState retry(f.policy, call);
  HedgeState hedge(&f.hedge, f.policy, call, retry);
  (void)hedge.begin_round(retry.start_attempt().attempt, milliseconds(100));
  f.clock.advance(milliseconds(100));
  ASSERT_TRUE(hedge.start_hedge().proceed);
  EXPECT_FALSE(hedge.finish(0, unavailable()).done);
  EXPECT_EQ(hedge.in_flight(), 1);
  const keel::HedgeVerdict v = hedge.finish(1, ok());
  EXPECT_TRUE(v.done);
  EXPECT_EQ(v.winner, 1);
  EXPECT_EQ(v.decision.reason, StopReason::kSuccess);
  // Both outcomes reached the breaker.
  EXPECT_EQ(breaker.snapshot().calls, 2);
  EXPECT_EQ(breaker.snapshot().failures, 1);
}

TEST(HedgeState, ARoundWhoseAttemptsAllFailedIsRetriedAsOneFailedAttempt) {
  Fixture f;
  const keel::CallOptions call = f.call();
  keel::RetryState retry(f.policy, call);
  HedgeState hedge(&f.hedge, f.policy, call, retry);
  (void)hedge.begin_round(retry.start_attempt().attempt, milliseconds(100));
  f.clock.advance(milliseconds(100));
  ASSERT_TRUE(hedge.start_hedge().proceed);
  EXPECT_FALSE(hedge.finish(1, unavailable()).done);
  const keel::HedgeVerdict v = hedge.finish(0, unavailable());
  ASSERT_TRUE(v.done);
  EXPECT_TRUE(v.decision.retry);
  EXPECT_LE(v.decision.delay, milliseconds(10));  // the backoff's full jitter
  f.clock.advance(v.decision.delay);
  // The next round: the engine's second attempt, the operation's third request.
  const AttemptStart next = retry.start_attempt();
  ASSERT_TRUE(next.proceed);
  EXPECT_EQ(next.attempt.number, 2);
  EXPECT_EQ(hedge.begin_round(next.attempt, milliseconds(100)).number, 3);
  EXPECT_TRUE(hedge.next_hedge_at().has_value());
  EXPECT_EQ(hedge.sent(), 3);
}

TEST(HedgeState, AFailureThatFinishesAloneEndsTheRoundBeforeAnyHedge) {
  Fixture f;
  const keel::CallOptions call = f.call();
  keel::RetryState retry(f.policy, call);
  HedgeState hedge(&f.hedge, f.policy, call, retry);
  (void)hedge.begin_round(retry.start_attempt().attempt, milliseconds(100));
  const keel::HedgeVerdict v = hedge.finish(0, Outcome::transient());
  EXPECT_TRUE(v.done);
  EXPECT_TRUE(v.decision.retry);  // the retry engine's backoff, not a hedge
  EXPECT_EQ(hedge.hedges(), 0);
}

TEST(HedgeState, AThrottledAnswerEndsHedgingForTheRound) {
  Fixture f;
  const HedgePolicy two({.delay = milliseconds(100), .max_hedges = 2});
  const keel::CallOptions call = f.call();
  keel::RetryState retry(f.policy, call);
  HedgeState hedge(&two, f.policy, call, retry);
  (void)hedge.begin_round(retry.start_attempt().attempt, milliseconds(100));
  f.clock.advance(milliseconds(100));
  ASSERT_TRUE(hedge.start_hedge().proceed);
  EXPECT_FALSE(hedge.finish(1, Outcome::throttled(seconds(1))).done);
  EXPECT_FALSE(hedge.next_hedge_at().has_value());
  f.clock.advance(milliseconds(100));
  EXPECT_EQ(hedge.start_hedge().refusal, HedgeRefusal::kLimit);
}

TEST(HedgeState, AHedgeTheBudgetRefusesIsNotSentAndTheCallWaits) {
  Fixture f;
  // Five tokens, a retry costs 5: one hedge or retry, then none.
  keel::TokenBucketBudget budget({.capacity = 5, .retry_cost = 5, .success_refund = 0});
  keel::CallOptions call = f.call();
  call.budget = &budget;
  {
    keel::RetryState retry(f.policy, call);
    HedgeState hedge(&f.hedge, f.policy, call, retry);
    (void)hedge.begin_round(retry.start_attempt().attempt, milliseconds(100));
    f.clock.advance(milliseconds(100));
    ASSERT_TRUE(hedge.start_hedge().proceed);
    EXPECT_EQ(budget.tokens(), 0);
    const keel::HedgeVerdict v = hedge.finish(0, ok());
    ASSERT_TRUE(v.done);
    hedge.cancel(1);  // the hedge lost: it was sent, its charge stays
    EXPECT_EQ(budget.tokens(), 0);
  }
  keel::RetryState retry(f.policy, call);
  HedgeState hedge(&f.hedge, f.policy, call, retry);
  (void)hedge.begin_round(retry.start_attempt().attempt, milliseconds(100));
  f.clock.advance(milliseconds(100));
  EXPECT_EQ(hedge.start_hedge().refusal, HedgeRefusal::kBudgetExhausted);
  EXPECT_FALSE(hedge.next_hedge_at().has_value());
  EXPECT_EQ(hedge.in_flight(), 1);
  EXPECT_EQ(hedge.hedges(), 0);
  const keel::HedgeVerdict v = hedge.finish(0, ok());
  EXPECT_TRUE(v.done);
  EXPECT_EQ(v.decision.reason, StopReason::kSuccess);
}

TEST(HedgeState, AWinningHedgeIsRefundedAsASuccessfulRetry) {
  Fixture f;
  keel::TokenBucketBudget budget({.capacity = 100, .retry_cost = 5, .success_refund = 1});
  keel::CallOptions call = f.call();
  call.budget = &budget;
  keel::RetryState retry(f.policy, call);
  HedgeState hedge(&f.hedge, f.policy, call, retry);
  (void)hedge.begin_round(retry.start_attempt().attempt, milliseconds(100));
  f.clock.advance(milliseconds(100));
  ASSERT_TRUE(hedge.start_hedge().proceed);
  EXPECT_EQ(budget.tokens(), 95);
  // The primary fails first (recorded on the hedge's permit), the hedge's success ends the
  // round on the first attempt's: the bucket sees one failure and one first-attempt success.
  EXPECT_FALSE(hedge.finish(0, unavailable()).done);
  EXPECT_TRUE(hedge.finish(1, ok()).done);
  EXPECT_EQ(budget.tokens(), 96);
}

TEST(HedgeState, TheRatioBudgetCountsEveryHedgeAsARetry) {
  Fixture f;
  keel::RatioBudget budget({.ratio = 0.1, .reserve_per_second = 0.0, .clock = &f.clock});
  keel::CallOptions call = f.call();
  call.budget = &budget;
  int hedged = 0;
  for (int i = 0; i < 100; ++i) {
    keel::RetryState retry(f.policy, call);
    HedgeState hedge(&f.hedge, f.policy, call, retry);
    (void)hedge.begin_round(retry.start_attempt().attempt, milliseconds(1));
    f.clock.advance(milliseconds(1));
    const keel::HedgeStart h = hedge.start_hedge();
    if (h.proceed) ++hedged;
    (void)hedge.finish(0, ok());
    if (h.proceed) hedge.cancel(h.index);
  }
  // Every operation was slow, but hedges stay within 10% of the first attempts.
  EXPECT_EQ(hedged, 10);
}

TEST(HedgeState, AnOpenBreakerRefusesTheHedge) {
  Fixture f;
  keel::CircuitBreaker breaker(
      {.minimum_calls = 1, .failure_rate_threshold = 0.5, .clock = &f.clock});
  keel::CallOptions call = f.call();
  call.breaker = &breaker;
  keel::RetryState retry(f.policy, call);
  HedgeState hedge(&f.hedge, f.policy, call, retry);
  (void)hedge.begin_round(retry.start_attempt().attempt, milliseconds(100));
  // Another operation's failure trips the breaker while this attempt is in flight.
  const keel::BreakerPermit other = breaker.try_acquire();
  breaker.record(other, Outcome::transient());
  ASSERT_EQ(breaker.state(), keel::BreakerState::kOpen);
  f.clock.advance(milliseconds(100));
  EXPECT_EQ(hedge.start_hedge().refusal, HedgeRefusal::kCircuitOpen);
  EXPECT_FALSE(hedge.next_hedge_at().has_value());
}

TEST(HedgeState, NoHedgeWithoutTimeForAnAttemptBeforeTheDeadline) {
  Fixture f;
  keel::CallOptions call = f.call();
  call.deadline = keel::Deadline::at(f.clock.now() + milliseconds(100));
  keel::RetryState retry(f.policy, call);
  HedgeState hedge(&f.hedge, f.policy, call, retry);
  const AttemptStart start = retry.start_attempt();
  EXPECT_EQ(start.attempt.timeout, milliseconds(100));
  (void)hedge.begin_round(start.attempt, milliseconds(60));
  f.clock.advance(milliseconds(60));
  const keel::HedgeStart h = hedge.start_hedge();
  ASSERT_TRUE(h.proceed);
  EXPECT_EQ(h.attempt.timeout, milliseconds(40));  // what the deadline leaves
  hedge.cancel(h.index);
  HedgeState late(&f.hedge, f.policy, call, retry);
  (void)late.begin_round(start.attempt, milliseconds(40));
  f.clock.advance(milliseconds(40));  // the deadline
  EXPECT_EQ(late.start_hedge().refusal, HedgeRefusal::kDeadline);
}

TEST(HedgeState, CancellingTheOperationReleasesEveryAttempt) {
  Fixture f;
  keel::CircuitBreaker breaker({.clock = &f.clock});
  keel::CallOptions call = f.call();
  call.breaker = &breaker;
  keel::RetryState retry(f.policy, call);
  HedgeState hedge(&f.hedge, f.policy, call, retry);
  (void)hedge.begin_round(retry.start_attempt().attempt, milliseconds(100));
  f.clock.advance(milliseconds(100));
  ASSERT_TRUE(hedge.start_hedge().proceed);
  hedge.cancel_operation();
  EXPECT_EQ(retry.stop_reason(), StopReason::kCancelled);
  EXPECT_EQ(hedge.in_flight(), 0);
  EXPECT_EQ(breaker.snapshot().calls, 0);
}

}  // namespace
