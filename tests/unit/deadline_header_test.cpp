// Keel-Deadline-Ms: the strict parser over hostile input (size, sign, overflow, whitespace,
// duplicates folded into a list), the sender's formatting, and the retry engine's ceiling
// (min of its own deadline and the incoming one) in virtual time.
#include "keel/core/deadline_header.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "keel/core/retry.hpp"

using namespace std::chrono_literals;
using keel::Duration;
using keel::format_deadline_header;
using keel::parse_deadline_header;

TEST(DeadlineHeader, ParsesWholeMilliseconds) {
  EXPECT_EQ(*parse_deadline_header("0"), Duration::zero());
  EXPECT_EQ(*parse_deadline_header("1"), 1ms);
  EXPECT_EQ(*parse_deadline_header("2500"), 2500ms);
  EXPECT_EQ(*parse_deadline_header("0002500"), 2500ms);
  EXPECT_EQ(*parse_deadline_header("31536000000"), keel::kMaxPropagatedDeadline);
}

TEST(DeadlineHeader, SurroundingSpacesAndTabsAreNotPartOfTheValue) {
  EXPECT_EQ(*parse_deadline_header(" 2500"), 2500ms);
  EXPECT_EQ(*parse_deadline_header("2500\t "), 2500ms);
  EXPECT_EQ(*parse_deadline_header("\t 7 \t"), 7ms);
}

TEST(DeadlineHeader, RejectsEverythingElseAsAnError) {
  const std::vector<std::string> bad = {
      "",                       // empty
      "   ",                    // blank
      "\t",                     // blank
      "-1",                     // sign
      "+1",                     // sign
      "-0",                     // sign
      "1.5",                    // fraction
      "1e3",                    // exponent
      "10ms",                   // unit
      "0x10",                   // hex
      "100, 200",               // a field sent twice, folded into a list
      "100,100",                // the same, without the space
      "1 2",                    // inner whitespace
      "12\r\n",                 // line ending
      "\n12",                   // line ending
      "31536000001",            // one millisecond over 365 days
      "99999999999",            // 11 digits, over 365 days
      "000000000001",           // 12 digits, even if small
      "9223372036854775807",    // int64 max
      "18446744073709551616",   // 2^64
      std::string(10000, '9'),  // a huge digit string
      std::string("12\0"
                  "3",
                  4),  // an embedded NUL
      "\xd9\xa1",      // ARABIC-INDIC DIGIT ONE
      "\xff",          // not UTF-8
  };
  for (const std::string& value : bad) {
    const keel::Expected<Duration> d = parse_deadline_header(value);
    ASSERT_FALSE(d.has_value()) << keel::quote_value(value);
    EXPECT_EQ(d.error().field, "Keel-Deadline-Ms");
    EXPECT_LE(d.error().message().size(), 200u) << "the quoted value is capped";
  }
}

TEST(DeadlineHeader, EveryValueWithinTheLimitRoundTrips) {
  for (const Duration d : {Duration::zero(), Duration(1ms), Duration(999ms), Duration(30s),
                           Duration(std::chrono::hours(24 * 364))}) {
    EXPECT_EQ(*parse_deadline_header(format_deadline_header(d)), d);
  }
}

TEST(DeadlineHeader, FormatRoundsDownAndClamps) {
  EXPECT_EQ(format_deadline_header(Duration::zero()), "0");
  EXPECT_EQ(format_deadline_header(-5ms), "0");
  EXPECT_EQ(format_deadline_header(999us), "0") << "never more time than the caller has";
  EXPECT_EQ(format_deadline_header(1999us), "1");
  EXPECT_EQ(format_deadline_header(2500ms), "2500");
  EXPECT_EQ(format_deadline_header(std::chrono::hours(24 * 400)), "31536000000");
  EXPECT_EQ(format_deadline_header(keel::kInfinite), "31536000000");
}

