// The retry engine with its brakes: one retrying layer (thread and explicit context), the circuit
// breaker before each attempt, the retry budget before each retry, and every stop reason reaching
// the give-up hook.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "keel/core/breaker.hpp"
#include "keel/core/budget.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/random.hpp"
#include "keel/core/retry.hpp"

namespace {

using namespace std::chrono_literals;
using keel::Outcome;
using keel::StopReason;

struct Harness {
  keel::ManualClock clock;
  keel::Rng rng{42};
  keel::CallOptions call() {
    keel::CallOptions c;
    c.clock = &clock;
    c.rng = &rng;
    c.safe_to_repeat = true;
    return c;
  }
};

// ---------------------------------------------------------------------------------------------
// One retrying layer

TEST(RetryLayer, ThreeNestedLayersReachTheBottomThreeTimesNotTwentySeven) {
  Harness h;
  const keel::RetryPolicy policy({.max_attempts = 3});
  int bottom = 0;
  int middle_attempts = 0;
  auto r = keel::retry(
      policy,
      [&] {
        auto mid = keel::retry(
            policy,
            [&] {
              ++middle_attempts;
              auto inner = keel::retry(
                  policy,
                  [&] {
                    ++bottom;
                    return Outcome::transient();
                  },
                  h.call());
              EXPECT_EQ(inner.attempts, 1);
              return inner.outcome;
            },
            h.call());
        EXPECT_EQ(mid.attempts, 1);
        EXPECT_EQ(mid.reason, StopReason::kAttemptsExhausted);
        return mid.outcome;
      },
      h.call());
  EXPECT_EQ(bottom, 3);
  EXPECT_EQ(middle_attempts, 3);
  EXPECT_EQ(r.attempts, 3);
  EXPECT_EQ(r.reason, StopReason::kAttemptsExhausted);
  EXPECT_EQ(keel::retry_depth(), 0);  // every scope closed
}

TEST(RetryLayer, NestedRetriesCanBeAllowedExplicitly) {
  Harness h;
  const keel::RetryPolicy policy({.max_attempts = 3});
  keel::CallOptions inner_call = h.call();
  inner_call.nested = keel::NestedRetries::kRetry;
  int bottom = 0;
  auto layer = [&](auto&& below) {
    return [&, below] { return keel::retry(policy, below, inner_call).outcome; };
  };
  auto leaf = [&] {
    ++bottom;
    return Outcome::transient();
  };
  auto r = keel::retry(policy, layer(layer(leaf)), h.call());
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(bottom, 27);
}

TEST(RetryLayer, AnOuterLoopRetriesNormallyAndTheDepthIsTracked) {
  Harness h;
  const keel::RetryPolicy policy({.max_attempts = 4});
  std::vector<int> depths;
  auto r = keel::retry(
      policy,
      [&] {
        depths.push_back(keel::retry_depth());
        return Outcome::transient();
      },
      h.call());
  EXPECT_EQ(r.attempts, 4);
  EXPECT_EQ(depths, (std::vector<int>{1, 1, 1, 1}));
  keel::RetryState st(policy, h.call());
  EXPECT_FALSE(st.nested());
  EXPECT_EQ(st.max_attempts(), 4);
}

TEST(RetryLayer, AStateCreatedInsideAScopeIsNested) {
  Harness h;
  const keel::RetryPolicy policy({.max_attempts = 5});
  const keel::RetryScope scope;
  keel::RetryState st(policy, h.call());
  EXPECT_TRUE(st.nested());
  EXPECT_EQ(st.max_attempts(), 1);
  ASSERT_TRUE(st.start_attempt().proceed);
  const auto d = st.next(Outcome::transient());
  EXPECT_FALSE(d.retry);
  EXPECT_EQ(d.reason, StopReason::kAttemptsExhausted);
}

TEST(RetryLayer, AnExplicitContextCarriesTheRuleAcrossThreads) {
  Harness h;
  const keel::RetryPolicy policy({.max_attempts = 3});
  keel::RetryContext context;
  keel::CallOptions call = h.call();
  call.context = &context;
  std::atomic<int> bottom{0};
  auto r = keel::retry(
      policy,
      [&] {
        // The inner operation runs on another thread, as an async continuation would.
        Outcome inner_outcome;
        int inner_attempts = 0;
        std::thread worker([&] {
          EXPECT_EQ(keel::retry_depth(), 0);          // not on this thread...
          EXPECT_EQ(keel::retry_depth(&context), 1);  // ...but in this context
          auto inner = keel::retry(
              policy,
              [&] {
                bottom.fetch_add(1);
                return Outcome::transient();
              },
              call);
          inner_outcome = inner.outcome;
          inner_attempts = inner.attempts;
        });
        worker.join();
        EXPECT_EQ(inner_attempts, 1);
        return inner_outcome;
      },
      call);
  EXPECT_EQ(r.attempts, 3);
  EXPECT_EQ(bottom.load(), 3);
  EXPECT_EQ(context.depth(), 0);
}

// ---------------------------------------------------------------------------------------------
// Circuit breaker in the engine

TEST(EngineBreaker, AnOpenBreakerStopsBeforeTheAttemptRuns) {
  Harness h;
  keel::CircuitBreaker breaker({.minimum_calls = 1, .clock = &h.clock});
  const auto p = breaker.try_acquire();
  breaker.record(p, Outcome::transient());
  ASSERT_EQ(breaker.state(), keel::BreakerState::kOpen);

  std::vector<keel::GiveUpEvent> gave_up;
  const keel::RetryPolicy policy(
      {.max_attempts = 3, .on_give_up = [&](const keel::GiveUpEvent& e) { gave_up.push_back(e); }});
  keel::CallOptions call = h.call();
  call.breaker = &breaker;
  int ran = 0;
  auto r = keel::retry(
      policy,
      [&] {
        ++ran;
        return Outcome::success();
      },
      call);
  EXPECT_EQ(ran, 0);
  EXPECT_EQ(r.reason, StopReason::kCircuitOpen);
  EXPECT_EQ(r.attempts, 0);
  ASSERT_EQ(gave_up.size(), 1U);
  EXPECT_EQ(gave_up[0].reason, StopReason::kCircuitOpen);
  EXPECT_NE(keel::format_give_up(gave_up[0]).find("circuit open"), std::string::npos);
}

TEST(EngineBreaker, AttemptsAreRecordedAndTheBreakerStopsARetryLoop) {
  Harness h;
  keel::CircuitBreaker breaker({.window = keel::BreakerWindow::kCount,
                                .window_calls = 10,
                                .minimum_calls = 2,
                                .clock = &h.clock});
  const keel::RetryPolicy policy({.max_attempts = 5});
  keel::CallOptions call = h.call();
  call.breaker = &breaker;
  int ran = 0;
  auto r = keel::retry(
      policy,
      [&] {
        ++ran;
        return Outcome::transient();
      },
      call);
  // Two failures trip it (2 of 2 >= 50%); the third attempt is refused.
  EXPECT_EQ(ran, 2);
  EXPECT_EQ(r.attempts, 2);
  EXPECT_EQ(r.reason, StopReason::kCircuitOpen);
  EXPECT_EQ(r.outcome.kind, keel::OutcomeKind::kTransient);
}

TEST(EngineBreaker, SuccessesAndPermanentFailuresKeepItClosed) {
  Harness h;
  keel::CircuitBreaker breaker({.window = keel::BreakerWindow::kCount,
                                .window_calls = 10,
                                .minimum_calls = 2,
                                .clock = &h.clock});
  const keel::RetryPolicy policy({.max_attempts = 3});
  keel::CallOptions call = h.call();
  call.breaker = &breaker;
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(keel::retry(
                  policy, [] { return Outcome::permanent(); }, call)
                  .reason,
              StopReason::kPermanent);
    EXPECT_TRUE(keel::retry(
                    policy, [] { return Outcome::success(); }, call)
                    .ok());
  }
  EXPECT_EQ(breaker.state(), keel::BreakerState::kClosed);
  EXPECT_EQ(breaker.snapshot().calls, 10);
}

