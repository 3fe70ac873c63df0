// A guarded call: circuit breaker + retry budget + retry engine (keel::retry) around a call that
// succeeds, on 1 and 2 threads sharing one breaker and one budget, next to the floor measured in
// the same run: one steady-clock read plus one uncontended atomic increment.
//
// Each benchmark reports allocs/op and clock_reads/op (counted in a separate, untimed call with
// counting clocks: steady reads and coarse reads apart). A counting clock is not
// keel::steady_clock() itself, so for the breaker on the steady clock (kTimeSteady) the count
// shows one steady read where the timed run, on keel::steady_clock(), makes one coarse read (the
// breaker places its window by the coarse clock; see BreakerOptions::clock). With several
// threads, items_per_second is the aggregate throughput of all of them.
#include <benchmark/benchmark.h>

#include <atomic>
#include <chrono>
#include <cstdint>

#include "alloc_counter.hpp"
#include "keel/core/breaker.hpp"
#include "keel/core/budget.hpp"
#include "keel/core/retry.hpp"

namespace {

// Counts reads, then delegates. Used only for the untimed count.
class CountingClock final : public keel::Clock {
 public:
  explicit CountingClock(keel::Clock& inner) : inner_(inner) {}
  [[nodiscard]] keel::TimePoint now() const noexcept override {
    reads_.fetch_add(1, std::memory_order_relaxed);
    return inner_.now();
  }
  [[nodiscard]] keel::WallTime wall_now() const noexcept override { return inner_.wall_now(); }
  void sleep_for(keel::Duration d) override { inner_.sleep_for(d); }
  [[nodiscard]] std::int64_t reads() const noexcept { return reads_.load(); }

