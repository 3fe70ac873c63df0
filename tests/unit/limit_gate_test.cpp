// keel::http's LimitGate, the driver of a host's rate and concurrency limits before each attempt,
// in virtual time: it applies core's rule for a slot whose call would leave late
// (RateLimit::on_time), and a permit it waited for outlives the slot it gave up.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <optional>

#include "keel/core/clock.hpp"
#include "keel/core/concurrency_limit.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/rate_limit.hpp"
#include "keel/http/detail/attempt.hpp"

namespace {

using namespace std::chrono_literals;
using keel::Duration;
using keel::TimePoint;
using keel::http::detail::LimitGate;

// A manual clock whose next sleeps end late, as a busy host's timers do, and that runs a hook as
// each sleep ends (another caller's move while this one waited).
class LateWakingClock final : public keel::Clock {
 public:
  [[nodiscard]] TimePoint now() const noexcept override { return inner_.now(); }
  [[nodiscard]] keel::WallTime wall_now() const noexcept override { return inner_.wall_now(); }
  void sleep_for(Duration d) override {
    if (d <= Duration::zero()) return;
    ++sleeps;
    inner_.advance(late_sleeps_ > 0 ? d + late_ : d);
    if (late_sleeps_ > 0) --late_sleeps_;
    if (after_sleep) after_sleep(sleeps);
  }
  // The next `count` sleeps end `late` after their time.
  void late(Duration late, int count) {
    late_ = late;
    late_sleeps_ = count;
  }
  std::function<void(int)> after_sleep;
  int sleeps = 0;

 private:
  keel::ManualClock inner_;
  Duration late_{};
  int late_sleeps_ = 0;
};

// 10 calls a second with the default headroom (3%): slots 103.1 ms apart, each to be spent within
// 15 ms of its time.
constexpr Duration kSpacing = Duration(103'092'784);
constexpr Duration kAllowance = 15ms;

TEST(LimitGate, ACallThatWakesPastItsSlotsAllowanceGivesItUpAndLeavesOnTheNext) {
  LateWakingClock clock;
  auto rate = std::make_shared<keel::RateLimit>(keel::RateLimitOptions{.rate_per_s = 10});
  const TimePoint t0 = clock.now();
  LimitGate first(rate, nullptr, 10s);
  ASSERT_FALSE(first.pass(clock, keel::Deadline::infinite()).has_value());
  EXPECT_EQ(clock.now(), t0) << "the first slot is now";

  // The second call's slot is one spacing later; its thread wakes 50 ms after it.
  clock.late(50ms, 1);
  LimitGate second(rate, nullptr, 10s);
  ASSERT_FALSE(second.pass(clock, keel::Deadline::infinite()).has_value());
  EXPECT_EQ(rate->stats().slots_late, 1U);
  // It did not leave at t0 + 153 ms on the slot it woke late for, but on the next one, within
  // that slot's allowance.
  EXPECT_GE(clock.now() - t0, 2 * kSpacing - 1ms);
  EXPECT_LE(clock.now() - t0, 2 * kSpacing + kAllowance);

  // Woken within the allowance: the slot is spent, nothing given up.
  clock.late(10ms, 1);
  LimitGate third(rate, nullptr, 10s);
  const TimePoint before = clock.now();
  ASSERT_FALSE(third.pass(clock, keel::Deadline::infinite()).has_value());
  EXPECT_EQ(rate->stats().slots_late, 1U);
  EXPECT_LE(clock.now() - before, kSpacing + 10ms);
}

TEST(LimitGate, ACallThatWokeLateForEverySlotStopsAtItsLimitWaitNotSendingLate) {
  // Every wake 50 ms late (past the 15 ms allowance each time): no slot is ever spent late; the
  // call stops once what is left of its wait for the limits is shorter than the next slot.
  LateWakingClock clock;
  auto rate = std::make_shared<keel::RateLimit>(keel::RateLimitOptions{.rate_per_s = 10});
  LimitGate busy(rate, nullptr, 10s);
  ASSERT_FALSE(busy.pass(clock, keel::Deadline::infinite()).has_value());
  clock.late(50ms, 1'000'000);
  LimitGate late(rate, nullptr, 1s);
  const std::optional<Duration> refused = late.pass(clock, keel::Deadline::infinite());
  ASSERT_TRUE(refused.has_value()) << "stops, nothing sent";
  EXPECT_GE(rate->stats().slots_late, 5U);
  EXPECT_GE(rate->stats().refused, 1U);
}

TEST(LimitGate, TheLimitWaitCountsTheTimeWaitedNotTheSleepsAskedFor) {
  // Every wake 60 ms late, over a grid of limit waits: the call stops within its limit wait and
  // one late wake of it, however many sleeps it took. Counting the sleeps asked for, it waited
  // about 1.6 times its limit (each 103 ms sleep took 163 ms).
  for (const Duration max_wait : {Duration(300ms), Duration(1s), Duration(2500ms), Duration(7s)}) {
    LateWakingClock clock;
    auto rate = std::make_shared<keel::RateLimit>(keel::RateLimitOptions{.rate_per_s = 10});
    LimitGate busy(rate, nullptr, 10s);
    ASSERT_FALSE(busy.pass(clock, keel::Deadline::infinite()).has_value());
    clock.late(60ms, 1'000'000);
    LimitGate late(rate, nullptr, max_wait);
    const TimePoint start = clock.now();
    ASSERT_TRUE(late.pass(clock, keel::Deadline::infinite()).has_value())
        << "every slot woken for late: nothing sent";
    EXPECT_LE(clock.now() - start, max_wait + 60ms) << keel::format_duration(max_wait);
    EXPECT_GE(clock.sleeps, 2) << keel::format_duration(max_wait);
    EXPECT_EQ(late.wait_left(), std::max(max_wait - (clock.now() - start), Duration::zero()));
  }
}

TEST(LimitGate, APermitWaitedForIsKeptWhileTheCallAsksForANewSlot) {
  // One permit, held by another call. This call takes its slot, waits for the permit past the
  // slot's allowance, gets it, gives the slot up and waits for the next one holding the permit:
  // a call that comes for it meanwhile is refused, and the wait for a permit cost one slot.
  LateWakingClock clock;
  // One call a second: the next slot is well after the wait for the permit, however it is drawn.
  auto rate = std::make_shared<keel::RateLimit>(keel::RateLimitOptions{.rate_per_s = 1});
  auto concurrency = std::make_shared<keel::AdaptiveConcurrencyLimit>(
      keel::ConcurrencyLimitOptions{.initial_limit = 1, .min_limit = 1, .max_limit = 1});
  keel::ConcurrencyPermit other = concurrency->try_acquire();
  ASSERT_TRUE(other);
  bool stolen = false;
  clock.late(50ms, 1);  // the wait for the permit ends past the slot's allowance
  clock.after_sleep = [&](int sleep) {
    if (sleep == 1) other.ignore();  // the other call ends while this one waits
    if (sleep == 2) stolen = static_cast<bool>(concurrency->try_acquire());
  };
  LimitGate gate(rate, concurrency, 10s);
  ASSERT_FALSE(gate.pass(clock, keel::Deadline::infinite()).has_value());
  EXPECT_EQ(clock.sleeps, 2) << "one wait for the permit, one for the next slot";
  EXPECT_FALSE(stolen) << "the permit was held through the wait for the next slot";
  EXPECT_EQ(concurrency->in_flight(), 1);
  EXPECT_EQ(rate->stats().slots_late, 1U);
  (void)gate.finish(keel::Outcome::success(), 10ms, clock.now());
  EXPECT_EQ(concurrency->in_flight(), 0);
}

}  // namespace

