// Human durations for flags and config: "250ms", "1.5s", "2m", "1h" (and "ns", "us").
//
// Thread-safety: pure functions.
//
// Example:
//   auto d = keel::parse_duration("1.5s");    // 1500 ms
//   auto bad = keel::parse_duration("fast");  // !bad; bad.error().message() names the problem
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "keel/core/clock.hpp"
#include "keel/core/expected.hpp"

namespace keel {

/// Parses a non-negative decimal number followed by a unit: ns, us, ms, s, m, h. No spaces, no
/// sign, no exponent. Returns an Error (field "duration": the caller renames it to its flag) on
/// anything else, on a value too large for Duration, and on a non-zero value that rounds to zero
/// nanoseconds.
[[nodiscard]] Expected<Duration> parse_duration(std::string_view text);

/// `d` in whole milliseconds, truncated toward zero (as std::chrono::duration_cast): the one
/// conversion keel makes for a duration it stores or sends as milliseconds (a lease, a TTL, a
/// retry's due time, a timeout setting). A job made due `to_ms(delay)` after now is due once
/// `delay` has passed; an option whose 0 would mean "none" is refused below 1 ms where it is
/// built.
[[nodiscard]] constexpr std::int64_t to_ms(Duration d) noexcept {
  return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
}

/// The shortest exact-enough human form: "0s", "250ms", "1.5s", "2m", "1h30m", "inf".
[[nodiscard]] std::string format_duration(Duration d);

}  // namespace keel
