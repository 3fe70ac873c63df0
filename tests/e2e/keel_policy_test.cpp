// keel policy as a process, table-driven: policies that fit their deadline (exit 0), policies
// that do not (exit 1, naming the first attempt that does not fit), invalid flags (exit 2,
// naming the flag and the value); and keel call -v printing the same warning once.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "run_keel.hpp"

namespace {

using keel::test::KeelRun;
using keel::test::run_keel;

struct Case {
  std::vector<std::string> flags;
  int status;
  std::string in_out;  // expected in stdout ("" for none)
  std::string in_err;  // expected in stderr ("" for none)
};

std::string count(const std::string& haystack, const std::string& needle) {
  int n = 0;
  for (auto pos = haystack.find(needle); pos != std::string::npos;
       pos = haystack.find(needle, pos + 1)) {
    ++n;
  }
  return std::to_string(n);
}

TEST(KeelPolicy, ExitStatusSaysWhetherTheAttemptsFitTheDeadline) {
  const std::vector<Case> cases = {
      // Fits: 3 x 250ms + 100ms + 200ms = 1.05s <= 2s.
      {{"--max-attempts", "3", "--per-try-timeout", "250ms", "--deadline", "2s"},
       0,
       "worst total 1.05s, expected 900ms",
       ""},
      // Exactly at the deadline still fits.
      {{"--max-attempts", "2", "--per-try-timeout", "400ms", "--deadline", "1s", "--jitter", "none",
        "--backoff-base", "200ms", "--backoff-cap", "200ms"},
       0,
       "fits: all 2 attempts",
       ""},
      // The seed's 250ms x 3 plus backoff against 1s.
      {{"--max-attempts", "3", "--per-try-timeout", "250ms", "--deadline", "1s"},
       1,
       "3        0s         650ms      800ms",
       "attempt 3 of 3 does not fit the 1s deadline: in the worst case it starts at 800ms and "
       "its 250ms timeout ends at 1.05s"},
      // Every jitter kind is accepted; equal jitter's waits have a floor, so attempt 4 never
      // starts before a 250ms deadline.
      {{"--max-attempts", "4", "--per-try-timeout", "50ms", "--deadline", "250ms", "--jitter",
        "equal"},
       1,
       "never starts",
       "attempt 3 of 4 does not fit"},
      {{"--jitter", "decorrelated", "--deadline", "1h"}, 0, "100ms..300ms ~200ms", ""},
      // keel call's defaults fit: 3 x 9s + 100ms + 200ms = 27.3s <= 30s.
      {{}, 0, "", ""},
      // 3 x 10s + 100ms + 200ms = 30.3s > 30s.
      {{"--per-try-timeout", "10s"}, 1, "", "attempt 3 of 3 does not fit the 30s deadline"},
      // Invalid flags name the flag and the value.
      {{"--deadline", "nan"}, 2, "", "--deadline does not start with a number"},
      {{"--per-try-timeout", "inf"}, 2, "", "--per-try-timeout does not start with a number"},
      {{"--backoff-base", "-100ms"}, 2, "", "--backoff-base does not start with a number"},
      {{"--retry-after-cap", "60sx"}, 2, "", "--retry-after-cap has an unknown unit 'sx'"},
      {{"--deadline", "0s"}, 2, "", "--deadline must be greater than zero (got '0s')"},
      {{"--max-attempts", "3x"}, 2, "", "--max-attempts must be a whole number (got '3x')"},
      {{"--max-attempts", "-1"}, 2, "", "--max-attempts"},
      {{"--max-attempts", "0"}, 2, "", "--max-attempts must be between 1 and"},
      {{"--jitter", "fullish"}, 2, "", "--jitter must be full, equal, decorrelated or none"},
      {{"--backoff-base", "2s", "--backoff-cap", "1s"},
       2,
       "",
       "--backoff-cap: must be at least --backoff-base (2s), got '1s'"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = {"policy"};
    args.insert(args.end(), c.flags.begin(), c.flags.end());
    std::string shown;
    for (const auto& a : args) shown += a + " ";
    SCOPED_TRACE(shown);
    const KeelRun r = run_keel(args);
    EXPECT_EQ(r.status, c.status) << r.out << r.err;
    if (!c.in_out.empty()) {
      EXPECT_NE(r.out.find(c.in_out), std::string::npos) << r.out;
    }
    if (!c.in_err.empty()) {
      EXPECT_NE(r.err.find(c.in_err), std::string::npos) << r.err;
    }
    if (c.status == 2) {
      EXPECT_TRUE(r.out.empty()) << r.out;
    }
  }
}

TEST(KeelPolicy, ListsAtMostAHundredAttemptsAndCountsTheRest) {
  const KeelRun r = run_keel({"policy", "--max-attempts", "2147483647", "--deadline", "1h"});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("... and 2147483547 more attempts (not listed)"), std::string::npos)
      << r.out;
  EXPECT_NE(r.err.find("does not fit the 1h deadline"), std::string::npos) << r.err;
}

#ifdef KEEL_CLI_HTTP
// keel call -v warns once, before sending, with the same sentence; without -v it says nothing.
// Port 1 on loopback refuses at once, so the call ends well within its second.
TEST(KeelPolicy, CallVerboseWarnsOnceWhenThePolicyDoesNotFit) {
  const std::vector<std::string> flags = {"--max-attempts", "3",  "--per-try-timeout",  "250ms",
                                          "--deadline",     "1s", "http://127.0.0.1:1/"};
  std::vector<std::string> verbose = {"call", "-v"};
  verbose.insert(verbose.end(), flags.begin(), flags.end());
  const KeelRun v = run_keel(verbose);
  const std::string warning = "keel call: warning: attempt 3 of 3 does not fit the 1s deadline";
  EXPECT_EQ(count(v.err, warning), "1") << v.err;
  std::vector<std::string> quiet = {"call"};
  quiet.insert(quiet.end(), flags.begin(), flags.end());
  EXPECT_EQ(count(run_keel(quiet).err, "warning"), "0");
  // A policy that fits: no warning.
  const KeelRun fits = run_keel({"call", "-v", "--max-attempts", "2", "--per-try-timeout", "250ms",
                                 "--deadline", "1s", "http://127.0.0.1:1/"});
  EXPECT_EQ(count(fits.err, "warning"), "0") << fits.err;
}
#endif

}  // namespace
