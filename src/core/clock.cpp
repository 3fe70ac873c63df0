#include "keel/core/clock.hpp"

#include <ctime>
#include <thread>

namespace keel {

TimePoint SteadyClock::now() const noexcept {
  return std::chrono::time_point_cast<Duration>(std::chrono::steady_clock::now());
}

WallTime SteadyClock::wall_now() const noexcept {
  return std::chrono::time_point_cast<Duration>(std::chrono::system_clock::now());
}

void SteadyClock::sleep_for(Duration d) {
  if (d > Duration::zero()) std::this_thread::sleep_for(d);
}

TimePoint CoarseClock::now() const noexcept {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return TimePoint(std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec));
}

WallTime CoarseClock::wall_now() const noexcept {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME_COARSE, &ts);
  return WallTime(std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec));
}

void CoarseClock::sleep_for(Duration d) {
  if (d > Duration::zero()) std::this_thread::sleep_for(d);
}

Clock& steady_clock() noexcept {
  static SteadyClock clock;
  return clock;
}

Clock& coarse_clock() noexcept {
  static CoarseClock clock;
  return clock;
}

namespace {
// 2024-01-01T00:00:00Z
constexpr std::chrono::seconds kDefaultWallStart{1704067200};
constexpr std::chrono::seconds kSteadyStart{1000};
}  // namespace

ManualClock::ManualClock() noexcept : wall_start_(kDefaultWallStart) {}
ManualClock::ManualClock(WallTime wall_start) noexcept
    : wall_start_(wall_start.time_since_epoch()) {}

TimePoint ManualClock::now() const noexcept {
  return TimePoint(
      saturating_add(Duration(kSteadyStart), Duration(offset_.load(std::memory_order_acquire))));
}

WallTime ManualClock::wall_now() const noexcept {
  return WallTime(saturating_add(wall_start_, Duration(offset_.load(std::memory_order_acquire))));
}

void ManualClock::advance(Duration d) noexcept {
  if (d <= Duration::zero()) return;
  auto cur = offset_.load(std::memory_order_relaxed);
  while (!offset_.compare_exchange_weak(cur, saturating_add(Duration(cur), d).count(),
                                        std::memory_order_acq_rel)) {
  }
}

void ManualClock::sleep_for(Duration d) {
  if (d <= Duration::zero()) return;
  advance(d);
  auto cur = slept_.load(std::memory_order_relaxed);
  while (!slept_.compare_exchange_weak(cur, saturating_add(Duration(cur), d).count(),
                                       std::memory_order_relaxed)) {
  }
  sleeps_.fetch_add(1, std::memory_order_relaxed);
}

Duration ManualClock::begin_timer_wait(Duration d) {
  sleep_for(d);
  return Duration::zero();
}

Duration ManualClock::slept() const noexcept { return Duration(slept_.load()); }
std::int64_t ManualClock::sleeps() const noexcept { return sleeps_.load(); }

}  // namespace keel