// keel::waits_in_line through the gate: a call whose wait ended in the rate limit's line gives
// up with its turn and says so (Outcome::in_line: its queue's worker goes on leasing); a turn
// longer than a call may wait at all, or a pause, is not the line (the worker holds its leasing).
TEST(LimitGate, ACallWhoseWaitEndedInTheLineSaysSoAndALongerTurnOrAPauseDoesNot) {
  // In line: every wake 50 ms late, so the call gives its slots up until what is left of its
  // 1 s is shorter than the next slot, which a new call would wait for.
  {
    LateWakingClock clock;
    auto rate = std::make_shared<keel::RateLimit>(keel::RateLimitOptions{.rate_per_s = 10});
    LimitGate busy(rate, nullptr, 10s);
    ASSERT_FALSE(busy.pass(clock, keel::Deadline::infinite()).has_value());  // the slot now
    clock.late(50ms, 1'000'000);
    LimitGate gate(rate, nullptr, 1s);
    const std::optional<Duration> refused = gate.pass(clock, keel::Deadline::infinite());
    ASSERT_TRUE(refused.has_value());
    EXPECT_GT(*refused, Duration::zero());
    EXPECT_LE(*refused, 1s);
    EXPECT_TRUE(gate.in_line());
  }
  // A turn longer than a call's whole wait (one call every 10 s, a wait of 1 s).
  {
    LateWakingClock clock;
    auto rate = std::make_shared<keel::RateLimit>(keel::RateLimitOptions{.rate_per_s = 0.1});
    LimitGate first(rate, nullptr, 1s);
    ASSERT_FALSE(first.pass(clock, keel::Deadline::infinite()).has_value());
    LimitGate second(rate, nullptr, 1s);
    const std::optional<Duration> refused = second.pass(clock, keel::Deadline::infinite());
    ASSERT_TRUE(refused.has_value());
    EXPECT_GT(*refused, 9s);
    EXPECT_FALSE(second.in_line());
  }
  // A pause, however short.
  {
    LateWakingClock clock;
    auto rate = std::make_shared<keel::RateLimit>(keel::RateLimitOptions{});
    (void)rate->pause(clock.now(), 1500ms);
    LimitGate held(rate, nullptr, 1s);
    const std::optional<Duration> refused = held.pass(clock, keel::Deadline::infinite());
    ASSERT_TRUE(refused.has_value());
    EXPECT_GE(*refused, 1500ms);
    EXPECT_FALSE(held.in_line());
  }
  EXPECT_TRUE(keel::waits_in_line({.go = false, .wait = 1500ms}, 2s));
  EXPECT_TRUE(keel::waits_in_line({.go = false, .wait = 2s}, 2s));
  EXPECT_FALSE(keel::waits_in_line({.go = false, .wait = 30s}, 2s));
  EXPECT_FALSE(keel::waits_in_line({.go = false, .wait = 500ms, .paused = true}, 2s));
  EXPECT_FALSE(keel::waits_in_line({.go = true}, 2s));
}