namespace {

struct Harness {
  keel::ManualClock clock;
  keel::Rng rng{99};
  keel::CallOptions call(keel::Deadline ceiling, keel::Deadline deadline = {}) {
    keel::CallOptions c;
    c.clock = &clock;
    c.rng = &rng;
    c.safe_to_repeat = true;
    c.deadline = deadline;
    c.ceiling = ceiling;
    return c;
  }
};

}  // namespace

TEST(DeadlineCeiling, AnEarlierIncomingDeadlineBoundsTheOperation) {
  Harness h;
  const keel::RetryPolicy policy({.max_attempts = 3, .overall_timeout = 10s});
  keel::RetryState state(policy, h.call(keel::Deadline::after(h.clock, 2s)));
  const keel::AttemptStart start = state.start_attempt();
  ASSERT_TRUE(start.proceed);
  EXPECT_EQ(start.attempt.timeout, 2s);
  EXPECT_EQ(start.attempt.deadline.when(), h.clock.now() + 2s);
  EXPECT_EQ(state.deadline().when(), h.clock.now() + 2s);
}

TEST(DeadlineCeiling, ALaterIncomingDeadlineLeavesTheOwnDeadline) {
  Harness h;
  const keel::RetryPolicy policy({.max_attempts = 3, .overall_timeout = 10s});
  const keel::TimePoint t0 = h.clock.now();
  keel::RetryState state(policy, h.call(keel::Deadline::after(h.clock, 60s)));
  EXPECT_EQ(state.deadline().when(), t0 + 10s);
  // The caller's own deadline, when earliest, wins too.
  keel::RetryState own(
      policy, h.call(keel::Deadline::after(h.clock, 60s), keel::Deadline::after(h.clock, 3s)));
  EXPECT_EQ(own.deadline().when(), t0 + 3s);
  const keel::AttemptStart start = own.start_attempt();
  EXPECT_EQ(start.attempt.timeout, 3s);
}

TEST(DeadlineCeiling, WithoutAnyDeadlineTheAttemptHasNone) {
  Harness h;
  const keel::RetryPolicy policy({.max_attempts = 2});
  keel::RetryState state(policy, h.call(keel::Deadline::infinite()));
  const keel::AttemptStart start = state.start_attempt();
  ASSERT_TRUE(start.proceed);
  EXPECT_TRUE(start.attempt.deadline.is_infinite());
  EXPECT_EQ(start.attempt.timeout, keel::kInfinite);
}

TEST(DeadlineCeiling, AnExpiredIncomingDeadlineStartsNoAttempt) {
  Harness h;
  const keel::RetryPolicy policy({.max_attempts = 3, .overall_timeout = 10s});
  const keel::Deadline ceiling = keel::Deadline::after(h.clock, 1s);
  h.clock.advance(1s);
  int calls = 0;
  const auto r = keel::retry(
      policy,
      [&] {
        ++calls;
        return keel::Outcome::success();
      },
      h.call(ceiling));
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(r.reason, keel::StopReason::kDeadline);
}

TEST(DeadlineCeiling, RetriesStopAtTheIncomingDeadlineInVirtualTime) {
  Harness h;
  // Waits of exactly 400 ms (no jitter) and attempts of 100 ms: a 10 s policy would make all 10
  // attempts; a 1 s incoming deadline leaves room for two.
  const keel::RetryPolicy policy(
      {.max_attempts = 10,
       .overall_timeout = 10s,
       .backoff = {.base = 400ms, .cap = 400ms, .jitter = keel::Jitter::kNone}});
  const keel::TimePoint t0 = h.clock.now();
  std::vector<Duration> timeouts;
  const auto r = keel::retry(
      policy,
      [&](const keel::AttemptInfo& a) {
        timeouts.push_back(a.timeout);
        h.clock.advance(100ms);
        return keel::Outcome::transient();
      },
      h.call(keel::Deadline::after(h.clock, 1s)));
  EXPECT_EQ(r.reason, keel::StopReason::kDeadline);
  ASSERT_EQ(timeouts.size(), 2u);
  EXPECT_EQ(timeouts[0], 1s);
  EXPECT_EQ(timeouts[1], 500ms);
  EXPECT_LE(h.clock.now() - t0, 1s) << "never waits past the incoming deadline";
}
