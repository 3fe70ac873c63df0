// Circuit breakers: the published scenario replayed in virtual time for both window kinds, the
// seeds' "more than half in 30 s" rule, slow calls, growing breaks, the half-open timeout, the
// registry, and concurrent recording with real threads.
#include "keel/core/breaker.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "keel/core/clock.hpp"

namespace {

using namespace std::chrono_literals;
using keel::BreakerState;
using keel::Outcome;

constexpr Outcome kF = Outcome::transient();
constexpr Outcome kS = Outcome::success();

// Runs one call through the breaker; returns false when it was refused (the call did not run).
bool call(keel::CircuitBreaker& b, const Outcome& o) {
  const auto permit = b.try_acquire();
  if (!permit) return false;
  b.record(permit, o);
  return true;
}

class BreakerScenario : public ::testing::TestWithParam<keel::BreakerWindow> {};

// Threshold 50%, minimum 5 calls, open 5 s, 4 half-open trials.
TEST_P(BreakerScenario, ReplaysThePublishedSequence) {
  keel::ManualClock clock;
  std::vector<std::pair<BreakerState, BreakerState>> changes;
  keel::CircuitBreaker b({.window = GetParam(),
                          .window_calls = 10,
                          .window_length = 60s,
                          .minimum_calls = 5,
                          .failure_rate_threshold = 0.5,
                          .break_duration = 5s,
                          .half_open_trials = 4,
                          .clock = &clock,
                          .on_state_change = [&](BreakerState from, BreakerState to) {
                            changes.emplace_back(from, to);
                          }});
  // F,F,F,S,S: opens at the 5th call (3 of 5 = 60%).
  for (const Outcome& o : {kF, kF, kF, kS}) {
    ASSERT_TRUE(call(b, o));
    EXPECT_EQ(b.state(), BreakerState::kClosed);
  }
  ASSERT_TRUE(call(b, kS));
  EXPECT_EQ(b.state(), BreakerState::kOpen);

  // The next call is refused without running.
  int ran = 0;
  const auto permit = b.try_acquire();
  if (permit) ++ran;
  EXPECT_EQ(ran, 0);

  clock.advance(3s);
  EXPECT_EQ(b.state(), BreakerState::kOpen);
  EXPECT_FALSE(b.try_acquire());
  clock.advance(3s);  // 6 s after the trip
  EXPECT_EQ(b.state(), BreakerState::kHalfOpen);

  // Half-open admits exactly 4 calls.
  std::vector<keel::BreakerPermit> trials;
  for (int i = 0; i < 4; ++i) {
    trials.push_back(b.try_acquire());
    ASSERT_TRUE(trials.back()) << i;
    EXPECT_TRUE(trials.back().trial);
  }
  EXPECT_FALSE(b.try_acquire());
  // F,F,S,F re-opens.
  b.record(trials[0], kF);
  b.record(trials[1], kF);
  b.record(trials[2], kS);
  EXPECT_EQ(b.state(), BreakerState::kHalfOpen);
  b.record(trials[3], kF);
  EXPECT_EQ(b.state(), BreakerState::kOpen);

  clock.advance(6s);
  trials.clear();
  for (int i = 0; i < 4; ++i) trials.push_back(b.try_acquire());
  for (const auto& p : trials) ASSERT_TRUE(p);
  // F,S,S,S closes.
  b.record(trials[0], kF);
  b.record(trials[1], kS);
  b.record(trials[2], kS);
  b.record(trials[3], kS);
  EXPECT_EQ(b.state(), BreakerState::kClosed);
  EXPECT_EQ(b.snapshot().calls, 0);  // a fresh window
  EXPECT_TRUE(call(b, kS));

  const std::vector<std::pair<BreakerState, BreakerState>> expected = {
      {BreakerState::kClosed, BreakerState::kOpen},
      {BreakerState::kOpen, BreakerState::kHalfOpen},
      {BreakerState::kHalfOpen, BreakerState::kOpen},
      {BreakerState::kOpen, BreakerState::kHalfOpen},
      {BreakerState::kHalfOpen, BreakerState::kClosed},
  };
  EXPECT_EQ(changes, expected);
}

INSTANTIATE_TEST_SUITE_P(BothWindows, BreakerScenario,
                         ::testing::Values(keel::BreakerWindow::kCount, keel::BreakerWindow::kTime),
                         [](const auto& param_info) {
                           return param_info.param == keel::BreakerWindow::kCount ? "Count"
                                                                                  : "Time";
                         });

TEST(Breaker, TheSeedsRuleMoreThanHalfInThirtySeconds) {
  keel::ManualClock clock;
  auto options = keel::BreakerOptions::more_than_half_failed(30s, 4);
  options.clock = &clock;
  EXPECT_EQ(options.window, keel::BreakerWindow::kTime);
  EXPECT_EQ(options.window_length, 30s);
  keel::CircuitBreaker b(options);
  // Exactly half failed: not "more than half".
  for (const Outcome& o : {kF, kS, kF, kS}) ASSERT_TRUE(call(b, o));
  EXPECT_EQ(b.state(), BreakerState::kClosed);
  // 3 of 5 failed within 30 s: open.
  ASSERT_TRUE(call(b, kF));
  EXPECT_EQ(b.state(), BreakerState::kOpen);
}

TEST(Breaker, FailuresOlderThanTheWindowDoNotCount) {
  keel::ManualClock clock;
  auto options = keel::BreakerOptions::more_than_half_failed(30s, 4);
  options.clock = &clock;
  keel::CircuitBreaker b(options);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(call(b, kF));
  clock.advance(31s);  // those three have left the 30 s window
  for (const Outcome& o : {kS, kF, kS, kF}) ASSERT_TRUE(call(b, o));
  EXPECT_EQ(b.state(), BreakerState::kClosed);
  EXPECT_EQ(b.snapshot().calls, 4);
  EXPECT_EQ(b.snapshot().failures, 2);
}

TEST(Breaker, TheTimeWindowSlidesBucketByBucket) {
  keel::ManualClock clock;
  keel::CircuitBreaker b(
      {.window_length = 10s, .window_buckets = 10, .minimum_calls = 100, .clock = &clock});
  for (int s = 0; s < 10; ++s) {
    ASSERT_TRUE(call(b, kF));
    clock.advance(1s);
  }
  EXPECT_EQ(b.snapshot().failures, 9);  // the one from second 0 has left
  clock.advance(5s);
  EXPECT_EQ(b.snapshot().failures, 4);
  EXPECT_EQ(b.snapshot().calls, 4);
}

TEST(Breaker, TheCountWindowKeepsTheLastNCalls) {
  keel::ManualClock clock;
  keel::CircuitBreaker b({.window = keel::BreakerWindow::kCount,
                          .window_calls = 4,
                          .minimum_calls = 4,
                          .clock = &clock});
  for (const Outcome& o : {kF, kS, kS, kS, kS, kS}) ASSERT_TRUE(call(b, o));
  EXPECT_EQ(b.snapshot().calls, 4);
  EXPECT_EQ(b.snapshot().failures, 0);  // the failure was pushed out
  ASSERT_TRUE(call(b, kF));
  EXPECT_EQ(b.state(), BreakerState::kClosed);  // 1 of 4
  ASSERT_TRUE(call(b, kF));
  EXPECT_EQ(b.state(), BreakerState::kOpen);  // 2 of 4 = 50%
}

TEST(Breaker, PermanentFailuresDoNotCountThrottlingDoes) {
  keel::ManualClock clock;
  keel::CircuitBreaker b({.window = keel::BreakerWindow::kCount,
                          .window_calls = 10,
                          .minimum_calls = 4,
                          .clock = &clock});
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(call(b, Outcome::permanent()));  // 400s
  EXPECT_EQ(b.state(), BreakerState::kClosed);
  EXPECT_EQ(b.snapshot().failures, 0);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(call(b, Outcome::throttled(1s)));  // 429s
  EXPECT_EQ(b.state(), BreakerState::kOpen);
}

TEST(Breaker, SlowCallsTripItWithoutFailures) {
  keel::ManualClock clock;
  keel::CircuitBreaker b({.window = keel::BreakerWindow::kCount,
                          .window_calls = 10,
                          .minimum_calls = 4,
                          .slow_call_duration = 2s,
                          .slow_call_rate_threshold = 0.5,
                          .clock = &clock});
  // Measured by the breaker from the permit.
  auto p = b.try_acquire();
  clock.advance(3s);
  b.record(p, kS);
  p = b.try_acquire();
  clock.advance(1s);
  b.record(p, kS);
  EXPECT_EQ(b.snapshot().slow, 1);
  // Measured by the caller.
  b.record(b.try_acquire(), kS, 500ms);
  EXPECT_EQ(b.state(), BreakerState::kClosed);
  b.record(b.try_acquire(), kS, 2s);  // 2 of 4 slow
  EXPECT_EQ(b.state(), BreakerState::kOpen);
}

TEST(Breaker, TheBreakGrowsOnRepeatedTripsUpToTheCap) {
  keel::ManualClock clock;
  keel::CircuitBreaker b({.window = keel::BreakerWindow::kCount,
                          .window_calls = 1,
                          .minimum_calls = 1,
                          .break_duration = 5s,
                          .break_growth = 2,
                          .max_break_duration = 15s,
                          .half_open_trials = 1,
                          .clock = &clock});
  ASSERT_TRUE(call(b, kF));
  for (const auto expected : {5s, 10s, 15s, 15s}) {
    ASSERT_EQ(b.state(), BreakerState::kOpen);
    EXPECT_EQ(b.snapshot().open_remaining, expected);
    clock.advance(expected - 1ms);
    EXPECT_FALSE(b.try_acquire());
    clock.advance(1ms);
    ASSERT_TRUE(call(b, kF));  // the trial fails: open again, for longer
  }
  clock.advance(15s);
  ASSERT_TRUE(call(b, kS));  // the trial succeeds: closed, and the growth starts over
  EXPECT_EQ(b.state(), BreakerState::kClosed);
  ASSERT_TRUE(call(b, kF));
  EXPECT_EQ(b.snapshot().open_remaining, 5s);
}

TEST(Breaker, HalfOpenTimesOutWhenTrialsNeverReport) {
  keel::ManualClock clock;
  keel::CircuitBreaker b({.window = keel::BreakerWindow::kCount,
                          .window_calls = 1,
                          .minimum_calls = 1,
                          .break_duration = 5s,
                          .half_open_trials = 2,
                          .half_open_timeout = 10s,
                          .clock = &clock});
  ASSERT_TRUE(call(b, kF));
  clock.advance(5s);
  const auto lost1 = b.try_acquire();
  const auto lost2 = b.try_acquire();
  ASSERT_TRUE(lost1);
  ASSERT_TRUE(lost2);
  EXPECT_FALSE(b.try_acquire());
  clock.advance(9s);
  EXPECT_FALSE(b.try_acquire());
  EXPECT_EQ(b.state(), BreakerState::kHalfOpen);
  clock.advance(1s);
  EXPECT_FALSE(b.try_acquire());  // the timeout re-opens it...
  EXPECT_EQ(b.state(), BreakerState::kOpen);
  clock.advance(5s);  // ...and a new half-open round starts after the break
  const auto fresh = b.try_acquire();
  ASSERT_TRUE(fresh);
  // A report from the lost round does not count in the new one.
  b.record(lost1, kS);
  b.record(lost2, kS);
  EXPECT_EQ(b.state(), BreakerState::kHalfOpen);
  b.record(fresh, kS);
  b.record(b.try_acquire(), kS);
  EXPECT_EQ(b.state(), BreakerState::kClosed);
}

TEST(Breaker, LateReportsFromBeforeATripAreIgnored) {
  keel::ManualClock clock;
  keel::CircuitBreaker b({.window = keel::BreakerWindow::kCount,
                          .window_calls = 2,
                          .minimum_calls = 2,
                          .clock = &clock});
  const auto slow_call = b.try_acquire();
  ASSERT_TRUE(call(b, kF));
  ASSERT_TRUE(call(b, kF));
  ASSERT_EQ(b.state(), BreakerState::kOpen);
  b.record(slow_call, kS);  // reported after the trip
  EXPECT_EQ(b.state(), BreakerState::kOpen);
}

// A fleet's process judges after its share of the minimum calls (3 of 20 when 8 share). Two calls
// it sent before the fleet's break, reported only after the fleet closed again, must not make 2 of
// its first 3 calls after the close: they met the dependency as it was before the break.
TEST(Breaker, CallsAdmittedBeforeABreakDoNotCountAfterTheBreakerClosesAgain) {
  keel::ManualClock clock;
  for (const bool closed_by_reset : {false, true}) {
    SCOPED_TRACE(closed_by_reset ? "closed by reset (the fleet's release)" : "closed by a trial");
    keel::CircuitBreaker b({.minimum_calls = 20, .break_duration = 5s, .clock = &clock});
    b.set_fleet_size(8);
    ASSERT_EQ(b.minimum_calls(), 3);
    const auto before1 = b.try_acquire();  // in flight when the break begins
    const auto before2 = b.try_acquire();
    ASSERT_TRUE(before1 && before2);
    b.force_open(5s);  // another process's breaker opened
    clock.advance(5s);
    if (closed_by_reset) {
      b.reset();
    } else {
      const auto trial = b.try_acquire();
      ASSERT_TRUE(trial.trial);
      b.record(trial, kS);
    }
    ASSERT_EQ(b.state(), BreakerState::kClosed);
    b.record(before1, kF);  // their failures arrive after the close
    b.record(before2, kF);
    ASSERT_TRUE(call(b, kS));  // the first call of the closed period
    EXPECT_EQ(b.state(), BreakerState::kClosed);
    EXPECT_EQ(b.snapshot().calls, 1);
    EXPECT_EQ(b.snapshot().failures, 0);
    // Calls admitted after the close count as always: 2 of 3 failed trips it.
    ASSERT_TRUE(call(b, kF));
    ASSERT_TRUE(call(b, kF));
    EXPECT_EQ(b.state(), BreakerState::kOpen);
  }
}

// The same in a count window, and for a breaker that tripped on its own calls: a call admitted in
// an earlier closed period never lands in a later one.
TEST(Breaker, ACountWindowIgnoresAReportFromAnEarlierClosedPeriod) {
  keel::ManualClock clock;
  keel::CircuitBreaker b({.window = keel::BreakerWindow::kCount,
                          .window_calls = 4,
                          .minimum_calls = 2,
                          .break_duration = 1s,
                          .clock = &clock});
  const auto slow_call = b.try_acquire();
  ASSERT_TRUE(call(b, kF));
  ASSERT_TRUE(call(b, kF));
  ASSERT_EQ(b.state(), BreakerState::kOpen);
  clock.advance(1s);
  ASSERT_TRUE(call(b, kS));  // the trial closes it
  ASSERT_EQ(b.state(), BreakerState::kClosed);
  b.record(slow_call, kF);
  ASSERT_TRUE(call(b, kF));  // 1 of 1 counted: below the minimum
  EXPECT_EQ(b.state(), BreakerState::kClosed);
  EXPECT_EQ(b.snapshot().calls, 1);
}

TEST(Breaker, ResetClosesItWithAnEmptyWindow) {
  keel::ManualClock clock;
  keel::CircuitBreaker b({.minimum_calls = 1, .clock = &clock});
  ASSERT_TRUE(call(b, kF));
  ASSERT_EQ(b.state(), BreakerState::kOpen);
  b.reset();
  EXPECT_EQ(b.state(), BreakerState::kClosed);
  EXPECT_EQ(b.snapshot().calls, 0);
  EXPECT_TRUE(call(b, kS));
}

TEST(Breaker, ForceOpenStopsCallsForTheGivenBreakThenProbes) {
  keel::ManualClock clock;
  std::vector<std::pair<BreakerState, BreakerState>> changes;
  keel::CircuitBreaker b({.minimum_calls = 5,
                          .break_duration = 5s,
                          .clock = &clock,
                          .on_state_change = [&](BreakerState from, BreakerState to) {
                            changes.emplace_back(from, to);
                          }});
  ASSERT_TRUE(call(b, kS));
  b.force_open(3s);  // another process's breaker opened: this one stops without tripping itself
  EXPECT_EQ(b.state(), BreakerState::kOpen);
  EXPECT_EQ(b.snapshot().open_remaining, 3s);
  EXPECT_EQ(b.snapshot().consecutive_trips, 1);
  EXPECT_EQ(b.retry_in(), 3s);
  clock.advance(3s - 1ms);
  EXPECT_FALSE(b.try_acquire());
  clock.advance(1ms);
  const auto trial = b.try_acquire();  // the forced break is over: one half-open trial
  ASSERT_TRUE(trial);
  EXPECT_TRUE(trial.trial);
  EXPECT_FALSE(b.try_acquire());
  b.record(trial, kS);
  EXPECT_EQ(b.state(), BreakerState::kClosed);
  const std::vector<std::pair<BreakerState, BreakerState>> expected = {
      {BreakerState::kClosed, BreakerState::kOpen},
      {BreakerState::kOpen, BreakerState::kHalfOpen},
      {BreakerState::kHalfOpen, BreakerState::kClosed}};
  EXPECT_EQ(changes, expected);
}

TEST(Breaker, ForceOpenReplacesTheBreakOfAnOpenOrHalfOpenBreaker) {
  keel::ManualClock clock;
  int changes = 0;
  keel::CircuitBreaker b({.window = keel::BreakerWindow::kCount,
                          .window_calls = 1,
                          .minimum_calls = 1,
                          .break_duration = 2s,
                          .clock = &clock,
                          .on_state_change = [&](BreakerState, BreakerState) { ++changes; }});
  ASSERT_TRUE(call(b, kF));  // tripped by itself: open for 2 s
  ASSERT_EQ(changes, 1);
  b.force_open(10s);  // the fleet's break is longer: open -> open, no state change reported
  EXPECT_EQ(changes, 1);
  EXPECT_EQ(b.snapshot().open_remaining, 10s);
  EXPECT_EQ(b.snapshot().consecutive_trips, 2);
  clock.advance(10s);
  const auto trial = b.try_acquire();  // half-open, its trial out
  ASSERT_TRUE(trial);
  b.force_open(4s);  // the fleet's probe failed elsewhere: half-open -> open
  EXPECT_EQ(b.state(), BreakerState::kOpen);
  b.record(trial, kS);  // the lost round's trial does not close it
  EXPECT_EQ(b.state(), BreakerState::kOpen);
  clock.advance(1500us);  // off the millisecond grid: a break already over must not round up
  b.force_open(-1s);      // a break already over: the next call is a trial
  EXPECT_EQ(b.state(), BreakerState::kHalfOpen);
  EXPECT_EQ(b.retry_in(), 0ns);
  const auto next = b.try_acquire();
  ASSERT_TRUE(next);
  EXPECT_TRUE(next.trial);
  b.reset();  // the fleet closed
  EXPECT_EQ(b.state(), BreakerState::kClosed);
  EXPECT_EQ(b.snapshot().consecutive_trips, 0);
}

TEST(Breaker, TheTrialGateHoldsTheBreakerOpenWhileSomebodyElseProbes) {
  keel::ManualClock clock;
  std::vector<std::pair<BreakerState, BreakerState>> changes;
  std::vector<keel::Duration> answers = {2s, 0s};  // first: another process probes; then: us
  int asked = 0;
  keel::CircuitBreaker b(
      {.window = keel::BreakerWindow::kCount,
       .window_calls = 1,
       .minimum_calls = 1,
       .break_duration = 5s,
       .clock = &clock,
       .on_state_change = [&](BreakerState from,
                              BreakerState to) { changes.emplace_back(from, to); },
       .trial_gate = [&] { return answers.at(asked++); }});
  ASSERT_TRUE(call(b, kF));  // tripped: open for 5 s
  ASSERT_EQ(asked, 0);       // closed-state calls never ask
  clock.advance(5s);
  EXPECT_FALSE(b.try_acquire());  // the gate says somebody else probes: held open for 2 s
  EXPECT_EQ(asked, 1);
  EXPECT_EQ(b.state(), BreakerState::kOpen);
  EXPECT_EQ(b.retry_in(), 2s);
  EXPECT_EQ(b.snapshot().consecutive_trips, 1);  // a hold is not a trip
  clock.advance(2s - 1ms);
  EXPECT_FALSE(b.try_acquire());  // still held; the gate is not asked while open
  EXPECT_EQ(asked, 1);
  clock.advance(1ms);
  const auto trial = b.try_acquire();  // the gate lets this one probe
  ASSERT_TRUE(trial);
  EXPECT_TRUE(trial.trial);
  EXPECT_EQ(asked, 2);
  EXPECT_FALSE(b.try_acquire());  // the one trial is out: refused without asking
  EXPECT_EQ(asked, 2);
  b.record(trial, kS);
  EXPECT_EQ(b.state(), BreakerState::kClosed);
  const std::vector<std::pair<BreakerState, BreakerState>> expected = {
      {BreakerState::kClosed, BreakerState::kOpen},
      {BreakerState::kOpen, BreakerState::kHalfOpen},
      {BreakerState::kHalfOpen, BreakerState::kOpen},  // held
      {BreakerState::kOpen, BreakerState::kHalfOpen},
      {BreakerState::kHalfOpen, BreakerState::kClosed}};
  EXPECT_EQ(changes, expected);
}

TEST(Breaker, ProbesCountTheTrialsThatRanNotTheMomentsTheGateHeld) {
  keel::ManualClock clock;
  std::vector<keel::Duration> answers = {1s, 1s, 0s, 0s, 0s};  // held twice, then trials run
  std::size_t asked = 0;
  keel::CircuitBreaker b({.window = keel::BreakerWindow::kCount,
                          .window_calls = 1,
                          .minimum_calls = 1,
                          .break_duration = 5s,
                          .clock = &clock,
                          .trial_gate = [&] { return answers.at(asked++); }});
  ASSERT_TRUE(call(b, kF));
  EXPECT_EQ(b.snapshot().probes, 0);
  for (int held = 0; held < 2; ++held) {
    clock.advance(5s);
    EXPECT_FALSE(b.try_acquire());  // held open: half-open and back, no call sent
  }
  EXPECT_EQ(asked, 2U);
  EXPECT_EQ(b.snapshot().probes, 0);
  clock.advance(1s);
  auto trial = b.try_acquire();
  ASSERT_TRUE(trial.trial);
  b.record(trial, Outcome::not_attempted());  // released unattempted: not a probe
  EXPECT_EQ(b.snapshot().probes, 0);
  trial = b.try_acquire();
  ASSERT_TRUE(trial.trial);
  b.record(trial, kF);  // a probe that failed: open again
  EXPECT_EQ(b.snapshot().probes, 1);
  clock.advance(10s);
  trial = b.try_acquire();
  ASSERT_TRUE(trial.trial);
  b.record(trial, kS);
  EXPECT_EQ(b.state(), BreakerState::kClosed);
  EXPECT_EQ(b.snapshot().probes, 2);
  EXPECT_EQ(asked, 5U);
}

TEST(Breaker, ATrialGateThatThrowsLetsTheBreakerDecideAlone) {
  keel::ManualClock clock;
  keel::CircuitBreaker b(
      {.window = keel::BreakerWindow::kCount,
       .window_calls = 1,
       .minimum_calls = 1,
       .break_duration = 1s,
       .clock = &clock,
       .trial_gate = []() -> keel::Duration { throw std::runtime_error("database unreachable"); }});
  ASSERT_TRUE(call(b, kF));
  clock.advance(1s);
  const auto trial = b.try_acquire();
  ASSERT_TRUE(trial);
  EXPECT_TRUE(trial.trial);
}

TEST(Breaker, AHeldTrialSlotIsFreeForTheNextRoundUnderRealThreads) {
  // Many threads reach half-open at once; the gate holds the first three rounds and lets the
  // fourth probe. Exactly one trial runs in the whole run; it closes the breaker.
  keel::ManualClock clock;
  std::atomic<int> asked{0};
  keel::CircuitBreaker b({.window = keel::BreakerWindow::kCount,
                          .window_calls = 1,
                          .minimum_calls = 1,
                          .break_duration = 1s,
                          .clock = &clock,
                          .trial_gate = [&]() -> keel::Duration {
                            return asked.fetch_add(1) < 3 ? keel::Duration(1ns) : keel::Duration{};
                          }});
  ASSERT_TRUE(call(b, kF));
  clock.advance(1s);
  std::atomic<int> admitted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        const auto p = b.try_acquire();
        if (p.trial) {
          admitted.fetch_add(1);
          b.record(p, kS);
        }
        clock.advance(1ms);  // holds of 1 ns end at the next millisecond tick
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(admitted.load(), 1);
  EXPECT_EQ(asked.load(), 4);
  EXPECT_EQ(b.state(), BreakerState::kClosed);
}

TEST(Breaker, OneOfAFleetJudgesAfterItsShareOfTheMinimumCalls) {
  keel::ManualClock clock;
  keel::CircuitBreaker b({.minimum_calls = 20, .clock = &clock});
  EXPECT_EQ(b.minimum_calls(), 20);
  b.set_fleet_size(8);
  EXPECT_EQ(b.minimum_calls(), 3);  // ceil(20 / 8)
  b.set_fleet_size(100);
  EXPECT_EQ(b.minimum_calls(), 3);  // never fewer than 3
  b.set_fleet_size(4);
  EXPECT_EQ(b.minimum_calls(), 5);
  ASSERT_TRUE(call(b, kF));
  ASSERT_TRUE(call(b, kS));
  ASSERT_TRUE(call(b, kF));
  ASSERT_TRUE(call(b, kS));
  EXPECT_EQ(b.state(), BreakerState::kClosed);  // 4 calls: not yet judged
  ASSERT_TRUE(call(b, kF));                     // 3 of 5 failed
  EXPECT_EQ(b.state(), BreakerState::kOpen);
  b.set_fleet_size(0);  // alone again
  EXPECT_EQ(b.minimum_calls(), 20);
  keel::CircuitBreaker small({.minimum_calls = 2, .clock = &clock});
  small.set_fleet_size(8);
  EXPECT_EQ(small.minimum_calls(), 2);  // a minimum below 3 is kept
}

TEST(Breaker, RejectsInvalidOptionsNamingTheField) {
  const auto message = [](keel::BreakerOptions o) -> std::string {
    try {
      keel::CircuitBreaker b(std::move(o));
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "accepted";
  };
  EXPECT_NE(message({.window_calls = 0}).find("window_calls"), std::string::npos);
  EXPECT_NE(message({.minimum_calls = 0}).find("minimum_calls"), std::string::npos);
  EXPECT_NE(message({.failure_rate_threshold = 0}).find("failure_rate_threshold"),
            std::string::npos);
  EXPECT_NE(message({.failure_rate_threshold = 1.5}).find("1.5"), std::string::npos);
  EXPECT_NE(message({.break_duration = 0s}).find("break_duration"), std::string::npos);
  EXPECT_NE(message({.break_growth = 0.5}).find("break_growth"), std::string::npos);
  EXPECT_NE(message({.break_duration = 10s, .max_break_duration = 5s}).find("max_break"),
            std::string::npos);
  EXPECT_NE(message({.half_open_trials = 0}).find("half_open_trials"), std::string::npos);
  EXPECT_NE(message({.slow_call_duration = 0s}).find("slow_call_duration"), std::string::npos);
}

TEST(Breaker, ConcurrentRecordingIsCountedExactly) {
  keel::ManualClock clock;  // time stands still: no bucket rotates
  keel::CircuitBreaker b({.minimum_calls = 1000000, .clock = &clock});
  std::vector<std::thread> threads;
  threads.reserve(8);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 5000; ++i) {
        const auto p = b.try_acquire();
        b.record(p, (i % 5 == 0 && t % 2 == 0) ? kF : kS);
      }
    });
  }
  for (auto& th : threads) th.join();
  const auto snap = b.snapshot();
  EXPECT_EQ(snap.calls, 20000);
  EXPECT_EQ(snap.failures, 2000);
  EXPECT_EQ(snap.state, BreakerState::kClosed);
}

