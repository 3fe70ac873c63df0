// A retry policy's schedule, computed without running it: when each attempt can start (its
// window from the best case to the worst case), the timeout it gets, how long the whole
// operation takes in the worst case and on average, and whether max_attempts can be reached
// before the overall deadline. "250 ms times 3 attempts plus backoff must fit in the budget the
// caller gave you": check_policy says whether it does, and which attempt is the first that does
// not.
//
// The cases, for attempt k (1-based) with per-try timeout T, deadline D and the backoff wait
// w_n before retry n (n = k - 2, 0-based, as Backoff::delay counts):
//   earliest start  every earlier attempt failed at once and every wait was its shortest
//   expected start  every earlier attempt timed out (took T) and every wait was the jitter's mean
//   latest start    every earlier attempt timed out and every wait was its longest (the ceiling)
//   fits            latest start + T <= D: even in the worst case the attempt runs to its full
//                   timeout before the deadline
// Wait ranges, with ceiling c_n = clamp(base * multiplier^n, min_ceiling, cap) (see backoff.hpp):
//   full          [0, c_n)                 mean c_n / 2
//   equal         [c_n / 2, c_n)           mean 3 c_n / 4
//   none          c_n                      mean c_n
//   decorrelated  [base, M_n)  with M_0 = min(cap, 3 base), M_n = min(cap, 3 M_(n-1)); the mean
//                 is E[min(cap, uniform[base, 3 p))] at p = the previous wait's mean (base at
//                 first): exact while the cap is not reached, the mean-field estimate after.
// The worst total is max_attempts x T + the sum of the longest waits; the expected total is
// max_attempts x T + the sum of the mean waits (every attempt times out, the waits are
// average). A server's Retry-After replaces the backoff up to retry_after_cap, so the worst
// case with server delays counts each wait as max(longest backoff wait, retry_after_cap); the
// engine never waits past the deadline (it stops with StopReason::kDeadline instead), so a long
// Retry-After ends an operation early rather than late. That total is reported, not used for
// fits.
//
// Thread-safety: pure functions.
//
// Example:
//   keel::RetryPolicy policy({.max_attempts = 3, .per_try_timeout = 250ms,
//                             .overall_timeout = 1s, .backoff = {.base = 100ms, .cap = 5s}});
//   keel::PolicySchedule s = keel::check_policy(policy);
//   // worst 3 x 250ms + 100ms + 200ms = 1.05s > 1s: s.first_unfit == 3
//   if (!s.fits()) std::puts(keel::format_unfit(s).c_str());
#pragma once

#include <string>
#include <vector>

#include "keel/core/clock.hpp"
#include "keel/core/retry.hpp"

namespace keel {

/// The backoff wait before one retry: its shortest, longest and mean value.
struct WaitRange {
  Duration min{};
  Duration max{};
  Duration mean{};
};

/// One attempt of a policy's schedule. Times are from the start of the operation.
struct ScheduledAttempt {
  /// 1 for the first attempt.
  int number = 1;
  /// The backoff wait before this attempt (all zero for the first).
  WaitRange wait_before;
  /// Best case: every earlier attempt failed at once, every wait its shortest.
  Duration earliest_start{};
  /// Every earlier attempt took its whole timeout, every wait the jitter's mean.
  Duration expected_start{};
  /// Worst case: every earlier attempt took its whole timeout, every wait its longest.
  Duration latest_start{};
  /// The attempt's timeout when it starts at earliest_start: min(per_try_timeout, time left).
  Duration timeout{};
  /// The same at latest_start (zero when the deadline has passed by then).
  Duration worst_timeout{};
  /// latest_start + per_try_timeout <= deadline: it runs to its full timeout even in the worst
  /// case.
  bool fits = true;
  /// earliest_start + min_attempt_time <= deadline: the engine can start it at all (false: it
  /// never runs; the operation always stops with kDeadline before it).
  bool can_start = true;
};

struct PolicySchedule {
  /// The first min(max_attempts, kListedAttempts) attempts (the totals count them all).
  std::vector<ScheduledAttempt> attempts;
  int max_attempts = 1;
  Duration per_try_timeout = kInfinite;
  /// The policy's overall_timeout (kInfinite: none).
  Duration deadline = kInfinite;
  /// max_attempts x per_try_timeout + the longest waits (saturating at kInfinite).
  Duration worst_total{};
  /// max_attempts x per_try_timeout + the mean waits.
  Duration expected_total{};
  /// As worst_total, with each wait max(longest backoff wait, retry_after_cap).
  Duration worst_total_with_retry_after{};
  Duration retry_after_cap{};
  /// The first attempt that does not fit (latest start + per-try timeout > deadline); 0 when
  /// every attempt fits.
  int first_unfit = 0;
  /// That attempt's latest start (zero when every attempt fits).
  Duration first_unfit_latest_start{};
  /// The first attempt that can never start (earliest start + min_attempt_time > deadline); 0
  /// when every attempt can start.
  int first_never_started = 0;

  /// Every attempt fits: worst_total <= deadline.
  [[nodiscard]] bool fits() const noexcept { return first_unfit == 0; }
};

/// How many attempts PolicySchedule::attempts lists at most.
inline constexpr int kListedAttempts = 100;

/// The schedule of `policy` (see the top of this header). Never fails: the policy was validated
/// when it was built. Exact for any max_attempts: once the waits stop changing (the ceiling
/// reached the cap) the rest is multiplied out, and after a million distinct waits the last one
/// is repeated.
[[nodiscard]] PolicySchedule check_policy(const RetryPolicy& policy);

/// One sentence on the first attempt that does not fit, for a warning: "attempt 3 of 3 does not
/// fit the 1s deadline: in the worst case it starts at 800ms and its 250ms timeout ends at
/// 1.05s (worst total 1.05s)". Empty when the schedule fits.
[[nodiscard]] std::string format_unfit(const PolicySchedule& schedule);

}  // namespace keel
