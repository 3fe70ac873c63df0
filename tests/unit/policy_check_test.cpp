// check_policy against schedules computed by hand, one per jitter kind, plus the edges: no
// per-try timeout, a worst case exactly at the deadline, attempts that can never start, and a
// billion attempts multiplied out in closed form.
#include "keel/core/policy_check.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <vector>

#include "keel/core/random.hpp"

using namespace std::chrono_literals;
using keel::check_policy;
using keel::Duration;
using keel::Jitter;
using keel::kInfinite;
using keel::PolicySchedule;
using keel::RetryPolicy;

namespace {

struct Row {
  Duration earliest;
  Duration expected;
  Duration latest;
  bool fits;
};

void expect_rows(const PolicySchedule& s, const std::vector<Row>& rows) {
  ASSERT_EQ(s.attempts.size(), rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    SCOPED_TRACE("attempt " + std::to_string(i + 1));
    EXPECT_EQ(s.attempts[i].number, static_cast<int>(i + 1));
    EXPECT_EQ(s.attempts[i].earliest_start, rows[i].earliest);
    EXPECT_EQ(s.attempts[i].expected_start, rows[i].expected);
    EXPECT_EQ(s.attempts[i].latest_start, rows[i].latest);
    EXPECT_EQ(s.attempts[i].fits, rows[i].fits);
  }
}

}  // namespace

// The seed's case: 250 ms x 3 attempts plus backoff against a 1 s budget. Full jitter waits
// [0, 100ms) then [0, 200ms), means 50 and 100 ms.
TEST(PolicyCheck, FullJitterThreeAttemptsOf250msDoNotFitOneSecond) {
  const PolicySchedule s =
      check_policy(RetryPolicy({.max_attempts = 3,
                                .per_try_timeout = 250ms,
                                .overall_timeout = 1s,
                                .backoff = {.base = 100ms, .cap = 5s, .jitter = Jitter::kFull}}));
  expect_rows(s, {{0ms, 0ms, 0ms, true},         // ends by 250ms
                  {0ms, 300ms, 350ms, true},     // 250 + 50; 250 + 100
                  {0ms, 650ms, 800ms, false}});  // 800 + 250 = 1.05s > 1s
  EXPECT_EQ(s.attempts[1].wait_before.min, 0ms);
  EXPECT_EQ(s.attempts[1].wait_before.max, 100ms);
  EXPECT_EQ(s.attempts[1].wait_before.mean, 50ms);
  EXPECT_EQ(s.attempts[2].timeout, 250ms);
  EXPECT_EQ(s.attempts[2].worst_timeout, 200ms);               // 1s - 800ms
  EXPECT_EQ(s.worst_total, 1050ms);                            // 3 x 250 + 100 + 200
  EXPECT_EQ(s.expected_total, 900ms);                          // 3 x 250 + 50 + 100
  EXPECT_EQ(s.worst_total_with_retry_after, 750ms + 2 * 60s);  // each wait the 60s cap
  EXPECT_FALSE(s.fits());
  EXPECT_EQ(s.first_unfit, 3);
  EXPECT_EQ(s.first_unfit_latest_start, 800ms);
  EXPECT_EQ(s.first_never_started, 0);
  EXPECT_EQ(keel::format_unfit(s),
            "attempt 3 of 3 does not fit the 1s deadline: in the worst case it starts at 800ms "
            "and its 250ms timeout ends at 1.05s (worst total 1.05s)");
}

// Equal jitter: ceilings 100, 200, 300 (capped); waits [50,100) [100,200) [150,300), means 75,
// 150, 225.
TEST(PolicyCheck, EqualJitterWaitsAtLeastHalfTheCeiling) {
  const PolicySchedule s = check_policy(
      RetryPolicy({.max_attempts = 4,
                   .per_try_timeout = 100ms,
                   .overall_timeout = 2s,
                   .backoff = {.base = 100ms, .cap = 300ms, .jitter = Jitter::kEqual}}));
  expect_rows(s, {{0ms, 0ms, 0ms, true},
                  {50ms, 175ms, 200ms, true},
                  {150ms, 425ms, 500ms, true},
                  {300ms, 750ms, 900ms, true}});
  EXPECT_EQ(s.attempts[3].wait_before.min, 150ms);
  EXPECT_EQ(s.attempts[3].wait_before.max, 300ms);
  EXPECT_EQ(s.worst_total, 1000ms);
  EXPECT_EQ(s.expected_total, 850ms);
  EXPECT_TRUE(s.fits());
  EXPECT_TRUE(keel::format_unfit(s).empty());
}

