// The summary of a run from its slices and counters: amplification, peaks, goodput over the
// steady window, recovery after the trigger, and the latency percentiles.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>

#include "detail/engine.hpp"
#include "keel/core/duration.hpp"

namespace keel::sim::detail {

bool Engine::healthy(const Slice& sl) const {
  const std::int64_t ended = sl.successes + sl.failures;
  if (ended == 0) return true;
  return static_cast<double>(sl.successes) >= s_.healthy_ratio * static_cast<double>(ended);
}

Result Engine::summarize(std::int64_t events) {
  Result r;
  Summary& m = r.summary;
  m.events = events;
  m.first_attempts = first_attempts_;
  m.total_calls = total_calls_;
  m.layer_calls = layer_calls_;
  m.amplification = first_attempts_ > 0
                        ? static_cast<double>(total_calls_) / static_cast<double>(first_attempts_)
                        : 0.0;
  m.wasted = wasted_;
  const Window steady = s_.steady.empty() ? Window{Duration::zero(), s_.duration} : s_.steady;
  std::int64_t steady_calls = 0;
  std::int64_t steady_served_ok = 0;
  for (std::size_t i = 0; i < slices_.size(); ++i) {
    const Slice& sl = slices_[i];
    const Duration start(static_cast<std::int64_t>(i) * slice_ns_);
    if (steady.contains(start)) {
      steady_calls += sl.offered;
      steady_served_ok += sl.served_ok;
    }
    if (sl.offered > m.peak_per_slice) {
      m.peak_per_slice = sl.offered;
      m.peak_slice_start = start;
    }
    m.peak_retries_per_slice = std::max(m.peak_retries_per_slice, sl.retries);
    m.ops_succeeded += sl.ops_succeeded;
    m.ops_failed += sl.ops_failed;
  }
  const double steady_s = std::chrono::duration<double>(steady.end - steady.start).count();
  m.offered_per_s = steady_s > 0 ? static_cast<double>(steady_calls) / steady_s : 0.0;
  m.goodput_per_s = steady_s > 0 ? static_cast<double>(steady_served_ok) / steady_s : 0.0;
  m.limited = limited_;
  m.throttled = throttled_;
  if (!served_latencies_.empty()) {
    auto pick = [&](double q) {
      const auto k =
          static_cast<std::size_t>(q * static_cast<double>(served_latencies_.size() - 1));
      std::nth_element(served_latencies_.begin(),
                       served_latencies_.begin() + static_cast<std::ptrdiff_t>(k),
                       served_latencies_.end());
      return Duration(served_latencies_[k]);
    };
    m.served_p50_latency = pick(0.50);
    m.served_p99_latency = pick(0.99);
  }

  // Recovery: the first slice at or after trigger_end from which every slice is healthy.
  const auto first = static_cast<std::size_t>(s_.trigger_end.count() / slice_ns_);
  std::optional<std::size_t> healthy_from;
  for (std::size_t i = slices_.size(); i-- > first;) {
    if (!healthy(slices_[i])) break;
    healthy_from = i;
  }
  // Without a trigger there is nothing to recover from: recovered means healthy throughout.
  if (s_.trigger_end <= Duration::zero() && healthy_from && *healthy_from != 0) {
    healthy_from.reset();
  }
  if (healthy_from) {
    m.recovered = true;
    const Duration at(static_cast<std::int64_t>(*healthy_from) * slice_ns_);
    m.recovery = at > s_.trigger_end ? at - s_.trigger_end : Duration::zero();
  }
  std::optional<std::size_t> ops_healthy_from;
  for (std::size_t i = slices_.size(); i-- > first;) {
    const Slice& sl = slices_[i];
    const std::int64_t ended = sl.ops_succeeded + sl.ops_failed;
    if (ended > 0 &&
        static_cast<double>(sl.ops_succeeded) < s_.healthy_ratio * static_cast<double>(ended)) {
      break;
    }
    ops_healthy_from = i;
  }
  if (ops_healthy_from) {
    const Duration at(static_cast<std::int64_t>(*ops_healthy_from) * slice_ns_);
    m.ops_recovery = at > s_.trigger_end ? at - s_.trigger_end : Duration::zero();
  }
  m.outage_calls = outage_calls_;
  m.probes = probes_;
  m.breaker_opens = breaker_opens_;
  if (!latencies_.empty()) {
    auto pick = [&](double q) {
      const auto k = static_cast<std::size_t>(q * static_cast<double>(latencies_.size() - 1));
      std::nth_element(latencies_.begin(), latencies_.begin() + static_cast<std::ptrdiff_t>(k),
                       latencies_.end());
      return Duration(latencies_[k]);
    };
    m.p50_latency = pick(0.50);
    m.p99_latency = pick(0.99);
  }
  r.slices = std::move(slices_);
  return r;
}

}  // namespace keel::sim::detail
