#include "keel/core/clock.hpp"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

using namespace std::chrono_literals;
using keel::Deadline;
using keel::Duration;
using keel::kInfinite;

TEST(Saturating, AddAndSubClampInsteadOfWrapping) {
  EXPECT_EQ(keel::saturating_add(kInfinite, 1s), kInfinite);
  EXPECT_EQ(keel::saturating_add(Duration::max() - 1ns, 10ns), kInfinite);
  EXPECT_EQ(keel::saturating_add(Duration::min(), -1s), Duration::min());
  EXPECT_EQ(keel::saturating_sub(Duration::min(), 1s), Duration::min());
  EXPECT_EQ(keel::saturating_add(1s, 2s), 3s);
  EXPECT_EQ(keel::saturating_scale(1s, 1e30), kInfinite);
  EXPECT_EQ(keel::saturating_scale(1s, -2), 0s);
  EXPECT_EQ(keel::saturating_scale(1s, 1.5), 1500ms);
}

TEST(ManualClock, SleepAdvancesVirtualTimeAtOnce) {
  keel::ManualClock clock;
  const auto t0 = clock.now();
  const auto w0 = clock.wall_now();
  clock.sleep_for(30s);
  EXPECT_EQ(clock.now() - t0, 30s);
  EXPECT_EQ(clock.wall_now() - w0, 30s);
  EXPECT_EQ(clock.slept(), 30s);
  EXPECT_EQ(clock.sleeps(), 1);
  clock.sleep_for(-5s);  // ignored
  clock.advance(-5s);    // ignored: time never goes backwards
  EXPECT_EQ(clock.now() - t0, 30s);
  clock.advance(1s);
  EXPECT_EQ(clock.slept(), 30s);  // advance is not a sleep
  EXPECT_EQ(clock.now() - t0, 31s);
}

TEST(ManualClock, ATimerWaitAdvancesVirtualTimeAndLeavesNothingToWaitInRealTime) {
  keel::ManualClock clock;
  const auto t0 = clock.now();
  EXPECT_EQ(clock.begin_timer_wait(30s), Duration::zero());
  EXPECT_EQ(clock.now() - t0, 30s);
  EXPECT_EQ(clock.slept(), 30s);
  EXPECT_EQ(clock.sleeps(), 1);
  EXPECT_EQ(clock.begin_timer_wait(-5s), Duration::zero());
  EXPECT_EQ(clock.now() - t0, 30s);
}

TEST(SteadyClock, ATimerWaitIsTheWholeDelayInRealTime) {
  keel::Clock& clock = keel::steady_clock();
  EXPECT_EQ(clock.begin_timer_wait(30s), Duration(30s));
  EXPECT_EQ(clock.begin_timer_wait(-5s), Duration::zero());
}

TEST(ManualClock, TenYearsDoesNotOverflow) {
  keel::ManualClock clock;
  clock.sleep_for(std::chrono::hours(24 * 365 * 10));
  clock.sleep_for(kInfinite);
  EXPECT_GT(clock.now().time_since_epoch(), std::chrono::hours(24 * 365 * 10));
}

TEST(ManualClock, ConcurrentAdvanceLosesNothing) {
  keel::ManualClock clock;
  const auto t0 = clock.now();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) clock.sleep_for(1ms);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(clock.now() - t0, 40s);
  EXPECT_EQ(clock.sleeps(), 40000);
}

TEST(Deadline, InfiniteNeverExpires) {
  keel::ManualClock clock;
  const Deadline d = Deadline::after(clock, kInfinite);
  EXPECT_TRUE(d.is_infinite());
  clock.sleep_for(std::chrono::hours(24 * 365 * 100));
  EXPECT_FALSE(d.expired(clock.now()));
  EXPECT_EQ(d.remaining(clock.now()), kInfinite);
}

TEST(Deadline, RemainingCountsDownToZeroNeverNegative) {
  keel::ManualClock clock;
  const Deadline d = Deadline::after(clock, 5s);
  EXPECT_EQ(d.remaining(clock.now()), 5s);
  clock.sleep_for(2s);
  EXPECT_EQ(d.remaining(clock.now()), 3s);
  EXPECT_FALSE(d.expired(clock.now()));
  clock.sleep_for(3s);
  EXPECT_TRUE(d.expired(clock.now()));
  EXPECT_EQ(d.remaining(clock.now()), 0s);
  clock.sleep_for(1h);
  EXPECT_EQ(d.remaining(clock.now()), 0s);
}

TEST(Deadline, HugeDurationSaturates) {
  keel::ManualClock clock;
  const Deadline d = Deadline::after(clock, kInfinite - 1ns);
  EXPECT_FALSE(d.expired(clock.now()));
  EXPECT_GT(d.remaining(clock.now()), std::chrono::hours(24 * 365 * 200));
}

TEST(Deadline, MinPicksTheEarlier) {
  keel::ManualClock clock;
  const Deadline a = Deadline::after(clock, 5s);
  const Deadline b = Deadline::after(clock, 2s);
  EXPECT_EQ(a.min(b).when(), b.when());
  EXPECT_EQ(Deadline::infinite().min(a).when(), a.when());
}

TEST(SteadyClock, MovesForward) {
  auto& clock = keel::steady_clock();
  const auto t0 = clock.now();
  clock.sleep_for(0s);
  EXPECT_GE(clock.now(), t0);
  EXPECT_GE(keel::coarse_clock().now().time_since_epoch(), 0s);
}
