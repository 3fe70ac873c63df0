// The flag checks that keel's command-line programs share (keel and keel-demo): each value is
// taken as text and parsed strictly, into an Error that names the flag when it is refused.
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>

#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"

namespace keel::cli {

/// Exit status for invalid arguments, shared by every subcommand.
inline constexpr int kExitUsage = 2;

/// A whole-number value of `flag`: decimal digits only (no sign, space, hex, exponent or
/// trailing text) within [min, max]; otherwise an Error naming the flag.
inline Expected<std::uint64_t> parse_count(std::string_view flag, std::string_view text,
                                           std::uint64_t min, std::uint64_t max) {
  if (text.empty() || text.find_first_not_of("0123456789") != std::string_view::npos) {
    return Error{
        .field = std::string(flag), .problem = "must be a whole number", .got = quote_value(text)};
  }
  std::uint64_t v = 0;
  bool overflow = false;
  for (char c : text) {
    const auto digit = static_cast<std::uint64_t>(c - '0');
    if (v > (UINT64_MAX - digit) / 10) {
      overflow = true;
      break;
    }
    v = v * 10 + digit;
  }
  if (overflow || v < min || v > max) {
    return Error{
        .field = std::string(flag),
        .problem = "must be between " + std::to_string(min) + " and " + std::to_string(max),
        .got = quote_value(text)};
  }
  return v;
}

/// A decimal value of `flag`: plain decimal ("0.25", "1", ".5"; no sign, exponent, nan or inf)
/// within [min, max]; otherwise an Error naming the flag.
inline Expected<double> parse_fraction(std::string_view flag, std::string_view text, double min,
                                       double max) {
  const std::size_t dot = text.find('.');
  const bool digits_ok =
      !text.empty() && text != "." &&
      text.find_first_not_of("0123456789.") == std::string_view::npos &&
      (dot == std::string_view::npos || text.find('.', dot + 1) == std::string_view::npos);
  if (!digits_ok || text.size() > 32) {
    return Error{.field = std::string(flag),
                 .problem = "must be a decimal number",
                 .got = quote_value(text)};
  }
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || !std::isfinite(v) || v < min ||
      v > max) {
    char range[64];
    std::snprintf(range, sizeof range, "between %g and %g", min, max);
    return Error{.field = std::string(flag),
                 .problem = "must be " + std::string(range),
                 .got = quote_value(text)};
  }
  return v;
}

/// HOST:PORT: the text before the last colon (not empty) and a port of 0 to 65535 in decimal
/// digits after it.
struct HostPort {
  std::string host;
  std::uint16_t port = 0;
};

/// `text` as HOST:PORT, or nullopt.
inline std::optional<HostPort> parse_host_port(std::string_view text) {
  const std::size_t colon = text.rfind(':');
  if (colon == std::string_view::npos || colon == 0) return std::nullopt;
  const auto port = parse_count("port", text.substr(colon + 1), 0, 65535);
  if (!port) return std::nullopt;
  return HostPort{.host = std::string(text.substr(0, colon)),
                  .port = static_cast<std::uint16_t>(*port)};
}

/// A duration value of `flag` (keel::parse_duration: no sign, exponent, nan, inf or trailing
/// text); with `positive`, zero is refused too. Otherwise an Error naming the flag.
inline Expected<Duration> parse_duration_flag(std::string_view flag, std::string_view text,
                                              bool positive) {
  auto d = parse_duration(text);
  if (!d) return d.error().in(flag);
  if (positive && *d <= Duration::zero()) {
    return Error{.field = std::string(flag),
                 .problem = "must be greater than zero",
                 .got = quote_value(text)};
  }
  return d;
}

/// The values a duration flag can honour, beyond parse_duration's syntax: a value the component
/// would round to something else, or that would overflow where it is used, is refused with the
/// reason instead of being misread.
struct DurationRange {
  /// Whether 0 is taken (a flag whose 0 means something: no delay, release at once).
  bool zero = false;
  /// The least value other than 0, and why it is the least.
  Duration min = Duration(1);
  std::string_view why_min;
  /// The largest value, and why it is the largest.
  Duration max = Duration::max();
  std::string_view why_max;
};

/// What counts in whole milliseconds (the job queue's times, libcurl's timeouts, timers): a
/// non-zero value below 1 ms would be read as 0 or as 1 ms.
inline constexpr std::string_view kWholeMilliseconds = "it is counted in whole milliseconds";

/// A timeout libcurl applies: from 1 ms to 596 h, the whole hours under its longest, 2^31-1 ms
/// (about 24.8 days), beyond which it would be cut short silently.
inline constexpr DurationRange kCurlTimeout{
    .min = std::chrono::milliseconds(1),
    .why_min = "libcurl counts timeouts in whole milliseconds",
    .max = std::chrono::hours(596),
    .why_max = "libcurl's longest timeout is 2^31-1 ms, about 24.8 days"};

/// A duration value of `flag` within `range`: parse_duration_flag, then the range's bounds.
/// Otherwise an Error naming the flag, the bound and why.
inline Expected<Duration> parse_duration_flag(std::string_view flag, std::string_view text,
                                              const DurationRange& range) {
  auto d = parse_duration_flag(flag, text, !range.zero);
  if (!d) return d;
  const auto refuse = [&](std::string problem) {
    return Error{
        .field = std::string(flag), .problem = std::move(problem), .got = quote_value(text)};
  };
  if (*d != Duration::zero() && *d < range.min) {
    return refuse("must be " + std::string(range.zero ? "0 or " : "") + "at least " +
                  format_duration(range.min) +
                  (range.why_min.empty() ? "" : " (" + std::string(range.why_min) + ")"));
  }
  if (*d > range.max) {
    return refuse("must be at most " + format_duration(range.max) +
                  (range.why_max.empty() ? "" : " (" + std::string(range.why_max) + ")"));
  }
  return d;
}

}  // namespace keel::cli
