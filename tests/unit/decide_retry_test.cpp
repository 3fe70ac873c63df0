// keel::decide_retry, the one home of the retry rules (RetryState::next and the job queue both
// apply it), and what the brakes see when nothing is sent: a default Outcome is not success, a
// breaker refusal is kNotAttempted with the breaker's retry_in, a budget grant whose retry never
// ran is given back, a cancelled attempt is released uncounted. All in virtual time.
#include <gtest/gtest.h>

#include <vector>

#include "keel/core/retry.hpp"

using namespace std::chrono_literals;
using keel::decide_retry;
using keel::Duration;
using keel::Outcome;
using keel::OutcomeKind;
using keel::RetryLimits;
using keel::RetryPolicy;
using keel::RetryProgress;
using keel::StopReason;

namespace {

RetryPolicy policy(int attempts = 5) {
  return RetryPolicy({.max_attempts = attempts,
                      .backoff = {.base = 100ms, .cap = 10s},
                      .retry_after_cap = 30s,
                      .min_attempt_time = 1ms});
}

RetryLimits limits(int max_attempts = 5, bool safe = true, Duration left = keel::kInfinite) {
  return {.max_attempts = max_attempts, .safe_to_repeat = safe, .time_left = left};
}

TEST(Outcome, DefaultIsNotAttemptedNeverSuccess) {
  const Outcome o;
  EXPECT_EQ(o.kind, OutcomeKind::kNotAttempted);
  EXPECT_FALSE(o.attempted());
  EXPECT_FALSE(keel::is_dependency_failure(o.kind));
  EXPECT_EQ(keel::to_string(o.kind), "not attempted");
  EXPECT_EQ(Outcome::success().kind, OutcomeKind::kSuccess);
  EXPECT_EQ(keel::describe(Outcome::not_attempted(4200ms)), "not attempted (retry in 4.2s)");
}

TEST(DecideRetry, SuccessPermanentAndUnsafeAmbiguousStop) {
  keel::Rng rng(1);
  const RetryPolicy p = policy();
  EXPECT_EQ(decide_retry(p, limits(), {}, Outcome::success(), rng).reason, StopReason::kSuccess);
  EXPECT_EQ(decide_retry(p, limits(), {}, Outcome::permanent(), rng).reason,
            StopReason::kPermanent);
  EXPECT_EQ(decide_retry(p, limits(5, false), {}, Outcome::ambiguous(), rng).reason,
            StopReason::kNotSafeToRetry);
  EXPECT_TRUE(decide_retry(p, limits(5, true), {}, Outcome::ambiguous(), rng).retry);
}

TEST(DecideRetry, AttemptLimitAndRetryLimitStop) {
  keel::Rng rng(1);
  const RetryPolicy p = policy();
  EXPECT_EQ(decide_retry(p, limits(3), {.attempts = 3}, Outcome::transient(), rng).reason,
            StopReason::kAttemptsExhausted);
  // A 500 carries retry_limit 1: one retry, then the limit stops it whatever max_attempts says.
  const Outcome five_hundred =
      keel::classify_http_status(500, {keel::Method::kPost, /*has_idempotency_key=*/true});
  const auto first = decide_retry(p, limits(25), {.attempts = 1}, five_hundred, rng);
  ASSERT_TRUE(first.retry);
  EXPECT_EQ(first.progress.limited_retries, 1);
  EXPECT_EQ(decide_retry(p, limits(25), first.progress, five_hundred, rng).reason,
            StopReason::kAttemptsExhausted);
}

TEST(DecideRetry, RetryAfterReplacesTheBackoffAndIsCappedByRetryAfterCap) {
  keel::Rng rng(1);
  const RetryPolicy p = policy();
  const auto small = decide_retry(p, limits(), {.attempts = 4}, Outcome::throttled(20ms), rng);
  ASSERT_TRUE(small.retry);
  EXPECT_EQ(small.delay, Duration(20ms));  // not max(backoff, 20ms)
  EXPECT_TRUE(small.server_delay_used);
  const auto big = decide_retry(p, limits(), {.attempts = 1}, Outcome::throttled(5min), rng);
  EXPECT_EQ(big.delay, Duration(30s));  // retry_after_cap, not the backoff cap
}

TEST(DecideRetry, BackoffDrawsAreFullJitterUnderTheCeiling) {
  const RetryPolicy p = policy(50);
  for (std::uint64_t seed = 1; seed <= 50; ++seed) {
    keel::Rng rng(seed);
    for (int attempts = 1; attempts <= 10; ++attempts) {
      const auto v = decide_retry(p, limits(50), {.attempts = attempts}, Outcome::transient(), rng);
      ASSERT_TRUE(v.retry);
      const Duration ceiling = std::min<Duration>(10s, Duration(100ms) * (1 << (attempts - 1)));
      EXPECT_GE(v.delay, Duration::zero());
      EXPECT_LT(v.delay, ceiling);
      EXPECT_EQ(v.progress.previous_delay, v.delay);
    }
  }
}

TEST(DecideRetry, SameDelaysAsRetryStateForEverySeed) {
  // The engine's in-memory loop and a durable driver that stores the progress agree exactly.
  const RetryPolicy p = policy(6);
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    keel::ManualClock clock;
    keel::Rng engine_rng(seed);
    keel::CallOptions call;
    call.clock = &clock;
    call.rng = &engine_rng;
    call.safe_to_repeat = true;
    keel::RetryState state(p, call);
    keel::Rng durable_rng(seed);
    RetryProgress progress;
    for (int n = 1;; ++n) {
      ASSERT_TRUE(state.start_attempt().proceed);
      const keel::Decision d = state.next(Outcome::transient());
      progress.attempts = n;
      const auto v = decide_retry(p, limits(6), progress, Outcome::transient(), durable_rng);
      ASSERT_EQ(d.retry, v.retry);
      if (!d.retry) {
        EXPECT_EQ(d.reason, v.reason);
        break;
      }
      EXPECT_EQ(d.delay, v.delay) << "seed " << seed << " attempt " << n;
      progress = v.progress;
      clock.advance(d.delay);
    }
  }
}

