// Human durations for flags and config: "250ms", "1.5s", "2m", "1h" (and "ns", "us").
//
// Thread-safety: pure functions.
//
// Example:
//   std::string error;
//   auto d = keel::parse_duration("1.5s", &error);   // 1500 ms
//   auto bad = keel::parse_duration("fast", &error);  // nullopt; error names the problem
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "keel/clock.hpp"

namespace keel {

/// Parses a non-negative decimal number followed by a unit: ns, us, ms, s, m, h. No spaces, no
/// sign, no exponent. Returns nullopt on anything else, on a value too large for Duration, and
/// on a non-zero value that rounds to zero nanoseconds; when `error` is given it receives a
/// sentence saying what is wrong (without naming a flag: the caller knows which).
[[nodiscard]] std::optional<Duration> parse_duration(std::string_view text,
                                                     std::string* error = nullptr);

/// The shortest exact-enough human form: "0s", "250ms", "1.5s", "2m", "1h30m", "inf".
[[nodiscard]] std::string format_duration(Duration d);

}  // namespace keel
