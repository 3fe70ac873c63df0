// keel's side of the peer comparison (scripts/bench.sh): the same workloads that the programs in
// bench/peers/ run, so the report can divide one by the other.
//
//   floor      a bare call of the dependency, which does one uncontended atomic increment
//   success    the call wrapped in keel (see the compositions below); it succeeds first time
//   fail_once  the call fails once (transient) and then succeeds; the delay between the two
//              attempts is computed (full jitter) but not waited: a ManualClock absorbs it, as the
//              peers' no-op timers/sleeps do
//
// Compositions, each named after the peer it is compared with:
//   Retry           keel::retry, 3 attempts                       (tenacity, cenkalti/backoff)
//   RetryBreaker    keel::retry + CircuitBreaker                  (cockatiel: retry + breaker)
//   Breaker         try_acquire, call, record; fail_once by hand  (opossum: a breaker only)
//   RetryBreakerBudget  + TokenBucketBudget                       (no peer has a budget)
// The breaker uses its defaults (30 s time window, steady clock: calls are placed in the window
// by the coarse clock, see BreakerOptions::clock) except a failure-rate threshold of 0.6:
// fail_once fails half of its attempts, which must not trip it (opossum and cockatiel are
// configured not to trip either). A benchmark whose breaker opened reports an error.
//
// BM_BreakerRecord runs on 1 and 2 threads recording successes into one shared breaker (time
// window; BM_BreakerRecordCountWindow: count window); the report divides the 2-thread
// throughput by the 1-thread one.
//
// The "dependency" is an out-of-line function so the compiler cannot fold it into the loop.
// Every benchmark reports allocs/op (global operator new is counted, see alloc_counter.hpp).
// Thread-safety: each benchmark owns its objects except BM_BreakerRecord's shared breaker.
#include <benchmark/benchmark.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>

#include "alloc_counter.hpp"
#include "keel/core/breaker.hpp"
#include "keel/core/budget.hpp"
#include "keel/core/retry.hpp"

