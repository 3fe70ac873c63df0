// The cost of the limits on calls to a dependency, next to no limit measured in the same run:
//   - AdaptiveConcurrencyLimit: try_acquire() and the permit's release(latency, now), the path
//     every call takes (the goal: 20 ns or less on one thread; the window's end, once per 100
//     ms, is in the average). Time is a TimePoint advanced by hand: no clock read is counted
//     (a caller that measures latency reads the clock anyway).
//   - RateLimit::reserve() on its own schedule (no fleet), and with a fleet's chunks: the
//     counter fleet_round_trips_per_1000_calls is the database round trips a process makes for
//     them (a chunk lease is one statement in a bounded transaction of its own, two round
//     trips; each lease holds chunk_size() slots, a tenth of a second of the rate).
// With several threads, items_per_second is the aggregate throughput.
#include <benchmark/benchmark.h>

#include <atomic>
#include <chrono>
#include <cstdint>

#include "keel/core/concurrency_limit.hpp"
#include "keel/core/random.hpp"
#include "keel/core/rate_limit.hpp"

namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;

// No limit: the call's own bookkeeping, one relaxed increment and decrement of an in-flight
// count, which a caller without a limiter often keeps anyway.
void BM_NoLimit(benchmark::State& state) {
  static std::atomic<std::int64_t> in_flight{0};
  for (auto _ : state) {
    in_flight.fetch_add(1, std::memory_order_relaxed);
    benchmark::ClobberMemory();
    in_flight.fetch_sub(1, std::memory_order_relaxed);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_NoLimit)->Threads(1)->Threads(2)->UseRealTime();

keel::AdaptiveConcurrencyLimit& shared_limit() {
  static keel::AdaptiveConcurrencyLimit limit({.initial_limit = 1000, .max_limit = 1000});
  return limit;
}

// One call: a permit, then its release with a latency of 1-2 ms; the clock moves 10 us a call.
void BM_AdaptiveConcurrencyLimit(benchmark::State& state) {
  keel::AdaptiveConcurrencyLimit& limit = shared_limit();
  keel::TimePoint now{std::chrono::seconds(1000)};
  std::int64_t i = std::int64_t{state.thread_index()} * 7919;
  std::int64_t refused = 0;
  for (auto _ : state) {
    keel::ConcurrencyPermit p = limit.try_acquire();
    if (!p) [[unlikely]] {
      ++refused;
      continue;
    }
    p.release(microseconds(1000 + (i & 1023)), now);
    now += microseconds(10);
    ++i;
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["refused"] = static_cast<double>(refused);
}
BENCHMARK(BM_AdaptiveConcurrencyLimit)->Threads(1)->Threads(2)->UseRealTime();

// RateLimit::reserve() on its own schedule at a rate it never reaches (every call goes).
void BM_RateLimit_Local(benchmark::State& state) {
  static keel::RateLimit limit({.rate_per_s = 1e6, .burst = 1e6});
  keel::Rng rng(1);
  keel::TimePoint now{std::chrono::seconds(1000)};
  for (auto _ : state) {
    benchmark::DoNotOptimize(limit.reserve(now, milliseconds(100), rng));
    now += microseconds(10);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_RateLimit_Local)->Threads(1)->Threads(2)->UseRealTime();

// A fleet that answers at once, as the background thread does when the database is quick,
// and counts its statements.
class CountingFleet final : public keel::RateLimitFleet {
 public:
  keel::RateLimit* limit = nullptr;
  keel::TimePoint* now = nullptr;
  std::int64_t leases = 0;
  void want(std::string_view) override {
    ++leases;
    limit->add_chunk(*now, std::chrono::nanoseconds(0), limit->chunk_size());
  }
  bool lease(std::string_view key) override {
    want(key);
    return true;
  }
  void paused(std::string_view, keel::TimePoint) override {}
};

// The fleet's schedule at 50/s (the drill's rate) and 1,000/s, one process: calls come at the
// rate.
void BM_RateLimit_FleetChunks(benchmark::State& state) {
  keel::RateLimitRegistry limits({.rate_per_s = static_cast<double>(state.range(0))});
  CountingFleet fleet;
  keel::TimePoint now{std::chrono::seconds(1000)};
  limits.attach_fleet(&fleet);
  auto limit = limits.get("api:443");
  fleet.limit = limit.get();
  fleet.now = &now;
  limit->set_sharing(true);
  keel::Rng rng(1);
  std::int64_t calls = 0;
  for (auto _ : state) {
    const keel::RateDecision d = limit->reserve(now, std::chrono::seconds(10), rng);
    if (d.go) {
      ++calls;
      now += d.wait;
    }
  }
  limits.attach_fleet(nullptr);
  state.SetItemsProcessed(state.iterations());
  state.counters["fleet_round_trips_per_1000_calls"] =
      calls > 0 ? 2.0 * 1000.0 * static_cast<double>(fleet.leases) / static_cast<double>(calls)
                : 0.0;
}
BENCHMARK(BM_RateLimit_FleetChunks)->Arg(50)->Arg(1000);

}  // namespace

BENCHMARK_MAIN();
