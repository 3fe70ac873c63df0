// An adaptive concurrency limit: how many calls to one dependency may be in flight at once, found
// from the latency the calls measure and the overload answers they get, instead of a number
// chosen by hand. A caller asks for a permit before a call and hands back the call's latency
// (or a drop: a timeout, a 503, a 429) when it ends; the limit follows the dependency's capacity.
//
// How it converges (docs/concurrency.md has the reasoning and the simulator's figures): calls
// are measured in windows (at least `window` long and `window_samples` calls). At the end of a
// window its mean latency is compared with the dependency's baseline, the lowest window mean
// over the last one to two `baseline_window`s (the latency without a queue in front of it; each
// such epoch starts with a probe, two windows at half the limit (the second measured), whose mean
// starts the epoch's baseline, so that a queue kept all along is not taken for the dependency's
// speed):
//
//   a drop in the window      limit = limit x backoff_ratio                (multiplicative cut)
//   else                      gradient = clamp(tolerance x baseline / mean, 0.5, 1)
//                             target = limit x gradient + growth x limit
//                             limit = limit + smoothing x (target - limit)
//
// So latency within `tolerance` of the baseline grows the limit by up to `growth` per window
// (multiplicatively: a limit cut by an outage is back in a few seconds), and latency above it
// shrinks the limit in proportion to the queueing it shows. Once the dependency is saturated,
// the mean latency is in-flight / throughput, and the limit settles where the mean latency is
// tolerance / (1 - growth) times the baseline (about 1.4 with the defaults): the dependency is
// kept busy, with a short queue. A window in which fewer than half the limit were ever in
// flight does not grow it (the caller, not the dependency, was the bottleneck), so an idle
// limit does not drift up to max_limit.
//
// Thread-safety: safe for concurrent use. try_acquire() and a permit's release are the fast
// path: no lock, one atomic read-modify-write each plus relaxed loads (bench/limits_bench.cpp
// measures it). The window's end is taken by one thread under a mutex it only tries to lock:
// nobody waits on it. A ConcurrencyPermit is not thread-safe (move it, do not share it) and must
// not outlive its limit.
//
// Example:
//   static keel::AdaptiveConcurrencyLimit limit({.initial_limit = 20});
//   keel::ConcurrencyPermit p = limit.try_acquire();
//   if (!p) return defer(limit.retry_in());            // over the limit: nothing is sent
//   const auto t0 = clock.now();
//   Outcome o = call();
//   if (o.kind == OutcomeKind::kThrottled || o.timed_out) p.drop(clock.now());
//   else p.release(clock.now() - t0, clock.now());
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "keel/core/clock.hpp"

namespace keel {

struct ConcurrencyLimitOptions {
  /// The limit before anything is measured. Requires: in [min_limit, max_limit]. Default 20.
  std::int64_t initial_limit = 20;
  /// The lowest limit. Requires: >= 1. Default 1.
  std::int64_t min_limit = 1;
  /// The highest limit. Requires: >= min_limit and <= 2^20. Default 1,000.
  std::int64_t max_limit = 1000;
  /// A window's mean latency up to tolerance x the baseline is not queueing. Requires: in
  /// [1, 10]. Default 1.25.
  double tolerance = 1.25;
  /// Growth per window while latency is within tolerance, as a fraction of the limit.
  /// Requires: in (0, 1). Default 0.1.
  double growth = 0.1;
  /// Weight of a window's target in the new limit. Requires: in (0, 1]. Default 0.5.
  double smoothing = 0.5;
  /// The cut after a window with a drop (timeout, 503, 429). Requires: in [0.5, 1).
  /// Default 0.9.
  double backoff_ratio = 0.9;
  /// The shortest window. Requires: > 0. Default 100 ms.
  Duration window = std::chrono::milliseconds(100);
  /// The fewest calls a window measures before it ends (a drop ends it at once). Requires:
  /// >= 1. Default 10.
  int window_samples = 10;
  /// The baseline is the lowest window mean within the last one to two of these, each started
  /// by a probe of two windows at half the limit; so a dependency that became slower for good is
  /// learnt within twice this, and a queue the limit kept is drained at each probe. Requires:
  /// >= window. Default 30 s.
  Duration baseline_window = std::chrono::seconds(30);
};

class AdaptiveConcurrencyLimit;

/// One call's place under the limit: granted (true) or refused (false). Move-only; a permit
/// destroyed without release() or drop() gives its place back without a measurement.
class ConcurrencyPermit {
 public:
  ConcurrencyPermit() = default;
  ConcurrencyPermit(ConcurrencyPermit&& other) noexcept
      : limit_(other.limit_), in_flight_(other.in_flight_) {
    other.limit_ = nullptr;
  }
  ConcurrencyPermit& operator=(ConcurrencyPermit&& other) noexcept;
  ConcurrencyPermit(const ConcurrencyPermit&) = delete;
  ConcurrencyPermit& operator=(const ConcurrencyPermit&) = delete;
  ~ConcurrencyPermit() { ignore(); }

