// Exponential backoff with jitter. The ceiling for retry n (n = 0 before the first retry) is
// min(cap, base * multiplier^n); the delay actually waited depends on the jitter kind:
//
//   full          uniform[0, ceiling)                    (default; fewest calls across a fleet)
//   equal         ceiling/2 + uniform[0, ceiling/2)
//   decorrelated  min(cap, uniform[base, previous * 3))  (previous = the last delay, base at first)
//   none          ceiling                                (synchronises a fleet: for comparison)
//
// See docs/backoff.md for the reasoning and the numbers (AWS Architecture Blog, 2015).
//
// Thread-safety: a Backoff is immutable after construction and safe for concurrent use; the
// random generator passed to delay() is the caller's.
//
// Example:
//   keel::Backoff backoff({.base = 100ms, .cap = 5s});    // full jitter
//   keel::Rng rng(7);
//   auto d0 = backoff.delay(0, {}, rng);                  // in [0, 100ms)
//   auto d1 = backoff.delay(1, d0, rng);                  // in [0, 200ms)
#pragma once

#include <chrono>
#include <optional>
#include <string_view>

#include "keel/clock.hpp"
#include "keel/random.hpp"

namespace keel {

enum class Jitter : unsigned char { kFull, kEqual, kDecorrelated, kNone };

/// "full", "equal", "decorrelated", "none".
[[nodiscard]] std::string_view to_string(Jitter jitter) noexcept;
/// Inverse of to_string; nullopt for anything else.
[[nodiscard]] std::optional<Jitter> parse_jitter(std::string_view text) noexcept;

struct BackoffOptions {
  /// Ceiling before the first retry. Requires: > 0. Default 100 ms.
  Duration base = std::chrono::milliseconds(100);
  /// Largest ceiling (and largest delay). Requires: >= base. Default 10 s.
  Duration cap = std::chrono::seconds(10);
  /// Growth per retry. Requires: >= 1 and finite. Default 2.
  double multiplier = 2.0;
  /// How the delay is drawn under the ceiling. Default full jitter.
  Jitter jitter = Jitter::kFull;
};

class Backoff {
 public:
  /// Throws std::invalid_argument naming the field and the value when the options break a
  /// Requires line above.
  explicit Backoff(BackoffOptions options = {});

  /// min(cap, base * multiplier^retry), saturating. Requires: retry >= 0.
  [[nodiscard]] Duration ceiling(int retry) const noexcept;

  /// The delay to wait before retry number `retry` (0-based). `previous` is the delay chosen
  /// before the previous retry (only decorrelated jitter uses it; pass zero for the first).
  [[nodiscard]] Duration delay(int retry, Duration previous, BitGenRef gen) const noexcept;

  [[nodiscard]] const BackoffOptions& options() const noexcept { return options_; }

 private:
  BackoffOptions options_;
};

/// uniform[lo, hi) in nanoseconds; lo when hi <= lo.
[[nodiscard]] Duration uniform_duration(Duration lo, Duration hi, BitGenRef gen) noexcept;

}  // namespace keel