TEST(Breaker, ConcurrentRecordingWhileTimeMovesAndTheBreakerTrips) {
  keel::ManualClock clock;
  keel::CircuitBreaker b({.window_length = 1s,
                          .minimum_calls = 50,
                          .failure_rate_threshold = 0.5,
                          .break_duration = 10ms,
                          .half_open_trials = 3,
                          .clock = &clock});
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  threads.reserve(8);
  std::atomic<long> admitted_trials{0};
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20000; ++i) {
        const auto p = b.try_acquire();
        if (!p) continue;
        if (p.trial) admitted_trials.fetch_add(1);
        b.record(p, (i + t) % 2 == 0 ? kF : kS);
      }
    });
  }
  threads.emplace_back([&] {
    while (!stop.load()) {
      clock.advance(7ms);
      std::this_thread::yield();
    }
  });
  for (int t = 0; t < 3; ++t) threads[static_cast<std::size_t>(t)].join();
  stop.store(true);
  threads.back().join();
  const auto snap = b.snapshot();
  EXPECT_GE(snap.calls, 0);
  EXPECT_GE(snap.failures, 0);
  EXPECT_LE(snap.failures, 60000);
}

TEST(Breaker, HalfOpenAdmitsExactlyTheTrialsAcrossThreads) {
  keel::ManualClock clock;
  keel::CircuitBreaker b({.window = keel::BreakerWindow::kCount,
                          .window_calls = 1,
                          .minimum_calls = 1,
                          .break_duration = 1s,
                          .half_open_trials = 5,
                          .clock = &clock});
  for (int round = 0; round < 50; ++round) {
    b.reset();
    ASSERT_TRUE(call(b, kF));
    clock.advance(1s);
    std::atomic<int> admitted{0};
    std::atomic<int> ready{0};
    std::vector<std::thread> threads;
    threads.reserve(8);
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&] {
        ready.fetch_add(1);
        while (ready.load() < 4) {
        }
        for (int i = 0; i < 5; ++i) {
          if (b.try_acquire()) admitted.fetch_add(1);
        }
      });
    }
    for (auto& th : threads) th.join();
    ASSERT_EQ(admitted.load(), 5) << "round " << round;
  }
}