TEST(DecideRetry, NotAttemptedIsADeferralThatCountsNoAttempt) {
  keel::Rng rng(1);
  const RetryPolicy p = policy(3);
  // Even at the attempt limit: nothing was sent, so nothing was spent.
  const auto v = decide_retry(p, limits(3), {.attempts = 3}, Outcome::not_attempted(4200ms), rng);
  ASSERT_TRUE(v.retry);
  EXPECT_FALSE(v.counts_attempt);
  EXPECT_EQ(v.delay, Duration(4200ms));
  EXPECT_EQ(v.progress.previous_delay, Duration::zero());  // the backoff exponent is untouched
  // Without the brake's estimate: a backoff draw at the current exponent.
  const auto guess = decide_retry(p, limits(3), {.attempts = 1}, Outcome::not_attempted(), rng);
  ASSERT_TRUE(guess.retry);
  EXPECT_LT(guess.delay, Duration(100ms));
  // The deadline (a queue's max age) still applies.
  EXPECT_EQ(
      decide_retry(p, limits(3, true, 1s), {.attempts = 1}, Outcome::not_attempted(5s), rng).reason,
      StopReason::kDeadline);
}

TEST(DecideRetry, AWaitThatDoesNotFitTheDeadlineStops) {
  keel::Rng rng(1);
  const RetryPolicy p = policy();
  EXPECT_EQ(decide_retry(p, limits(5, true, 1s), {}, Outcome::throttled(2s), rng).reason,
            StopReason::kDeadline);
  EXPECT_EQ(
      decide_retry(p, limits(5, true, Duration::zero()), {}, Outcome::transient(), rng).reason,
      StopReason::kDeadline);
}

TEST(Breaker, RetryInFollowsTheBreakAndReleaseFreesATrial) {
  keel::ManualClock clock;
  keel::BreakerOptions o;
  o.window = keel::BreakerWindow::kCount;
  o.window_calls = 4;
  o.minimum_calls = 4;
  o.break_duration = 5s;
  o.clock = &clock;
  keel::CircuitBreaker breaker(o);
  EXPECT_EQ(breaker.retry_in(), Duration::zero());
  for (int i = 0; i < 4; ++i) breaker.record(breaker.try_acquire(), Outcome::transient());
  ASSERT_EQ(breaker.state(), keel::BreakerState::kOpen);
  EXPECT_EQ(breaker.retry_in(), Duration(5s));
  clock.advance(3s);
  EXPECT_EQ(breaker.retry_in(), Duration(2s));
  clock.advance(2s);
  const keel::BreakerPermit trial = breaker.try_acquire();
  ASSERT_TRUE(trial.trial);
  EXPECT_FALSE(breaker.try_acquire().allowed);  // the one trial is out
  EXPECT_GT(breaker.retry_in(), Duration::zero());
  breaker.release(trial);  // cancelled: the trial slot is free again, nothing counted
  EXPECT_EQ(breaker.retry_in(), Duration::zero());
  const keel::BreakerPermit again = breaker.try_acquire();
  ASSERT_TRUE(again.trial);
  breaker.record(again, Outcome());  // kNotAttempted: a release, not a success
  EXPECT_EQ(breaker.state(), keel::BreakerState::kHalfOpen);
  breaker.record(breaker.try_acquire(), Outcome::success());
  EXPECT_EQ(breaker.state(), keel::BreakerState::kClosed);
}

TEST(Budget, CancelGivesBackExactlyTheGrant) {
  keel::TokenBucketBudget bucket({.capacity = 10, .retry_cost = 5});
  const keel::RetryPermit p = bucket.try_acquire_retry(Outcome::transient());
  ASSERT_TRUE(p.granted);
  EXPECT_EQ(bucket.available(), 1.0);
  bucket.cancel(p);
  EXPECT_EQ(bucket.available(), 2.0);
  bucket.cancel(keel::RetryPermit{});  // not granted: ignored
  EXPECT_EQ(bucket.available(), 2.0);

  keel::ManualClock clock;
  keel::RatioBudget ratio({.ratio = 0.0, .reserve_per_second = 1.0, .window = 2s, .clock = &clock});
  ASSERT_EQ(ratio.available(), 2.0);
  const keel::RetryPermit r = ratio.try_acquire_retry(Outcome::transient());
  ASSERT_TRUE(r.granted);
  EXPECT_EQ(ratio.available(), 1.0);
  ratio.cancel(r);
  EXPECT_EQ(ratio.available(), 2.0);
}

