// Retry-After (RFC 9110 section 10.2.3): delta-seconds or an HTTP-date, where an HTTP-date is
// IMF-fixdate ("Sun, 06 Nov 1994 08:49:37 GMT") or one of the two obsolete forms recipients must
// accept: RFC 850 ("Sunday, 06-Nov-94 08:49:37 GMT", two-digit year) and asctime
// ("Sun Nov  6 08:49:37 1994").
//
// The parser is strict: garbage, a sign, an exponent, trailing junk or an impossible date is
// rejected, and a rejected header is ignored (never trusted). A value too large to represent (a
// delta of 9223372037 s or more, a date centuries ahead) is valid and saturates at kInfinite,
// so that it is capped like any long delay rather than read as "no delay". A date in the past
// means "retry now". Capping is the caller's job (RetryPolicy caps at 60 s by default) so that a
// hostile header cannot park a caller.
//
// Thread-safety: pure functions.
//
// Example:
//   auto d = keel::parse_retry_after("120", clock.wall_now());   // 120 s
//   auto e = keel::parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", clock.wall_now());  // 0
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "keel/core/clock.hpp"
#include "keel/core/random.hpp"

namespace keel {

/// Seconds since the Unix epoch for an HTTP-date in any of the three forms, or nullopt.
/// `now` resolves RFC 850's two-digit year: a year more than 50 years in the future means the
/// most recent past year with the same last two digits.
[[nodiscard]] std::optional<std::int64_t> parse_http_date(std::string_view text, WallTime now);

/// The delay a Retry-After value asks for, measured from `now`; zero for a date in the past;
/// nullopt when the value is not valid (the header must then be ignored); kInfinite when it is
/// valid but beyond what a Duration holds. Surrounding spaces and tabs are allowed. Not capped.
[[nodiscard]] std::optional<Duration> parse_retry_after(std::string_view value, WallTime now);

/// The delta-seconds a server sends for a wait: whole seconds rounded up, and at least 1, since
/// the header cannot say a sub-second wait and "0" would invite an immediate retry. A negative
/// or zero wait gives "1"; kInfinite gives the largest value a Duration holds, in seconds. The
/// one rule every keel receiver (idempotency flow, rate limiter, admission, chaos) answers with.
[[nodiscard]] std::string format_retry_after(Duration wait);

/// Largest spread_retry_after() accepts: an hour.
inline constexpr int kMaxRetryAfterSpread = 3600;

/// A server's Retry-After for a failure every waiting client meets at once (its database is
/// down, a commit is in doubt): whole seconds drawn uniformly from 1..max_seconds by `gen`, so
/// that the clients told to wait come back spread out instead of together. Requires:
/// 1 <= max_seconds <= kMaxRetryAfterSpread (a value outside is clamped into it).
/// Example: keel::format_retry_after(keel::spread_retry_after(3, keel::thread_rng()))  // "1".."3"
[[nodiscard]] std::chrono::seconds spread_retry_after(int max_seconds, BitGenRef gen);

/// Formats seconds since the epoch as IMF-fixdate ("Sun, 06 Nov 1994 08:49:37 GMT").
[[nodiscard]] std::string format_http_date(std::int64_t unix_seconds);

}  // namespace keel
