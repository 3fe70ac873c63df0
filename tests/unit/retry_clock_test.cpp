// When the retry engine reads its clock, and what RetryResult::elapsed then measures: no read for
// a first-try success without a deadline or a per-try timeout (elapsed is zero), a read at the
// start when there is one (elapsed covers the whole operation), and otherwise a first read when
// an attempt fails (elapsed counts from the end of that attempt). In virtual time.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <vector>

#include "keel/core/retry.hpp"

namespace {

using namespace std::chrono_literals;
using keel::AttemptInfo;
using keel::Outcome;
using keel::RetryPolicy;

// A ManualClock that counts the reads of now().
class CountingClock final : public keel::Clock {
 public:
  [[nodiscard]] keel::TimePoint now() const noexcept override {
    reads_.fetch_add(1, std::memory_order_relaxed);
    return inner_.now();
  }
  [[nodiscard]] keel::WallTime wall_now() const noexcept override { return inner_.wall_now(); }
  void sleep_for(keel::Duration d) override { inner_.sleep_for(d); }
  void advance(keel::Duration d) noexcept { inner_.advance(d); }
  [[nodiscard]] std::int64_t reads() const noexcept { return reads_.load(); }

 private:
  keel::ManualClock inner_;
  mutable std::atomic<std::int64_t> reads_{0};
};

struct Harness {
  CountingClock clock;
  keel::Rng rng{99};
  keel::CallOptions call(keel::Deadline deadline = keel::Deadline::infinite()) {
    keel::CallOptions c;
    c.clock = &clock;
    c.rng = &rng;
    c.safe_to_repeat = true;
    c.deadline = deadline;
    return c;
  }
};

// A dependency whose attempts each take `takes` of virtual time and return the script in order.
struct TimedScript {
  CountingClock& clock;
  keel::Duration takes;
  std::vector<Outcome> outcomes;
  std::size_t next = 0;
  Outcome operator()(const AttemptInfo& /*attempt*/) {
    clock.advance(takes);
    const Outcome o = outcomes[next < outcomes.size() ? next : outcomes.size() - 1];
    ++next;
    return o;
  }
};

TEST(RetryClock, AFirstTrySuccessWithoutDeadlineReadsNoClock) {
  Harness h;
  const RetryPolicy policy({.max_attempts = 3});
  auto r = keel::retry(policy, TimedScript{h.clock, 2s, {Outcome::success()}}, h.call());
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r.attempts, 1);
  EXPECT_EQ(h.clock.reads(), 0);
  EXPECT_EQ(r.elapsed, keel::Duration::zero());  // not measured: nothing needed the time
}

TEST(RetryClock, AStateMachineSuccessWithoutDeadlineReadsNoClock) {
  Harness h;
  const RetryPolicy policy;
  keel::RetryState state(policy, h.call());
  const keel::AttemptStart start = state.start_attempt();
  ASSERT_TRUE(start.proceed);
  EXPECT_EQ(start.attempt.timeout, keel::kInfinite);
  EXPECT_FALSE(state.next(Outcome::success()).retry);
  EXPECT_EQ(h.clock.reads(), 0);
  EXPECT_EQ(state.elapsed(), keel::Duration::zero());
}

TEST(RetryClock, AnOverallTimeoutIsMeasuredFromTheStart) {
  Harness h;
  const RetryPolicy policy({.max_attempts = 3, .overall_timeout = 10s});
  auto r = keel::retry(policy, TimedScript{h.clock, 2s, {Outcome::success()}}, h.call());
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r.elapsed, 2s);
  EXPECT_GE(h.clock.reads(), 1);
}

// keel::retry starts its first attempt as it constructs the state: with a deadline it reads the
// clock at the start and for elapsed, not a third time for the first deadline check.
TEST(RetryClock, WithADeadlineKeelRetryReadsAtTheStartAndForElapsed) {
  Harness h;
  const RetryPolicy policy({.max_attempts = 3, .overall_timeout = 10s});
  auto r = keel::retry(policy, TimedScript{h.clock, 0s, {Outcome::success()}}, h.call());
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(h.clock.reads(), 2);
}

// A state driven by hand checks the deadline at the first start_attempt() itself: time that
// passed since construction counts.
TEST(RetryClock, AHandDrivenStateChecksTheDeadlineWhenTheFirstAttemptStarts) {
  Harness h;
  const RetryPolicy policy({.max_attempts = 3});
  keel::RetryState late(policy, h.call(keel::Deadline::after(h.clock, 1s)));
  h.clock.advance(2s);
  const keel::AttemptStart start = late.start_attempt();
  EXPECT_FALSE(start.proceed);
  EXPECT_EQ(start.reason, keel::StopReason::kDeadline);

  keel::RetryState soon(policy, h.call(keel::Deadline::after(h.clock, 1s)));
  h.clock.advance(400ms);
  const keel::AttemptStart first = soon.start_attempt();
  ASSERT_TRUE(first.proceed);
  EXPECT_EQ(first.attempt.timeout, 600ms);
}

TEST(RetryClock, ACallersDeadlineIsMeasuredFromTheStart) {
  Harness h;
  const RetryPolicy policy({.max_attempts = 3});
  auto r = keel::retry(policy, TimedScript{h.clock, 3s, {Outcome::success()}},
                       h.call(keel::Deadline::after(h.clock, 1min)));
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r.elapsed, 3s);
}

TEST(RetryClock, APerTryTimeoutIsMeasuredFromTheStart) {
  Harness h;
  const RetryPolicy policy({.max_attempts = 3, .per_try_timeout = 5s});
  auto r = keel::retry(policy, TimedScript{h.clock, 2s, {Outcome::success()}}, h.call());
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r.elapsed, 2s);
}

// Without a deadline or a per-try timeout the first read is at the first failure: elapsed holds
// the wait and the later attempts, not the first attempt.
TEST(RetryClock, WithoutDeadlineElapsedCountsFromTheFirstFailure) {
  Harness h;
  std::vector<keel::GiveUpEvent> gave_up;
  const RetryPolicy policy(
      {.max_attempts = 3,
       .backoff = {.base = 1s, .cap = 1s, .jitter = keel::Jitter::kNone},
       .on_give_up = [&](const keel::GiveUpEvent& e) { gave_up.push_back(e); }});
  auto ok = keel::retry(
      policy, TimedScript{h.clock, 3s, {Outcome::transient(), Outcome::success()}}, h.call());
  EXPECT_TRUE(ok.ok());
  EXPECT_EQ(ok.attempts, 2);
  EXPECT_EQ(ok.elapsed, 1s + 3s);  // the wait, then the second attempt

  auto failed = keel::retry(policy, TimedScript{h.clock, 3s, {Outcome::transient()}}, h.call());
  EXPECT_EQ(failed.reason, keel::StopReason::kAttemptsExhausted);
  EXPECT_EQ(failed.elapsed, 2 * (1s + 3s));
  ASSERT_EQ(gave_up.size(), 1u);
  EXPECT_EQ(gave_up[0].elapsed, failed.elapsed);
}

TEST(RetryClock, TheRetryDepthIsThisThreadsAndEndsWithTheLoop) {
  Harness h;
  const RetryPolicy policy({.max_attempts = 3});
  int depth_inside = -1;
  auto r = keel::retry(
      policy,
      [&] {
        depth_inside = keel::retry_depth();
        return Outcome::success();
      },
      h.call());
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(depth_inside, 1);
  EXPECT_EQ(keel::retry_depth(), 0);
}

}  // namespace
