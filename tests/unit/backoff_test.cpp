#include "keel/core/backoff.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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

TEST(Backoff, MinCeilingFloorsTheCeilingsThenTheyGrowToTheCap) {
  Backoff b({.base = 500ms, .cap = 20s, .jitter = Jitter::kNone, .min_ceiling = 5s});
  const std::vector<Duration> expected = {5s, 5s, 5s, 5s, 8s, 16s, 20s, 20s};
  for (int retry = 0; retry < 8; ++retry) {
    EXPECT_EQ(b.ceiling(retry), expected[static_cast<std::size_t>(retry)]) << "retry " << retry;
  }
  EXPECT_EQ(b.ceiling(1000), 20s);
  // Zero (the default) changes nothing; a floor below base changes nothing either.
  Backoff unfloored({.base = 100ms, .cap = 5s});
  Backoff low({.base = 100ms, .cap = 5s, .min_ceiling = 50ms});
  for (int retry = 0; retry < 10; ++retry) {
    EXPECT_EQ(low.ceiling(retry), unfloored.ceiling(retry));
  }
}

TEST(Backoff, FleetPresetIsTheDocumentedFormula) {
  const BackoffOptions o = BackoffOptions::fleet();
  EXPECT_EQ(o.base, 500ms);
  EXPECT_EQ(o.cap, 20s);
  EXPECT_EQ(o.multiplier, 2.0);
  EXPECT_EQ(o.jitter, Jitter::kFull);
  EXPECT_EQ(o.min_ceiling, 5s);
  EXPECT_NO_THROW(Backoff{o});
  // The interactive default keeps no floor.
  EXPECT_EQ(BackoffOptions{}.min_ceiling, 0s);
}

TEST(Backoff, FleetPresetExactSequenceForSeed) {
  Backoff b(BackoffOptions::fleet());
  keel::Rng rng(42);
  std::vector<Duration> got;
  for (int i = 0; i < 8; ++i) got.push_back(b.delay(i, 0s, rng));
  // 0.42 s, 1.89 s, 3.40 s, 4.62 s under 5 s; 7.93 s under 8 s; 12.3 s under 16 s; then under 20 s.
  const std::vector<Duration> expected = {419'314'855ns,    1'894'901'253ns, 3'400'217'055ns,
                                          4'623'464'726ns,  7'934'431'314ns, 12'315'831'366ns,
                                          14'385'171'557ns, 17'000'168'878ns};
  EXPECT_EQ(got, expected);
  for (int i = 0; i < 8; ++i) {
    EXPECT_GE(got[static_cast<std::size_t>(i)], 0s);
    EXPECT_LT(got[static_cast<std::size_t>(i)], b.ceiling(i));
  }
}

TEST(Backoff, FleetPresetIsUniformUnderEachCeilingAcrossSeeds) {
  // One client per seed, as a fleet is: each client's delay before retry n is uniform on
  // [0, ceiling n), so the first four are uniform on [0, 5 s) and no shorter window exists.
  // Kolmogorov-Smirnov at alpha = 0.001: 1.95 / sqrt(n).
  Backoff b(BackoffOptions::fleet());
  constexpr int kClients = 20'000;
  for (int retry = 0; retry < 7; ++retry) {
    std::vector<double> xs;
    xs.reserve(kClients);
    for (int seed = 0; seed < kClients; ++seed) {
      keel::Rng rng(static_cast<std::uint64_t>(seed));
      Duration d{};
      for (int i = 0; i <= retry; ++i) d = b.delay(i, d, rng);
      xs.push_back(static_cast<double>(d.count()));
    }
    const double hi = static_cast<double>(b.ceiling(retry).count());
    EXPECT_LT(ks_uniform(xs, hi), 1.95 / std::sqrt(kClients)) << "retry " << retry;
    EXPECT_LT(*std::max_element(xs.begin(), xs.end()), hi);
    double sum = 0;
    for (double x : xs) sum += x;
    EXPECT_NEAR(sum / kClients / hi, 0.5, 0.01) << "retry " << retry;
  }
}

TEST(Backoff, EqualJitterHonoursMinCeiling) {
  Backoff b({.base = 100ms, .cap = 10s, .jitter = Jitter::kEqual, .min_ceiling = 2s});
  keel::Rng rng(13);
  for (int retry = 0; retry < 8; ++retry) {
    for (int i = 0; i < 1000; ++i) {
      const Duration d = b.delay(retry, 0s, rng);
      EXPECT_GE(d, 1s);
      EXPECT_LT(d, b.ceiling(retry));
    }
  }
}

