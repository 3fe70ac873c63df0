// The retry-policy flags shared by `keel call` and `keel policy` (--max-attempts, --deadline,
// --per-try-timeout, --backoff-base, --backoff-cap, --jitter, --retry-after-cap): their names,
// defaults and help in one place, and one parser that refuses bad values with a message naming
// the flag and the value.
#pragma once

#include <cstdio>
#include <optional>
#include <string>

#include "commands.hpp"
#include "keel/backoff.hpp"
#include "keel/duration.hpp"
#include "keel/retry.hpp"

namespace keel::cli {

/// The flags as typed, with `keel call`'s defaults.
struct PolicyFlags {
  std::string max_attempts = "3";
  std::string deadline = "30s";
  std::string per_try_timeout = "9s";  // 3 x 9 s + the waits fit the 30 s deadline
  std::string backoff_base = "100ms";
  std::string backoff_cap = "10s";
  std::string jitter = "full";
  std::string retry_after_cap = "60s";
};

/// Prints "keel COMMAND: MESSAGE" on stderr; returns kExitUsage.
inline int flag_error(const char* command, const std::string& message) {
  std::fprintf(stderr, "keel %s: %s\n", command, message.c_str());
  return kExitUsage;
}

/// Parses a duration flag (keel::parse_duration: no sign, exponent, nan, inf or trailing text);
/// with `positive`, zero is refused too. On error prints a message naming the flag and the value
/// and returns nullopt.
inline std::optional<Duration> duration_flag(const char* command, const char* flag,
                                             const std::string& text, bool positive) {
  auto d = parse_duration_flag(flag, text, positive);
  if (!d) {
    flag_error(command, d.error().message());
    return std::nullopt;
  }
  return *d;
}

/// As above, within `range` (flags.hpp).
inline std::optional<Duration> duration_flag(const char* command, const char* flag,
                                             const std::string& text, const DurationRange& range) {
  auto d = parse_duration_flag(flag, text, range);
  if (!d) {
    flag_error(command, d.error().message());
    return std::nullopt;
  }
  return *d;
}

/// A deadline: at least 1 ms (a shorter one passes before the first attempt can start; keel's
/// clocks and libcurl count whole milliseconds).
inline constexpr DurationRange kDeadlineDuration{.min = std::chrono::milliseconds(1),
                                                 .why_min = kWholeMilliseconds};

/// Registers the seven policy flags on `sub`, bound to `flags`.
inline void add_policy_flags(CLI::App* sub, PolicyFlags& flags) {
  sub->add_option("--max-attempts", flags.max_attempts, "Attempts in all, the first included")
      ->capture_default_str();
  sub->add_option("--deadline", flags.deadline, "Deadline of the whole call")
      ->capture_default_str();
  sub->add_option("--per-try-timeout", flags.per_try_timeout, "Timeout of one attempt")
      ->capture_default_str();
  sub->add_option("--backoff-base", flags.backoff_base, "Backoff ceiling before the first retry")
      ->capture_default_str();
  sub->add_option("--backoff-cap", flags.backoff_cap, "Largest backoff delay")
      ->capture_default_str();
  sub->add_option("--jitter", flags.jitter, "full|equal|decorrelated|none")->capture_default_str();
  sub->add_option("--retry-after-cap", flags.retry_after_cap, "Largest Retry-After delay honoured")
      ->capture_default_str();
}

/// The RetryOptions the flags describe (max_attempts, overall_timeout, per_try_timeout, backoff,
/// retry_after_cap; the rest default). On an invalid value prints a message naming the flag and
/// the value and returns nullopt; a RetryPolicy built from the result does not throw.
inline std::optional<RetryOptions> parse_policy_flags(const char* command, const PolicyFlags& f) {
  const auto deadline = duration_flag(command, "--deadline", f.deadline, kDeadlineDuration);
  if (!deadline) return std::nullopt;
  const auto per_try = duration_flag(command, "--per-try-timeout", f.per_try_timeout, kCurlTimeout);
  if (!per_try) return std::nullopt;
  const auto base = duration_flag(command, "--backoff-base", f.backoff_base, true);
  if (!base) return std::nullopt;
  const auto cap = duration_flag(command, "--backoff-cap", f.backoff_cap, true);
  if (!cap) return std::nullopt;
  if (*cap < *base) {
    flag_error(command, "--backoff-cap: must be at least --backoff-base (" + f.backoff_base +
                            "), got '" + f.backoff_cap + "'");
    return std::nullopt;
  }
  const auto retry_after_cap =
      duration_flag(command, "--retry-after-cap", f.retry_after_cap, false);
  if (!retry_after_cap) return std::nullopt;
  const auto jitter = parse_jitter(f.jitter);
  if (!jitter) {
    flag_error(command, Error{.field = "--jitter",
                              .problem = "must be full, equal, decorrelated or none",
                              .got = quote_value(f.jitter)}
                            .message());
    return std::nullopt;
  }
  const auto max_attempts = parse_count("--max-attempts", f.max_attempts, 1, 2147483647);
  if (!max_attempts) {
    flag_error(command, max_attempts.error().message());
    return std::nullopt;
  }
  RetryOptions out;
  out.max_attempts = static_cast<int>(*max_attempts);
  out.overall_timeout = *deadline;
  out.per_try_timeout = *per_try;
  out.backoff = {.base = *base, .cap = *cap, .jitter = *jitter};
  out.retry_after_cap = *retry_after_cap;
  return out;
}

}  // namespace keel::cli