// ---------------------------------------------------------------------------------------------
// Retry budget in the engine

TEST(EngineBudget, ARefusedRetryStopsWithBudgetExhausted) {
  Harness h;
  keel::TokenBucketBudget budget({.capacity = 10});  // two retries of 5
  std::vector<StopReason> reasons;
  const keel::RetryPolicy policy(
      {.max_attempts = 10,
       .on_give_up = [&](const keel::GiveUpEvent& e) { reasons.push_back(e.reason); }});
  keel::CallOptions call = h.call();
  call.budget = &budget;
  int ran = 0;
  auto r = keel::retry(
      policy,
      [&] {
        ++ran;
        return Outcome::transient();
      },
      call);
  EXPECT_EQ(ran, 3);  // the first attempt and the two retries the budget could pay for
  EXPECT_EQ(r.reason, StopReason::kBudgetExhausted);
  EXPECT_EQ(reasons, (std::vector<StopReason>{StopReason::kBudgetExhausted}));
  EXPECT_EQ(budget.tokens(), 0);
}

TEST(EngineBudget, ASuccessfulRetryRefundsItsCostAndAFirstSuccessRefundsOne) {
  Harness h;
  keel::TokenBucketBudget budget({.capacity = 500});
  const keel::RetryPolicy policy({.max_attempts = 3});
  keel::CallOptions call = h.call();
  call.budget = &budget;
  // Drain a little so refunds are visible under the cap.
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(budget.try_acquire_retry(Outcome::transient()));
  ASSERT_EQ(budget.tokens(), 480);
  int n = 0;
  auto r = keel::retry(
      policy, [&] { return ++n == 1 ? Outcome::transient() : Outcome::success(); }, call);
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(budget.tokens(), 480);  // -5 for the retry, +5 when it succeeded
  EXPECT_TRUE(keel::retry(
                  policy, [] { return Outcome::success(); }, call)
                  .ok());
  EXPECT_EQ(budget.tokens(), 481);
}

