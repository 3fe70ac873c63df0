// The adaptive concurrency limit in virtual time: it refuses past its limit, finds the
// concurrency a saturated dependency sustains from latency alone (from far below and far above),
// cuts once per window on drops, does not grow while the caller is the bottleneck, learns a
// dependency that became slower for good within two baseline windows, and keeps its in-flight
// count under real threads (run under ThreadSanitizer by the tsan preset).
#include "keel/core/concurrency_limit.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace std::chrono_literals;
using keel::AdaptiveConcurrencyLimit;
using keel::ConcurrencyLimitOptions;
using keel::ConcurrencyPermit;
using keel::Duration;
using keel::TimePoint;

// A dependency of `servers` servers that each take `service`: with n calls in flight, a call
// takes service x max(1, n / servers) (a FIFO queue in front of the servers). Every caller
// calls as fast as the limit lets it: one window of calls per step.
struct Saturated {
  int servers = 10;
  Duration service = 10ms;
  [[nodiscard]] Duration latency(std::int64_t in_flight) const {
    const double load = std::max(1.0, static_cast<double>(in_flight) / servers);
    return std::chrono::duration_cast<Duration>(service * load);
  }
};

// Runs `seconds` of virtual time: every 10 ms, as many calls as the limit allows start (up to
// `demand` in flight) and the calls started one latency ago end. Returns the limit at the end.
std::int64_t drive(AdaptiveConcurrencyLimit& limit, const Saturated& dep, Duration run,
                   TimePoint& now, std::int64_t demand = 1'000'000) {
  const TimePoint end = now + run;
  while (now < end) {
    std::vector<ConcurrencyPermit> permits;
    while (static_cast<std::int64_t>(permits.size()) < demand) {
      ConcurrencyPermit p = limit.try_acquire();
      if (!p) break;
      permits.push_back(std::move(p));
    }
    const Duration took = dep.latency(static_cast<std::int64_t>(permits.size()));
    now += took;
    for (auto& p : permits) p.release(took, now);
  }
  return limit.limit();
}

TEST(AdaptiveConcurrencyLimit, RefusesPastTheLimitAndAPermitGivesItsPlaceBack) {
  AdaptiveConcurrencyLimit limit({.initial_limit = 2});
  ConcurrencyPermit a = limit.try_acquire();
  ConcurrencyPermit b = limit.try_acquire();
  ASSERT_TRUE(a);
  ASSERT_TRUE(b);
  EXPECT_EQ(b.in_flight_at_grant(), 2);
  EXPECT_FALSE(limit.try_acquire());
  EXPECT_EQ(limit.in_flight(), 2);
  a.ignore();
  EXPECT_EQ(limit.in_flight(), 1);
  {
    ConcurrencyPermit c = limit.try_acquire();
    EXPECT_TRUE(c);
  }  // destroyed: given back
  EXPECT_EQ(limit.in_flight(), 1);
  ConcurrencyPermit moved = std::move(b);
  EXPECT_FALSE(b);  // NOLINT(bugprone-use-after-move): a moved-from permit holds nothing
  moved.release(1ms, TimePoint{});
  EXPECT_EQ(limit.in_flight(), 0);
  EXPECT_EQ(limit.stats().refused, 1u);
  EXPECT_EQ(limit.retry_in(), 100ms);  // nothing measured yet: one window
}

