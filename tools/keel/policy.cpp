// `keel policy [policy flags]`: a retry policy's schedule without sending anything (each
// attempt's start window and timeout, the worst and expected totals), and whether its attempts
// fit its deadline (keel::check_policy). Takes the same policy flags as `keel call`.
#include <cstdio>
#include <memory>
#include <string>

#include "commands.hpp"
#include "keel/core/policy_check.hpp"
#include "policy_flags.hpp"

namespace keel::cli {
namespace {

constexpr int kExitUnfit = 1;

constexpr const char* kPolicyFooter =
    R"(The flags are keel call's, with the same defaults. Durations are a number and a unit:
250ms, 1.5s, 2m, 1h (also ns, us).

Each attempt's start is shown as a window from the operation's start: EARLIEST if every
earlier attempt failed at once and every backoff wait was its shortest, EXPECTED if every
earlier attempt timed out and the waits were the jitter's mean, LATEST if every earlier attempt
timed out and every wait was its longest. TIMEOUT is min(--per-try-timeout, time left) at the
earliest start, WORST at the latest. An attempt fits when, started at its latest, it runs to
its full timeout before the deadline; it is cut short when it starts but its timeout is
clipped; it may not start when its latest start leaves less than 1ms; it never starts when even
its earliest does.

The worst total is attempts x per-try timeout + the longest waits; the expected total uses the
mean waits. A server's Retry-After replaces the backoff up to --retry-after-cap: the total with
each wait at that cap is shown too, but not used for the verdict, because keel never waits past
the deadline (it stops instead). See docs/deadlines.md.

Exit status:
  0  every attempt fits the deadline in the worst case
  1  an attempt does not fit (the message names the first one)
  2  invalid arguments (the message names the flag))";

std::string wait_text(const WaitRange& w) {
  if (w.min == w.max) return format_duration(w.max);
  return format_duration(w.min) + ".." + format_duration(w.max) + " ~" + format_duration(w.mean);
}

std::string status_text(const ScheduledAttempt& a, const RetryOptions& o) {
  if (a.fits) return "fits";
  if (!a.can_start) return "never starts";
  if (saturating_add(a.latest_start, o.min_attempt_time) <= o.overall_timeout) return "cut short";
  return "may not start";
}

int run_policy(const PolicyFlags& flags) {
  if (!check_policy_flags("policy", flags)) return kExitUsage;
  const RetryOptions& options = flags.retry;
  const RetryPolicy policy(options);
  const PolicySchedule s = check_policy(policy);
  const BackoffOptions& b = options.backoff;
  std::printf(
      "%d attempts, per-try timeout %s, deadline %s; %s jitter, base %s, cap %s; "
      "Retry-After cap %s\n",
      s.max_attempts, format_duration(s.per_try_timeout).c_str(),
      format_duration(s.deadline).c_str(), std::string(to_string(b.jitter)).c_str(),
      format_duration(b.base).c_str(), format_duration(b.cap).c_str(),
      format_duration(s.retry_after_cap).c_str());
  std::printf("%-8s %-10s %-10s %-10s %-9s %-9s %-24s %s\n", "ATTEMPT", "EARLIEST", "EXPECTED",
              "LATEST", "TIMEOUT", "WORST", "WAIT BEFORE", "STATUS");
  for (const ScheduledAttempt& a : s.attempts) {
    std::printf("%-8d %-10s %-10s %-10s %-9s %-9s %-24s %s\n", a.number,
                format_duration(a.earliest_start).c_str(),
                format_duration(a.expected_start).c_str(), format_duration(a.latest_start).c_str(),
                format_duration(a.timeout).c_str(), format_duration(a.worst_timeout).c_str(),
                a.number == 1 ? "-" : wait_text(a.wait_before).c_str(),
                status_text(a, options).c_str());
  }
  if (s.max_attempts > static_cast<int>(s.attempts.size())) {
    std::printf("... and %d more attempts (not listed)\n",
                s.max_attempts - static_cast<int>(s.attempts.size()));
  }
  std::printf("worst total %s, expected %s; with every wait at the Retry-After cap %s\n",
              format_duration(s.worst_total).c_str(), format_duration(s.expected_total).c_str(),
              format_duration(s.worst_total_with_retry_after).c_str());
  if (!s.fits()) {
    std::fprintf(stderr, "keel policy: %s\n", format_unfit(s).c_str());
    return kExitUnfit;
  }
  std::printf("fits: all %d attempts end before the %s deadline in the worst case\n",
              s.max_attempts, format_duration(s.deadline).c_str());
  return 0;
}

}  // namespace

Runner add_policy(CLI::App& app) {
  return add_command<PolicyFlags>(
      app, "policy", "Show a retry policy's schedule and whether its attempts fit its deadline",
      kPolicyFooter,
      [](CLI::App* sub, PolicyFlags& flags) { add_policy_flags(sub, "policy", flags); },
      run_policy);
}

}  // namespace keel::cli
