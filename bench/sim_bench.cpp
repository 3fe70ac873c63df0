// keel::sim throughput: simulated events per second on one core. The headline case is the one
// the simulator promises to run "well under a second": 60 s of virtual time at 10,000 req/s
// (over 600,000 simulated requests) with keel's real retry engine deciding every retry.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>

#include "keel/sim/engine.hpp"
#include "keel/sim/scenarios.hpp"

namespace {

using namespace std::chrono_literals;

keel::sim::Scenario sixty_seconds_at_10k(double failure_fraction) {
  keel::sim::Scenario s;
  s.clients.arrivals_per_s = 10'000;
  s.dependency.capacity_per_s = 12'000;
  s.dependency.failure_fraction = failure_fraction;
  s.dependency.queue_limit = 12'000;
  s.duration = 60s;
  return s;
}

void run(benchmark::State& state, const keel::sim::Scenario& s, const char* policy) {
  const keel::sim::ClientPolicy p = keel::sim::make_policy(policy, {});
  std::int64_t events = 0;
  std::int64_t requests = 0;
  for (auto _ : state) {
    const auto r = keel::sim::run(s, p, 1);
    events += r.summary.events;
    requests += r.summary.total_calls;
    benchmark::DoNotOptimize(r.summary.total_calls);
  }
  state.counters["events/s"] =
      benchmark::Counter(static_cast<double>(events), benchmark::Counter::kIsRate);
  state.counters["requests/s"] =
      benchmark::Counter(static_cast<double>(requests), benchmark::Counter::kIsRate);
  state.counters["requests/run"] =
      static_cast<double>(requests) /
      static_cast<double>(std::max<std::int64_t>(1, state.iterations()));
}

void BM_Sim60sAt10kHealthy(benchmark::State& state) {
  run(state, sixty_seconds_at_10k(0.0), "full-jitter");
}
void BM_Sim60sAt10kHalfFailingNaive(benchmark::State& state) {
  run(state, sixty_seconds_at_10k(0.5), "naive");
}
void BM_Sim60sAt10kHalfFailingBudget(benchmark::State& state) {
  run(state, sixty_seconds_at_10k(0.5), "full-jitter+budget");
}

}  // namespace

BENCHMARK(BM_Sim60sAt10kHealthy)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Sim60sAt10kHalfFailingNaive)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Sim60sAt10kHalfFailingBudget)->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
