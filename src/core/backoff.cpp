#include "keel/core/backoff.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "detail/invalid.hpp"
#include "keel/core/duration.hpp"

namespace keel {

std::string_view to_string(Jitter jitter) noexcept {
  switch (jitter) {
    case Jitter::kFull:
      return "full";
    case Jitter::kEqual:
      return "equal";
    case Jitter::kDecorrelated:
      return "decorrelated";
    case Jitter::kNone:
      return "none";
  }
  return "unknown";
}

std::optional<Jitter> parse_jitter(std::string_view text) noexcept {
  for (Jitter j : {Jitter::kFull, Jitter::kEqual, Jitter::kDecorrelated, Jitter::kNone}) {
    if (text == to_string(j)) return j;
  }
  return std::nullopt;
}

Backoff::Backoff(BackoffOptions options) : options_(options) {
  if (options_.base <= Duration::zero()) {
    detail::reject("Backoff", "base", "> 0", format_duration(options_.base));
  }
  if (options_.cap < options_.base) {
    detail::reject(
        "Backoff", "cap", ">= base",
        "cap " + format_duration(options_.cap) + ", base " + format_duration(options_.base));
  }
  if (!(options_.multiplier >= 1.0) || !std::isfinite(options_.multiplier)) {
    detail::reject("Backoff", "multiplier", "a finite number >= 1",
                   detail::format_number(options_.multiplier));
  }
  if (options_.min_ceiling < Duration::zero()) {
    detail::reject("Backoff", "min_ceiling", ">= 0", format_duration(options_.min_ceiling));
  }
  if (options_.min_ceiling > options_.cap) {
    detail::reject("Backoff", "min_ceiling", "<= cap",
                   "min_ceiling " + format_duration(options_.min_ceiling) + ", cap " +
                       format_duration(options_.cap));
  }
  if (options_.jitter == Jitter::kDecorrelated && options_.min_ceiling != Duration::zero()) {
    detail::reject("Backoff", "min_ceiling", "0 with decorrelated jitter",
                   format_duration(options_.min_ceiling));
  }
}

BackoffOptions BackoffOptions::fleet() {
  return {.base = std::chrono::milliseconds(500),
          .cap = std::chrono::seconds(20),
          .multiplier = 2.0,
          .jitter = Jitter::kFull,
          .min_ceiling = std::chrono::seconds(5)};
}

Duration Backoff::ceiling(int retry) const noexcept {
  Duration raw = options_.base;
  if (retry > 0) {
    const double growth = std::pow(options_.multiplier, static_cast<double>(retry));
    raw = saturating_scale(options_.base, growth);
  }
  // min_ceiling <= cap (checked at construction), so the clamp is well ordered.
  if (raw < options_.min_ceiling) raw = options_.min_ceiling;
  return raw < options_.cap ? raw : options_.cap;
}

Duration uniform_duration(Duration lo, Duration hi, BitGenRef gen) noexcept {
  if (hi <= lo) return lo;
  const double span = static_cast<double>(hi.count()) - static_cast<double>(lo.count());
  auto offset = static_cast<Duration::rep>(uniform01(gen) * span);
  // Rounding of large spans can land exactly on hi; keep the interval half-open.
  const Duration out = lo + Duration(offset);
  return out < hi ? out : hi - Duration(1);
}

Duration Backoff::delay(int retry, Duration previous, BitGenRef gen) const noexcept {
  switch (options_.jitter) {
    case Jitter::kNone:
      return ceiling(retry);
    case Jitter::kFull:
      return uniform_duration(Duration::zero(), ceiling(retry), gen);
    case Jitter::kEqual: {
      const Duration c = ceiling(retry);
      const Duration half = c / 2;
      return half + uniform_duration(Duration::zero(), c - half, gen);
    }
    case Jitter::kDecorrelated: {
      const Duration prev = previous > Duration::zero() ? previous : options_.base;
      const Duration hi = saturating_scale(prev, 3.0);
      const Duration d = uniform_duration(options_.base, hi, gen);
      return d < options_.cap ? d : options_.cap;
    }
  }
  return ceiling(retry);
}

Duration jittered(Duration interval, BitGenRef gen) noexcept {
  if (interval <= Duration::zero()) return Duration::zero();
  const Duration half = interval / 2;
  return uniform_duration(half, saturating_add(interval, half), gen);
}

BackoffSequence::BackoffSequence(BackoffOptions options, std::uint64_t seed)
    : backoff_(options), rng_(seed) {}

Duration BackoffSequence::next() noexcept {
  // Past 62 retries every ceiling is the cap: the count goes on, the exponent need not.
  previous_ = backoff_.delay(std::min(failures_, 62), previous_, rng_);
  if (failures_ < std::numeric_limits<int>::max()) ++failures_;
  return previous_;
}

void BackoffSequence::reset() noexcept {
  failures_ = 0;
  previous_ = Duration::zero();
}

PeriodicSchedule::PeriodicSchedule(Duration interval, BackoffOptions on_failure, std::uint64_t seed)
    : interval_(interval), failures_(on_failure, seed), rng_(seed ^ 0x9e3779b97f4a7c15ULL) {
  if (interval <= Duration::zero()) {
    detail::reject("PeriodicSchedule", "interval", "> 0", format_duration(interval));
  }
}

Duration PeriodicSchedule::after_success() noexcept {
  failures_.reset();
  return jittered(interval_, rng_);
}

Duration PeriodicSchedule::after_failure() noexcept { return failures_.next(); }

}  // namespace keel