// A count window larger than 16 calls hands out its slots in runs; one thread still fills it in
// order, so exactly window_calls successes replace the oldest failures one by one.
TEST(Breaker, CountWindowOfRunsSlidesExactlyOnOneThread) {
  keel::ManualClock clock;
  keel::CircuitBreaker b({.window = keel::BreakerWindow::kCount,
                          .window_calls = 100,
                          .minimum_calls = 100,
                          .failure_rate_threshold = 1.0,
                          .clock = &clock});
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(call(b, kF));
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(call(b, kS));
  EXPECT_EQ(b.snapshot().calls, 100);
  EXPECT_EQ(b.snapshot().failures, 50);
  for (int i = 1; i <= 50; ++i) {
    ASSERT_TRUE(call(b, kS));
    ASSERT_EQ(b.snapshot().failures, 50 - i) << "after " << i << " more successes";
  }
  EXPECT_EQ(b.snapshot().calls, 100);
  EXPECT_EQ(b.state(), BreakerState::kClosed);
}

TEST(Breaker, CountWindowUnderRealThreadsKeepsItsTotalsConsistent) {
  keel::ManualClock clock;
  keel::CircuitBreaker b({.window = keel::BreakerWindow::kCount,
                          .window_calls = 100,
                          .minimum_calls = 1000000,  // never trips: the totals are under test
                          .clock = &clock});
  std::vector<std::thread> threads;
  threads.reserve(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20000; ++i) {
        const auto p = b.try_acquire();
        b.record(p, (i + t) % 3 == 0 ? kF : kS);
      }
    });
  }
  for (auto& th : threads) th.join();
  const auto mixed = b.snapshot();
  EXPECT_EQ(mixed.calls, 100);
  EXPECT_GE(mixed.failures, 0);
  EXPECT_LE(mixed.failures, 100);
  // One thread's window_calls successes, plus one run (at most 8) for the slots it had claimed
  // before, replace every failure.
  for (int i = 0; i < 108; ++i) ASSERT_TRUE(call(b, kS));
  EXPECT_EQ(b.snapshot().calls, 100);
  EXPECT_EQ(b.snapshot().failures, 0);
}