// No jitter: waits exactly 1s, 2s, 2s. Attempt 3 starts between 3s and 5s and cannot get its
// second before the 5s deadline; attempt 4's earliest start is the deadline itself, so it never
// starts (min_attempt_time 1ms).
TEST(PolicyCheck, NoJitterNamesTheFirstAttemptThatCanNeverStart) {
  const PolicySchedule s =
      check_policy(RetryPolicy({.max_attempts = 4,
                                .per_try_timeout = 1s,
                                .overall_timeout = 5s,
                                .backoff = {.base = 1s, .cap = 2s, .jitter = Jitter::kNone}}));
  expect_rows(s,
              {{0s, 0s, 0s, true}, {1s, 2s, 2s, true}, {3s, 5s, 5s, false}, {5s, 8s, 8s, false}});
  EXPECT_TRUE(s.attempts[2].can_start);
  EXPECT_EQ(s.attempts[2].worst_timeout, 0s);
  EXPECT_FALSE(s.attempts[3].can_start);
  EXPECT_EQ(s.attempts[3].timeout, 0s);
  EXPECT_EQ(s.worst_total, 9s);
  EXPECT_EQ(s.expected_total, 9s);
  EXPECT_EQ(s.first_unfit, 3);
  EXPECT_EQ(s.first_never_started, 4);
  EXPECT_NE(keel::format_unfit(s).find("attempt 4 can never start"), std::string::npos);
}

// Decorrelated jitter: wait n is min(cap, uniform[base, 3 x previous)). Longest: 300ms, 900ms,
// 1s (capped). Means: 200ms, 350ms, then E[min(1s, U[100ms, 1050ms))] =
// (900 x 1100 / 2 + 50 x 1000) / 950 ms = 573.684... ms.
TEST(PolicyCheck, DecorrelatedJitterGrowsFromThePreviousWait) {
  const PolicySchedule s = check_policy(
      RetryPolicy({.max_attempts = 4,
                   .per_try_timeout = 200ms,
                   .backoff = {.base = 100ms, .cap = 1s, .jitter = Jitter::kDecorrelated}}));
  ASSERT_EQ(s.attempts.size(), 4U);
  const Duration third_mean = s.attempts[3].wait_before.mean;
  using Ms = std::chrono::duration<double, std::milli>;
  EXPECT_NEAR(Ms(third_mean).count(), 545000.0 / 950.0, 1e-3);
  expect_rows(s, {{0ms, 0ms, 0ms, true},
                  {100ms, 400ms, 500ms, true},
                  {200ms, 950ms, 1600ms, true},
                  {300ms, 1150ms + third_mean, 2800ms, true}});
  EXPECT_EQ(s.attempts[2].wait_before.max, 900ms);
  EXPECT_EQ(s.attempts[3].wait_before.max, 1s);
  EXPECT_EQ(s.worst_total, 3000ms);
  EXPECT_EQ(s.expected_total, 1350ms + third_mean);
  EXPECT_TRUE(s.fits());  // no deadline
  EXPECT_EQ(s.deadline, kInfinite);
}