namespace {

std::atomic<std::uint64_t> g_calls{0};

// The dependency: one uncontended atomic increment, then the outcome it was told to return.
[[gnu::noinline]] keel::Outcome call_dependency(bool fail) {
  g_calls.fetch_add(1, std::memory_order_relaxed);
  benchmark::ClobberMemory();
  return fail ? keel::Outcome::transient() : keel::Outcome::success();
}

void report_allocations(benchmark::State& state, std::uint64_t before) {
  state.counters["allocs/op"] = benchmark::Counter(
      static_cast<double>(keel::bench::allocations() - before), benchmark::Counter::kAvgIterations);
}

void BM_Floor(benchmark::State& state) {
  const auto before = keel::bench::allocations();
  for (auto _ : state) {
    benchmark::DoNotOptimize(call_dependency(false));
  }
  report_allocations(state, before);
}
BENCHMARK(BM_Floor);

// Three attempts at most, the policy a user would write for an idempotent call.
const keel::RetryPolicy& policy() {
  static const keel::RetryPolicy p({.max_attempts = 3});
  return p;
}

keel::BreakerOptions breaker_options() {
  keel::BreakerOptions options;
  options.failure_rate_threshold = 0.6;
  return options;
}

enum class Guard { kNone, kBreaker, kBreakerBudget };

struct Guards {
  explicit Guards(Guard guard) {
    if (guard != Guard::kNone) breaker = std::make_unique<keel::CircuitBreaker>(breaker_options());
    if (guard == Guard::kBreakerBudget) budget = std::make_unique<keel::TokenBucketBudget>();
  }
  void apply(keel::CallOptions& call) const {
    call.breaker = breaker.get();
    call.budget = budget.get();
  }
  // Fails the benchmark when the breaker opened: the numbers would measure refusals.
  void check(benchmark::State& state) const {
    if (breaker && breaker->state() != keel::BreakerState::kClosed) {
      state.SkipWithError("the circuit breaker opened during the run");
    }
  }
  std::unique_ptr<keel::CircuitBreaker> breaker;
  std::unique_ptr<keel::RetryBudget> budget;
};

template <Guard kGuard>
void BM_Success(benchmark::State& state) {
  const Guards guards(kGuard);
  keel::CallOptions call;
  call.safe_to_repeat = true;
  guards.apply(call);
  const auto before = keel::bench::allocations();
  for (auto _ : state) {
    auto result = keel::retry(
        policy(), [] { return call_dependency(false); }, call);
    benchmark::DoNotOptimize(result);
  }
  report_allocations(state, before);
  guards.check(state);
}

template <Guard kGuard>
void BM_FailOnce(benchmark::State& state) {
  const Guards guards(kGuard);
  keel::ManualClock clock;
  keel::Rng rng(7);
  keel::CallOptions call;
  call.clock = &clock;
  call.rng = &rng;
  call.safe_to_repeat = true;
  guards.apply(call);
  const auto before = keel::bench::allocations();
  for (auto _ : state) {
    auto result = keel::retry(
        policy(), [](const keel::AttemptInfo& a) { return call_dependency(a.number == 1); }, call);
    benchmark::DoNotOptimize(result);
  }
  report_allocations(state, before);
  guards.check(state);
}

BENCHMARK(BM_Success<Guard::kNone>)->Name("BM_Retry_Success");
// As BM_Retry_Success with keel::coarse_clock() as the call's clock. A first-try success without
// a deadline reads no clock, so the two rows differ only by noise.
void BM_Retry_Success_CoarseClock(benchmark::State& state) {
  keel::CallOptions call;
  call.clock = &keel::coarse_clock();
  call.safe_to_repeat = true;
  const auto before = keel::bench::allocations();
  for (auto _ : state) {
    auto result = keel::retry(
        policy(), [] { return call_dependency(false); }, call);
    benchmark::DoNotOptimize(result);
  }
  report_allocations(state, before);
}
BENCHMARK(BM_Retry_Success_CoarseClock);
// As BM_Retry_Success with an overall timeout of 15 min, cenkalti's default MaxElapsedTime (its
// Reset reads the clock once): keel reads the steady clock at the start (which the first
// deadline check reuses) and for RetryResult::elapsed.
void BM_Retry_Success_Deadline(benchmark::State& state) {
  static const keel::RetryPolicy with_deadline(
      {.max_attempts = 3, .overall_timeout = std::chrono::minutes(15)});
  keel::CallOptions call;
  call.safe_to_repeat = true;
  const auto before = keel::bench::allocations();
  for (auto _ : state) {
    auto result = keel::retry(
        with_deadline, [] { return call_dependency(false); }, call);
    benchmark::DoNotOptimize(result);
  }
  report_allocations(state, before);
}
BENCHMARK(BM_Retry_Success_Deadline);
BENCHMARK(BM_FailOnce<Guard::kNone>)->Name("BM_Retry_FailOnce");
BENCHMARK(BM_Success<Guard::kBreaker>)->Name("BM_RetryBreaker_Success");
BENCHMARK(BM_FailOnce<Guard::kBreaker>)->Name("BM_RetryBreaker_FailOnce");
BENCHMARK(BM_Success<Guard::kBreakerBudget>)->Name("BM_RetryBreakerBudget_Success");
BENCHMARK(BM_FailOnce<Guard::kBreakerBudget>)->Name("BM_RetryBreakerBudget_FailOnce");

// One guarded call through the breaker alone, as opossum's breaker.fire() does.
bool breaker_call(keel::CircuitBreaker& breaker, bool fail) {
  const keel::BreakerPermit permit = breaker.try_acquire();
  if (!permit) return false;
  const keel::Outcome outcome = call_dependency(fail);
  breaker.record(permit, outcome);
  return outcome.kind == keel::OutcomeKind::kSuccess;
}

void BM_Breaker_Success(benchmark::State& state) {
  keel::CircuitBreaker breaker(breaker_options());
  const auto before = keel::bench::allocations();
  for (auto _ : state) benchmark::DoNotOptimize(breaker_call(breaker, false));
  report_allocations(state, before);
  if (breaker.state() != keel::BreakerState::kClosed) state.SkipWithError("breaker opened");
}
BENCHMARK(BM_Breaker_Success);

void BM_Breaker_FailOnce(benchmark::State& state) {
  keel::CircuitBreaker breaker(breaker_options());
  const auto before = keel::bench::allocations();
  for (auto _ : state) {
    // A hand-written retry around two guarded calls, as in bench/peers/opossum.js.
    if (!breaker_call(breaker, true)) benchmark::DoNotOptimize(breaker_call(breaker, false));
  }
  report_allocations(state, before);
  if (breaker.state() != keel::BreakerState::kClosed) state.SkipWithError("breaker opened");
}
BENCHMARK(BM_Breaker_FailOnce);

// Contention: every thread records into the same breaker (default options, steady clock).
keel::CircuitBreaker& shared_breaker() {
  static keel::CircuitBreaker breaker(breaker_options());
  return breaker;
}

void BM_BreakerRecord(benchmark::State& state) {
  keel::CircuitBreaker& breaker = shared_breaker();
  for (auto _ : state) {
    const keel::BreakerPermit permit = breaker.try_acquire();
    breaker.record(permit, keel::Outcome::success());
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_BreakerRecord)->Threads(1)->Threads(2)->UseRealTime();

// The same with a count window (the last 100 calls), the other window kind.
void BM_BreakerRecordCountWindow(benchmark::State& state) {
  static keel::CircuitBreaker breaker([] {
    keel::BreakerOptions options = breaker_options();
    options.window = keel::BreakerWindow::kCount;
    return options;
  }());
  for (auto _ : state) {
    const keel::BreakerPermit permit = breaker.try_acquire();
    breaker.record(permit, keel::Outcome::success());
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_BreakerRecordCountWindow)->Threads(1)->Threads(2)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
