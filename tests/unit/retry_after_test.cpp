#include "keel/core/retry_after.hpp"

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "keel/core/classify.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/random.hpp"
#include "keel/core/retry.hpp"

using namespace std::chrono_literals;
using keel::parse_http_date;
using keel::parse_retry_after;
using keel::WallTime;

namespace {
WallTime at(std::int64_t unix_seconds) { return WallTime(std::chrono::seconds(unix_seconds)); }
// 2026-11-29T00:00:00Z
const WallTime kNow = at(1795910400);
}  // namespace

TEST(HttpDate, AllThreeFormsMeanTheSameInstant) {
  EXPECT_EQ(parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT", kNow), 784111777);
  EXPECT_EQ(parse_http_date("Sunday, 06-Nov-94 08:49:37 GMT", kNow), 784111777);
  EXPECT_EQ(parse_http_date("Sun Nov  6 08:49:37 1994", kNow), 784111777);
  EXPECT_EQ(parse_http_date("Fri, 31 Dec 1999 23:59:59 GMT", kNow), 946684799);
}

TEST(HttpDate, Rfc850TwoDigitYearFollowsTheFiftyYearRule) {
  // Seen from 2026: "30" is 2030 (4 years ahead), "94" would be 2094 (68 years ahead) so 1994.
  EXPECT_EQ(parse_http_date("Tuesday, 01-Jan-30 00:00:00 GMT", kNow), 1893456000);
  EXPECT_EQ(parse_http_date("Tuesday, 01-Jan-80 00:00:00 GMT", kNow), 315532800);     // 1980
  EXPECT_EQ(parse_http_date("Wednesday, 01-Jan-76 00:00:00 GMT", kNow), 3345062400);  // 2076
  EXPECT_EQ(parse_http_date("Monday, 01-Jan-80 00:00:00 GMT", at(3155760000)),
            3471292800);  // 2070: 2080
}

TEST(HttpDate, RejectsImpossibleAndMalformedDates) {
  for (const char* bad : {"Sun, 31 Feb 1994 08:49:37 GMT", "Sun, 06 Nov 1994 24:00:00 GMT",
                          "Sun, 06 Nov 1994 08:60:00 GMT", "Sun, 06 Foo 1994 08:49:37 GMT",
                          "Sun, 06 Nov 1994 08:49:37 UTC", "Sun, 06 Nov 1994 08:49:37 GMT ",
                          "Sun, 6 Nov 1994 08:49:37 GMT", "sun, 06 nov 1994 08:49:37 gmt",
                          "Sunday, 06-Nov-1994 08:49:37 GMT", "Sun Nov 6 08:49:37 1994",
                          "Xyz, 06 Nov 1994 08:49:37 GMT", "Sun, 29 Feb 1900 00:00:00 GMT"}) {
    EXPECT_FALSE(parse_http_date(bad, kNow)) << bad;
  }
  EXPECT_TRUE(parse_http_date("Tue, 29 Feb 2000 00:00:00 GMT", kNow));  // 2000 is a leap year
}

TEST(RetryAfter, DeltaSeconds) {
  EXPECT_EQ(parse_retry_after("120", kNow), 120s);
  EXPECT_EQ(parse_retry_after("0", kNow), 0s);
  EXPECT_EQ(parse_retry_after(" 5\t", kNow), 5s);  // optional whitespace around the value
  EXPECT_EQ(parse_retry_after("315360000", kNow), 315360000s);  // ten years: no overflow
}

TEST(RetryAfter, RejectsGarbage) {
  for (const char* bad :
       {"IAintNoDateFool", "-5", "1e3", "120abc", "", " ", "+5", "+10", "+0", "5.0", "0x10",
        "12 34", "1,2", "99999999999999999999x", "\xd9\xa1\xd9\xa2", "10\r\n"}) {
    EXPECT_FALSE(parse_retry_after(bad, kNow)) << "'" << bad << "'";
  }
  EXPECT_FALSE(parse_retry_after(std::string_view("12\0", 3), kNow));
}

TEST(RetryAfter, HttpDateIsMeasuredFromNow) {
  const WallTime now = at(784111777) - 90s;
  EXPECT_EQ(parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", now), 90s);
  // A sub-second "now" counts: the delay ends exactly at the date.
  EXPECT_EQ(parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", now + 250ms), 89750ms);
}

TEST(RetryAfter, DateInThePastMeansNow) {
  EXPECT_EQ(parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", kNow), 0s);
}

TEST(HttpDate, FormatRoundTrips) {
  EXPECT_EQ(keel::format_http_date(784111777), "Sun, 06 Nov 1994 08:49:37 GMT");
  EXPECT_EQ(keel::format_http_date(946684799), "Fri, 31 Dec 1999 23:59:59 GMT");
  for (std::int64_t t : {0LL, 951782400LL, 1795910400LL, 4102444799LL}) {
    EXPECT_EQ(parse_http_date(keel::format_http_date(t), kNow), t) << t;
  }
}

TEST(RetryAfter, FormatRoundsUpToWholeSecondsAndNeverSaysZero) {
  EXPECT_EQ(keel::format_retry_after(0s), "1");
  EXPECT_EQ(keel::format_retry_after(-5s), "1");
  EXPECT_EQ(keel::format_retry_after(1ms), "1");
  EXPECT_EQ(keel::format_retry_after(1s), "1");
  EXPECT_EQ(keel::format_retry_after(1001ms), "2");
  EXPECT_EQ(keel::format_retry_after(120s), "120");
  // What is sent parses back to a wait at least as long as the one asked for.
  for (keel::Duration wait : {keel::Duration(1ms), keel::Duration(999ms), keel::Duration(61s)}) {
    EXPECT_GE(*parse_retry_after(keel::format_retry_after(wait), kNow), wait);
  }
  EXPECT_EQ(keel::format_retry_after(keel::kInfinite),
            std::to_string(std::chrono::ceil<std::chrono::seconds>(keel::kInfinite).count()));
}

TEST(RetryAfter, DateBeyondWhatNanosecondsHoldSaturatesNotOverflows) {
  // Found by the fuzzer: the year 2594 overflowed a nanosecond conversion.
  EXPECT_EQ(parse_retry_after("Sun Nov  6 08:49:37 2594", kNow), keel::kInfinite);
  EXPECT_LT(*parse_retry_after("Sun Nov  6 08:49:37 2194", kNow), keel::kInfinite);
}

// An absurd but well-formed value is a very long delay, never "absent" (which would mean retry
// at once): every form past the range of a Duration saturates at kInfinite.
TEST(RetryAfter, OutOfRangeValuesSaturate) {
  for (const char* huge :
       {"9223372037", "9223372036854775807", "9223372036854775808", "99999999999999999999",
        "18446744073709551616", " 99999999999999999999999999999999999999999999999999 ",
        "Fri, 31 Dec 9999 23:59:59 GMT", "Fri Dec 31 23:59:59 9999",
        "Sat, 01 Jan 2400 00:00:00 GMT", "Mon, 01 Jan 3000 00:00:00 GMT"}) {
    EXPECT_EQ(parse_retry_after(huge, kNow), keel::kInfinite) << "'" << huge << "'";
  }
  // A leap second at the very end of year 9999 stays in year 9999 (found by the fuzzer).
  EXPECT_EQ(parse_http_date("Fri, 31 Dec 9999 23:59:60 GMT", kNow), 253402300799);
  EXPECT_EQ(parse_retry_after("Fri, 31 Dec 9999 23:59:60 GMT", kNow), keel::kInfinite);
  // The largest delta a Duration holds is still exact.
  EXPECT_EQ(parse_retry_after("9223372036", kNow), std::chrono::seconds(9223372036));
  EXPECT_EQ(parse_retry_after(std::string(100000, '9'), kNow), keel::kInfinite);
}

// What the retry engine does with one: the delay is capped by retry_after_cap, so a cap inside
// the deadline waits the cap and a cap past it stops with kDeadline. Virtual time only.
TEST(RetryAfter, AnOutOfRangeValueIsCappedAndRunsIntoTheDeadline) {
  const keel::RequestTraits get{keel::Method::kGet, false};
  for (const char* huge : {"9223372037", "99999999999999999999", "Fri, 31 Dec 9999 23:59:59 GMT"}) {
    for (const int status : {429, 503}) {
      const keel::Outcome o =
          keel::classify_http_status(status, get, parse_retry_after(huge, kNow));
      ASSERT_TRUE(o.has_server_delay()) << huge;
      keel::ManualClock clock;
      keel::CallOptions call;
      call.clock = &clock;
      {
        keel::RetryPolicy policy({.max_attempts = 3, .retry_after_cap = 2s});
        keel::RetryState state(policy, call);
        ASSERT_TRUE(state.start_attempt().proceed);
        const keel::Decision d = state.next(o);
        EXPECT_TRUE(d.retry) << huge;
        EXPECT_EQ(d.delay, 2s) << huge;
      }
      {
        keel::RetryPolicy policy(
            {.max_attempts = 3, .overall_timeout = 30s, .retry_after_cap = 60s});
        keel::RetryState state(policy, call);
        ASSERT_TRUE(state.start_attempt().proceed);
        const keel::Decision d = state.next(o);
        EXPECT_FALSE(d.retry) << huge;
        EXPECT_EQ(d.reason, keel::StopReason::kDeadline) << huge;
      }
    }
  }
}

// The receiver's spread Retry-After: every value of 1..N, each about 1/N of the time (a
// chi-square bound at a fixed seed), the same sequence from the same seed, and the edges.
TEST(SpreadRetryAfter, IsUniformOverOneToNSeconds) {
  for (const int n : {1, 2, 3, 5, 10}) {
    keel::Rng rng(42);
    constexpr int kDraws = 30000;
    std::vector<int> counts(static_cast<std::size_t>(n) + 1, 0);
    for (int i = 0; i < kDraws; ++i) {
      const std::chrono::seconds s = keel::spread_retry_after(n, rng);
      ASSERT_GE(s.count(), 1) << n;
      ASSERT_LE(s.count(), n) << n;
      ++counts[static_cast<std::size_t>(s.count())];
    }
    const double expected = static_cast<double>(kDraws) / n;
    double chi2 = 0;
    for (int v = 1; v <= n; ++v) {
      EXPECT_GT(counts[static_cast<std::size_t>(v)], 0) << "value " << v << " of 1.." << n;
      const double d = counts[static_cast<std::size_t>(v)] - expected;
      chi2 += d * d / expected;
    }
    // The 99.9th percentile of chi-square with 9 degrees of freedom is 27.9.
    EXPECT_LT(chi2, 27.9) << "n = " << n;
  }
}

TEST(SpreadRetryAfter, EverySeedGivesEveryValueAndOneSeedOneSequence) {
  // Over many seeds, the first draw alone takes every value of 1..3.
  std::array<int, 4> first{};
  for (std::uint64_t seed = 1; seed <= 300; ++seed) {
    keel::Rng rng(seed);
    ++first[static_cast<std::size_t>(keel::spread_retry_after(3, rng).count())];
  }
  for (int v = 1; v <= 3; ++v) EXPECT_GT(first[static_cast<std::size_t>(v)], 60) << v;
  keel::Rng a(7);
  keel::Rng b(7);
  for (int i = 0; i < 100; ++i) {
    EXPECT_EQ(keel::spread_retry_after(3, a), keel::spread_retry_after(3, b));
  }
  keel::Rng rng(1);
  EXPECT_EQ(keel::spread_retry_after(0, rng), 1s) << "clamped to 1";
  EXPECT_LE(keel::spread_retry_after(1 << 30, rng), 3600s) << "clamped to an hour";
}
