// Per-try timeouts from measured latency. A static per-try timeout is a guess (often 30 s);
// the timeout that cuts a stuck attempt without cutting healthy ones is a little above the
// dependency's tail latency: measure its p99.9 (say 180 ms) and time out a little above it
// (say 250 ms). See docs/timeouts.md for the reasoning and the numbers.
//
//   LatencyTracker          the latencies of one dependency over a sliding window of the last
//                           `window`, in log-linear histograms (HdrHistogram-style buckets:
//                           64 per power of two, relative error at most 1/128 = 0.79%), and
//                           their quantiles.
//   AdaptiveTimeout         a tracker and the rule: timeout = clamp(quantile(p) x factor +
//                           margin, floor, ceiling), or the static per-try timeout until the
//                           window holds min_samples latencies.
//   AdaptiveTimeoutRegistry one AdaptiveTimeout per key ("host:port"), created on first use.
//
// Time is passed in (a TimePoint from the caller's keel::Clock); nothing here reads a clock.
//
// Thread-safety: LatencyTracker and AdaptiveTimeout are safe for concurrent use; record() is
// lock-free (two atomic adds: the current time bucket's counter and its running total; moving to a
// new bucket empties the old one once, by exchange, as the breaker's and the budget's windows do)
// and allocates nothing. quantile() and timeout() read one running total per histogram bucket (1344
// loads, a microsecond or two) and take no lock. Memory is fixed at construction: about (buckets +
// 1) x 10.5 KiB per tracker (74 KiB with the defaults). AdaptiveTimeoutRegistry is safe for
// concurrent use (a mutex around its map; cache the returned pointer on hot paths).
//
// Example:
//   keel::AdaptiveTimeout timeout({.quantile = 0.999, .factor = 1.25, .margin = 25ms});
//   const keel::Duration limit = timeout.timeout(clock.now(), 10s);  // 10 s until 1000 samples
//   auto began = clock.now();
//   auto outcome = call_dependency(limit);
//   if (answered(outcome)) timeout.record(clock.now() - began, clock.now());
//   // once the window's p99.9 is 180 ms: timeout.timeout(clock.now(), 10s) is about 250 ms
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>

#include "keel/core/clock.hpp"

namespace keel {

struct LatencyTrackerOptions {
  /// How long a latency counts. Requires: in [1ms, 24h]. Default 60 s.
  Duration window = std::chrono::seconds(60);
  /// The window slides in this many steps: a latency leaves it between window x (1 - 1/buckets)
  /// and window after it was recorded. Requires: in [1, 100], window / buckets >= 1 us.
  /// Default 6 (10 s steps).
  int buckets = 6;
};

/// The latencies of one dependency in the last `window`, and their quantiles. Latencies are kept
/// in microseconds in log-linear buckets: exact below 128 us, then 64 buckets per power of two,
/// so a quantile is reported within kRelativeError of a latency of the window's sample at that
/// rank. Latencies above kMaxLatency count as kMaxLatency; negative ones as zero.
class LatencyTracker {
 public:
  /// Largest relative error of quantile() for latencies of at least 128 us (below: 0.5 us).
  static constexpr double kRelativeError = 1.0 / 128;
  /// The largest latency told apart (2^26 us, about 67 s).
  static constexpr Duration kMaxLatency = std::chrono::microseconds(std::int64_t{1} << 26);

  /// Throws std::invalid_argument naming the field and value when a Requires line is broken.
  explicit LatencyTracker(LatencyTrackerOptions options = {});
  ~LatencyTracker();
  LatencyTracker(const LatencyTracker&) = delete;
  LatencyTracker& operator=(const LatencyTracker&) = delete;

  /// Adds one latency observed at `now`. Lock-free, no allocation. Requires: `now` comes from
  /// one monotonic clock for every call on this tracker.
  void record(Duration latency, TimePoint now) noexcept;

  /// The p-quantile of the latencies in the window ending at `now`: the smallest recorded
  /// latency with at least p of the window's latencies at or below it (to kRelativeError).
  /// nullopt when the window holds fewer than `min_samples` latencies (or none). Requires: p in
  /// [0, 1] (outside, it is clamped).
  [[nodiscard]] std::optional<Duration> quantile(double p, TimePoint now,
                                                 std::int64_t min_samples = 1) const noexcept;

  /// Latencies in the window ending at `now`.
  [[nodiscard]] std::int64_t count(TimePoint now) const noexcept;

  [[nodiscard]] const LatencyTrackerOptions& options() const noexcept { return options_; }

 private:
  struct Window;
  [[nodiscard]] std::int64_t step_at(TimePoint now) const noexcept;

