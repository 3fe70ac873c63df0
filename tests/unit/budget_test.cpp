// Retry budgets: the published sequences replayed exactly in virtual time, expiry of the ratio
// window, and atomic reservation under real threads.
#include "keel/core/budget.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "keel/core/clock.hpp"

namespace {

using namespace std::chrono_literals;
using keel::Outcome;

Outcome timed_out() {
  Outcome o = Outcome::transient();
  o.timed_out = true;
  return o;
}

// ---------------------------------------------------------------------------------------------
// gRPC retry throttling

TEST(ThrottleBudget, ReplaysTheGrpcSequence) {
  // max_tokens 4, token_ratio 1.6, starting full. Each step: record the outcome, then ask.
  keel::ThrottleBudget b({.max_tokens = 4, .token_ratio = 1.6});
  struct Step {
    bool success;
    double tokens;
    bool allowed;
  };
  const Step steps[] = {
      {false, 3.0, true},  {true, 4.0, true},   {false, 3.0, true},  {false, 2.0, false},
      {false, 1.0, false}, {false, 0.0, false}, {false, 0.0, false}, {true, 1.6, false},
      {true, 3.2, true},   {false, 2.2, true},  {false, 1.2, false},
  };
  int i = 0;
  for (const Step& s : steps) {
    b.record(s.success ? Outcome::success() : Outcome::transient(), {});
    EXPECT_DOUBLE_EQ(b.tokens(), s.tokens) << "step " << i;
    EXPECT_EQ(b.retry_allowed(), s.allowed) << "step " << i;
    EXPECT_EQ(static_cast<bool>(b.try_acquire_retry(Outcome::transient())), s.allowed)
        << "step " << i;
    ++i;
  }
}

TEST(ThrottleBudget, PermanentFailuresDoNotCountThrottlingDoes) {
  keel::ThrottleBudget b({.max_tokens = 4, .token_ratio = 1});
  b.record(Outcome::permanent(), {});
  EXPECT_DOUBLE_EQ(b.tokens(), 4.0);
  b.record(Outcome::throttled(), {});
  EXPECT_DOUBLE_EQ(b.tokens(), 3.0);
  b.record(Outcome::ambiguous(), {});
  EXPECT_DOUBLE_EQ(b.tokens(), 2.0);
  EXPECT_FALSE(b.retry_allowed());
}

TEST(ThrottleBudget, RejectsInvalidOptionsNamingTheField) {
  try {
    keel::ThrottleBudget b({.max_tokens = 0});
    FAIL() << "accepted max_tokens 0";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("max_tokens"), std::string::npos) << e.what();
  }
  EXPECT_THROW(keel::ThrottleBudget({.max_tokens = 2000}), std::invalid_argument);
  EXPECT_THROW(keel::ThrottleBudget({.token_ratio = 0}), std::invalid_argument);
}

TEST(ThrottleBudget, ConcurrentUpdatesStayClamped) {
  keel::ThrottleBudget b({.max_tokens = 10, .token_ratio = 0.5});
  std::vector<std::thread> threads;
  threads.reserve(8);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20000; ++i) {
        b.record((i + t) % 3 == 0 ? Outcome::transient() : Outcome::success(), {});
        const double tokens = b.tokens();
        EXPECT_GE(tokens, 0.0);
        EXPECT_LE(tokens, 10.0);
      }
    });
  }
  for (auto& th : threads) th.join();
  // Only successes from here: 20 successes of 0.5 fill it from anywhere.
  for (int i = 0; i < 20; ++i) b.record(Outcome::success(), {});
  EXPECT_DOUBLE_EQ(b.tokens(), 10.0);
}

// ---------------------------------------------------------------------------------------------
// AWS token bucket

TEST(TokenBucketBudget, StartsAt500AndARetryCosts5) {
  keel::TokenBucketBudget b;
  EXPECT_EQ(b.tokens(), 500);
  int granted = 0;
  while (b.try_acquire_retry(Outcome::transient())) ++granted;
  EXPECT_EQ(granted, 100);
  EXPECT_EQ(b.tokens(), 0);
}

TEST(TokenBucketBudget, ARetryAfterATimeoutCosts10) {
  keel::TokenBucketBudget b;
  const auto p = b.try_acquire_retry(timed_out());
  ASSERT_TRUE(p);
  EXPECT_EQ(p.cost, 10);
  EXPECT_EQ(b.tokens(), 490);
  int granted = 0;
  while (b.try_acquire_retry(timed_out())) ++granted;
  EXPECT_EQ(granted, 49);
}

TEST(TokenBucketBudget, SuccessRefundsOneOrTheRetrysCostCappedAtCapacity) {
  keel::TokenBucketBudget b;
  const auto a = b.try_acquire_retry(Outcome::transient());  // 495
  const auto t = b.try_acquire_retry(timed_out());           // 485
  EXPECT_EQ(b.tokens(), 485);
  b.record(Outcome::success(), {});  // a first attempt succeeded: +1
  EXPECT_EQ(b.tokens(), 486);
  b.record(Outcome::success(), t);  // a retry after a timeout succeeded: +10
  EXPECT_EQ(b.tokens(), 496);
  b.record(Outcome::transient(), a);  // a failed retry refunds nothing
  EXPECT_EQ(b.tokens(), 496);
  b.record(Outcome::success(), a);  // +5, capped at 500
  EXPECT_EQ(b.tokens(), 500);
  b.record(Outcome::success(), {});
  EXPECT_EQ(b.tokens(), 500);
}