  [[nodiscard]] bool granted() const noexcept { return limit_ != nullptr; }
  [[nodiscard]] explicit operator bool() const noexcept { return granted(); }
  /// Calls in flight when this one was granted, itself included.
  [[nodiscard]] std::int64_t in_flight_at_grant() const noexcept { return in_flight_; }
  /// The call ended with an answer after `latency`; `now` ends the window when it is due.
  void release(Duration latency, TimePoint now) noexcept;
  /// The call ended in a drop: a timeout, or an answer that says the dependency is over its
  /// capacity (429, 503). The window it falls in ends with one cut, however many it holds.
  void drop(TimePoint now) noexcept;
  /// The call ended without saying anything about the dependency (cancelled, a local error).
  void ignore() noexcept;

 private:
  friend class AdaptiveConcurrencyLimit;
  AdaptiveConcurrencyLimit* limit_ = nullptr;
  std::int64_t in_flight_ = 0;
};

/// Counters since the limit was built (a snapshot; each field read on its own).
struct ConcurrencyLimitStats {
  std::int64_t limit = 0;
  std::int64_t in_flight = 0;
  std::uint64_t measured = 0;  // calls released with a latency, in windows that ended
  std::uint64_t refused = 0;
  std::uint64_t drops = 0;
  std::uint64_t windows = 0;  // windows ended (limit updates)
  Duration baseline{};        // zero until a window ended
  Duration last_mean{};       // the last window's mean latency
  bool probing = false;       // this window is a probe at half the limit
};

class AdaptiveConcurrencyLimit {
 public:
  /// Throws std::invalid_argument naming the field and value when a Requires line is broken.
  explicit AdaptiveConcurrencyLimit(ConcurrencyLimitOptions options = {});
  AdaptiveConcurrencyLimit(const AdaptiveConcurrencyLimit&) = delete;
  AdaptiveConcurrencyLimit& operator=(const AdaptiveConcurrencyLimit&) = delete;

  /// A permit when fewer than limit() calls are in flight; refused otherwise. Never blocks.
  [[nodiscard]] ConcurrencyPermit try_acquire() noexcept {
    const std::int64_t before = in_flight_.fetch_add(1, std::memory_order_acquire);
    if (before >= limit_.load(std::memory_order_relaxed)) [[unlikely]] {
      in_flight_.fetch_sub(1, std::memory_order_relaxed);
      refused_.fetch_add(1, std::memory_order_relaxed);
      return {};
    }
    if (before + 1 > peak_.load(std::memory_order_relaxed)) [[unlikely]] {
      peak_.store(before + 1, std::memory_order_relaxed);
    }
    ConcurrencyPermit p;
    p.limit_ = this;
    p.in_flight_ = before + 1;
    return p;
  }

  /// The limit now.
  [[nodiscard]] std::int64_t limit() const noexcept {
    return limit_.load(std::memory_order_relaxed);
  }
  [[nodiscard]] std::int64_t in_flight() const noexcept {
    return in_flight_.load(std::memory_order_relaxed);
  }
  /// When a refused caller may ask again: the last window's mean latency (a call in flight has
  /// likely ended by then), or `window` before any was measured. The caller adds its jitter.
  [[nodiscard]] Duration retry_in() const noexcept {
    const auto ns = last_mean_ns_.load(std::memory_order_relaxed);
    return ns > 0 ? Duration(ns) : options_.window;
  }
  /// Measures a call that holds no permit, for a caller that keeps its own in-flight count
  /// (AdmissionLimiter): `in_flight` is that count when the call was admitted.
  void observe(Duration latency, TimePoint now, std::int64_t in_flight) noexcept {
    if (in_flight > peak_.load(std::memory_order_relaxed)) {
      peak_.store(in_flight, std::memory_order_relaxed);
    }
    record(latency, now);
  }
  [[nodiscard]] ConcurrencyLimitStats stats() const noexcept;
  [[nodiscard]] const ConcurrencyLimitOptions& options() const noexcept { return options_; }