  LatencyTrackerOptions options_;
  Duration step_{};
  std::unique_ptr<Window> window_;
};

struct AdaptiveTimeoutOptions {
  /// The latency quantile the timeout is set above. Requires: in (0, 1]. Default 0.999 (p99.9).
  double quantile = 0.999;
  /// The quantile is multiplied by this. Requires: in [1, 100]. Default 1.25.
  double factor = 1.25;
  /// Then this is added (room for a slow scheduler, a GC pause, a retransmit).
  /// Requires: >= 0. Default 25 ms. With the defaults a p99.9 of 180 ms gives 250 ms.
  Duration margin = std::chrono::milliseconds(25);
  /// The shortest timeout computed. Requires: > 0. Default 10 ms.
  Duration floor = std::chrono::milliseconds(10);
  /// The longest timeout computed. Requires: >= floor. Default 60 s.
  Duration ceiling = std::chrono::seconds(60);
  /// Latencies the window must hold before the timeout follows them; until then the static
  /// timeout is used. Requires: >= 1. Default 1000 (below 1/(1 - p) samples a p99.9 is only
  /// the maximum).
  std::int64_t min_samples = 1000;
  /// How long a latency counts (LatencyTrackerOptions::window). Requires: in [1ms, 24h].
  /// Default 60 s.
  Duration window = std::chrono::seconds(60);
  /// Steps the window slides in (LatencyTrackerOptions::buckets). Requires: in [1, 100].
  /// Default 6.
  int buckets = 6;
};

/// The per-try timeout of one dependency, from its measured latency. A rising tail raises the
/// timeout as soon as a fraction 1 - p of the window is slower; a falling one lowers it once the
/// slow latencies have left the window.
///
/// Which latencies to record: those of answered attempts (a response, success or error status:
/// the time the dependency took to answer), and, through record_timeout, attempts that ran out
/// of their timeout. A timed-out attempt's latency is unknown but at least its timeout (a
/// right-censored sample); recorded at the timeout, it keeps the quantile a lower bound of the
/// truth instead of hiding the slow tail. Dropping timeouts would be worse: after a shift above
/// the timeout every attempt times out, nothing is recorded, and the timeout never rises. At the
/// timeout, once more than 1 - p of the attempts time out the quantile reaches the timeout and
/// the next one is factor x timeout + margin: the timeout climbs until it covers the new
/// latency (or meets the ceiling). Failures without an answer that are not timeouts (connection
/// refused or reset, DNS) are not latencies of the dependency's work: record neither.
class AdaptiveTimeout {
 public:
  /// Throws std::invalid_argument naming the field and value when a Requires line is broken.
  explicit AdaptiveTimeout(AdaptiveTimeoutOptions options = {});

  /// An answered attempt took `latency`, observed at `now`. Lock-free, no allocation.
  void record(Duration latency, TimePoint now) noexcept { tracker_.record(latency, now); }
  /// An attempt ran out of its timeout after `waited`: recorded as a latency of `waited` (a lower
  /// bound of the real one).
  void record_timeout(Duration waited, TimePoint now) noexcept { tracker_.record(waited, now); }

  /// clamp(quantile x factor + margin, floor, ceiling) over the window ending at `now`; nullopt
  /// while the window holds fewer than min_samples latencies.
  [[nodiscard]] std::optional<Duration> computed(TimePoint now) const noexcept;

  /// The timeout to use at `now`: computed(now), or `fallback` (the static per-try timeout) while
  /// there are too few samples.
  [[nodiscard]] Duration timeout(TimePoint now, Duration fallback) const noexcept {
    return computed(now).value_or(fallback);
  }

  /// The timeout of an attempt the retry engine gave `engine_timeout` (min of the static per-try
  /// timeout and the time left before the deadline): the computed timeout when it is shorter,
  /// else engine_timeout. The static timeout stays the upper bound, so the deadline and every
  /// backstop built on the engine's timeout still hold.
  [[nodiscard]] Duration attempt_timeout(Duration engine_timeout, TimePoint now) const noexcept {
    const std::optional<Duration> c = computed(now);
    return c.has_value() && *c < engine_timeout ? *c : engine_timeout;
  }

  [[nodiscard]] const LatencyTracker& tracker() const noexcept { return tracker_; }
  [[nodiscard]] const AdaptiveTimeoutOptions& options() const noexcept { return options_; }

 private:
  AdaptiveTimeoutOptions options_;
  LatencyTracker tracker_;
};

struct AdaptiveTimeoutRegistryOptions {
  /// Options of every AdaptiveTimeout the registry creates.
  AdaptiveTimeoutOptions timeout = {};
  /// Most keys kept (each costs the tracker's memory). At the bound, get() of a new key returns
  /// nullptr: that dependency keeps its static timeout. Requires: >= 1. Default 256.
  std::size_t max_keys = 256;
};

/// One AdaptiveTimeout per key (a client uses "host:port"), created on first use.
class AdaptiveTimeoutRegistry {
 public:
  /// Throws std::invalid_argument when options are invalid (see AdaptiveTimeoutOptions).
  explicit AdaptiveTimeoutRegistry(AdaptiveTimeoutRegistryOptions options = {});
  AdaptiveTimeoutRegistry(const AdaptiveTimeoutRegistry&) = delete;
  AdaptiveTimeoutRegistry& operator=(const AdaptiveTimeoutRegistry&) = delete;

  /// The AdaptiveTimeout of `key`, created on first use; nullptr when max_keys are in use.
  /// The pointer stays valid while held.
  [[nodiscard]] std::shared_ptr<AdaptiveTimeout> get(std::string_view key);
  /// The AdaptiveTimeout of `key` if it exists.
  [[nodiscard]] std::shared_ptr<AdaptiveTimeout> find(std::string_view key) const;
  [[nodiscard]] std::size_t size() const;
  [[nodiscard]] const AdaptiveTimeoutRegistryOptions& options() const noexcept { return options_; }

 private:
  AdaptiveTimeoutRegistryOptions options_;
  mutable std::mutex mutex_;
  std::unordered_map<std::string, std::shared_ptr<AdaptiveTimeout>>
      timeouts_;  // GUARDED_BY(mutex_)
};

}  // namespace keel
