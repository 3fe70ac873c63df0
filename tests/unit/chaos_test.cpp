// keel::faults::ChaosDecider and Chaos without a network: with a fixed seed the decisions
// replay, and over many requests each fault's share is its fraction (within five standard
// deviations of a binomial, so a correct decider fails about once in two million runs).
#include "keel/faults/chaos.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <vector>

namespace keel::faults {
namespace {

using std::chrono::milliseconds;

constexpr int kRequests = 200000;

// Whether `count` of kRequests is a plausible draw of a binomial with probability p.
::testing::AssertionResult near_fraction(int count, double p) {
  const double observed = static_cast<double>(count) / kRequests;
  const double sigma = std::sqrt(p * (1 - p) / kRequests);
  if (std::abs(observed - p) <= 5 * sigma + 1e-12) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "observed " << observed << ", expected " << p << " +- " << 5 * sigma;
}

TEST(ChaosDecider, Answers503ForItsFraction) {
  ChaosDecider decider({.fraction_503 = 0.2, .seed = 42});
  int hits = 0;
  for (int i = 0; i < kRequests; ++i) hits += decider.answer_503() ? 1 : 0;
  EXPECT_TRUE(near_fraction(hits, 0.2));
}

TEST(ChaosDecider, HangsFirstThenDelaysAFractionOfTheRest) {
  ChaosDecider decider({.delay_fraction = 0.3, .hang_fraction = 0.1, .seed = 7});
  int hangs = 0;
  int delays = 0;
  for (int i = 0; i < kRequests; ++i) {
    const ChaosSlowdown s = decider.slow_down();
    hangs += s == ChaosSlowdown::kHang ? 1 : 0;
    delays += s == ChaosSlowdown::kDelay ? 1 : 0;
  }
  EXPECT_TRUE(near_fraction(hangs, 0.1));
  EXPECT_TRUE(near_fraction(delays, 0.9 * 0.3));
}

TEST(ChaosDecider, DropsAfterCommitForItsFraction) {
  ChaosDecider decider({.drop_after_commit = 0.05, .seed = 3});
  int drops = 0;
  for (int i = 0; i < kRequests; ++i) drops += decider.drop_after_commit() ? 1 : 0;
  EXPECT_TRUE(near_fraction(drops, 0.05));
}

TEST(ChaosDecider, ASeedReplaysTheSameDecisions) {
  const auto run = [](std::uint64_t seed) {
    ChaosDecider decider({.fraction_503 = 0.5, .delay_fraction = 0.5, .seed = seed});
    std::vector<int> out;
    for (int i = 0; i < 256; ++i) {
      out.push_back(decider.answer_503() ? 1 : 0);
      out.push_back(static_cast<int>(decider.slow_down()));
    }
    return out;
  };
  EXPECT_EQ(run(42), run(42));
  EXPECT_NE(run(42), run(43));
}

TEST(ChaosDecider, AZeroFractionDrawsNothing) {
  // The delays decided are the same whether or not the (zero) 503 and hang decisions are asked.
  ChaosDecider alone({.delay_fraction = 0.5, .seed = 9});
  ChaosDecider asked({.delay_fraction = 0.5, .seed = 9});
  for (int i = 0; i < 1000; ++i) {
    EXPECT_FALSE(asked.answer_503());
    EXPECT_FALSE(asked.drop_after_commit());
    ASSERT_EQ(alone.slow_down(), asked.slow_down()) << "request " << i;
  }
}

TEST(ChaosDecider, FractionOneAlwaysAndBadOptionsThrow) {
  ChaosDecider always({.fraction_503 = 1, .hang_fraction = 1, .drop_after_commit = 1});
  for (int i = 0; i < 1000; ++i) {
    ASSERT_TRUE(always.answer_503());
    ASSERT_EQ(always.slow_down(), ChaosSlowdown::kHang);
    ASSERT_TRUE(always.drop_after_commit());
  }
  EXPECT_THROW(ChaosDecider({.fraction_503 = 1.5}), std::invalid_argument);
  EXPECT_THROW(ChaosDecider({.delay_fraction = -0.1}), std::invalid_argument);
  EXPECT_THROW(ChaosDecider({.hang_fraction = std::nan("")}), std::invalid_argument);
  EXPECT_THROW(ChaosDecider({.delay = milliseconds(-1)}), std::invalid_argument);
}

TEST(Chaos, AppliesTheDecisionsThroughItsHooksAndCountsThem) {
  int dropped = 0;
  Chaos chaos({.fraction_503 = 1,
               .retry_after_503 = milliseconds(300),
               .delay_fraction = 1,
               .delay = milliseconds(0),
               .drop_after_commit = 1},
              {.drop_connection = [&](const httplib::Request&) { return ++dropped > 0; }});
  httplib::Request request;
  httplib::Response response;
  EXPECT_EQ(chaos.pre_routing(request, response), httplib::Server::HandlerResponse::Handled);
  EXPECT_EQ(response.status, 503);
  EXPECT_EQ(response.get_header_value("Retry-After"), "1");  // whole seconds, rounded up

  bool ran = false;
  const httplib::Server::Handler handler =
      chaos.wrap([&](const httplib::Request&, httplib::Response&) { ran = true; });
  handler(request, response);
  EXPECT_TRUE(ran);
  EXPECT_TRUE(chaos.after_commit(request));
  EXPECT_EQ(dropped, 1);

  EXPECT_EQ(chaos.injected(ChaosFault::k503), 1u);
  EXPECT_EQ(chaos.injected(ChaosFault::kDelay), 1u);
  EXPECT_EQ(chaos.injected(ChaosFault::kHang), 0u);
  EXPECT_EQ(chaos.injected(ChaosFault::kDrop), 1u);
}

TEST(Chaos, AHangEndsAtStop) {
  Chaos chaos({.hang_fraction = 1, .hang = std::chrono::minutes(10)});
  chaos.stop();
  httplib::Request request;
  httplib::Response response;
  bool ran = false;
  chaos.wrap([&](const httplib::Request&, httplib::Response&) { ran = true; })(request, response);
  EXPECT_TRUE(ran);
  EXPECT_EQ(chaos.injected(ChaosFault::kHang), 1u);
}

TEST(Chaos, ADropThroughTheHttplibHookNeedsTheHook) {
  Chaos chaos({.drop_after_commit = 1});
  httplib::Request request;
  EXPECT_THROW((void)chaos.after_commit(request), std::logic_error);
  EXPECT_EQ(chaos.injected(ChaosFault::kDrop), 0u);
}

TEST(Chaos, TheFrameworkFreeCallsDecideApplyAndCount) {
  Chaos chaos({.fraction_503 = 1,
               .retry_after_503 = milliseconds(2500),
               .delay_fraction = 1,
               .delay = milliseconds(0),
               .drop_after_commit = 1});
  EXPECT_TRUE(chaos.inject_503());
  ASSERT_TRUE(chaos.retry_after_503().has_value());
  EXPECT_EQ(*chaos.retry_after_503(), milliseconds(2500));
  chaos.slow_down();
  EXPECT_TRUE(chaos.drop_after_commit());
  EXPECT_EQ(chaos.injected(ChaosFault::k503), 1u);
  EXPECT_EQ(chaos.injected(ChaosFault::kDelay), 1u);
  EXPECT_EQ(chaos.injected(ChaosFault::kDrop), 1u);
  Chaos calm({});
  EXPECT_FALSE(calm.inject_503());
  calm.slow_down();
  EXPECT_FALSE(calm.drop_after_commit());
  EXPECT_FALSE(calm.retry_after_503().has_value());
  EXPECT_EQ(calm.injected(ChaosFault::kDelay), 0u);
}

}  // namespace
}  // namespace keel::faults