TEST(Breaker, CountWindowTripsUnderRealThreads) {
  keel::ManualClock clock;
  keel::CircuitBreaker b({.window = keel::BreakerWindow::kCount,
                          .window_calls = 100,
                          .minimum_calls = 20,
                          .failure_rate_threshold = 0.5,
                          .break_duration = 1h,
                          .max_break_duration = 1h,
                          .clock = &clock});
  std::vector<std::thread> threads;
  threads.reserve(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 1000; ++i) {
        const auto p = b.try_acquire();
        if (p) b.record(p, kF);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(b.state(), BreakerState::kOpen);
}

// On the default (steady) clock a time window places calls by the coarse clock: every call is
// still counted in the window, and a trip opens the breaker for its break.
TEST(Breaker, DefaultClockTimeWindowCountsEveryCall) {
  keel::CircuitBreaker b({.minimum_calls = 10, .failure_rate_threshold = 0.5});
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(call(b, kS));
  EXPECT_EQ(b.snapshot().calls, 10);
  for (int i = 0; i < 9; ++i) ASSERT_TRUE(call(b, kF));
  EXPECT_EQ(b.snapshot().calls, 19);
  EXPECT_EQ(b.snapshot().failures, 9);
  EXPECT_EQ(b.state(), BreakerState::kClosed);
  ASSERT_TRUE(call(b, kF));  // 10 of 20 failed
  EXPECT_EQ(b.state(), BreakerState::kOpen);
  EXPECT_GT(b.retry_in(), 4s);  // the default 5 s break, from the steady clock
}

// ---------------------------------------------------------------------------------------------
// Registry

keel::BreakerRegistryOptions registry_options(keel::Clock& clock, std::size_t max_keys = 1024) {
  keel::BreakerRegistryOptions o;
  o.breaker.window = keel::BreakerWindow::kCount;
  o.breaker.window_calls = 2;
  o.breaker.minimum_calls = 2;
  o.breaker.clock = &clock;
  o.max_keys = max_keys;
  return o;
}

TEST(BreakerRegistry, OneBrokenEndpointDoesNotBlockAnother) {
  keel::ManualClock clock;
  keel::BreakerRegistry registry(registry_options(clock));
  auto payments = registry.get("api.example/payments");
  auto search = registry.get("api.example/search");
  ASSERT_NE(payments, nullptr);
  ASSERT_NE(search, nullptr);
  EXPECT_NE(payments.get(), search.get());
  EXPECT_EQ(registry.get("api.example/payments").get(), payments.get());
  ASSERT_TRUE(call(*payments, kF));
  ASSERT_TRUE(call(*payments, kF));
  EXPECT_EQ(registry.state("api.example/payments"), BreakerState::kOpen);
  EXPECT_EQ(registry.state("api.example/search"), BreakerState::kClosed);
  EXPECT_EQ(registry.state("unknown"), std::nullopt);
  EXPECT_TRUE(call(*search, kS));
}

TEST(BreakerRegistry, ListenersHearEveryChangeWithTheKey) {
  keel::ManualClock clock;
  keel::BreakerRegistry registry(registry_options(clock));
  std::vector<std::string> heard;
  registry.add_listener([&](std::string_view key, BreakerState from, BreakerState to) {
    heard.push_back(std::string(key) + ": " + std::string(keel::to_string(from)) + " -> " +
                    std::string(keel::to_string(to)));
  });
  auto b = registry.get("db");
  ASSERT_TRUE(call(*b, kF));
  ASSERT_TRUE(call(*b, kF));
  clock.advance(5s);
  ASSERT_TRUE(call(*b, kS));
  const std::vector<std::string> expected = {"db: closed -> open", "db: open -> half-open",
                                             "db: half-open -> closed"};
  EXPECT_EQ(heard, expected);
}

TEST(BreakerRegistry, ARemovedListenerHearsNothingMore) {
  keel::ManualClock clock;
  keel::BreakerRegistry registry(registry_options(clock));
  int first = 0;
  int second = 0;
  const auto id =
      registry.add_listener([&](std::string_view, BreakerState, BreakerState) { ++first; });
  registry.add_listener([&](std::string_view, BreakerState, BreakerState) { ++second; });
  auto b = registry.get("db");
  ASSERT_TRUE(call(*b, kF));
  ASSERT_TRUE(call(*b, kF));  // closed -> open
  registry.remove_listener(id);
  registry.remove_listener(id + 100);  // unknown: nothing
  clock.advance(5s);
  ASSERT_TRUE(call(*b, kS));  // open -> half-open -> closed
  EXPECT_EQ(first, 1);
  EXPECT_EQ(second, 3);
}

TEST(BreakerRegistry, TheTrialGateReachesBreakersMadeBeforeAndAfterItWithTheirKey) {
  keel::ManualClock clock;
  keel::BreakerRegistry registry(registry_options(clock));
  auto before = registry.get("before");
  std::vector<std::string> asked;
  registry.set_trial_gate([&](std::string_view key) {
    asked.emplace_back(key);
    return keel::Duration(3s);  // somebody else probes every key
  });
  auto after = registry.get("after");
  for (auto* b : {before.get(), after.get()}) {
    ASSERT_TRUE(call(*b, kF));
    ASSERT_TRUE(call(*b, kF));
  }
  clock.advance(5s);
  EXPECT_FALSE(before->try_acquire());
  EXPECT_FALSE(after->try_acquire());
  EXPECT_EQ(asked, (std::vector<std::string>{"before", "after"}));
  EXPECT_EQ(before->retry_in(), 3s);
  registry.set_trial_gate(nullptr);  // removed: the breakers probe for themselves again
  clock.advance(3s);
  EXPECT_TRUE(before->try_acquire().trial);
  EXPECT_EQ(asked.size(), 2U);
}

TEST(BreakerRegistry, TheFleetSizeReachesBreakersMadeBeforeAndAfterIt) {
  keel::ManualClock clock;
  keel::BreakerRegistryOptions o;
  o.breaker.minimum_calls = 20;
  o.breaker.clock = &clock;
  keel::BreakerRegistry registry(o);
  auto before = registry.get("before");
  registry.set_fleet_size(4);
  auto after = registry.get("after");
  EXPECT_EQ(registry.fleet_size(), 4);
  EXPECT_EQ(before->minimum_calls(), 5);
  EXPECT_EQ(after->minimum_calls(), 5);
  registry.set_fleet_size(1);
  EXPECT_EQ(before->minimum_calls(), 20);
  EXPECT_EQ(after->minimum_calls(), 20);
}

TEST(BreakerRegistry, TheNumberOfKeysIsBounded) {
  keel::ManualClock clock;
  keel::BreakerRegistry registry(registry_options(clock, 2));
  auto a = registry.get("a");
  auto b = registry.get("b");
  ASSERT_TRUE(call(*a, kF));
  ASSERT_TRUE(call(*a, kF));   // a is open, b closed
  auto c = registry.get("c");  // evicts b, the oldest closed breaker
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(registry.size(), 2U);
  EXPECT_EQ(registry.evictions(), 1U);
  EXPECT_EQ(registry.find("b"), nullptr);
  EXPECT_TRUE(call(*b, kS));  // the holder's breaker is still alive
  EXPECT_EQ(registry.state("a"), BreakerState::kOpen);
  ASSERT_TRUE(call(*c, kF));
  ASSERT_TRUE(call(*c, kF));              // every breaker is open now
  EXPECT_EQ(registry.get("d"), nullptr);  // never shares a breaker between dependencies
  const auto snap = registry.snapshot();
  ASSERT_EQ(snap.size(), 2U);
  EXPECT_EQ(snap[0].first, "a");
  EXPECT_EQ(snap[1].first, "c");
  EXPECT_EQ(snap[1].second.state, BreakerState::kOpen);
}

TEST(BreakerRegistry, RejectsInvalidOptions) {
  keel::BreakerRegistryOptions o;
  o.max_keys = 0;
  EXPECT_THROW(keel::BreakerRegistry{o}, std::invalid_argument);
  keel::BreakerRegistryOptions bad;
  bad.breaker.minimum_calls = 0;
  EXPECT_THROW(keel::BreakerRegistry{bad}, std::invalid_argument);
}

TEST(BreakerRegistry, ConcurrentGetAndRecord) {
  keel::ManualClock clock;
  keel::BreakerRegistry registry(registry_options(clock, 8));
  std::mutex heard_mutex;
  int heard = 0;
  registry.add_listener([&](std::string_view, BreakerState, BreakerState) {
    const std::lock_guard lock(heard_mutex);
    ++heard;
  });
  std::vector<std::thread> threads;
  threads.reserve(8);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        auto b = registry.get("host-" + std::to_string((i + t) % 6));
        if (b) (void)call(*b, i % 3 == 0 ? kF : kS);
        (void)registry.state("host-1");
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(registry.size(), 6U);
  const std::lock_guard lock(heard_mutex);
  EXPECT_GE(heard, 0);
}

}  // namespace