 private:
  keel::Clock& inner_;
  mutable std::atomic<std::int64_t> reads_{0};
};

enum class BudgetKind { kNone, kTokenBucket, kRatio, kThrottle };
enum class BreakerKind { kNone, kTimeCoarse, kTimeSteady, kCount };

struct Guards {
  std::unique_ptr<keel::RetryBudget> budget;
  std::unique_ptr<keel::CircuitBreaker> breaker;
};

Guards make_guards(BudgetKind budget, BreakerKind breaker, keel::Clock& steady,
                   keel::Clock& coarse) {
  Guards g;
  switch (budget) {
    case BudgetKind::kNone:
      break;
    case BudgetKind::kTokenBucket:
      g.budget = std::make_unique<keel::TokenBucketBudget>();
      break;
    case BudgetKind::kRatio:
      g.budget = std::make_unique<keel::RatioBudget>(keel::RatioBudgetOptions{.clock = &coarse});
      break;
    case BudgetKind::kThrottle:
      g.budget = std::make_unique<keel::ThrottleBudget>();
      break;
  }
  switch (breaker) {
    case BreakerKind::kNone:
      break;
    case BreakerKind::kTimeCoarse:
      g.breaker = std::make_unique<keel::CircuitBreaker>(keel::BreakerOptions{.clock = &coarse});
      break;
    case BreakerKind::kTimeSteady:
      g.breaker = std::make_unique<keel::CircuitBreaker>(keel::BreakerOptions{.clock = &steady});
      break;
    case BreakerKind::kCount:
      g.breaker = std::make_unique<keel::CircuitBreaker>(
          keel::BreakerOptions{.window = keel::BreakerWindow::kCount, .clock = &steady});
      break;
  }
  return g;
}

keel::CallOptions call_options(const Guards& g, keel::Clock& clock) {
  keel::CallOptions call;
  call.clock = &clock;
  call.safe_to_repeat = true;
  call.budget = g.budget.get();
  call.breaker = g.breaker.get();
  return call;
}

const keel::RetryPolicy& policy() {
  static const keel::RetryPolicy p({.max_attempts = 3});
  return p;
}

void BM_Floor_ClockReadPlusAtomicIncrement(benchmark::State& state) {
  std::atomic<std::uint64_t> counter{0};  // per thread: uncontended
  const auto before = keel::bench::allocations();
  for (auto _ : state) {
    benchmark::DoNotOptimize(std::chrono::steady_clock::now());
    counter.fetch_add(1, std::memory_order_relaxed);
  }
  benchmark::DoNotOptimize(counter.load());
  state.SetItemsProcessed(state.iterations());
  if (state.thread_index() == 0) {
    state.counters["allocs/op"] =
        benchmark::Counter(static_cast<double>(keel::bench::allocations() - before),
                           benchmark::Counter::kAvgIterations);
  }
}
BENCHMARK(BM_Floor_ClockReadPlusAtomicIncrement)->Threads(1)->Threads(2)->UseRealTime();

void BM_ClockRead_Steady(benchmark::State& state) {
  keel::Clock& clock = keel::steady_clock();
  for (auto _ : state) benchmark::DoNotOptimize(clock.now());
}
BENCHMARK(BM_ClockRead_Steady);

void BM_ClockRead_Coarse(benchmark::State& state) {
  keel::Clock& clock = keel::coarse_clock();
  for (auto _ : state) benchmark::DoNotOptimize(clock.now());
}
BENCHMARK(BM_ClockRead_Coarse);

enum class Driver {
  kStateMachine,  // RetryState driven by hand, as an event loop does
  kRetryHelper,   // keel::retry (adds the retry scope; no clock read without a deadline)
};

template <Driver kDriver>
void guarded_call(const keel::CallOptions& call) {
  if constexpr (kDriver == Driver::kStateMachine) {
    keel::RetryState st(policy(), call);
    auto start = st.start_attempt();
    benchmark::DoNotOptimize(start);
    auto decision = st.next(keel::Outcome::success());
    benchmark::DoNotOptimize(decision);
  } else {
    auto r = keel::retry(
        policy(), [] { return keel::Outcome::success(); }, call);
    benchmark::DoNotOptimize(r);
  }
}

template <Driver kDriver, BudgetKind kBudget, BreakerKind kBreaker>
void BM_Guarded(benchmark::State& state) {
  // One breaker and one budget shared by every thread of the run, as for one dependency.
  static Guards shared = make_guards(kBudget, kBreaker, keel::steady_clock(), keel::coarse_clock());
  const keel::CallOptions call = call_options(shared, keel::steady_clock());

  if (state.thread_index() == 0) {
    // Untimed: how many clock reads one guarded call makes, on fresh guards.
    CountingClock steady(keel::steady_clock());
    CountingClock coarse(keel::coarse_clock());
    const Guards counted = make_guards(kBudget, kBreaker, steady, coarse);
    const auto steady_before = steady.reads();
    const auto coarse_before = coarse.reads();
    guarded_call<kDriver>(call_options(counted, steady));
    state.counters["steady_reads/op"] = static_cast<double>(steady.reads() - steady_before);
    state.counters["coarse_reads/op"] = static_cast<double>(coarse.reads() - coarse_before);
  }

  const auto before = keel::bench::allocations();
  for (auto _ : state) guarded_call<kDriver>(call);
  state.SetItemsProcessed(state.iterations());
  if (state.thread_index() == 0) {
    state.counters["allocs/op"] =
        benchmark::Counter(static_cast<double>(keel::bench::allocations() - before),
                           benchmark::Counter::kAvgIterations);
  }
}

// The recommended set-up: time-window breaker and ratio budget on the coarse clock, or the token
// bucket (no clock at all).
BENCHMARK_TEMPLATE(BM_Guarded, Driver::kStateMachine, BudgetKind::kTokenBucket,
                   BreakerKind::kTimeCoarse)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_Guarded, Driver::kStateMachine, BudgetKind::kRatio, BreakerKind::kTimeCoarse)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_Guarded, Driver::kStateMachine, BudgetKind::kThrottle,
                   BreakerKind::kTimeCoarse)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();
// The same on the steady clock (its window placed by the coarse clock), and the count window
// (ring slots handed out in runs per thread).
BENCHMARK_TEMPLATE(BM_Guarded, Driver::kStateMachine, BudgetKind::kTokenBucket,
                   BreakerKind::kTimeSteady)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_Guarded, Driver::kStateMachine, BudgetKind::kTokenBucket, BreakerKind::kCount)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();
// The same guarded call through keel::retry, with each breaker window kind.
BENCHMARK_TEMPLATE(BM_Guarded, Driver::kRetryHelper, BudgetKind::kTokenBucket,
                   BreakerKind::kTimeCoarse)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_Guarded, Driver::kRetryHelper, BudgetKind::kTokenBucket,
                   BreakerKind::kTimeSteady)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_Guarded, Driver::kRetryHelper, BudgetKind::kTokenBucket, BreakerKind::kCount)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_Guarded, Driver::kRetryHelper, BudgetKind::kNone, BreakerKind::kNone)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();
// The engine alone, for reference.
BENCHMARK_TEMPLATE(BM_Guarded, Driver::kStateMachine, BudgetKind::kNone, BreakerKind::kNone)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
