// The cost of adaptive per-try timeouts: keel::LatencyTracker::record() on 1 and 2 threads
// sharing one tracker (the path every attempt takes), and AdaptiveTimeout::timeout() (a quantile
// over the window, once per attempt), next to the floor measured in the same run: one
// uncontended atomic increment. Time is a fixed TimePoint advanced by hand, so no clock read is
// counted; with several threads, items_per_second is the aggregate throughput.
#include <benchmark/benchmark.h>

#include <atomic>
#include <chrono>
#include <cstdint>

#include "keel/core/latency.hpp"

namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;

void BM_Floor_AtomicIncrement(benchmark::State& state) {
  static std::atomic<std::int64_t> counter{0};
  for (auto _ : state) counter.fetch_add(1, std::memory_order_relaxed);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Floor_AtomicIncrement);

keel::LatencyTracker& shared_tracker() {
  static keel::LatencyTracker tracker;
  return tracker;
}

// Latencies spread over 1-100 ms, so that records land in different histogram buckets; the
// window moves on by 1 ms every 1024 records (a bucket rotates every 10,000 of those).
void BM_LatencyTracker_Record(benchmark::State& state) {
  keel::LatencyTracker& tracker = shared_tracker();
  keel::TimePoint now{std::chrono::seconds(1000)};
  std::int64_t i = std::int64_t{state.thread_index()} * 7919;
  for (auto _ : state) {
    tracker.record(microseconds(1000 + (i * 7919) % 99'000), now);
    if ((++i & 1023) == 0) now += milliseconds(1);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_LatencyTracker_Record)->Threads(1)->Threads(2)->UseRealTime();

// A window holding 100,000 lognormal-ish latencies; one timeout() per iteration.
void BM_AdaptiveTimeout_Timeout(benchmark::State& state) {
  keel::AdaptiveTimeout timeout;
  const keel::TimePoint now{std::chrono::seconds(1000)};
  for (std::int64_t i = 0; i < 100'000; ++i) {
    const std::int64_t x = (i * 2654435761) % 1000;
    timeout.record(microseconds(5000 + x * x * 4), now);  // 5 ms to about 4 s, skewed
  }
  for (auto _ : state) benchmark::DoNotOptimize(timeout.timeout(now, std::chrono::seconds(10)));
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_AdaptiveTimeout_Timeout);

}  // namespace

BENCHMARK_MAIN();