TEST(RetryState, BreakerRefusalBeforeAnyAttemptIsNotAttemptedWithRetryIn) {
  keel::ManualClock clock;
  keel::BreakerOptions o;
  o.window = keel::BreakerWindow::kCount;
  o.window_calls = 1;
  o.minimum_calls = 1;
  o.break_duration = 7s;
  o.clock = &clock;
  keel::CircuitBreaker breaker(o);
  breaker.record(breaker.try_acquire(), Outcome::transient());
  const RetryPolicy p = policy();
  keel::CallOptions call;
  call.clock = &clock;
  call.breaker = &breaker;
  const auto r = keel::retry(
      p, [] { return Outcome::success(); }, call);
  EXPECT_EQ(r.reason, StopReason::kCircuitOpen);
  EXPECT_EQ(r.attempts, 0);
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kNotAttempted);
  EXPECT_EQ(r.outcome.server_delay, Duration(7s));
}

TEST(RetryState, BudgetGrantIsRefundedWhenTheBreakerRefusesTheRetry) {
  keel::ManualClock clock;
  keel::BreakerOptions o;
  o.window = keel::BreakerWindow::kCount;
  o.window_calls = 1;
  o.minimum_calls = 1;
  o.clock = &clock;
  keel::CircuitBreaker breaker(o);
  keel::TokenBucketBudget budget({.capacity = 100, .retry_cost = 5});
  keel::Rng rng(3);
  keel::CallOptions call;
  call.clock = &clock;
  call.rng = &rng;
  call.safe_to_repeat = true;
  call.breaker = &breaker;
  call.budget = &budget;
  const RetryPolicy p = policy();
  // The first attempt fails and trips the breaker; the budget grants the retry, the breaker
  // then refuses it: the grant comes back.
  const auto r = keel::retry(
      p, [] { return Outcome::transient(); }, call);
  EXPECT_EQ(r.reason, StopReason::kCircuitOpen);
  EXPECT_EQ(r.attempts, 1);
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kTransient);  // the last real attempt's
  EXPECT_EQ(budget.available(), 20.0);
}

TEST(RetryState, PriorAttemptsMakeTheFirstAttemptARetryForTheBudget) {
  keel::ManualClock clock;
  keel::TokenBucketBudget budget({.capacity = 5, .retry_cost = 5});
  keel::CallOptions call;
  call.clock = &clock;
  call.budget = &budget;
  call.prior_attempts = 3;
  const RetryPolicy p = policy(1);
  const auto ok = keel::retry(
      p, [] { return Outcome::transient(); }, call);
  EXPECT_EQ(ok.attempts, 1);  // granted: the budget is now empty
  EXPECT_EQ(budget.available(), 0.0);
  const auto refused = keel::retry(
      p, [] { return Outcome::success(); }, call);
  EXPECT_EQ(refused.reason, StopReason::kBudgetExhausted);
  EXPECT_EQ(refused.attempts, 0);
  EXPECT_FALSE(refused.outcome.attempted());
}

TEST(RetryState, CancelStopsReleasesTheBreakerAndRefundsAnUnusedGrant) {
  keel::ManualClock clock;
  keel::CircuitBreaker breaker({.window = keel::BreakerWindow::kCount, .clock = &clock});
  keel::TokenBucketBudget budget({.capacity = 100, .retry_cost = 5});
  std::vector<StopReason> gave_up;
  RetryPolicy p({.max_attempts = 3,
                 .on_give_up = [&](const keel::GiveUpEvent& e) { gave_up.push_back(e.reason); }});
  keel::CallOptions call;
  call.clock = &clock;
  call.safe_to_repeat = true;
  call.breaker = &breaker;
  call.budget = &budget;
  keel::RetryState state(p, call);
  ASSERT_TRUE(state.start_attempt().proceed);
  state.cancel();  // in flight: released, not counted as a call
  EXPECT_EQ(state.stop_reason(), StopReason::kCancelled);
  EXPECT_EQ(breaker.snapshot().calls, 0);
  state.cancel();  // no-op once stopped
  EXPECT_EQ(gave_up, std::vector<StopReason>{StopReason::kCancelled});

  keel::RetryState waiting(p, call);
  ASSERT_TRUE(waiting.start_attempt().proceed);
  ASSERT_TRUE(waiting.next(Outcome::transient()).retry);  // the budget granted the retry
  EXPECT_EQ(budget.available(), 19.0);
  waiting.cancel();  // during the wait: the grant comes back
  EXPECT_EQ(budget.available(), 20.0);
}

}  // namespace