TEST(AdaptiveConcurrencyLimit, RefusesInvalidOptionsByName) {
  const auto refused = [](ConcurrencyLimitOptions o, const std::string& field) {
    try {
      AdaptiveConcurrencyLimit limit(o);
      ADD_FAILURE() << field << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  refused({.min_limit = 0}, "min_limit");
  refused({.initial_limit = 5, .min_limit = 2, .max_limit = 1}, "max_limit");
  refused({.initial_limit = 0}, "initial_limit");
  refused({.tolerance = 0.9}, "tolerance");
  refused({.growth = 0}, "growth");
  refused({.smoothing = 0}, "smoothing");
  refused({.backoff_ratio = 1.0}, "backoff_ratio");
  refused({.window = 0ms}, "window");
  refused({.window_samples = 0}, "window_samples");
  refused({.window = 1s, .baseline_window = 500ms}, "baseline_window");
}

// Saturated, the limit settles where latency is about tolerance / (1 - growth) = 1.39 times the
// unloaded latency: the servers stay busy (limit >= servers) with a short queue (<= 2x).
TEST(AdaptiveConcurrencyLimit, FindsTheConcurrencyASaturatedDependencySustains) {
  const Saturated dep{.servers = 10, .service = 10ms};
  // From far above, the first windows take the queue for the dependency's speed; the probes
  // at each baseline epoch drain it (shorter epochs here, to see it within the run).
  for (const std::int64_t initial : {1, 10, 200}) {
    AdaptiveConcurrencyLimit limit(
        {.initial_limit = initial, .baseline_window = initial > 20 ? 2s : 30s});
    TimePoint now{};
    (void)drive(limit, dep, 40s, now);
    std::int64_t lo = 1 << 30;
    std::int64_t hi = 0;
    for (int i = 0; i < 20; ++i) {  // the next 2 s, sampled (a probe window may fall in them)
      const std::int64_t l = drive(limit, dep, 100ms, now);
      if (limit.stats().probing) continue;
      lo = std::min(lo, l);
      hi = std::max(hi, l);
    }
    EXPECT_GE(lo, 10) << "from " << initial;  // every server kept busy
    EXPECT_LE(hi, 20) << "from " << initial;  // latency at most 2x unloaded
  }
}

TEST(AdaptiveConcurrencyLimit, ADropCutsOncePerWindowWhateverItHolds) {
  AdaptiveConcurrencyLimit limit({.initial_limit = 100, .window_samples = 1});
  TimePoint now{};
  limit.try_acquire().release(10ms, now);  // starts the first window
  std::vector<ConcurrencyPermit> permits;
  for (int i = 0; i < 50; ++i) permits.push_back(limit.try_acquire());
  now += 150ms;
  for (auto& p : permits) p.drop(now);
  EXPECT_EQ(limit.limit(), 90);  // 100 x 0.9, once
  EXPECT_EQ(limit.stats().drops, 50u);
}

TEST(AdaptiveConcurrencyLimit, DoesNotGrowWhileTheCallerIsTheBottleneck) {
  const Saturated dep{.servers = 1000, .service = 10ms};
  AdaptiveConcurrencyLimit limit({.initial_limit = 20});
  TimePoint now{};
  (void)drive(limit, dep, 30s, now, /*demand=*/5);  // never more than 5 in flight
  EXPECT_EQ(limit.limit(), 20);
  (void)drive(limit, dep, 5s, now);  // then as many as it allows: it grows
  EXPECT_GT(limit.limit(), 100);
}

// A dependency that is slower for good (a new region, a slower disk) is not read as queueing
// forever: the baseline is the lowest window within the last one to two baseline windows.
TEST(AdaptiveConcurrencyLimit, LearnsADependencyThatBecameSlowerForGood) {
  AdaptiveConcurrencyLimit limit({.initial_limit = 20, .baseline_window = 10s});
  TimePoint now{};
  (void)drive(limit, {.servers = 10, .service = 10ms}, 20s, now);
  const Saturated slower{.servers = 10, .service = 40ms};
  EXPECT_GE(limit.stats().baseline, 9ms);
  EXPECT_LE(limit.stats().baseline, 11ms);
  (void)drive(limit, slower, 1s, now);
  EXPECT_LT(limit.limit(), 10);  // at first, read as queueing: cut
  (void)drive(limit, slower, 35s, now);
  EXPECT_GE(limit.stats().baseline, 40ms);  // learnt
  EXPECT_GE(limit.limit(), 10);
  EXPECT_LE(limit.limit(), 20);
}

TEST(AdaptiveConcurrencyLimit, KeepsItsCountUnderThreads) {
  AdaptiveConcurrencyLimit limit({.initial_limit = 8, .max_limit = 16, .window_samples = 5});
  std::atomic<int> inside{0};
  std::atomic<int> most{0};
  std::atomic<std::int64_t> clock_ns{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 20000; ++i) {
        ConcurrencyPermit p = limit.try_acquire();
        if (!p) continue;
        const int n = inside.fetch_add(1) + 1;
        int m = most.load();
        while (n > m && !most.compare_exchange_weak(m, n)) {
        }
        inside.fetch_sub(1);
        const TimePoint now{Duration(clock_ns.fetch_add(100'000))};
        if (i % 97 == 0) {
          p.drop(now);
        } else {
          p.release(1ms, now);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(limit.in_flight(), 0);
  EXPECT_LE(most.load(), 16);
  EXPECT_GT(limit.stats().windows, 0u);
  EXPECT_GE(limit.limit(), 1);
  EXPECT_LE(limit.limit(), 16);
}

}  // namespace
