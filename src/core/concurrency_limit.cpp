#include "keel/core/concurrency_limit.hpp"

#include <cmath>
#include <map>
#include <sstream>
#include <string>

#include "detail/invalid.hpp"
#include "keel/core/expected.hpp"

namespace keel {
namespace {

void validate(const ConcurrencyLimitOptions& o) {
  constexpr detail::OptionsCheck reject("ConcurrencyLimitOptions");
  const auto text = [](auto v) { return detail::got_text(v); };
  if (o.min_limit < 1) reject("min_limit", ">= 1", text(o.min_limit));
  if (o.max_limit < o.min_limit || o.max_limit > (std::int64_t{1} << 20)) {
    reject("max_limit", "in [min_limit, 2^20]", text(o.max_limit));
  }
  if (o.initial_limit < o.min_limit || o.initial_limit > o.max_limit) {
    reject("initial_limit", "in [min_limit, max_limit]", text(o.initial_limit));
  }
  if (!(o.tolerance >= 1 && o.tolerance <= 10))
    reject("tolerance", "in [1, 10]", text(o.tolerance));
  if (!(o.growth > 0 && o.growth < 1)) reject("growth", "in (0, 1)", text(o.growth));
  if (!(o.smoothing > 0 && o.smoothing <= 1)) {
    reject("smoothing", "in (0, 1]", text(o.smoothing));
  }
  if (!(o.backoff_ratio >= 0.5 && o.backoff_ratio < 1)) {
    reject("backoff_ratio", "in [0.5, 1)", text(o.backoff_ratio));
  }
  if (o.window <= Duration::zero()) reject("window", "> 0", text(o.window.count()) + " ns");
  if (o.window_samples < 1) reject("window_samples", ">= 1", text(o.window_samples));
  if (o.baseline_window < o.window) {
    reject("baseline_window", ">= window", text(o.baseline_window.count()) + " ns");
  }
}

}  // namespace

AdaptiveConcurrencyLimit::AdaptiveConcurrencyLimit(ConcurrencyLimitOptions options)
    : options_(options) {
  validate(options_);
  limit_value_ = static_cast<double>(options_.initial_limit);
  limit_.store(options_.initial_limit, std::memory_order_relaxed);
  // The first window ends with the first release: its end is read from the caller's clock.
}

void AdaptiveConcurrencyLimit::on_drop(TimePoint now) noexcept {
  in_flight_.fetch_sub(1, std::memory_order_release);
  drops_.fetch_add(1, std::memory_order_relaxed);
  drop_count_.fetch_add(1, std::memory_order_relaxed);
  if (now.time_since_epoch().count() >= window_end_.load(std::memory_order_relaxed)) {
    end_window(now, true);
  }
}

void AdaptiveConcurrencyLimit::end_window(TimePoint now, bool dropped) noexcept {
  std::unique_lock lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) return;  // another thread is ending it
  const std::int64_t t = now.time_since_epoch().count();
  const std::int64_t window_ns = options_.window.count();
  if (!started_) {
    // The first call to end: the window starts now (the caller's clock has no known epoch).
    started_ = true;
    window_end_.store(t + window_ns, std::memory_order_relaxed);
    epoch_end_ns_ = t;  // the first measured window starts a probe: no baseline yet
    return;
  }
  const std::uint64_t seen = window_.load(std::memory_order_relaxed);
  const bool full = (seen >> kSumBits) >= (std::uint64_t{1} << 19);
  if (t < window_end_.load(std::memory_order_relaxed) && !full) return;  // ended meanwhile
  const std::uint64_t drops = drops_.load(std::memory_order_relaxed);
  if (!dropped && drops == 0 &&
      (seen >> kSumBits) < static_cast<std::uint64_t>(options_.window_samples)) {
    // Too few calls to judge: the window goes on, and is looked at again a window later.
    window_end_.store(t + window_ns, std::memory_order_relaxed);
    return;
  }
  const std::uint64_t packed = window_.exchange(0, std::memory_order_relaxed);
  (void)drops_.exchange(0, std::memory_order_relaxed);
  const std::int64_t peak =
      peak_.exchange(in_flight_.load(std::memory_order_relaxed), std::memory_order_relaxed);
  const std::uint64_t count = packed >> kSumBits;
  const std::uint64_t sum_us = packed & kSumMask;
  windows_.fetch_add(1, std::memory_order_relaxed);
  measured_.fetch_add(count, std::memory_order_relaxed);

