// The hedging scenarios of keel::sim over many seeds: hedging cuts the p99 of a heavy tail to the
// fast path's for about the tail's share of extra load, and during a brownout a 10% budget keeps
// the hedges' extra load within its ratio (plus its reserve) where unbudgeted hedges add half.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <stdexcept>

#include "build_kind.hpp"
#include "keel/sim/scenarios.hpp"

namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

// Attempts per first attempt, minus one, over the slices in [from, to).
double extra_load(const keel::sim::Report& r, keel::Duration from, keel::Duration to) {
  std::int64_t offered = 0;
  std::int64_t first = 0;
  for (std::size_t i = 0; i < r.slices.size(); ++i) {
    const keel::Duration t = r.slice * static_cast<std::int64_t>(i);
    if (t < from || t >= to) continue;
    offered += r.slices[i].offered;
    first += r.slices[i].first_attempts;
  }
  return first > 0 ? static_cast<double>(offered) / static_cast<double>(first) - 1.0 : 0.0;
}

TEST(SimHedging, AHedgeCutsTheP99OfAHeavyTailForTheTailsShareOfLoad) {
  for (std::uint64_t seed = 1; seed <= keel::test::seeds(8, 2); ++seed) {
    const auto none = keel::sim::run_scenario("hedge-tail", "no-hedge", seed);
    const auto hedged = keel::sim::run_scenario("hedge-tail", "hedge", seed);
    const auto budgeted = keel::sim::run_scenario("hedge-tail", "hedge+budget", seed);
    ASSERT_TRUE(none.summary.p99_latency && hedged.summary.p99_latency);
    EXPECT_GT(*none.summary.p99_latency, milliseconds(300)) << seed;  // in the slow tail
    EXPECT_LT(*hedged.summary.p99_latency, milliseconds(60)) << seed;
    EXPECT_LT(*budgeted.summary.p99_latency, milliseconds(60)) << seed;
    EXPECT_EQ(none.summary.amplification, 1.0);
    // About the 3% of slow attempts, and the budget (10%) does not bind.
    EXPECT_GT(hedged.summary.amplification, 1.02) << seed;
    EXPECT_LT(hedged.summary.amplification, 1.045) << seed;
    EXPECT_EQ(budgeted.summary.total_calls, hedged.summary.total_calls) << seed;
    EXPECT_EQ(hedged.summary.ops_succeeded, hedged.summary.first_attempts);
  }
}

TEST(SimHedging, DuringABrownoutTheBudgetKeepsHedgesWithinItsRatio) {
  for (std::uint64_t seed = 1; seed <= keel::test::seeds(8, 2); ++seed) {
    const auto hedged = keel::sim::run_scenario("hedge-brownout", "hedge", seed);
    const auto budgeted = keel::sim::run_scenario("hedge-brownout", "hedge+budget", seed);
    const double unbudgeted = extra_load(hedged, seconds(10), seconds(20));
    const double within = extra_load(budgeted, seconds(10), seconds(20));
    EXPECT_GT(unbudgeted, 0.45) << seed;
    // 10% of the window's first attempts, plus a reserve of 10 per second (1% at 1,000/s).
    EXPECT_LE(within, 0.115) << seed;
    EXPECT_GT(within, 0.08) << seed;
  }
}

TEST(SimHedging, TheSameSeedGivesTheSameReport) {
  const auto a = keel::sim::run_scenario("hedge-brownout", "hedge+budget", 7);
  const auto b = keel::sim::run_scenario("hedge-brownout", "hedge+budget", 7);
  EXPECT_EQ(keel::sim::to_json_line(a), keel::sim::to_json_line(b));
}

TEST(SimHedging, AnUnknownPolicyIsRejectedNamingTheKnownOnes) {
  try {
    (void)keel::sim::run_scenario("hedge-tail", "full-jitter", 1);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("no-hedge, hedge, hedge+budget"), std::string::npos)
        << e.what();
  }
}

}  // namespace
