#include "keel/core/latency.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <string>
#include <string_view>
#include <utility>

#include "detail/invalid.hpp"
#include "detail/time_window.hpp"
#include "keel/core/duration.hpp"

namespace keel {

namespace {

// Log-linear buckets over microseconds, HdrHistogram's layout with 64 sub-buckets per half: the
// values below 128 us each have a bucket of their own; above, every power of two [2^k, 2^(k+1))
// is cut into 64 equal buckets. A bucket [lo, lo + w) has lo >= 64 w, so its midpoint is within
// w / 2 <= lo / 128 of every value in it.
constexpr int kSubBits = 6;                                    // 64 buckets per power of two
constexpr std::int64_t kLinear = std::int64_t{2} << kSubBits;  // 128: exact below
constexpr int kMaxBits = 26;                                   // latencies below 2^26 us
constexpr int kTopShift = kMaxBits - (kSubBits + 1);           // 19
constexpr int kCounters = (kTopShift + 2) << kSubBits;         // 1344
constexpr std::int64_t kMaxMicros = (std::int64_t{1} << kMaxBits) - 1;

static_assert(LatencyTracker::kMaxLatency == std::chrono::microseconds(kMaxMicros + 1));
static_assert(LatencyTracker::kRelativeError == 1.0 / (2 * (1 << kSubBits)));

constexpr int bucket_of(std::int64_t micros) noexcept {
  const auto v = static_cast<std::uint64_t>(std::clamp<std::int64_t>(micros, 0, kMaxMicros));
  const int shift = static_cast<int>(std::bit_width(v | static_cast<std::uint64_t>(kLinear - 1))) -
                    (kSubBits + 1);
  return (shift << kSubBits) + static_cast<int>(v >> shift);
}

// The midpoint of bucket i, in nanoseconds.
constexpr Duration midpoint_of(int i) noexcept {
  std::int64_t lo = i;
  std::int64_t width = 1;
  if (i >= kLinear) {
    const int shift = (i >> kSubBits) - 1;
    lo = static_cast<std::int64_t>(i - (shift << kSubBits)) << shift;
    width = std::int64_t{1} << shift;
  }
  return Duration(lo * 1000 + width * 500);
}

static_assert(bucket_of(0) == 0 && bucket_of(127) == 127 && bucket_of(128) == 128);
static_assert(bucket_of(kMaxMicros) == kCounters - 1);
static_assert(bucket_of(kMaxMicros * 2) == kCounters - 1);
static_assert(midpoint_of(128) == Duration(128'000 + 1'000));  // [128, 130) us

std::string number(double v) { return detail::format_number(v); }

/// The window's bounds, checked once for the tracker and for the timeout that builds one, with
/// the context of whichever the caller configured.
void check_window(const LatencyTrackerOptions& o, std::string_view context) {
  if (o.window < std::chrono::milliseconds(1) || o.window > std::chrono::hours(24)) {
    detail::reject(context, "window", "in [1ms, 24h]", format_duration(o.window));
  }
  if (o.buckets < 1 || o.buckets > 100) {
    detail::reject(context, "buckets", "in [1, 100]", std::to_string(o.buckets));
  }
  if (o.window / o.buckets < std::chrono::microseconds(1)) {
    detail::reject(context, "buckets", "at most window / 1us", std::to_string(o.buckets));
  }
}

}  // namespace

// The window is detail::StripedTimeWindow (the breaker's and the budget's), with one shared
// counter per histogram bucket: a record adds 1 to its histogram bucket in the current time
// bucket and to that histogram bucket's running total; rotation takes a time bucket's counts out
// of the totals once. A quantile reads the totals.
struct LatencyTracker::Window : detail::StripedTimeWindow<kCounters> {};

LatencyTracker::LatencyTracker(LatencyTrackerOptions options) : options_(options) {
  check_window(options_, "LatencyTracker");
  step_ = options_.window / options_.buckets;
  window_ = std::make_unique<Window>();
  window_->init(options_.buckets);
}

LatencyTracker::~LatencyTracker() = default;

std::int64_t LatencyTracker::step_at(TimePoint now) const noexcept {
  const Duration since = now.time_since_epoch();
  return since <= Duration::zero() ? 0 : since / step_;
}

void LatencyTracker::record(Duration latency, TimePoint now) noexcept {
  const std::int64_t step = step_at(now);
  Window& w = *window_;
  w.expire(step);
  const int bucket =
      bucket_of(std::chrono::duration_cast<std::chrono::microseconds>(latency).count());
  w.add_shared(w.bucket_at(step), bucket, 1);
}

std::int64_t LatencyTracker::count(TimePoint now) const noexcept {
  Window& w = *window_;
  w.expire(step_at(now));
  std::int64_t n = 0;
  for (int i = 0; i < kCounters; ++i) n += std::max<std::int64_t>(0, std::as_const(w).total(i));
  return n;
}

std::optional<Duration> LatencyTracker::quantile(double p, TimePoint now,
                                                 std::int64_t min_samples) const noexcept {
  Window& w = *window_;
  w.expire(step_at(now));
  // One snapshot of the totals, so that the rank and the scan agree while others record. A
  // total can read below zero for an instant (a rotation took a count out before its add
  // reached the total): it counts as zero.
  std::array<std::int64_t, kCounters> counts{};
  std::int64_t n = 0;
  for (int i = 0; i < kCounters; ++i) {
    counts[static_cast<std::size_t>(i)] = std::max<std::int64_t>(0, std::as_const(w).total(i));
    n += counts[static_cast<std::size_t>(i)];
  }
  if (n == 0 || n < min_samples) return std::nullopt;
  const double q = std::clamp(std::isnan(p) ? 1.0 : p, 0.0, 1.0);
  const auto rank = std::clamp<std::int64_t>(
      static_cast<std::int64_t>(std::ceil(q * static_cast<double>(n))), 1, n);
  std::int64_t seen = 0;
  for (int i = 0; i < kCounters; ++i) {
    seen += counts[static_cast<std::size_t>(i)];
    if (seen >= rank) return midpoint_of(i);
  }
  return midpoint_of(kCounters - 1);  // not reached: seen ends at n >= rank
}

// ---------------------------------------------------------------------------------------------

namespace {

LatencyTrackerOptions tracker_options(const AdaptiveTimeoutOptions& o) {
  if (!(o.quantile > 0.0 && o.quantile <= 1.0)) {
    detail::reject("AdaptiveTimeout", "quantile", "in (0, 1]", number(o.quantile));
  }
  if (!(o.factor >= 1.0 && o.factor <= 100.0)) {
    detail::reject("AdaptiveTimeout", "factor", "in [1, 100]", number(o.factor));
  }
  if (o.margin < Duration::zero()) {
    detail::reject("AdaptiveTimeout", "margin", ">= 0", format_duration(o.margin));
  }
  if (o.floor <= Duration::zero()) {
    detail::reject("AdaptiveTimeout", "floor", "> 0", format_duration(o.floor));
  }
  if (o.ceiling < o.floor) {
    detail::reject("AdaptiveTimeout", "ceiling", ">= floor (" + format_duration(o.floor) + ")",
                   format_duration(o.ceiling));
  }
  if (o.min_samples < 1) {
    detail::reject("AdaptiveTimeout", "min_samples", ">= 1", std::to_string(o.min_samples));
  }
  const LatencyTrackerOptions window{.window = o.window, .buckets = o.buckets};
  check_window(window, "AdaptiveTimeout");
  return window;
}

}  // namespace

AdaptiveTimeout::AdaptiveTimeout(AdaptiveTimeoutOptions options)
    : options_(options), tracker_(tracker_options(options)) {}

std::optional<Duration> AdaptiveTimeout::computed(TimePoint now) const noexcept {
  const std::optional<Duration> q = tracker_.quantile(options_.quantile, now, options_.min_samples);
  if (!q.has_value()) return std::nullopt;
  const Duration t = saturating_add(saturating_scale(*q, options_.factor), options_.margin);
  return std::clamp(t, options_.floor, options_.ceiling);
}

// ---------------------------------------------------------------------------------------------

AdaptiveTimeoutRegistry::AdaptiveTimeoutRegistry(AdaptiveTimeoutRegistryOptions options)
    : options_(options) {
  (void)tracker_options(options_.timeout);
  if (options_.max_keys < 1) detail::reject("AdaptiveTimeoutRegistry", "max_keys", ">= 1", "0");
}

std::shared_ptr<AdaptiveTimeout> AdaptiveTimeoutRegistry::get(std::string_view key) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = timeouts_.find(std::string(key));
  if (it != timeouts_.end()) return it->second;
  if (timeouts_.size() >= options_.max_keys) return nullptr;
  auto timeout = std::make_shared<AdaptiveTimeout>(options_.timeout);
  timeouts_.emplace(std::string(key), timeout);
  return timeout;
}

std::shared_ptr<AdaptiveTimeout> AdaptiveTimeoutRegistry::find(std::string_view key) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = timeouts_.find(std::string(key));
  return it == timeouts_.end() ? nullptr : it->second;
}

std::size_t AdaptiveTimeoutRegistry::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return timeouts_.size();
}

}  // namespace keel
