// The limits in the simulator, over 20 seeds each in the release build, 3 under a sanitizer
// (tests/build_kind.hpp) (docs/concurrency.md and docs/rate-limits.md
// quote these figures):
//   - demo-story with the adaptive client limit and no budget: back under capacity within 5 s of
//     the blip's end (full jitter alone never is);
//   - overload-3x: adaptive admission keeps goodput at >= 90% of capacity and the p99 of an
//     admitted request within 2x its unloaded 10 ms; a fixed limit set 2x too high fails the
//     latency bound;
//   - fleet-rate-limit: the fleet's shared bucket sends at most 55 in any second and gets at most
//     1% 429s; a bucket per process lets the fleet send several times the limit.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "build_kind.hpp"
#include "keel/sim/scenarios.hpp"

namespace {

using namespace std::chrono_literals;
using keel::Duration;
namespace sim = keel::sim;

const int kSeeds = static_cast<int>(keel::test::seeds(20, 3));

const sim::PhaseLoad& phase(const std::vector<sim::PhaseLoad>& phases, const std::string& label) {
  for (const auto& p : phases) {
    if (p.label == label) return p;
  }
  throw std::runtime_error("no phase " + label);
}

TEST(SimLimits, DemoStoryWithTheAdaptiveClientLimitIsBackUnderCapacityWithin5sOfTheBlip) {
  for (int seed = 1; seed <= kSeeds; ++seed) {
    const sim::Report r = sim::run_scenario("demo-story", "full-jitter+adaptive-limit",
                                            static_cast<std::uint64_t>(seed));
    const std::vector<sim::PhaseLoad> loads = sim::phase_loads(r);
    const sim::PhaseLoad& after = phase(loads, "after the blip");
    ASSERT_TRUE(after.under_capacity_after.has_value()) << "seed " << seed;
    EXPECT_LE(*after.under_capacity_after, 5s) << "seed " << seed;
    EXPECT_GT(r.summary.limited, 0) << "seed " << seed;  // the limit held attempts back
  }
  // Without it (and without a budget), the same story never is.
  const sim::Report plain = sim::run_scenario("demo-story", "full-jitter", 1);
  const std::vector<sim::PhaseLoad> plain_loads = sim::phase_loads(plain);
  EXPECT_FALSE(phase(plain_loads, "after the blip").under_capacity_after.has_value());
}

TEST(SimLimits, AdaptiveAdmissionKeepsGoodputAndLatencyUnder3xOverloadAFixedLimit2xTooHighDoesNot) {
  for (int seed = 1; seed <= kSeeds; ++seed) {
    const auto s = static_cast<std::uint64_t>(seed);
    const sim::Report adaptive = sim::run_scenario("overload-3x", "adaptive-admission", s);
    EXPECT_GE(adaptive.summary.goodput_per_s, 900) << "seed " << seed;
    ASSERT_TRUE(adaptive.summary.served_p99_latency.has_value());
    EXPECT_LE(*adaptive.summary.served_p99_latency, 20ms) << "seed " << seed;

    const sim::Report too_high = sim::run_scenario("overload-3x", "fixed-admission-2x", s);
    ASSERT_TRUE(too_high.summary.served_p99_latency.has_value());
    const bool fails =
        too_high.summary.goodput_per_s < 900 || *too_high.summary.served_p99_latency > 20ms;
    EXPECT_TRUE(fails) << "seed " << seed;
  }
}

TEST(SimLimits, TheFleetsSharedBucketStaysUnderTheLimitABucketPerProcessDoesNot) {
  for (int seed = 1; seed <= kSeeds; ++seed) {
    const auto s = static_cast<std::uint64_t>(seed);
    const sim::Report shared =
        sim::run_scenario("fleet-rate-limit", "full-jitter+shared-rate-limit", s);
    EXPECT_LE(shared.summary.peak_per_slice, 55) << "seed " << seed;  // 1 s slices
    EXPECT_LE(100 * shared.summary.throttled, shared.summary.total_calls) << "seed " << seed;
    EXPECT_GE(shared.summary.goodput_per_s, 45) << "seed " << seed;

    const sim::Report apart = sim::run_scenario("fleet-rate-limit", "full-jitter+rate-limit", s);
    EXPECT_GT(apart.summary.peak_per_slice, 55) << "seed " << seed;
    EXPECT_GT(10 * apart.summary.throttled, apart.summary.total_calls) << "seed " << seed;
  }
}

}  // namespace