  double limit = limit_value_;
  const auto mean_ns = count > 0 ? static_cast<std::int64_t>(sum_us * 1000 / count) : 0;
  if (probing_.load(std::memory_order_relaxed)) {
    // The probe runs at half the limit for two windows: the first drains the calls granted
    // before it, the second's mean is the latency without the queue the limit kept. It starts
    // the new baseline epoch; then the limit is restored.
    if (++probe_windows_ < 2) {
      window_end_.store(t + window_ns, std::memory_order_relaxed);
      return;
    }
    probing_.store(false, std::memory_order_relaxed);
    if (count > 0 && drops == 0) {
      baseline_previous_ns_ = baseline_current_ns_ != 0 ? baseline_current_ns_ : mean_ns;
      baseline_current_ns_ = mean_ns;
      baseline_ns_.store(std::min(baseline_current_ns_, baseline_previous_ns_),
                         std::memory_order_relaxed);
    }
    epoch_end_ns_ = t + options_.baseline_window.count();
  } else if (drops > 0) {
    limit = limit * options_.backoff_ratio;
  } else if (count > 0 && t >= epoch_end_ns_) {
    // A new baseline epoch starts with a probe: one window at half the limit, so that a queue
    // the limit has kept all along (a start above the dependency's capacity, a baseline learnt
    // under load) is seen for what it is.
    probing_.store(true, std::memory_order_relaxed);
    probe_windows_ = 0;
    last_mean_ns_.store(std::max<std::int64_t>(mean_ns, 1), std::memory_order_relaxed);
    limit_.store(std::max(options_.min_limit, static_cast<std::int64_t>(limit / 2)),
                 std::memory_order_relaxed);
    window_end_.store(t + window_ns, std::memory_order_relaxed);
    return;
  } else if (count > 0) {
    last_mean_ns_.store(std::max<std::int64_t>(mean_ns, 1), std::memory_order_relaxed);
    if (baseline_current_ns_ == 0) {
      baseline_current_ns_ = baseline_previous_ns_ = mean_ns;
    } else {
      baseline_current_ns_ = std::min(baseline_current_ns_, mean_ns);
    }
    const std::int64_t baseline = std::min(baseline_current_ns_, baseline_previous_ns_);
    baseline_ns_.store(baseline, std::memory_order_relaxed);
    const double gradient = mean_ns <= 0
                                ? 1.0
                                : std::clamp(options_.tolerance * static_cast<double>(baseline) /
                                                 static_cast<double>(mean_ns),
                                             0.5, 1.0);
    double target = limit * gradient + options_.growth * limit;
    // Fewer than half the limit in flight all window: the caller was the bottleneck, and the
    // window says nothing about more.
    if (static_cast<double>(peak) * 2 < limit) target = std::min(target, limit);
    limit += options_.smoothing * (target - limit);
  }
  limit = std::clamp(limit, static_cast<double>(options_.min_limit),
                     static_cast<double>(options_.max_limit));
  limit_value_ = limit;
  limit_.store(std::clamp(static_cast<std::int64_t>(std::floor(limit)), options_.min_limit,
                          options_.max_limit),
               std::memory_order_relaxed);
  window_end_.store(t + window_ns, std::memory_order_relaxed);
}

ConcurrencyLimitStats AdaptiveConcurrencyLimit::stats() const noexcept {
  ConcurrencyLimitStats s;
  s.limit = limit_.load(std::memory_order_relaxed);
  s.in_flight = in_flight_.load(std::memory_order_relaxed);
  s.measured = measured_.load(std::memory_order_relaxed);
  s.refused = refused_.load(std::memory_order_relaxed);
  s.drops = drop_count_.load(std::memory_order_relaxed);
  s.windows = windows_.load(std::memory_order_relaxed);
  s.baseline = Duration(baseline_ns_.load(std::memory_order_relaxed));
  s.last_mean = Duration(last_mean_ns_.load(std::memory_order_relaxed));
  s.probing = probing_.load(std::memory_order_relaxed);
  return s;
}

struct ConcurrencyLimitRegistry::Impl {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<AdaptiveConcurrencyLimit>, std::less<>>
      limits;  // guarded by mu
};

ConcurrencyLimitRegistry::ConcurrencyLimitRegistry(ConcurrencyLimitOptions options,
                                                   std::size_t max_keys)
    : options_(options), max_keys_(max_keys), impl_(std::make_unique<Impl>()) {
  validate(options_);
}

ConcurrencyLimitRegistry::~ConcurrencyLimitRegistry() = default;

std::shared_ptr<AdaptiveConcurrencyLimit> ConcurrencyLimitRegistry::get(std::string_view key) {
  std::lock_guard lock(impl_->mu);
  if (const auto it = impl_->limits.find(key); it != impl_->limits.end()) return it->second;
  if (impl_->limits.size() >= max_keys_) return nullptr;
  auto limit = std::make_shared<AdaptiveConcurrencyLimit>(options_);
  impl_->limits.emplace(std::string(key), limit);
  return limit;
}

}  // namespace keel
