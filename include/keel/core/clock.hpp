// Time for keel: a Clock interface (steady time, wall time, sleep), a steady-clock implementation,
// a ManualClock whose sleep advances virtual time, a Deadline, and saturating duration arithmetic.
//
// Everything in keel::core takes time from a Clock it is given; nothing reads the system clock
// directly. Tests use ManualClock, so a 30 s breaker cool-down or a 10-year Retry-After runs in
// microseconds and never overflows.
//
// Thread-safety: SteadyClock and ManualClock are safe for concurrent use. Deadline is a value.
//
// Example:
//   keel::ManualClock clock;
//   auto deadline = keel::Deadline::after(clock, std::chrono::seconds(5));
//   clock.sleep_for(std::chrono::seconds(2));
//   deadline.remaining(clock.now());  // 3 s
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>

namespace keel {

/// All keel durations are nanoseconds (range: about +/-292 years).
using Duration = std::chrono::nanoseconds;
/// A point on the monotonic clock.
using TimePoint = std::chrono::time_point<std::chrono::steady_clock, Duration>;
/// A point in calendar time (for HTTP dates).
using WallTime = std::chrono::time_point<std::chrono::system_clock, Duration>;

/// Days since 1970-01-01 of a proleptic Gregorian date (month 1-12, day 1-31; not checked): the
/// one calendar conversion of keel (HTTP dates, RFC 3339 times). Hinnant's days_from_civil.
[[nodiscard]] constexpr std::int64_t days_from_civil(std::int64_t y, unsigned m,
                                                     unsigned d) noexcept {
  y -= m <= 2 ? 1 : 0;
  const std::int64_t era = (y >= 0 ? y : y - 399) / 400;
  const auto yoe = static_cast<unsigned>(y - era * 400);
  const unsigned doy = (153 * (m > 2 ? m - 3 : m + 9) + 2) / 5 + d - 1;
  const unsigned doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  return era * 146097 + static_cast<std::int64_t>(doe) - 719468;
}
static_assert(days_from_civil(1970, 1, 1) == 0 && days_from_civil(2000, 3, 1) == 11017);

/// A proleptic Gregorian date.
struct CivilDate {
  std::int64_t year = 1970;
  unsigned month = 1;  // 1-12
  unsigned day = 1;    // 1-31
};
/// The date `days` after 1970-01-01 (negative: before it): days_from_civil's inverse, Hinnant's
/// civil_from_days.
[[nodiscard]] constexpr CivilDate civil_from_days(std::int64_t days) noexcept {
  const std::int64_t z = days + 719468;
  const std::int64_t era = (z >= 0 ? z : z - 146096) / 146097;
  const auto doe = static_cast<unsigned>(z - era * 146097);
  const unsigned yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
  const unsigned doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
  const unsigned mp = (5 * doy + 2) / 153;
  const unsigned d = doy - (153 * mp + 2) / 5 + 1;
  const unsigned m = mp < 10 ? mp + 3 : mp - 9;
  return {
      .year = static_cast<std::int64_t>(yoe) + era * 400 + (m <= 2 ? 1 : 0), .month = m, .day = d};
}
static_assert(civil_from_days(0).year == 1970 && civil_from_days(11017).month == 3 &&
              civil_from_days(-1).year == 1969 && civil_from_days(-1).day == 31);

/// Whether `y` is a leap year of the proleptic Gregorian calendar.
[[nodiscard]] constexpr bool is_leap_year(std::int64_t y) noexcept {
  return (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
}

/// The days of month `m` (1-12) of year `y`.
[[nodiscard]] constexpr unsigned days_in_month(std::int64_t y, unsigned m) noexcept {
  constexpr unsigned kDays[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  return m == 2 && is_leap_year(y) ? 29 : kDays[m - 1];
}

/// "No limit": the largest Duration. Arithmetic below saturates at it instead of overflowing.
inline constexpr Duration kInfinite = Duration::max();

/// a + b, clamped to [Duration::min(), kInfinite].
[[nodiscard]] constexpr Duration saturating_add(Duration a, Duration b) noexcept {
  using Rep = Duration::rep;
  Rep out{};
  if (__builtin_add_overflow(a.count(), b.count(), &out)) {
    return b.count() > 0 ? kInfinite : Duration::min();
  }
  return Duration(out);
}

/// a - b, clamped.
[[nodiscard]] constexpr Duration saturating_sub(Duration a, Duration b) noexcept {
  using Rep = Duration::rep;
  Rep out{};
  if (__builtin_sub_overflow(a.count(), b.count(), &out)) {
    return b.count() < 0 ? kInfinite : Duration::min();
  }
  return Duration(out);
}

/// t + d, clamped to the representable range of TimePoint.
[[nodiscard]] constexpr TimePoint saturating_add(TimePoint t, Duration d) noexcept {
  return TimePoint(saturating_add(t.time_since_epoch(), d));
}

/// d scaled by a non-negative factor, clamped to [0, kInfinite]. NaN gives 0.
[[nodiscard]] constexpr Duration saturating_scale(Duration d, double factor) noexcept {
  const double v = static_cast<double>(d.count()) * factor;
  if (!(v > 0.0)) return Duration::zero();
  if (v >= static_cast<double>(std::numeric_limits<Duration::rep>::max())) return kInfinite;
  return Duration(static_cast<Duration::rep>(v));
}

/// Where time comes from. Implementations must be safe for concurrent use.
class Clock {
 public:
  virtual ~Clock() = default;
  /// Monotonic now; never goes backwards.
  [[nodiscard]] virtual TimePoint now() const noexcept = 0;
  /// Calendar now (for Retry-After dates).
  [[nodiscard]] virtual WallTime wall_now() const noexcept = 0;
  /// Blocks the calling thread for d (a ManualClock advances instead). d <= 0 returns at once.
  virtual void sleep_for(Duration d) = 0;
  /// For code that waits on a timer of its own (an event loop's) instead of blocking in
  /// sleep_for: called as a wait of d begins, returns how long that timer must wait in real
  /// time. A clock on real time returns d (this default); a clock that keeps time of its own
  /// moves it forward by d, as sleep_for would, and returns zero (ManualClock). Never negative.
  [[nodiscard]] virtual Duration begin_timer_wait(Duration d) {
    return d > Duration::zero() ? d : Duration::zero();
  }
  /// Whether this clock is std::chrono::steady_clock's time with real sleeps (SteadyClock), so
  /// that a caller may spend a wait of d blocked on something of its own for as long instead
  /// (the gRPC client watches its channel between attempts). False for every other clock.
  [[nodiscard]] virtual bool is_steady_clock() const noexcept { return false; }
};

/// The clock's calendar now in whole milliseconds since 1970-01-01 UTC: the one form in which
/// keel's stores write a time (a job's due time, a key's expiry, a message's record).
[[nodiscard]] inline std::int64_t wall_ms(const Clock& clock) noexcept {
  return std::chrono::duration_cast<std::chrono::milliseconds>(clock.wall_now().time_since_epoch())
      .count();
}

/// std::chrono::steady_clock and std::this_thread::sleep_for. Stateless.
class SteadyClock final : public Clock {
 public:
  [[nodiscard]] TimePoint now() const noexcept override;
  [[nodiscard]] WallTime wall_now() const noexcept override;
  void sleep_for(Duration d) override;
  [[nodiscard]] bool is_steady_clock() const noexcept override { return true; }
};

/// CLOCK_MONOTONIC_COARSE: a few ns per read instead of ~20, with a resolution of 1-4 ms.
/// Good enough for time windows measured in seconds (breaker buckets, ratio budgets).
class CoarseClock final : public Clock {
 public:
  [[nodiscard]] TimePoint now() const noexcept override;
  [[nodiscard]] WallTime wall_now() const noexcept override;
  void sleep_for(Duration d) override;
};

/// The process's SteadyClock (a stateless object; returned by reference for convenience).
[[nodiscard]] Clock& steady_clock() noexcept;
/// The process's CoarseClock.
[[nodiscard]] Clock& coarse_clock() noexcept;

/// Virtual time for tests and the simulator. sleep_for(d) advances time by d and returns at once.
/// Starts at an arbitrary fixed point (steady time 1000 s, wall time 2024-01-01T00:00:00Z)
/// unless told otherwise. Safe for concurrent use (time is one atomic).
class ManualClock final : public Clock {
 public:
  ManualClock() noexcept;
  explicit ManualClock(WallTime wall_start) noexcept;

  [[nodiscard]] TimePoint now() const noexcept override;
  [[nodiscard]] WallTime wall_now() const noexcept override;
  void sleep_for(Duration d) override;
  /// sleep_for(d), then zero: an event loop's timer does not wait for virtual time.
  [[nodiscard]] Duration begin_timer_wait(Duration d) override;

  /// Moves time forward by d (negative d is ignored: time never goes backwards).
  void advance(Duration d) noexcept;
  /// Total virtual time slept through sleep_for (not advance), for assertions.
  [[nodiscard]] Duration slept() const noexcept;
  /// Number of sleep_for calls with d > 0.
  [[nodiscard]] std::int64_t sleeps() const noexcept;

 private:
  std::atomic<Duration::rep> offset_{0};
  std::atomic<Duration::rep> slept_{0};
  std::atomic<std::int64_t> sleeps_{0};
  Duration wall_start_;
};

/// A point in time after which an operation should not continue. Infinite by default.
/// Arithmetic saturates: Deadline::after(clock, kInfinite) is infinite, not a wrapped value.
class Deadline {
 public:
  constexpr Deadline() noexcept = default;
  [[nodiscard]] static constexpr Deadline infinite() noexcept { return Deadline(); }
  [[nodiscard]] static constexpr Deadline at(TimePoint when) noexcept { return Deadline(when); }
  /// now + d (d = kInfinite gives an infinite deadline).
  [[nodiscard]] static Deadline after(const Clock& clock, Duration d) noexcept {
    return d >= kInfinite ? Deadline() : Deadline(saturating_add(clock.now(), d));
  }

  [[nodiscard]] constexpr bool is_infinite() const noexcept { return when_ == TimePoint::max(); }
  [[nodiscard]] constexpr TimePoint when() const noexcept { return when_; }
  /// Time left at `now`: kInfinite for an infinite deadline, zero once expired (never negative).
  [[nodiscard]] constexpr Duration remaining(TimePoint now) const noexcept {
    if (is_infinite()) return kInfinite;
    if (now >= when_) return Duration::zero();
    return saturating_sub(when_.time_since_epoch(), now.time_since_epoch());
  }
  [[nodiscard]] constexpr bool expired(TimePoint now) const noexcept {
    return !is_infinite() && now >= when_;
  }
  /// The earlier of two deadlines.
  [[nodiscard]] constexpr Deadline min(Deadline other) const noexcept {
    return other.when_ < when_ ? other : *this;
  }

 private:
  constexpr explicit Deadline(TimePoint when) noexcept : when_(when) {}
  TimePoint when_ = TimePoint::max();
};

}  // namespace keel
