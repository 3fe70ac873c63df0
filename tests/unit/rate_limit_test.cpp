// A dependency's rate limit in virtual time: calls are spaced on a schedule with no 1-second
// window over rate + burst; a wait longer than the caller's takes no slot; a pause holds every
// call until its end plus jitter, is capped and only grows; a fleet's chunks are spent in order,
// the next one asked for before the last is spent, an empty bucket asks once and falls back on
// its share; slots that passed unused are not saved up; invalid options are refused by name.
#include "keel/core/rate_limit.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "keel/core/random.hpp"

namespace {

using namespace std::chrono_literals;
using keel::Duration;
using keel::RateDecision;
using keel::RateLimit;
using keel::RateLimitRegistry;
using keel::TimePoint;

// The most calls that went in any window of `width`, given the times they went at.
int busiest(std::vector<TimePoint> sent, Duration width) {
  std::sort(sent.begin(), sent.end());
  int most = 0;
  std::size_t lo = 0;
  for (std::size_t hi = 0; hi < sent.size(); ++hi) {
    while (sent[hi] - sent[lo] >= width) ++lo;
    most = std::max(most, static_cast<int>(hi - lo + 1));
  }
  return most;
}

TEST(RateLimit, SpacesCallsSoNoSecondHoldsMoreThanRatePlusBurst) {
  keel::Rng rng(1);
  RateLimit limit({.rate_per_s = 50, .burst = 5, .headroom = 0});
  std::vector<TimePoint> sent;
  TimePoint now{};
  // 400 callers arrive in bursts of 40 every 100 ms: 8 times the rate.
  for (int wave = 0; wave < 10; ++wave, now += 100ms) {
    for (int i = 0; i < 40; ++i) {
      const RateDecision d = limit.reserve(now, 60s, rng);
      ASSERT_TRUE(d.go);
      sent.push_back(now + d.wait);
    }
  }
  EXPECT_LE(busiest(sent, 1s), 55);
  EXPECT_GE(busiest(sent, 1s), 50);
  // Spaced, not bunched: after the burst, one call every 20 ms.
  std::sort(sent.begin(), sent.end());
  EXPECT_EQ(sent[100] - sent[99], 20ms);
  EXPECT_EQ(limit.stats().went, 400u);
}

TEST(RateLimit, AWaitLongerThanTheCallersTakesNoSlot) {
  keel::Rng rng(1);
  RateLimit limit({.rate_per_s = 10, .burst = 1, .headroom = 0});
  const TimePoint now{};
  EXPECT_TRUE(limit.reserve(now, 0ms, rng).go);  // the burst
  EXPECT_TRUE(limit.reserve(now, 0ms, rng).go);
  const RateDecision refused = limit.reserve(now, 50ms, rng);
  EXPECT_FALSE(refused.go);
  EXPECT_FALSE(refused.paused);
  EXPECT_EQ(refused.wait, 100ms);
  const RateDecision waits = limit.reserve(now, 1s, rng);  // the same slot, nobody took it
  EXPECT_TRUE(waits.go);
  EXPECT_EQ(waits.wait, 100ms);
  EXPECT_EQ(limit.stats().refused, 1u);
}

TEST(RateLimit, APauseHoldsEveryCallUntilItsEndPlusJitter) {
  keel::Rng rng(7);
  RateLimit limit({.rate_per_s = 0, .max_pause = 10s, .release_spread = 1s});
  const TimePoint now{};
  EXPECT_TRUE(limit.reserve(now, 0ms, rng).go);  // no rate: only pauses
  EXPECT_TRUE(limit.pause(now, 5s, false));
  EXPECT_FALSE(limit.pause(now, 3s, false));  // a shorter one changes nothing
  Duration lo = 1h;
  Duration hi{};
  for (int i = 0; i < 200; ++i) {
    const RateDecision d = limit.reserve(now + 1s, 60s, rng);
    ASSERT_FALSE(d.go);
    ASSERT_TRUE(d.paused);
    lo = std::min(lo, d.wait);
    hi = std::max(hi, d.wait);
  }
  EXPECT_GE(lo, 4s);
  EXPECT_LT(hi, 5s);
  EXPECT_LT(lo, 4s + 100ms);  // spread over the whole second
  EXPECT_GT(hi, 4s + 900ms);
  EXPECT_TRUE(limit.reserve(now + 5s, 0ms, rng).go);
  EXPECT_TRUE(limit.pause(now, 1h, false));  // capped
  EXPECT_EQ(limit.paused_until(), now + 10s);
}

// A fleet that hands out chunks of the shared schedule, or none.
class FakeFleet final : public keel::RateLimitFleet {
 public:
  RateLimit* limit = nullptr;
  bool answer = true;
  int wants = 0;
  int leases = 0;
  std::vector<TimePoint> pauses;
  TimePoint now{};
  void want(std::string_view) override { ++wants; }
  bool lease(std::string_view) override {
    ++leases;
    if (!answer) return false;
    limit->add_chunk(now, 0ms, limit->chunk_size());
    return true;
  }
  void paused(std::string_view, TimePoint until) override { pauses.push_back(until); }
};

TEST(RateLimit, SpendsTheFleetsChunksAndAsksForTheNextBeforeTheLastIsSpent) {
  keel::Rng rng(1);
  RateLimitRegistry limits({.rate_per_s = 50, .burst = 1, .headroom = 0});
  FakeFleet fleet;
  limits.attach_fleet(&fleet);
  auto limit = limits.get("api:443");
  fleet.limit = limit.get();
  limit->set_sharing(true);
  EXPECT_EQ(limit->chunk_size(), 5);
  // Before its pace is known a process leases one slot at a time, when it has none, and asks
  // for nothing ahead (a chunk leased ahead by a slow process would pass unused).
  EXPECT_EQ(limit->lease_size(fleet.now), 1);
  RateDecision d = limit->reserve(fleet.now, 1s, rng);
  EXPECT_TRUE(d.go);
  EXPECT_EQ(fleet.leases, 1);
  EXPECT_EQ(fleet.wants, 0);
  // A second at the full rate: the pace is the rate, and a lease is a whole chunk.
  for (int i = 1; i < 60; ++i) {
    fleet.now += 20ms;
    d = limit->reserve(fleet.now, 1s, rng);
    ASSERT_TRUE(d.go);
    fleet.now += d.wait;
  }
  EXPECT_EQ(limit->lease_size(fleet.now), 5);
  // Spent down to under half a chunk, the next one is asked for in the background.
  while (limit->slots_left(fleet.now) > 0) (void)limit->reserve(fleet.now, 1s, rng);
  const int leases = fleet.leases;
  const int wants = fleet.wants;
  limit->add_chunk(fleet.now, 0ms, 5);
  (void)limit->reserve(fleet.now, 1s, rng);
  (void)limit->reserve(fleet.now, 1s, rng);
  EXPECT_EQ(fleet.wants, wants);  // 3 of 5 left
  (void)limit->reserve(fleet.now, 1s, rng);
  EXPECT_EQ(fleet.wants, wants + 1);      // 2 left, under half a chunk: the next is asked for
  limit->add_chunk(fleet.now, 100ms, 5);  // the background lease's answer
  std::vector<Duration> waits;
  for (int i = 0; i < 7; ++i) {
    d = limit->reserve(fleet.now, 1s, rng);
    ASSERT_TRUE(d.go);
    waits.push_back(d.wait);
  }
  EXPECT_EQ(fleet.leases, leases);  // no call waited on the fleet again
  EXPECT_EQ(waits[1], 80ms);        // the first chunk's last slot
  EXPECT_EQ(waits[2], 100ms);       // the second chunk's first
  EXPECT_EQ(waits[6], 180ms);
  // A pause this process learnt is told to the fleet.
  EXPECT_TRUE(limit->pause(fleet.now, 5s));
  ASSERT_EQ(fleet.pauses.size(), 1u);
  EXPECT_EQ(fleet.pauses[0], fleet.now + 5s);
  limits.attach_fleet(nullptr);
}

// A lease the fleet does not answer in time may be this process's slow round trip while the
// others lease on: its calls are told to come back, nothing sent, until the fleet has answered
// nothing for kUnansweredBeforeShare (8 processes at 500/s on a loaded machine, calls that went
// on their share at once took the busiest second to 545 of 500); then they go on the share.
TEST(RateLimit, WithoutAnAnswerFromTheFleetTheCallsWaitThenGoOnTheirShare) {
  keel::Rng rng(1);
  RateLimitRegistry limits({.rate_per_s = 80, .burst = 1, .headroom = 0});
  FakeFleet fleet;
  fleet.answer = false;
  limits.attach_fleet(&fleet);
  auto limit = limits.get("api:443");
  fleet.limit = limit.get();
  limit->set_sharing(true);
  limit->set_share(1.0 / 8);  // 10/s
  TimePoint now{};
  int told = 0;
  while (now < TimePoint{} + RateLimit::kUnansweredBeforeShare) {
    const RateDecision d = limit->reserve(now, 10s, rng);
    ASSERT_FALSE(d.go) << "nothing on the share before the fleet is presumed out";
    EXPECT_GE(d.wait, RateLimit::kUnansweredRetry);
    ++told;
    now += d.wait;
  }
  EXPECT_GE(told, 5);
  EXPECT_EQ(limit->stats().on_share, 0u);
  EXPECT_EQ(limit->stats().fleet_busy, static_cast<std::uint64_t>(told));
  std::vector<TimePoint> sent;
  for (int i = 0; i < 30; ++i) {
    const RateDecision d = limit->reserve(now, 10s, rng);
    ASSERT_TRUE(d.go);
    sent.push_back(now + d.wait);
  }
  EXPECT_LE(busiest(sent, 1s), 10 + 8);
  EXPECT_EQ(limit->stats().on_share, 30u);
  // An answer (here: the schedule's room) starts the count again.
  limit->full_until(now, 0ms);
  now += 1s;
  EXPECT_FALSE(limit->reserve(now, 10s, rng).go);
  EXPECT_EQ(limit->stats().on_share, 30u);
  limits.attach_fleet(nullptr);
}

TEST(RateLimit, SlotsThatPassedUnusedAreNotSavedUp) {
  keel::Rng rng(1);
  RateLimit limit({.rate_per_s = 10, .burst = 1, .headroom = 0});
  limit.set_sharing(true);
  limit.add_chunk(TimePoint{}, 0ms, 100);  // 10 s of the schedule
  const TimePoint later = TimePoint{} + 5s;
  int at_once = 0;
  while (limit.reserve(later, 0ms, rng).go) ++at_once;
  EXPECT_LE(at_once, 2);  // the burst, not 5 s of saved slots
  EXPECT_GE(limit.stats().slots_lost, 48u);
}

// Under one call a second the allowance is half the headroom's share of a slot's time, not of a
// second: a dependency counts such a rate over a minute or an hour. At 120/h (a slot every
// 30.9 s) a slot leased in a slow round trip (300 ms: a loaded database) is still spent, where
// 15 ms lost it and its 30 s. And calls each up to the allowance late keep any minute's count
// at the quota's two; late by 2 s, they would not.
TEST(RateLimit, UnderOneCallASecondASlotMayBeSpentLateByItsShareOfTheSlotsTime) {
  keel::Rng rng(1);
  RateLimit hourly({.rate_per_s = 120.0 / 3600});
  const TimePoint t0{};
  const RateDecision first = hourly.reserve(t0, 1s, rng);
  ASSERT_TRUE(first.go);
  const Duration allowance = first.spend_by - t0;
  EXPECT_GT(allowance, 450ms);
  EXPECT_LT(allowance, 470ms);
  EXPECT_TRUE(hourly.on_time(first, t0 + 300ms));
  EXPECT_FALSE(hourly.on_time(RateDecision{first}, t0 + 500ms));
  for (const Duration late : {Duration::zero(), allowance, Duration(2s)}) {
    RateLimit limit({.rate_per_s = 120.0 / 3600});
    std::vector<TimePoint> sent;
    TimePoint now = t0;
    for (int i = 0; i < 240; ++i) {
      const RateDecision d = limit.reserve(now, 1h, rng);
      ASSERT_TRUE(d.go);
      now += d.wait;
      // Every third call leaves as late as `late`: two slots later comes a call on time.
      sent.push_back(i % 3 == 0 ? now + late : now);
    }
    const bool allowed = late <= allowance;
    if (allowed) {
      EXPECT_LE(busiest(sent, 60s), 2) << late.count();
    } else {
      EXPECT_GT(busiest(sent, 60s), 2) << "late by 2 s goes over a minute's quota";
    }
  }
  // At a second's rate and over, the allowance is the second's share: 15 ms.
  RateLimit one_a_second({.rate_per_s = 1});
  const Duration second_allowance = one_a_second.reserve(t0, 1s, rng).spend_by - t0;
  EXPECT_GE(second_allowance, 15ms);
  EXPECT_LT(second_allowance, 16ms);
}

// A lease the fleet could not answer because its row was busy (a lock or statement timeout, a
// lost race: other processes are leasing) leaves the calls waiting for the schedule, not on this
// process's share, whose slots would come on top of the ones the others spend (8 processes at
// 500/s: 3 that went on their share after a statement timeout took the busiest second to 699).
// Only a busy row that stays busy (a lock held) or another failure goes on the share.
TEST(RateLimit, ABusyScheduleKeepsTheCallsWaitingAndOnlyAHeldOneGoesOnTheShare) {
  using keel::DatabaseFailure;
  keel::Rng rng(1);
  const TimePoint t0 = TimePoint{} + 1h;
  for (const DatabaseFailure failure :
       {DatabaseFailure::kConflict, DatabaseFailure::kBusy, DatabaseFailure::kUnavailable,
        DatabaseFailure::kWrongNode, DatabaseFailure::kInDoubt, DatabaseFailure::kPermanent}) {
    const bool busy = failure == DatabaseFailure::kBusy || failure == DatabaseFailure::kConflict;
    RateLimit limit({.rate_per_s = 500});
    limit.set_sharing(true);
    limit.set_share(1.0 / 8);
    TimePoint now = t0;
    // Each failure in a row; a busy one goes on the share only past kBusyLeasesInARow.
    for (int i = 0; i <= RateLimit::kBusyLeasesInARow; ++i) {
      const bool share = limit.fleet_failed(now, 200ms, failure);
      const bool expected = !busy || i == RateLimit::kBusyLeasesInARow;
      ASSERT_EQ(share, expected) << keel::to_string(failure) << " failure " << i;
      const RateDecision d = limit.reserve(now, 0ms, rng);
      EXPECT_EQ(d.go, expected) << keel::to_string(failure) << " failure " << i;
      if (!expected) {
        EXPECT_GE(d.wait, 200ms) << "told to come back when the fleet is asked again";
      }
      if (expected) break;
      now += 250ms;
    }
    EXPECT_EQ(limit.stats().on_share, 1u) << keel::to_string(failure);
    EXPECT_EQ(limit.stats().fleet_failures, 1u) << keel::to_string(failure);
    EXPECT_EQ(limit.stats().fleet_busy,
              busy ? static_cast<std::uint64_t>(RateLimit::kBusyLeasesInARow) : 0u)
        << keel::to_string(failure);
  }
  // An answer of the fleet (a chunk, or its room) between busy leases starts the count again.
  for (const bool chunk : {true, false}) {
    RateLimit limit({.rate_per_s = 500});
    limit.set_sharing(true);
    TimePoint now = t0;
    for (int i = 0; i < 3 * RateLimit::kBusyLeasesInARow; ++i) {
      EXPECT_FALSE(limit.fleet_failed(now, 200ms, DatabaseFailure::kBusy)) << i;
      if (i % RateLimit::kBusyLeasesInARow == RateLimit::kBusyLeasesInARow - 1) {
        if (chunk) {
          limit.add_chunk(now, 0ms, 1);
        } else {
          limit.full_until(now, 10ms);
        }
      }
      now += 250ms;
    }
    EXPECT_EQ(limit.stats().fleet_failures, 0u);
  }
}

// An answer that comes just after the call stopped waiting for it (the background thread
// finished the lease it was abandoned by) is used, not held back by a "come back later"; and a
// busy answer to a lease asked ahead holds back new leases, not the slots already held.
TEST(RateLimit, ALateAnswerIsUsedAndABusyAnswerLeavesTheHeldSlotsToSpend) {
  keel::Rng rng(1);
  class LateFleet final : public keel::RateLimitFleet {
   public:
    RateLimit* limit = nullptr;
    TimePoint now{};
    void want(std::string_view) override {}
    bool lease(std::string_view) override {
      limit->add_chunk(now, 0ms, 5);  // answered as the wait ended
      return false;
    }
    void paused(std::string_view, TimePoint) override {}
  };
  RateLimitRegistry limits({.rate_per_s = 50, .burst = 1, .headroom = 0});
  LateFleet fleet;
  limits.attach_fleet(&fleet);
  auto limit = limits.get("api:443");
  fleet.limit = limit.get();
  limit->set_sharing(true);
  const RateDecision d = limit->reserve(fleet.now, 1s, rng);
  EXPECT_TRUE(d.go) << "the chunk that came late is spent";
  EXPECT_EQ(limit->stats().fleet_busy, 0u);
  EXPECT_EQ(limit->stats().on_share, 0u);
  EXPECT_EQ(limit->stats().chunks, 1u);
  // Four slots held; a busy answer comes (a lease asked ahead): they are still spent, on time.
  EXPECT_FALSE(limit->fleet_failed(fleet.now, 500ms, keel::DatabaseFailure::kBusy));
  for (int i = 1; i < 5; ++i) {
    const RateDecision held = limit->reserve(fleet.now, 1s, rng);
    ASSERT_TRUE(held.go) << i;
    EXPECT_EQ(held.wait, i * 20ms);
  }
  // None left: told to come back until the busy answer's time.
  const RateDecision after = limit->reserve(fleet.now, 1s, rng);
  EXPECT_FALSE(after.go);
  EXPECT_EQ(after.wait, 500ms);
  limits.attach_fleet(nullptr);
}

// A slot leased from the fleet is held to the same allowance as a local one: over a grid of rates,
// a chunk's slot found just within the allowance after its time is spent (with that allowance's
// spend_by), one just past it is lost, not spent late.
TEST(RateLimit, ALeasedSlotIsSpentWithinTheSameAllowanceAsALocalOne) {
  keel::Rng rng(1);
  const TimePoint t0 = TimePoint{} + 1h;
  for (const double rate : {120.0 / 3600, 1.0 / 60, 0.5, 1.0, 5.0, 50.0, 500.0, 2000.0}) {
    RateLimit local({.rate_per_s = rate});
    const Duration allowance = local.reserve(t0, 1s, rng).spend_by - t0;
    for (const bool within : {true, false}) {
      RateLimit shared({.rate_per_s = rate});
      shared.set_sharing(true);
      // One slot, due `allowance` (or a microsecond more) before now.
      const Duration ago = within ? allowance : allowance + std::chrono::microseconds(1);
      shared.add_chunk(t0, -ago, 1);
      const RateDecision d = shared.reserve(t0, 0ms, rng);
      if (within) {
        ASSERT_TRUE(d.go) << rate;
        EXPECT_EQ(d.wait, 0ms) << rate;
        EXPECT_EQ(d.spend_by, t0) << rate << ": the allowance counts from the slot's time";
        EXPECT_EQ(shared.stats().slots_lost, 0u) << rate;
      } else {
        EXPECT_EQ(shared.stats().slots_lost, 1u) << rate << ": too late, lost";
      }
    }
  }
}

// A slot may be spent at most the limit's lateness after its time (half the headroom's share of a
// second: 15 ms at the default 3%): a call that would leave later gives it up and asks again.
TEST(RateLimit, ACallThatWouldLeaveLaterThanItsSlotAllowsGivesTheSlotUp) {
  keel::Rng rng(1);
  RateLimit limit({.rate_per_s = 50});  // a slot every 20.6 ms; 15 ms of lateness
  const TimePoint t0{};
  const RateDecision first = limit.reserve(t0, 1s, rng);
  ASSERT_TRUE(first.go);
  EXPECT_EQ(first.wait, 0ms);
  EXPECT_EQ(first.spend_by, t0 + 15ms);
  const RateDecision second = limit.reserve(t0, 1s, rng);
  ASSERT_TRUE(second.go);
  EXPECT_EQ(second.spend_by, t0 + second.wait + 15ms);
  EXPECT_TRUE(limit.on_time(first, t0 + 15ms));
  EXPECT_FALSE(limit.on_time(first, t0 + 15ms + 1ns));
  EXPECT_FALSE(limit.on_time(second, t0 + second.wait + 40ms));
  EXPECT_EQ(limit.stats().slots_late, 2u);
  // Asked again, the late call gets a slot after the ones already taken, not the lost one.
  const RateDecision again = limit.reserve(t0 + second.wait + 40ms, 1s, rng);
  ASSERT_TRUE(again.go);
  EXPECT_GE(again.spend_by, t0 + second.wait + 40ms);
  // Without a rate there is no slot to be late for.
  RateLimit pauses_only(keel::RateLimitOptions{});
  const RateDecision any = pauses_only.reserve(t0, 1s, rng);
  EXPECT_EQ(any.spend_by, TimePoint::max());
  EXPECT_TRUE(pauses_only.on_time(any, t0 + 24h));
  // A slot taken early (the burst, after a quiet spell) is due at once: the allowance counts
  // from now, not from the slot's virtual time.
  RateLimit bursty({.rate_per_s = 20, .burst = 2, .headroom = 0});  // 100 ms of burst: allowed late
  const TimePoint quiet = t0 + 10s;
  const RateDecision early = bursty.reserve(quiet, 1s, rng);
  ASSERT_TRUE(early.go);
  EXPECT_EQ(early.wait, 0ms);
  EXPECT_TRUE(bursty.on_time(early, quiet + 100ms));
  EXPECT_FALSE(bursty.on_time(early, quiet + 101ms));
  // A fleet's chunk: the same allowance after each leased slot.
  RateLimit shared({.rate_per_s = 50});
  shared.set_sharing(true);
  shared.add_chunk(t0, 100ms, 5);
  const RateDecision leased = shared.reserve(t0, 1s, rng);
  ASSERT_TRUE(leased.go);
  EXPECT_EQ(leased.wait, 100ms);
  EXPECT_EQ(leased.spend_by, t0 + 115ms);
  EXPECT_FALSE(shared.on_time(leased, t0 + 116ms));
}

TEST(RateLimit, LeavesItsHeadroomUnusedByDefault) {
  keel::Rng rng(1);
  RateLimit limit({.rate_per_s = 50});  // spaced at 48.5/s: 20.6 ms
  std::vector<TimePoint> sent;
  for (int i = 0; i < 200; ++i) {
    const RateDecision d = limit.reserve(TimePoint{}, 60s, rng);
    ASSERT_TRUE(d.go);
    sent.push_back(TimePoint{} + d.wait);
  }
  EXPECT_LE(busiest(sent, 1s), 49);  // 48.5 a second, no burst: never the full 50
  EXPECT_DOUBLE_EQ(limit.spaced_rate(), 48.5);
}

TEST(RateLimit, RefusesInvalidOptionsByName) {
  const auto refused = [](keel::RateLimitOptions o, const std::string& field) {
    try {
      RateLimit limit(o);
      ADD_FAILURE() << field << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  refused({.rate_per_s = -1}, "rate_per_s");
  refused({.rate_per_s = 10, .burst = 0.5}, "burst");
  refused({.rate_per_s = 10, .headroom = 0.5}, "headroom");
  refused({.max_pause = 0s}, "max_pause");
  refused({.release_spread = -1s}, "release_spread");
}

TEST(RateLimit, KeepsTheRateUnderThreads) {
  RateLimit limit({.rate_per_s = 1000, .burst = 10, .headroom = 0});
  std::vector<std::thread> threads;
  std::vector<std::vector<TimePoint>> sent(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      keel::Rng rng(static_cast<std::uint64_t>(t) + 1);
      for (int i = 0; i < 2000; ++i) {
        const TimePoint now{Duration(i * 1'000'000LL)};  // each thread's own virtual time
        const RateDecision d = limit.reserve(now, 60s, rng);
        if (d.go) sent[static_cast<std::size_t>(t)].push_back(now + d.wait);
      }
    });
  }
  for (auto& th : threads) th.join();
  std::vector<TimePoint> all;
  for (const auto& s : sent) all.insert(all.end(), s.begin(), s.end());
  EXPECT_EQ(all.size(), 8000u);
  EXPECT_LE(busiest(all, 1s), 1000 + 10);
}

}  // namespace