TEST(Backoff, InvalidMinCeilingNamesTheField) {
  auto message = [](BackoffOptions o) {
    try {
      Backoff b(o);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message({.min_ceiling = -1ms}).find("min_ceiling must be >= 0 (got -1ms)"),
            std::string::npos);
  EXPECT_NE(message({.cap = 10s, .min_ceiling = 11s}).find("min_ceiling must be <= cap"),
            std::string::npos);
  EXPECT_NE(message({.jitter = Jitter::kDecorrelated, .min_ceiling = 1s})
                .find("min_ceiling must be 0 with decorrelated jitter (got 1s)"),
            std::string::npos);
  EXPECT_EQ(message({.cap = 10s, .min_ceiling = 10s}), "");
  EXPECT_EQ(message({.jitter = Jitter::kDecorrelated}), "");
}

TEST(Jittered, SpreadsAPeriodUniformlyAroundItsInterval) {
  // Over many seeds: every draw within [interval/2, interval*3/2), the mean within 1% of the
  // interval, and both halves of the range used about equally.
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    keel::Rng rng(seed);
    const Duration interval = 1s;
    double sum = 0;
    int below = 0;
    constexpr int kDraws = 20000;
    for (int i = 0; i < kDraws; ++i) {
      const Duration d = keel::jittered(interval, rng);
      ASSERT_GE(d, 500ms);
      ASSERT_LT(d, 1500ms);
      sum += std::chrono::duration<double>(d).count();
      if (d < interval) ++below;
    }
    EXPECT_NEAR(sum / kDraws, 1.0, 0.01) << "seed " << seed;
    EXPECT_NEAR(static_cast<double>(below) / kDraws, 0.5, 0.02) << "seed " << seed;
  }
}

TEST(Jittered, AZeroOrNegativeIntervalIsZeroAndAHugeOneSaturates) {
  keel::Rng rng(1);
  EXPECT_EQ(keel::jittered(Duration::zero(), rng), Duration::zero());
  EXPECT_EQ(keel::jittered(-1s, rng), Duration::zero());
  const Duration huge = keel::jittered(Duration::max(), rng);
  EXPECT_GE(huge, Duration::max() / 2);
}

TEST(BackoffSequence, EachFailureInARowDrawsUnderTheNextCeilingAndResetStartsOver) {
  // The same draws as the stateless Backoff with the failures and previous delay kept by hand.
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    const BackoffOptions options{.base = 100ms, .cap = 2s};
    keel::BackoffSequence sequence(options, seed);
    const Backoff backoff(options);
    keel::Rng rng(seed);
    Duration previous{};
    for (int n = 0; n < 8; ++n) {
      const Duration expected = backoff.delay(n, previous, rng);
      previous = expected;
      ASSERT_EQ(sequence.next(), expected) << "seed " << seed << " failure " << n;
      EXPECT_LT(expected, backoff.ceiling(n));
    }
    EXPECT_EQ(sequence.failures(), 8);
    sequence.reset();
    EXPECT_EQ(sequence.failures(), 0);
    EXPECT_LT(sequence.next(), 100ms) << "after a reset the first ceiling again";
  }
}

TEST(BackoffSequence, ALongOutageStaysUnderTheCap) {
  keel::BackoffSequence sequence({.base = 10ms, .cap = 1s}, 5);
  for (int i = 0; i < 10000; ++i) ASSERT_LT(sequence.next(), 1s);
  EXPECT_EQ(sequence.failures(), 10000);
}

TEST(PeriodicSchedule, SuccessesAreJitteredAroundTheIntervalAndFailuresBackOff) {
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    keel::PeriodicSchedule schedule(1s, {.base = 50ms, .cap = 400ms}, seed);
    double sum = 0;
    for (int i = 0; i < 2000; ++i) {
      const Duration d = schedule.after_success();
      ASSERT_GE(d, 500ms);
      ASSERT_LT(d, 1500ms);
      sum += std::chrono::duration<double>(d).count();
    }
    EXPECT_NEAR(sum / 2000, 1.0, 0.03) << "seed " << seed;
    EXPECT_LT(schedule.after_failure(), 50ms);
    EXPECT_LT(schedule.after_failure(), 100ms);
    EXPECT_EQ(schedule.failures(), 2);
    (void)schedule.after_success();
    EXPECT_EQ(schedule.failures(), 0) << "a success starts the backoff over";
  }
  EXPECT_THROW(keel::PeriodicSchedule(Duration::zero(), {}), std::invalid_argument);
}

TEST(KeepReconnecting, FailuresInARowBackOffALostConnectionStartsOverAndAStopEndsIt) {
  using keel::SessionEnd;
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    keel::BackoffSequence backoff({.base = 100ms, .cap = 2s}, seed);
    // Three failures to connect, a session that worked and was lost, one more failure, a stop.
    const std::vector<SessionEnd> ends = {SessionEnd::kFailed, SessionEnd::kFailed,
                                          SessionEnd::kFailed, SessionEnd::kLost,
                                          SessionEnd::kFailed, SessionEnd::kStop};
    std::size_t session = 0;
    std::vector<Duration> waits;
    std::vector<int> failures_seen;
    keel::keep_reconnecting(
        backoff, [&] { return ends.at(session++); },
        [&](Duration d) {
          waits.push_back(d);
          failures_seen.push_back(backoff.failures());
          return true;
        });
    ASSERT_EQ(session, ends.size()) << "every session ran, none after the stop";
    ASSERT_EQ(waits.size(), 5u);
    EXPECT_EQ(failures_seen, (std::vector<int>{1, 2, 3, 1, 2})) << "the lost session reset it";
    EXPECT_LT(waits[0], 100ms);
    EXPECT_LT(waits[2], 400ms);
    EXPECT_LT(waits[3], 100ms) << "seed " << seed << ": after a working session, the first ceiling";
  }
  // A wait that says stop ends the loop at once.
  keel::BackoffSequence backoff({}, 3);
  int sessions = 0;
  keel::keep_reconnecting(
      backoff,
      [&] {
        ++sessions;
        return SessionEnd::kFailed;
      },
      [](Duration) { return false; });
  EXPECT_EQ(sessions, 1);
}
