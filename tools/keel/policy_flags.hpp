// The retry-policy flags shared by `keel call` and `keel policy` (--max-attempts, --deadline,
// --per-try-timeout, --backoff-base, --backoff-cap, --jitter, --retry-after-cap): their names,
// defaults and help in one place, read into a RetryOptions while the command line is parsed; a
// bad value is refused with a message naming the flag and the value.
#pragma once

#include <cstdio>
#include <optional>
#include <string>

#include "commands.hpp"
#include "flag_options.hpp"
#include "keel/core/backoff.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/retry.hpp"

namespace keel::cli {

/// The policy the flags describe (with `keel call`'s defaults), and the two backoff options for
/// the message of check_policy_flags.
struct PolicyFlags {
  RetryOptions retry;
  CLI::Option* backoff_base = nullptr;
  CLI::Option* backoff_cap = nullptr;
};

/// Prints "keel COMMAND: MESSAGE" on stderr; returns kExitUsage.
inline int flag_error(const char* command, const std::string& message) {
  std::fprintf(stderr, "keel %s: %s\n", command, message.c_str());
  return kExitUsage;
}

/// A deadline: at least 1 ms (a shorter one passes before the first attempt can start; keel's
/// clocks and libcurl count whole milliseconds).
inline constexpr DurationRange kDeadlineDuration{.min = std::chrono::milliseconds(1),
                                                 .why_min = kWholeMilliseconds};

/// --jitter's value: full, equal, decorrelated or none.
inline Expected<Jitter> parse_jitter_flag(std::string_view text) {
  const auto jitter = parse_jitter(text);
  if (!jitter) {
    return Error{.field = "--jitter",
                 .problem = "must be full, equal, decorrelated or none",
                 .got = quote_value(text)};
  }
  return *jitter;
}

/// Registers the seven policy flags on `sub` (of `keel COMMAND`), read into `flags.retry`
/// (max_attempts, overall_timeout, per_try_timeout, backoff, retry_after_cap; the rest default).
/// A refused value stops the parse with a message naming the flag and the value.
inline void add_policy_flags(CLI::App* sub, const char* command, PolicyFlags& flags) {
  const std::string name = std::string("keel ") + command;
  RetryOptions& r = flags.retry;
  add_count(sub, name, "--max-attempts", r.max_attempts, 1, 2147483647,
            "Attempts in all, the first included")
      ->default_val("3");
  add_duration(sub, name, "--deadline", r.overall_timeout, kDeadlineDuration,
               "Deadline of the whole call")
      ->default_val("30s");
  add_duration(sub, name, "--per-try-timeout", r.per_try_timeout, kCurlTimeout,
               "Timeout of one attempt")
      ->default_val("9s");  // 3 x 9 s + the waits fit the 30 s deadline
  flags.backoff_base = add_duration(sub, name, "--backoff-base", r.backoff.base, true,
                                    "Backoff ceiling before the first retry")
                           ->default_val("100ms");
  flags.backoff_cap =
      add_duration(sub, name, "--backoff-cap", r.backoff.cap, true, "Largest backoff delay")
          ->default_val("10s");
  add_checked(sub, name, "--jitter", r.backoff.jitter, FlagParser<Jitter>(parse_jitter_flag),
              "full|equal|decorrelated|none")
      ->default_val("full");
  add_duration(sub, name, "--retry-after-cap", r.retry_after_cap, false,
               "Largest Retry-After delay honoured")
      ->default_val("60s");
}

/// Whether the flags agree with each other (--backoff-cap at least --backoff-base); otherwise
/// prints a message naming the flags and the value and returns false. A RetryPolicy built from
/// flags.retry then does not throw.
inline bool check_policy_flags(const char* command, const PolicyFlags& flags) {
  if (flags.retry.backoff.cap < flags.retry.backoff.base) {
    flag_error(command, "--backoff-cap: must be at least --backoff-base (" +
                            given_text(flags.backoff_base) + "), got '" +
                            given_text(flags.backoff_cap) + "'");
    return false;
  }
  return true;
}

}  // namespace keel::cli
