// keel::LatencyTracker, keel::AdaptiveTimeout and keel::AdaptiveTimeoutRegistry, in virtual time
// (ManualClock, or time points built by hand): the timeout follows a latency shift, falls back
// to the static timeout below min_samples, clamps; the quantile error against the exact quantile
// of a million fixed-seed lognormal latencies; real threads recording while one reads (run
// under ThreadSanitizer by the tsan preset).
#include "keel/core/latency.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "keel/core/clock.hpp"

namespace {

using keel::AdaptiveTimeout;
using keel::AdaptiveTimeoutOptions;
using keel::Duration;
using keel::LatencyTracker;
using std::chrono::milliseconds;
using std::chrono::seconds;

double ms(Duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// 1000 latencies spread evenly over [50 ms, top], one every millisecond of virtual time: their
// p99.9 is the second largest (rank 999 of 1000), just under top.
void record_spread(AdaptiveTimeout& t, keel::ManualClock& clock, Duration top, int rounds = 1) {
  for (int r = 0; r < rounds; ++r) {
    for (int i = 0; i < 1000; ++i) {
      const Duration lat = milliseconds(50) + (top - milliseconds(50)) * i / 999;
      t.record(lat, clock.now());
      clock.advance(milliseconds(1));
    }
  }
}

TEST(AdaptiveTimeout, FollowsTheMeasuredTailAndALatencyShift) {
  keel::ManualClock clock;
  AdaptiveTimeout t({.quantile = 0.999, .factor = 1.25, .margin = milliseconds(25)});
  ASSERT_EQ(t.options().window, seconds(60));
  const Duration static_timeout = seconds(10);
  EXPECT_EQ(t.timeout(clock.now(), static_timeout), static_timeout);  // no history yet

  // p99.9 about 180 ms: timeout about 180 x 1.25 + 25 = 250 ms.
  record_spread(t, clock, milliseconds(180), 10);
  const Duration p999 = *t.tracker().quantile(0.999, clock.now());
  EXPECT_NEAR(ms(p999), 179.87, 179.87 * LatencyTracker::kRelativeError);
  const Duration before = t.timeout(clock.now(), static_timeout);
  EXPECT_NEAR(ms(before), 250.0, 3.0);

  // The dependency slows to 400 ms. A rising tail is followed at once: as soon as more than
  // 0.1% of the window is slower, the p99.9 is the slow latency.
  for (int i = 0; i < 100; ++i) {
    t.record(milliseconds(400), clock.now());
    clock.advance(milliseconds(1));
  }
  EXPECT_NEAR(ms(t.timeout(clock.now(), static_timeout)), 400 * 1.25 + 25, 6.0);

  // Back to 180 ms: the slow latencies keep the timeout up until they have left the window
  // (60 s in 6 steps of 10 s), then it follows the new tail.
  for (int s = 0; s < 50; ++s) record_spread(t, clock, milliseconds(180));  // 50 s
  EXPECT_NEAR(ms(t.timeout(clock.now(), static_timeout)), 525.0, 6.0);
  for (int s = 0; s < 30; ++s) record_spread(t, clock, milliseconds(180));  // 80 s in all
  EXPECT_NEAR(ms(t.timeout(clock.now(), static_timeout)), 250.0, 3.0);
}

TEST(AdaptiveTimeout, AShiftToSlowerLatencyIsFollowedOnceTheWindowRotates) {
  keel::ManualClock clock;
  AdaptiveTimeout t({.window = seconds(10), .buckets = 5});
  record_spread(t, clock, milliseconds(180), 5);  // 5 s at 180 ms
  EXPECT_NEAR(ms(t.timeout(clock.now(), seconds(10))), 250.0, 3.0);
  // All of it at 400 ms from now on: after one window only the new latencies are left, and
  // every quantile is 400 ms.
  for (int i = 0; i < 12'000; ++i) {
    t.record(milliseconds(400), clock.now());
    clock.advance(milliseconds(1));
  }
  EXPECT_NEAR(ms(*t.tracker().quantile(0.5, clock.now())), 400.0, 400 * 1.0 / 128);
  EXPECT_NEAR(ms(t.timeout(clock.now(), seconds(10))), 525.0, 6.0);
  EXPECT_LE(t.tracker().count(clock.now()), 10'000);
}

TEST(AdaptiveTimeout, FallsBackToTheStaticTimeoutBelowMinSamples) {
  keel::ManualClock clock;
  AdaptiveTimeout t({.min_samples = 1000});
  for (int i = 0; i < 999; ++i) t.record(milliseconds(20), clock.now());
  EXPECT_FALSE(t.computed(clock.now()).has_value());
  EXPECT_EQ(t.timeout(clock.now(), seconds(7)), seconds(7));
  EXPECT_EQ(t.attempt_timeout(seconds(7), clock.now()), seconds(7));
  EXPECT_FALSE(t.tracker().quantile(0.999, clock.now(), 1000).has_value());
  t.record(milliseconds(20), clock.now());
  ASSERT_TRUE(t.computed(clock.now()).has_value());
  EXPECT_NEAR(ms(t.timeout(clock.now(), seconds(7))), 20 * 1.25 + 25, 0.5);
  // Samples that leave the window take the timeout back to the static one.
  clock.advance(seconds(61));
  EXPECT_EQ(t.tracker().count(clock.now()), 0);
  EXPECT_EQ(t.timeout(clock.now(), seconds(7)), seconds(7));
}

TEST(AdaptiveTimeout, ClampsToFloorAndCeilingAndNeverExceedsTheEngineTimeout) {
  keel::ManualClock clock;
  AdaptiveTimeout fast({.factor = 1,
                        .margin = Duration::zero(),
                        .floor = milliseconds(10),
                        .ceiling = seconds(5),
                        .min_samples = 1});
  fast.record(std::chrono::microseconds(300), clock.now());
  EXPECT_EQ(fast.timeout(clock.now(), seconds(10)), milliseconds(10));

  AdaptiveTimeout slow({.floor = milliseconds(10), .ceiling = seconds(5), .min_samples = 1});
  slow.record(seconds(30), clock.now());
  EXPECT_EQ(slow.timeout(clock.now(), seconds(10)), seconds(5));
  // The engine's timeout (static per-try, or less before the deadline) stays the upper bound.
  EXPECT_EQ(slow.attempt_timeout(seconds(2), clock.now()), seconds(2));
  EXPECT_EQ(slow.attempt_timeout(seconds(10), clock.now()), seconds(5));
  EXPECT_EQ(fast.attempt_timeout(milliseconds(3), clock.now()), milliseconds(3));

  // Beyond the tracked range latencies count as the largest one, and nothing overflows.
  AdaptiveTimeout huge(
      {.factor = 100, .margin = keel::kInfinite, .ceiling = keel::kInfinite, .min_samples = 1});
  huge.record(std::chrono::hours(1000), clock.now());
  EXPECT_NEAR(ms(*huge.tracker().quantile(1.0, clock.now())), ms(LatencyTracker::kMaxLatency),
              ms(LatencyTracker::kMaxLatency) / 128);
  EXPECT_EQ(huge.timeout(clock.now(), seconds(1)), keel::kInfinite);
}

TEST(AdaptiveTimeout, ATimeoutRecordedAtItsLimitLetsTheTimeoutClimb) {
  // After a shift above the timeout every attempt times out. Recorded at the timeout (a lower
  // bound of its latency), they push the quantile up, and each timeout is factor x the last.
  keel::ManualClock clock;
  AdaptiveTimeout t({.min_samples = 100, .window = seconds(10)});
  for (int i = 0; i < 1000; ++i) t.record(milliseconds(40), clock.now());
  Duration limit = t.timeout(clock.now(), seconds(10));
  EXPECT_NEAR(ms(limit), 40 * 1.25 + 25, 1.0);
  const Duration real = milliseconds(800);
  int rounds = 0;
  while (limit < real && rounds < 100) {
    for (int i = 0; i < 5; ++i) t.record_timeout(limit, clock.now());  // 0.5% time out
    clock.advance(milliseconds(10));
    const Duration next = t.timeout(clock.now(), seconds(10));
    EXPECT_GT(next, limit);
    limit = next;
    ++rounds;
  }
  EXPECT_GE(limit, real);
  EXPECT_LT(rounds, 20);
}

TEST(LatencyTracker, QuantileErrorIsWithinTheStatedBoundOnAMillionLognormalLatencies) {
  // Heavy-tailed: median 20 ms, sigma 1 (p99.9 about 440 ms), fixed seed.
  std::mt19937_64 gen(20261201);
  std::lognormal_distribution<double> dist(std::log(20e6), 1.0);
  constexpr int kN = 1'000'000;
  std::vector<std::int64_t> samples(kN);
  LatencyTracker tracker;
  const keel::TimePoint now{seconds(1000)};
  for (auto& s : samples) {
    s = std::max<std::int64_t>(1, static_cast<std::int64_t>(dist(gen)));
    tracker.record(Duration(s), now);
  }
  EXPECT_EQ(tracker.count(now), kN);
  std::sort(samples.begin(), samples.end());
  for (const double p : {0.5, 0.99, 0.999}) {
    const auto rank = static_cast<std::size_t>(std::ceil(p * kN));
    const double exact = static_cast<double>(samples[rank - 1]);
    const double got = static_cast<double>(tracker.quantile(p, now)->count());
    const double error = std::abs(got - exact) / exact;
    std::printf("p%g: exact %.3f ms, tracked %.3f ms, relative error %.4f%%\n", p * 100,
                exact / 1e6, got / 1e6, error * 100);
    EXPECT_LE(error, LatencyTracker::kRelativeError) << "p = " << p;
  }
}

TEST(LatencyTracker, SmallLatenciesAreExactToHalfAMicrosecond) {
  LatencyTracker tracker;
  const keel::TimePoint now{seconds(5)};
  tracker.record(std::chrono::microseconds(37), now);
  EXPECT_EQ(*tracker.quantile(0.5, now), std::chrono::nanoseconds(37'500));
  tracker.record(-seconds(1), now);  // a negative latency counts as zero
  EXPECT_EQ(*tracker.quantile(0.0, now), std::chrono::nanoseconds(500));
  EXPECT_FALSE(tracker.quantile(0.5, now, 3).has_value());
}

TEST(AdaptiveTimeout, RejectsInvalidOptionsNamingTheField) {
  auto message = [](AdaptiveTimeoutOptions o) {
    try {
      AdaptiveTimeout t(o);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(message({.quantile = 0}), "keel::AdaptiveTimeout: quantile must be in (0, 1] (got 0)");
  EXPECT_EQ(message({.quantile = 1.5}),
            "keel::AdaptiveTimeout: quantile must be in (0, 1] (got 1.5)");
  EXPECT_EQ(message({.factor = 0.5}),
            "keel::AdaptiveTimeout: factor must be in [1, 100] (got 0.5)");
  EXPECT_EQ(message({.margin = -milliseconds(1)}),
            "keel::AdaptiveTimeout: margin must be >= 0 (got -1ms)");
  EXPECT_EQ(message({.floor = Duration::zero()}),
            "keel::AdaptiveTimeout: floor must be > 0 (got 0s)");
  EXPECT_EQ(message({.floor = seconds(2), .ceiling = seconds(1)}),
            "keel::AdaptiveTimeout: ceiling must be >= floor (2s) (got 1s)");
  EXPECT_EQ(message({.min_samples = 0}), "keel::AdaptiveTimeout: min_samples must be >= 1 (got 0)");
  EXPECT_EQ(message({.window = Duration::zero()}),
            "keel::AdaptiveTimeout: window must be in [1ms, 24h] (got 0s)");
  EXPECT_EQ(message({.buckets = 0}), "keel::AdaptiveTimeout: buckets must be in [1, 100] (got 0)");
  EXPECT_EQ(message({}), "accepted");
  EXPECT_THROW(keel::AdaptiveTimeoutRegistry({.max_keys = 0}), std::invalid_argument);
  EXPECT_THROW(LatencyTracker({.buckets = 101}), std::invalid_argument);
}

TEST(AdaptiveTimeoutRegistry, OneTimeoutPerKeyUpToMaxKeys) {
  keel::AdaptiveTimeoutRegistry registry({.timeout = {.min_samples = 1}, .max_keys = 2});
  auto a = registry.get("a:80");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(registry.get("a:80"), a);
  EXPECT_EQ(a->options().min_samples, 1);
  EXPECT_NE(registry.get("b:80"), nullptr);
  EXPECT_EQ(registry.get("c:80"), nullptr);  // full: c keeps its static timeout
  EXPECT_EQ(registry.find("c:80"), nullptr);
  EXPECT_EQ(registry.find("a:80"), a);
  EXPECT_EQ(registry.size(), 2u);
}

TEST(LatencyTracker, ThreadsRecordWhileOneReads) {
  // Real threads on one tracker; the clock moves on meanwhile, so buckets rotate under them.
  keel::ManualClock clock;
  LatencyTracker tracker({.window = seconds(1), .buckets = 10});
  constexpr int kWriters = 4;
  constexpr int kPerWriter = 50'000;
  std::atomic<bool> done{false};
  std::atomic<int> bad{0};
  std::vector<std::thread> writers;
  writers.reserve(kWriters);
  for (int w = 0; w < kWriters; ++w) {
    writers.emplace_back([&, w] {
      for (int i = 0; i < kPerWriter; ++i) {
        tracker.record(milliseconds(10 + (i + w) % 90), clock.now());
        if (i % 1000 == 0) clock.advance(milliseconds(7));
      }
    });
  }
  std::thread reader([&] {
    while (!done.load()) {
      const auto q = tracker.quantile(0.99, clock.now());
      if (q && (*q < milliseconds(9) || *q > milliseconds(101))) bad.fetch_add(1);
    }
  });
  for (auto& t : writers) t.join();
  done.store(true);
  reader.join();
  EXPECT_EQ(bad.load(), 0);

  // Without the clock moving, every record is counted exactly once.
  LatencyTracker still;
  const keel::TimePoint now{seconds(3)};
  std::vector<std::thread> more;
  more.reserve(kWriters);
  for (int w = 0; w < kWriters; ++w) {
    more.emplace_back([&] {
      for (int i = 0; i < kPerWriter; ++i) still.record(milliseconds(20), now);
    });
  }
  std::thread reader2([&] {
    for (int i = 0; i < 200; ++i) (void)still.quantile(0.999, now);
  });
  for (auto& t : more) t.join();
  reader2.join();
  EXPECT_EQ(still.count(now), kWriters * kPerWriter);
  EXPECT_NEAR(ms(*still.quantile(0.999, now)), 20.0, 20.0 / 128);
}

}  // namespace
