// The keel command-line tool is one small program over the libraries: each subcommand lives in
// its own file and registers itself here.
#pragma once

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace keel::cli {

/// Exit status for invalid arguments, shared by every subcommand.
inline constexpr int kExitUsage = 2;

/// A whole-number flag value: decimal digits only (no sign, space, hex, exponent or trailing
/// text) within [min, max]. Returns nullopt and sets `*why` (without naming the flag) otherwise.
inline std::optional<std::uint64_t> parse_count(std::string_view text, std::uint64_t min,
                                                std::uint64_t max, std::string* why) {
  if (text.empty() || text.find_first_not_of("0123456789") != std::string_view::npos) {
    *why = "expected a whole number, got '" + std::string(text) + "'";
    return std::nullopt;
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
    *why = "must be between " + std::to_string(min) + " and " + std::to_string(max) + ", got '" +
           std::string(text) + "'";
    return std::nullopt;
  }
  return v;
}

/// A fraction flag value: plain decimal ("0.25", "1", ".5"; no sign, exponent, nan or inf)
/// within [min, max]. Returns nullopt and sets `*why` otherwise.
inline std::optional<double> parse_fraction(std::string_view text, double min, double max,
                                            std::string* why) {
  const std::size_t dot = text.find('.');
  const bool digits_ok =
      !text.empty() && text != "." &&
      text.find_first_not_of("0123456789.") == std::string_view::npos &&
      (dot == std::string_view::npos || text.find('.', dot + 1) == std::string_view::npos);
  if (!digits_ok || text.size() > 32) {
    *why = "expected a decimal number, got '" + std::string(text) + "'";
    return std::nullopt;
  }
  const double v = std::stod(std::string(text));
  if (!std::isfinite(v) || v < min || v > max) {
    char range[64];
    std::snprintf(range, sizeof range, "between %g and %g", min, max);
    *why = "must be " + std::string(range) + ", got '" + std::string(text) + "'";
    return std::nullopt;
  }
  return v;
}

/// A subcommand's body, run after parsing; returns the process exit status.
using Runner = std::function<int()>;

/// Registers `keel demo-core` (the core engine at work on a simulated flaky call).
Runner add_demo_core(CLI::App& app);

/// Registers `keel policy` (a retry policy's schedule and whether it fits its deadline).
Runner add_policy(CLI::App& app);

/// Registers `keel serve` (a payments API with idempotency keys; needs keel::store).
Runner add_serve(CLI::App& app);

/// Registers `keel call` (one HTTP request with retries done right; needs keel::http).
Runner add_call(CLI::App& app);

/// Registers `keel upstream` (a fault-injecting HTTP server on 127.0.0.1; needs keel::http).
Runner add_upstream(CLI::App& app);

/// Registers `keel sim` (the retry-storm simulator: scenarios, run, serve; needs keel::sim).
Runner add_sim(CLI::App& app);
/// Registers `keel sim serve` under the `sim` subcommand (the storm explorer page).
Runner add_sim_serve(CLI::App& sim);

/// Registers `keel jobs` (the durable job queue: enqueue, work, stats; needs keel::store and
/// keel::http).
Runner add_jobs(CLI::App& app);
/// Registers `keel dlq` (the dead-letter queue: list, show, replay, discard, depth).
Runner add_dlq(CLI::App& app);

}  // namespace keel::cli