TEST(EngineBudget, TheRatioBudgetLimitsRetriesAcrossOperations) {
  Harness h;
  keel::RatioBudget budget({.ratio = 0.1, .reserve_per_second = 0, .clock = &h.clock});
  const keel::RetryPolicy policy({.max_attempts = 3});
  keel::CallOptions call = h.call();
  call.budget = &budget;
  int attempts = 0;
  int exhausted = 0;
  for (int op = 0; op < 100; ++op) {
    auto r = keel::retry(
        policy, [] { return Outcome::transient(); }, call);
    attempts += r.attempts;
    if (r.reason == StopReason::kBudgetExhausted) ++exhausted;
  }
  // 100 first attempts deposit 10 retries: 110 attempts in all instead of 300.
  EXPECT_EQ(attempts, 110);
  EXPECT_GE(exhausted, 90);
}

TEST(EngineBudget, TheThrottleStopsRetriesWhenHalfTheTokensAreGone) {
  Harness h;
  keel::ThrottleBudget budget({.max_tokens = 4, .token_ratio = 1});
  const keel::RetryPolicy policy({.max_attempts = 10});
  keel::CallOptions call = h.call();
  call.budget = &budget;
  int ran = 0;
  auto r = keel::retry(
      policy,
      [&] {
        ++ran;
        return Outcome::transient();
      },
      call);
  // 4 -> 3 (retry), -> 2 (refused: not above 2).
  EXPECT_EQ(ran, 2);
  EXPECT_EQ(r.reason, StopReason::kBudgetExhausted);
}

TEST(EngineBudget, NoRetryIsChargedWhenAnotherRuleStopsFirst) {
  Harness h;
  keel::TokenBucketBudget budget;
  const keel::RetryPolicy policy({.max_attempts = 2});
  keel::CallOptions call = h.call();
  call.budget = &budget;
  auto r = keel::retry(
      policy, [] { return Outcome::transient(); }, call);
  EXPECT_EQ(r.reason, StopReason::kAttemptsExhausted);
  EXPECT_EQ(budget.tokens(), 495);  // one retry paid; none for the retry that never happened
  r = keel::retry(
      policy, [] { return Outcome::permanent(); }, call);
  EXPECT_EQ(budget.tokens(), 495);
}

TEST(EngineBrakes, EveryStopReasonReachesTheGiveUpHook) {
  Harness h;
  std::vector<StopReason> reasons;
  const keel::RetryPolicy policy(
      {.max_attempts = 2, .overall_timeout = 10s, .on_give_up = [&](const keel::GiveUpEvent& e) {
         reasons.push_back(e.reason);
       }});
  keel::CallOptions call = h.call();
  (void)keel::retry(
      policy, [] { return Outcome::permanent(); }, call);
  (void)keel::retry(
      policy, [] { return Outcome::transient(); }, call);
  keel::CallOptions unsafe = h.call();
  unsafe.safe_to_repeat = false;
  (void)keel::retry(
      policy, [] { return Outcome::ambiguous(); }, unsafe);
  (void)keel::retry(
      policy, [] { return Outcome::throttled(1h); }, call);  // cannot fit
  keel::TokenBucketBudget empty({.capacity = 1});
  keel::CallOptions budgeted = h.call();
  budgeted.budget = &empty;
  (void)keel::retry(
      policy, [] { return Outcome::transient(); }, budgeted);
  keel::CircuitBreaker open({.minimum_calls = 1, .clock = &h.clock});
  open.record(open.try_acquire(), Outcome::transient());
  keel::CallOptions guarded = h.call();
  guarded.breaker = &open;
  (void)keel::retry(
      policy, [] { return Outcome::success(); }, guarded);
  EXPECT_EQ(reasons,
            (std::vector<StopReason>{StopReason::kPermanent, StopReason::kAttemptsExhausted,
                                     StopReason::kNotSafeToRetry, StopReason::kDeadline,
                                     StopReason::kBudgetExhausted, StopReason::kCircuitOpen}));
}

TEST(EngineBrakes, ConcurrentGuardedCallsShareOneBreakerAndBudget) {
  keel::CircuitBreaker breaker({.minimum_calls = 1000000});
  keel::TokenBucketBudget budget;
  const keel::RetryPolicy policy({.max_attempts = 3, .backoff = {.base = 1ns, .cap = 1ns}});
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  threads.reserve(8);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      keel::ManualClock clock;
      keel::CallOptions call;
      call.clock = &clock;
      call.safe_to_repeat = true;
      call.breaker = &breaker;
      call.budget = &budget;
      for (int i = 0; i < 2000; ++i) {
        int n = 0;
        auto r = keel::retry(
            policy,
            [&] {
              return (++n == 1 && (i + t) % 4 == 0) ? Outcome::transient() : Outcome::success();
            },
            call);
        if (r.ok()) ok.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(ok.load(), 8000);
  EXPECT_EQ(breaker.snapshot().calls, 10000);  // 8000 first attempts + 2000 retries
  EXPECT_EQ(breaker.snapshot().failures, 2000);
  EXPECT_EQ(budget.tokens(), 500);  // every retry succeeded and refunded its cost
}

}  // namespace