// Every decorrelated draw of a real chain lies inside the window check_policy reports.
TEST(PolicyCheck, DecorrelatedDrawsStayInsideTheReportedRanges) {
  const RetryPolicy policy(
      {.max_attempts = 8, .backoff = {.base = 10ms, .cap = 2s, .jitter = Jitter::kDecorrelated}});
  const PolicySchedule s = check_policy(policy);
  keel::Rng rng(42);
  for (int run = 0; run < 200; ++run) {
    Duration previous{};
    for (int retry = 0; retry < 7; ++retry) {
      const Duration d = policy.backoff().delay(retry, previous, rng);
      const keel::WaitRange& w = s.attempts[static_cast<std::size_t>(retry) + 1].wait_before;
      ASSERT_GE(d, w.min) << retry;
      ASSERT_LE(d, w.max) << retry;
      previous = d;
    }
  }
}

TEST(PolicyCheck, WorstCaseExactlyAtTheDeadlineFits) {
  const PolicySchedule s = check_policy(
      RetryPolicy({.max_attempts = 2,
                   .per_try_timeout = 400ms,
                   .overall_timeout = 1s,
                   .backoff = {.base = 200ms, .cap = 200ms, .jitter = Jitter::kNone}}));
  EXPECT_EQ(s.worst_total, 1s);
  EXPECT_TRUE(s.fits());
}

// Without a per-try timeout the first attempt may hang until the deadline.
TEST(PolicyCheck, NoPerTryTimeoutDoesNotFitAFiniteDeadline) {
  const PolicySchedule s = check_policy(RetryPolicy({.max_attempts = 3, .overall_timeout = 10s}));
  EXPECT_EQ(s.first_unfit, 1);
  EXPECT_EQ(s.worst_total, kInfinite);
  EXPECT_EQ(s.attempts[0].timeout, 10s);
  EXPECT_NE(keel::format_unfit(s).find("no per-try timeout"), std::string::npos);
  // And with neither, everything "fits": nothing bounds the operation, nothing is cut short.
  EXPECT_TRUE(check_policy(RetryPolicy({.max_attempts = 3})).fits());
}

// A billion attempts: the first 100 are listed, the rest multiplied out. Full jitter, base 1ms,
// cap 10ms, T 1ms: latest starts 0, 2, 5, 10, 19ms, then +11ms per attempt; the first k with
// 19 + (k - 5) x 11 + 1 > 3600000 ms is 327276.
TEST(PolicyCheck, ManyAttemptsAreMultipliedOutExactly) {
  const PolicySchedule s =
      check_policy(RetryPolicy({.max_attempts = 1'000'000'000,
                                .per_try_timeout = 1ms,
                                .overall_timeout = 1h,
                                .backoff = {.base = 1ms, .cap = 10ms, .jitter = Jitter::kFull}}));
  EXPECT_EQ(s.attempts.size(), static_cast<std::size_t>(keel::kListedAttempts));
  EXPECT_EQ(s.attempts[4].latest_start, 19ms);
  EXPECT_EQ(s.first_unfit, 327276);
  EXPECT_EQ(s.first_unfit_latest_start, 3600000ms);
  EXPECT_EQ(s.worst_total, 19ms + (1'000'000'000LL - 5) * 11ms + 1ms);
  EXPECT_EQ(s.first_never_started, 0);  // full jitter may wait zero every time
}

// The closed form agrees with attempt-by-attempt addition where both apply.
TEST(PolicyCheck, ClosedFormAgreesWithTheListedAttempts) {
  const auto make = [](int attempts) {
    return check_policy(
        RetryPolicy({.max_attempts = attempts,
                     .per_try_timeout = 30ms,
                     .overall_timeout = 5s,
                     .backoff = {.base = 5ms, .cap = 40ms, .jitter = Jitter::kEqual}}));
  };
  const PolicySchedule listed = make(keel::kListedAttempts);
  const PolicySchedule extended = make(keel::kListedAttempts + 50);
  const keel::ScheduledAttempt& last = listed.attempts.back();
  EXPECT_EQ(extended.worst_total, last.latest_start + 50 * (30ms + 40ms) + 30ms);
  EXPECT_EQ(extended.expected_total, last.expected_start + 50 * (30ms + 30ms) + 30ms);
  // 5s: the first attempt that does not fit is the same either way.
  EXPECT_EQ(listed.first_unfit, extended.first_unfit);
  EXPECT_GT(listed.first_unfit, 60);
}
