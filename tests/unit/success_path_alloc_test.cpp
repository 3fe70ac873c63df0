// keel::retry's success path allocates nothing: with a circuit breaker (count and time windows)
// and a retry budget, on the steady clock as users call it. Global operator new is counted by
// bench/alloc_counter.cpp, linked into this test alone so no other test pays for the counter.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>

#include "../../bench/alloc_counter.hpp"
#include "keel/core/breaker.hpp"
#include "keel/core/budget.hpp"
#include "keel/core/retry.hpp"

namespace keel {
namespace {

std::atomic<int> g_calls{0};

Outcome call_dependency() {
  g_calls.fetch_add(1, std::memory_order_relaxed);
  return Outcome::success();
}

// Allocations made by `n` successful keel::retry calls, after one warm-up call (thread-local
// generators and the clock are set up on first use).
std::uint64_t allocations_of_successes(const RetryPolicy& policy, const CallOptions& call, int n) {
  (void)retry(policy, call_dependency, call);
  const std::uint64_t before = bench::allocations();
  for (int i = 0; i < n; ++i) {
    const auto result = retry(policy, call_dependency, call);
    if (!result.ok()) ADD_FAILURE() << "call " << i << " did not succeed";
  }
  return bench::allocations() - before;
}

TEST(SuccessPathAllocations, RetryAloneAllocatesNothing) {
  const RetryPolicy policy({.max_attempts = 3});
  CallOptions call;
  call.safe_to_repeat = true;
  EXPECT_EQ(allocations_of_successes(policy, call, 1000), 0u);
}

TEST(SuccessPathAllocations, RetryWithBreakerAndBudgetAllocatesNothing) {
  const RetryPolicy policy({.max_attempts = 3});
  for (const BreakerWindow window : {BreakerWindow::kTime, BreakerWindow::kCount}) {
    BreakerOptions options;
    options.window = window;
    CircuitBreaker breaker(options);  // constructed before counting: its window is allocated here
    TokenBucketBudget budget;
    CallOptions call;
    call.safe_to_repeat = true;
    call.breaker = &breaker;
    call.budget = &budget;
    EXPECT_EQ(allocations_of_successes(policy, call, 1000), 0u)
        << "window " << (window == BreakerWindow::kTime ? "time" : "count");
    EXPECT_EQ(breaker.state(), BreakerState::kClosed);
  }
}

TEST(SuccessPathAllocations, TheCounterSeesAnAllocation) {
  const std::uint64_t before = bench::allocations();
  int* volatile p = new int(7);  // volatile: the allocation cannot be elided
  EXPECT_EQ(bench::allocations() - before, 1u);
  delete p;
}

}  // namespace
}  // namespace keel
