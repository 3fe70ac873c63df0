#include "keel/backoff.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <vector>

using namespace std::chrono_literals;
using keel::Backoff;
using keel::BackoffOptions;
using keel::Duration;
using keel::Jitter;

namespace {

// Kolmogorov-Smirnov statistic of samples against uniform on [0, hi).
double ks_uniform(std::vector<double> xs, double hi) {
  std::sort(xs.begin(), xs.end());
  const double n = static_cast<double>(xs.size());
  double d = 0;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const double f = xs[i] / hi;
    d = std::max({d, (static_cast<double>(i) + 1) / n - f, f - static_cast<double>(i) / n});
  }
  return d;
}

}  // namespace

TEST(Backoff, CeilingGrowsExponentiallyAndIsCapped) {
  Backoff b({.base = 100ms, .cap = 5s, .multiplier = 2.0, .jitter = Jitter::kNone});
  EXPECT_EQ(b.ceiling(0), 100ms);
  EXPECT_EQ(b.ceiling(1), 200ms);
  EXPECT_EQ(b.ceiling(2), 400ms);
  EXPECT_EQ(b.ceiling(5), 3200ms);
  EXPECT_EQ(b.ceiling(6), 5s);
  EXPECT_EQ(b.ceiling(1000), 5s);  // no overflow at absurd retry counts
}

TEST(Backoff, HugeCapDoesNotOverflow) {
  Backoff b({.base = 1s, .cap = keel::kInfinite, .multiplier = 10.0});
  EXPECT_EQ(b.ceiling(100), keel::kInfinite);
  keel::Rng rng(1);
  EXPECT_GE(b.delay(100, 0s, rng), 0s);
}

TEST(Backoff, NoJitterIsTheCeiling) {
  Backoff b({.base = 1s, .cap = 30s, .jitter = Jitter::kNone});
  keel::Rng rng(3);
  EXPECT_EQ(b.delay(0, 0s, rng), 1s);
  EXPECT_EQ(b.delay(1, 1s, rng), 2s);
  EXPECT_EQ(b.delay(2, 2s, rng), 4s);
}

TEST(Backoff, FullJitterExactSequenceForSeed) {
  // The same seed gives the same delays: jitter is reproducible in tests and the simulator.
  Backoff b({.base = 100ms, .cap = 5s});
  keel::Rng a(42), c(42);
  std::vector<Duration> first, second;
  for (int i = 0; i < 8; ++i) first.push_back(b.delay(i, 0s, a));
  for (int i = 0; i < 8; ++i) second.push_back(b.delay(i, 0s, c));
  EXPECT_EQ(first, second);
  for (int i = 0; i < 8; ++i) {
    EXPECT_GE(first[static_cast<std::size_t>(i)], 0s);
    EXPECT_LT(first[static_cast<std::size_t>(i)], b.ceiling(i));
  }
  keel::Rng other(43);
  EXPECT_NE(b.delay(0, 0s, other), first[0]);
}

TEST(Backoff, FullJitterIsUniformOnZeroToCeiling) {
  // Kolmogorov-Smirnov against uniform[0, ceiling) over 10^5 draws per attempt. Critical value
  // at alpha = 0.001 is 1.95 / sqrt(n) = 0.00617.
  Backoff b({.base = 100ms, .cap = 5s});
  keel::Rng rng(20240601);
  constexpr int kDraws = 100'000;
  for (int retry = 0; retry < 7; ++retry) {
    std::vector<double> xs;
    xs.reserve(kDraws);
    for (int i = 0; i < kDraws; ++i) {
      xs.push_back(static_cast<double>(b.delay(retry, 0s, rng).count()));
    }
    const double hi = static_cast<double>(b.ceiling(retry).count());
    EXPECT_LT(ks_uniform(xs, hi), 1.95 / std::sqrt(kDraws)) << "retry " << retry;
    EXPECT_LT(*std::max_element(xs.begin(), xs.end()), hi);
  }
}

TEST(Backoff, KolmogorovSmirnovRejectsEqualJitterAsUniformOnFullRange) {
  // The statistical check can fail: equal jitter lives on [c/2, c), far from uniform on [0, c).
  Backoff b({.base = 100ms, .cap = 5s, .jitter = Jitter::kEqual});
  keel::Rng rng(7);
  std::vector<double> xs;
  for (int i = 0; i < 10'000; ++i) xs.push_back(static_cast<double>(b.delay(2, 0s, rng).count()));
  EXPECT_GT(ks_uniform(xs, static_cast<double>(b.ceiling(2).count())), 0.4);
}

TEST(Backoff, EqualJitterStaysInUpperHalf) {
  Backoff b({.base = 100ms, .cap = 5s, .jitter = Jitter::kEqual});
  keel::Rng rng(9);
  for (int retry = 0; retry < 10; ++retry) {
    for (int i = 0; i < 1000; ++i) {
      const Duration d = b.delay(retry, 0s, rng);
      EXPECT_GE(d, b.ceiling(retry) / 2);
      EXPECT_LT(d, b.ceiling(retry));
    }
  }
}

TEST(Backoff, DecorrelatedJitterFollowsPreviousDelay) {
  Backoff b({.base = 100ms, .cap = 2s, .jitter = Jitter::kDecorrelated});
  keel::Rng rng(11);
  Duration prev = 0s;
  for (int retry = 0; retry < 50; ++retry) {
    const Duration d = b.delay(retry, prev, rng);
    EXPECT_GE(d, 100ms);
    EXPECT_LE(d, 2s);
    if (d < 2s) {
      EXPECT_LT(d, (prev > 0s ? prev : 100ms) * 3);
    }
    prev = d;
  }
}

TEST(Backoff, InvalidConfigurationNamesTheField) {
  auto message = [](BackoffOptions o) {
    try {
      Backoff b(o);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message({.base = 0s}).find("base must be > 0"), std::string::npos);
  EXPECT_NE(message({.base = -5ms}).find("(got -5ms)"), std::string::npos);
  EXPECT_NE(message({.base = 2s, .cap = 1s}).find("cap must be >= base"), std::string::npos);
  EXPECT_NE(message({.multiplier = 0.5}).find("multiplier"), std::string::npos);
  EXPECT_NE(message({.multiplier = NAN}).find("multiplier"), std::string::npos);
  EXPECT_EQ(message({}), "");
}

TEST(Backoff, JitterNamesRoundTrip) {
  for (Jitter j : {Jitter::kFull, Jitter::kEqual, Jitter::kDecorrelated, Jitter::kNone}) {
    EXPECT_EQ(keel::parse_jitter(keel::to_string(j)), j);
  }
  EXPECT_FALSE(keel::parse_jitter("Full"));
  EXPECT_FALSE(keel::parse_jitter(""));
}

TEST(Backoff, AcceptsAnyFullWidthGenerator) {
  std::mt19937_64 mt(5);
  Backoff b({.base = 1s, .cap = 1s});
  const Duration d = b.delay(0, 0s, mt);
  EXPECT_GE(d, 0s);
  EXPECT_LT(d, 1s);
}