TEST(TokenBucketBudget, EmptyMeansNoRetry) {
  keel::TokenBucketBudget b({.capacity = 12});
  EXPECT_TRUE(b.try_acquire_retry(Outcome::transient()));  // 7
  EXPECT_TRUE(b.try_acquire_retry(Outcome::transient()));  // 2
  EXPECT_FALSE(b.try_acquire_retry(Outcome::transient()));
  EXPECT_EQ(b.tokens(), 2);
  EXPECT_DOUBLE_EQ(b.available(), 0.0);
}

TEST(TokenBucketBudget, RejectsInvalidOptionsNamingTheField) {
  try {
    keel::TokenBucketBudget b({.capacity = 0});
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("capacity"), std::string::npos) << e.what();
  }
  EXPECT_THROW(keel::TokenBucketBudget({.retry_cost = -1}), std::invalid_argument);
  EXPECT_THROW(keel::TokenBucketBudget({.timeout_retry_cost = -1}), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Ratio budget (SRE book / Finagle)

TEST(RatioBudget, TenPercentOfTenThousandFirstAttempts) {
  keel::ManualClock clock;
  keel::RatioBudget b({.ratio = 0.1, .reserve_per_second = 0, .clock = &clock});
  EXPECT_FALSE(b.try_withdraw());  // nothing deposited, no reserve
  for (int i = 0; i < 10000; ++i) b.deposit();
  int granted = 0;
  while (b.try_withdraw()) ++granted;
  EXPECT_EQ(granted, 1000);
}

TEST(RatioBudget, AReserveOfTenPerSecondOverOneSecondAddsTen) {
  keel::ManualClock clock;
  keel::RatioBudget b({.ratio = 0.1, .reserve_per_second = 10, .window = 1s, .clock = &clock});
  for (int i = 0; i < 10000; ++i) b.deposit();
  int granted = 0;
  while (b.try_withdraw()) ++granted;
  EXPECT_EQ(granted, 1010);
}

TEST(RatioBudget, TheReserveAloneLetsALowTrafficCallerRetry) {
  keel::ManualClock clock;
  keel::RatioBudget b({.ratio = 0.1, .reserve_per_second = 10, .clock = &clock});  // 10 s
  int granted = 0;
  while (b.try_withdraw()) ++granted;
  EXPECT_EQ(granted, 100);  // 10/s over the 10 s window
}

TEST(RatioBudget, DepositsExpireAfterTheWindow) {
  keel::ManualClock clock;
  keel::RatioBudget b({.ratio = 0.5, .reserve_per_second = 0, .clock = &clock});
  for (int i = 0; i < 100; ++i) b.deposit();  // 50 retries
  EXPECT_DOUBLE_EQ(b.available(), 50.0);
  clock.advance(9s);
  EXPECT_DOUBLE_EQ(b.available(), 50.0);
  clock.advance(1s);  // the deposits' step has left the 10 s window
  EXPECT_DOUBLE_EQ(b.available(), 0.0);
  EXPECT_FALSE(b.try_withdraw());
}

TEST(RatioBudget, TheWindowSlidesBucketByBucket) {
  keel::ManualClock clock;
  keel::RatioBudget b({.ratio = 1, .reserve_per_second = 0, .window = 10s, .clock = &clock});
  for (int s = 0; s < 10; ++s) {  // one deposit per second for 10 s
    b.deposit();
    clock.advance(1s);
  }
  // Now at 10 s: the deposit made at 0 s has left; 9 remain.
  EXPECT_DOUBLE_EQ(b.available(), 9.0);
  clock.advance(4s);
  EXPECT_DOUBLE_EQ(b.available(), 5.0);
  int granted = 0;
  while (b.try_withdraw()) ++granted;
  EXPECT_EQ(granted, 5);
}

TEST(RatioBudget, WithdrawalsExpireToo) {
  keel::ManualClock clock;
  keel::RatioBudget b({.ratio = 0, .reserve_per_second = 1, .window = 10s, .clock = &clock});
  int granted = 0;
  while (b.try_withdraw()) ++granted;
  EXPECT_EQ(granted, 10);
  clock.advance(5s);
  EXPECT_FALSE(b.try_withdraw());
  clock.advance(5s);  // the withdrawals left the window: the reserve is whole again
  granted = 0;
  while (b.try_withdraw()) ++granted;
  EXPECT_EQ(granted, 10);
}

TEST(RatioBudget, TheEngineInterfaceDepositsOnFirstAttempts) {
  keel::ManualClock clock;
  keel::RatioBudget b({.ratio = 0.1, .reserve_per_second = 0, .clock = &clock});
  keel::RetryBudget& budget = b;
  for (int i = 0; i < 20; ++i) budget.on_first_attempt();
  EXPECT_TRUE(budget.try_acquire_retry(Outcome::transient()));
  EXPECT_TRUE(budget.try_acquire_retry(Outcome::transient()));
  EXPECT_FALSE(budget.try_acquire_retry(Outcome::transient()));
  EXPECT_EQ(budget.model(), "ratio");
}

// On the default (steady) clock the budget's 1 s steps are read from the coarse clock: deposits
// and withdrawals still meet in the same window.
TEST(RatioBudget, OnTheDefaultClockDepositsAndWithdrawalsMeet) {
  keel::RatioBudget b({.ratio = 0.1, .reserve_per_second = 0});
  for (int i = 0; i < 30; ++i) b.on_first_attempt();
  EXPECT_EQ(b.available(), 3.0);
  EXPECT_TRUE(b.try_acquire_retry(Outcome::transient()));
  EXPECT_TRUE(b.try_acquire_retry(Outcome::transient()));
  EXPECT_TRUE(b.try_acquire_retry(Outcome::transient()));
  EXPECT_FALSE(b.try_acquire_retry(Outcome::transient()));
  EXPECT_EQ(b.available(), 0.0);
}

TEST(RatioBudget, RejectsInvalidOptionsNamingTheField) {
  try {
    keel::RatioBudget b({.ratio = -0.1});
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("ratio"), std::string::npos) << e.what();
  }
  EXPECT_THROW(keel::RatioBudget({.reserve_per_second = -1}), std::invalid_argument);
  EXPECT_THROW(keel::RatioBudget({.window = 0s}), std::invalid_argument);
  EXPECT_THROW(keel::RatioBudget({.buckets = 0}), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Atomic reservation: the last retry goes to exactly one of the racing threads.

template <class Make>
void race_for_the_last_retry(Make make) {
  for (int round = 0; round < 300; ++round) {
    auto budget = make();  // exactly one retry available
    std::atomic<int> ready{0};
    std::atomic<int> granted{0};
    auto contender = [&] {
      ready.fetch_add(1);
      while (ready.load() < 2) {
      }
      if (budget->try_acquire_retry(Outcome::transient())) granted.fetch_add(1);
    };
    std::thread a(contender);
    std::thread b(contender);
    a.join();
    b.join();
    ASSERT_EQ(granted.load(), 1) << "round " << round;
  }
}

template <class Budget>
void many_threads_spend_exactly_the_balance(Budget& budget, int expected) {
  std::atomic<int> granted{0};
  std::vector<std::thread> threads;
  threads.reserve(8);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        if (budget.try_acquire_retry(Outcome::transient())) granted.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(granted.load(), expected);
}

TEST(BudgetConcurrency, TwoThreadsNeverBothTakeTheLastTokenBucketRetry) {
  race_for_the_last_retry([] {
    auto b = std::make_unique<keel::TokenBucketBudget>(
        keel::TokenBucketBudgetOptions{.capacity = 9});  // one retry of 5
    return b;
  });
}

TEST(BudgetConcurrency, TwoThreadsNeverBothTakeTheLastRatioRetry) {
  keel::ManualClock clock;
  race_for_the_last_retry([&] {
    auto b = std::make_unique<keel::RatioBudget>(
        keel::RatioBudgetOptions{.ratio = 0.1, .reserve_per_second = 0, .clock = &clock});
    for (int i = 0; i < 10; ++i) b->deposit();
    return b;
  });
}

TEST(BudgetConcurrency, ManyThreadsSpendExactlyTheTokenBucket) {
  keel::TokenBucketBudget b;
  many_threads_spend_exactly_the_balance(b, 100);
}

TEST(BudgetConcurrency, ManyThreadsSpendExactlyTheRatioBalanceWhileDepositing) {
  keel::ManualClock clock;
  keel::RatioBudget b({.ratio = 0.1, .reserve_per_second = 0, .clock = &clock});
  std::atomic<bool> go{false};
  std::vector<std::thread> depositors;
  depositors.reserve(8);
  for (int t = 0; t < 2; ++t) {
    depositors.emplace_back([&] {
      while (!go.load()) {
      }
      for (int i = 0; i < 5000; ++i) b.deposit();
    });
  }
  std::atomic<int> granted{0};
  std::vector<std::thread> spenders;
  spenders.reserve(8);
  for (int t = 0; t < 2; ++t) {
    spenders.emplace_back([&] {
      while (!go.load()) {
      }
      for (int i = 0; i < 5000; ++i) {
        if (b.try_withdraw()) granted.fetch_add(1);
      }
    });
  }
  go.store(true);
  for (auto& th : depositors) th.join();
  for (auto& th : spenders) th.join();
  // Never more than the deposits allow, and what is left adds up.
  EXPECT_LE(granted.load(), 1000);
  int rest = 0;
  while (b.try_withdraw()) ++rest;
  EXPECT_EQ(granted.load() + rest, 1000);
}

}  // namespace