 private:
  friend class ConcurrencyPermit;
  // The window's calls, packed: count in the top 20 bits, latency sum in microseconds below.
  static constexpr int kSumBits = 44;
  static constexpr std::uint64_t kSumMask = (std::uint64_t{1} << kSumBits) - 1;

  void on_release(Duration latency, TimePoint now) noexcept {
    in_flight_.fetch_sub(1, std::memory_order_release);
    record(latency, now);
  }
  void record(Duration latency, TimePoint now) noexcept {
    const auto us = static_cast<std::uint64_t>(
        std::clamp<Duration::rep>(latency.count() / 1000, 0, (Duration::rep{1} << 30)));
    const std::uint64_t before =
        window_.fetch_add((std::uint64_t{1} << kSumBits) + us, std::memory_order_relaxed);
    if (now.time_since_epoch().count() >= window_end_.load(std::memory_order_relaxed) ||
        (before >> kSumBits) >= (std::uint64_t{1} << 19)) [[unlikely]] {
      end_window(now, false);
    }
  }
  void on_drop(TimePoint now) noexcept;
  void on_ignore() noexcept { in_flight_.fetch_sub(1, std::memory_order_release); }
  void end_window(TimePoint now, bool dropped) noexcept;

  ConcurrencyLimitOptions options_;
  alignas(64) std::atomic<std::int64_t> in_flight_{0};
  std::atomic<std::int64_t> limit_{0};
  std::atomic<std::int64_t> peak_{0};  // most in flight this window (approximate)
  alignas(64) std::atomic<std::uint64_t> window_{0};
  std::atomic<std::int64_t> window_end_{0};  // ns since the clock's epoch
  std::atomic<std::uint64_t> drops_{0};
  std::atomic<std::uint64_t> refused_{0};
  std::atomic<std::int64_t> last_mean_ns_{0};

  std::mutex mu_;  // only try-locked, by the thread that ends a window
  // Guarded by mu_:
  double limit_value_ = 0;
  std::int64_t baseline_current_ns_ = 0;   // lowest window mean of this baseline epoch
  std::int64_t baseline_previous_ns_ = 0;  // of the previous one
  std::int64_t epoch_end_ns_ = 0;
  bool started_ = false;
  std::atomic<bool> probing_{false};        // this window runs at half the limit
  int probe_windows_ = 0;                   // windows of the probe ended
  std::atomic<std::uint64_t> measured_{0};  // counted per window, added when it ends
  std::atomic<std::uint64_t> windows_{0};
  std::atomic<std::uint64_t> drop_count_{0};
  std::atomic<std::int64_t> baseline_ns_{0};
};

inline ConcurrencyPermit& ConcurrencyPermit::operator=(ConcurrencyPermit&& other) noexcept {
  if (this != &other) {
    ignore();
    limit_ = other.limit_;
    in_flight_ = other.in_flight_;
    other.limit_ = nullptr;
  }
  return *this;
}

inline void ConcurrencyPermit::release(Duration latency, TimePoint now) noexcept {
  if (limit_ == nullptr) return;
  AdaptiveConcurrencyLimit* l = limit_;
  limit_ = nullptr;
  l->on_release(latency, now);
}

inline void ConcurrencyPermit::drop(TimePoint now) noexcept {
  if (limit_ == nullptr) return;
  AdaptiveConcurrencyLimit* l = limit_;
  limit_ = nullptr;
  l->on_drop(now);
}

inline void ConcurrencyPermit::ignore() noexcept {
  if (limit_ == nullptr) return;
  AdaptiveConcurrencyLimit* l = limit_;
  limit_ = nullptr;
  l->on_ignore();
}

/// Per-dependency adaptive limits, keyed by "host:port" or a name (at most max_keys; past it
/// get() returns nullptr and the caller goes without a limit). Safe for concurrent use.
class ConcurrencyLimitRegistry {
 public:
  explicit ConcurrencyLimitRegistry(ConcurrencyLimitOptions options = {},
                                    std::size_t max_keys = 10000);
  ~ConcurrencyLimitRegistry();
  /// The key's limit, built on first use; nullptr when the registry is full.
  [[nodiscard]] std::shared_ptr<AdaptiveConcurrencyLimit> get(std::string_view key);
  [[nodiscard]] const ConcurrencyLimitOptions& options() const noexcept { return options_; }

 private:
  struct Impl;
  ConcurrencyLimitOptions options_;
  std::size_t max_keys_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace keel
