// The retry engine's decision path: the cost of one logical operation that succeeds first time
// (construct state, start_attempt, next) and of one retry decision, next to the floor measured in
// the same run: one steady-clock read plus one uncontended atomic increment. Without a deadline
// or a per-try timeout a first-try success reads no clock; the _Deadline variants show what the
// reads a deadline needs cost (RetryState driven by hand: at the start and before the attempt;
// keel::retry: at the start, which its first deadline check reuses, and for elapsed).
#include <benchmark/benchmark.h>

#include <atomic>
#include <chrono>

#include "alloc_counter.hpp"
#include "keel/core/retry.hpp"

namespace {

void report_allocations(benchmark::State& state, std::uint64_t before) {
  state.counters["allocs/op"] = benchmark::Counter(
      static_cast<double>(keel::bench::allocations() - before), benchmark::Counter::kAvgIterations);
}

void BM_Floor_ClockReadPlusAtomicIncrement(benchmark::State& state) {
  std::atomic<std::uint64_t> counter{0};
  const auto before = keel::bench::allocations();
  for (auto _ : state) {
    benchmark::DoNotOptimize(std::chrono::steady_clock::now());
    counter.fetch_add(1, std::memory_order_relaxed);
  }
  benchmark::DoNotOptimize(counter.load());
  report_allocations(state, before);
}
BENCHMARK(BM_Floor_ClockReadPlusAtomicIncrement);

void BM_Decision_SuccessFirstTry(benchmark::State& state) {
  const keel::RetryPolicy policy;
  keel::CallOptions call;
  call.safe_to_repeat = true;
  const auto before = keel::bench::allocations();
  for (auto _ : state) {
    keel::RetryState st(policy, call);
    auto start = st.start_attempt();
    benchmark::DoNotOptimize(start);
    auto decision = st.next(keel::Outcome::success());
    benchmark::DoNotOptimize(decision);
  }
  report_allocations(state, before);
}
BENCHMARK(BM_Decision_SuccessFirstTry);

void BM_Decision_SuccessFirstTry_Deadline(benchmark::State& state) {
  const keel::RetryPolicy policy({.overall_timeout = std::chrono::seconds(10)});
  keel::CallOptions call;
  call.safe_to_repeat = true;
  const auto before = keel::bench::allocations();
  for (auto _ : state) {
    keel::RetryState st(policy, call);
    auto start = st.start_attempt();
    benchmark::DoNotOptimize(start);
    auto decision = st.next(keel::Outcome::success());
    benchmark::DoNotOptimize(decision);
  }
  report_allocations(state, before);
}
BENCHMARK(BM_Decision_SuccessFirstTry_Deadline);

void BM_Decision_OneRetry(benchmark::State& state) {
  const keel::RetryPolicy policy({.max_attempts = 3});
  keel::ManualClock clock;
  keel::Rng rng(1);
  keel::CallOptions call;
  call.clock = &clock;
  call.rng = &rng;
  call.safe_to_repeat = true;
  const auto transient = keel::classify_http_status(503, {});
  const auto before = keel::bench::allocations();
  for (auto _ : state) {
    keel::RetryState st(policy, call);
    (void)st.start_attempt();
    auto retry = st.next(transient);  // the decision under test: a jittered retry
    benchmark::DoNotOptimize(retry);
    (void)st.start_attempt();
    auto done = st.next(keel::Outcome::success());
    benchmark::DoNotOptimize(done);
  }
  report_allocations(state, before);
}
BENCHMARK(BM_Decision_OneRetry);

void BM_Blocking_RetryHelper_Success(benchmark::State& state) {
  const keel::RetryPolicy policy;
  keel::CallOptions call;
  call.safe_to_repeat = true;
  const auto before = keel::bench::allocations();
  for (auto _ : state) {
    auto r = keel::retry(
        policy, [] { return keel::Outcome::success(); }, call);
    benchmark::DoNotOptimize(r);
  }
  report_allocations(state, before);
}
BENCHMARK(BM_Blocking_RetryHelper_Success);

void BM_Blocking_RetryHelper_Success_Deadline(benchmark::State& state) {
  const keel::RetryPolicy policy({.overall_timeout = std::chrono::seconds(10)});
  keel::CallOptions call;
  call.safe_to_repeat = true;
  const auto before = keel::bench::allocations();
  for (auto _ : state) {
    auto r = keel::retry(
        policy, [] { return keel::Outcome::success(); }, call);
    benchmark::DoNotOptimize(r);
  }
  report_allocations(state, before);
}
BENCHMARK(BM_Blocking_RetryHelper_Success_Deadline);

void BM_FullJitterDelay(benchmark::State& state) {
  const keel::Backoff backoff;
  keel::Rng rng(7);
  int retry = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(backoff.delay(retry, {}, rng));
    retry = (retry + 1) & 7;
  }
}
BENCHMARK(BM_FullJitterDelay);

}  // namespace

BENCHMARK_MAIN();
