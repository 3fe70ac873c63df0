#include "keel/core/admission.hpp"

#include <algorithm>
#include <charconv>
#include <stdexcept>
#include <string>

#include "detail/invalid.hpp"

namespace keel {

std::string_view to_string(ShedReason reason) noexcept {
  switch (reason) {
    case ShedReason::kNone:
      return "none";
    case ShedReason::kRetryOverLimit:
      return "retry";
    case ShedReason::kOverCapacity:
      return "over_capacity";
  }
  return "unknown";
}

Admission::Admission(Admission&& other) noexcept
    : limiter_(other.limiter_),
      reason_(other.reason_),
      in_flight_at_admit_(other.in_flight_at_admit_),
      retry_after_(other.retry_after_) {
  other.limiter_ = nullptr;
}

Admission& Admission::operator=(Admission&& other) noexcept {
  if (this != &other) {
    release();
    limiter_ = other.limiter_;
    reason_ = other.reason_;
    in_flight_at_admit_ = other.in_flight_at_admit_;
    retry_after_ = other.retry_after_;
    other.limiter_ = nullptr;
  }
  return *this;
}

void Admission::release() noexcept {
  if (limiter_ != nullptr && reason_ == ShedReason::kNone) limiter_->release_one();
  limiter_ = nullptr;
}

void Admission::release(Duration latency, TimePoint now) noexcept {
  if (limiter_ != nullptr && reason_ == ShedReason::kNone) {
    limiter_->on_latency(latency, now, in_flight_at_admit_);
  }
  release();
}

void Admission::release(Duration latency) noexcept {
  if (limiter_ != nullptr && reason_ == ShedReason::kNone) {
    limiter_->on_latency(latency, in_flight_at_admit_);
  }
  release();
}

AdmissionLimiter::AdmissionLimiter(AdmissionOptions options) : options_(options) {
  constexpr detail::OptionsCheck reject("AdmissionOptions");
  if (options_.max_concurrency < 1) {
    reject("max_concurrency", ">= 1", std::to_string(options_.max_concurrency));
  }
  if (options_.queue_bound < 0) {
    reject("queue_bound", ">= 0", std::to_string(options_.queue_bound));
  }
  if (options_.max_concurrency > (std::int64_t{1} << 40) ||
      options_.queue_bound > (std::int64_t{1} << 40)) {
    reject("max_concurrency and queue_bound", "<= 2^40",
           std::to_string(options_.max_concurrency) + ", " + std::to_string(options_.queue_bound));
  }
  if (options_.retry_after_max <= Duration::zero()) {
    reject("retry_after_max", "> 0", std::to_string(options_.retry_after_max.count()) + " ns");
  }
  if (options_.latency_threshold < Duration::zero()) {
    reject("latency_threshold", ">= 0", std::to_string(options_.latency_threshold.count()) + " ns");
  }
  if (options_.min_concurrency < 1 || options_.min_concurrency > options_.max_concurrency) {
    reject("min_concurrency", "in [1, max_concurrency]", std::to_string(options_.min_concurrency));
  }
  if (!(options_.backoff_ratio >= 0.5 && options_.backoff_ratio < 1.0)) {
    reject("backoff_ratio", "in [0.5, 1)", std::to_string(options_.backoff_ratio));
  }
  // The adaptive limit's own settings mean nothing without it: a caller who set them expects
  // an adaptive limit and would silently get a fixed one.
  if (options_.latency_threshold == Duration::zero()) {
    if (options_.min_concurrency != AdmissionOptions{}.min_concurrency) {
      reject("min_concurrency", "left at its default without latency_threshold > 0",
             std::to_string(options_.min_concurrency));
    }
    if (options_.backoff_ratio != AdmissionOptions{}.backoff_ratio) {
      reject("backoff_ratio", "left at its default without latency_threshold > 0",
             std::to_string(options_.backoff_ratio));
    }
  }
  if (options_.adaptive) {
    if (options_.latency_threshold > Duration::zero()) {
      reject("adaptive", "unset with latency_threshold > 0 (one adaptive mode)",
             std::to_string(options_.latency_threshold.count()) + " ns");
    }
    adaptive_ = std::make_unique<AdaptiveConcurrencyLimit>(*options_.adaptive);
  }
  limit_.store(options_.max_concurrency, std::memory_order_relaxed);
}

// The first attempts' queue beyond the limit: queue_bound, in proportion to an adaptive limit's
// fall from its highest (a fixed queue in front of a limit cut to a few would be the queue the
// cut was made to drain), at least 1 unless queue_bound is 0.
std::int64_t AdmissionLimiter::queue_at(std::int64_t limit) const noexcept {
  const std::int64_t bound = options_.queue_bound;
  const bool adapts = adaptive_ || options_.latency_threshold > Duration::zero();
  if (!adapts || bound == 0) return bound;
  const std::int64_t top = adaptive_ ? adaptive_->options().max_limit : options_.max_concurrency;
  if (limit >= top) return bound;
  const double share = static_cast<double>(limit) / static_cast<double>(top);
  return std::max<std::int64_t>(1, static_cast<std::int64_t>(static_cast<double>(bound) * share));
}

void AdmissionLimiter::on_latency(Duration latency, TimePoint now,
                                  std::int64_t in_flight_at_admit) noexcept {
  if (adaptive_) {
    adaptive_->observe(latency, now, in_flight_at_admit);
    return;
  }
  on_latency(latency, in_flight_at_admit);
}

// AIMD: a cut per slow answer that found the limit full; one more only after a limit's worth of
// fast answers (as TCP's congestion avoidance grows by one per round trip), so that the limit
// does not overshoot by the answers that come back before its queue shows.
void AdmissionLimiter::on_latency(Duration latency, std::int64_t in_flight_at_admit) noexcept {
  if (options_.latency_threshold <= Duration::zero()) return;
  std::int64_t current = limit_.load(std::memory_order_relaxed);
  if (latency > options_.latency_threshold) {
    // A slow answer cuts the limit only when the request found it full: a queue this limit let
    // in. Below the limit the latency is the dependency's own (a slow dependency keeps up with
    // more in flight, its throughput still rising with them), and a cut would only shed.
    if (in_flight_at_admit < current) return;
    const auto scaled =
        static_cast<std::int64_t>(static_cast<double>(current) * options_.backoff_ratio);
    const std::int64_t next = std::max(options_.min_concurrency, std::min(scaled, current - 1));
    if (next != current &&
        limit_.compare_exchange_strong(current, next, std::memory_order_relaxed)) {
      grow_credit_.store(0, std::memory_order_relaxed);
    }
    return;
  }
  // A fast answer while at least half the limit was in use is a credit; a limit's worth of
  // them adds 1.
  if (in_flight_at_admit * 2 < current || current >= options_.max_concurrency) return;
  if (grow_credit_.fetch_add(1, std::memory_order_relaxed) + 1 < current) return;
  grow_credit_.store(0, std::memory_order_relaxed);
  (void)limit_.compare_exchange_strong(current, current + 1, std::memory_order_relaxed);
}

Admission AdmissionLimiter::admit(int attempt, BitGenRef gen) noexcept {
  const bool retry = attempt > 1;
  const std::int64_t base = limit();
  const std::int64_t limit = retry ? base : base + queue_at(base);
  Admission out;
  std::int64_t current = in_flight_.load(std::memory_order_relaxed);
  while (current < limit) {
    if (in_flight_.compare_exchange_weak(current, current + 1, std::memory_order_acquire,
                                         std::memory_order_relaxed)) {
      (retry ? admitted_retry_ : admitted_first_).fetch_add(1, std::memory_order_relaxed);
      out.limiter_ = this;
      out.in_flight_at_admit_ = current + 1;
      return out;
    }
  }
  // Shed: a retry at the first threshold, a first attempt at the second.
  out.reason_ = retry ? ShedReason::kRetryOverLimit : ShedReason::kOverCapacity;
  shed_[static_cast<int>(out.reason_)].fetch_add(1, std::memory_order_relaxed);
  out.retry_after_ = saturating_scale(options_.retry_after_max, uniform01(gen));
  return out;
}

AdmissionStats AdmissionLimiter::stats() const noexcept {
  AdmissionStats s;
  s.in_flight = in_flight_.load(std::memory_order_relaxed);
  s.limit = limit();
  s.admitted_first = admitted_first_.load(std::memory_order_relaxed);
  s.admitted_retry = admitted_retry_.load(std::memory_order_relaxed);
  for (int i = 0; i < kShedReasons; ++i) s.shed[i] = shed_[i].load(std::memory_order_relaxed);
  return s;
}

int attempt_number(const AttemptHeaders& headers) noexcept {
  static constexpr std::int64_t kMax = 1'000'000;
  const auto parse = [](std::optional<std::string_view> v) -> std::optional<std::int64_t> {
    if (!v) return std::nullopt;
    std::string_view s = *v;
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
    if (s.empty() || s.size() > 18) {
      // Too long to parse as int64: a valid all-digit value is huge, so clamp it.
      if (!s.empty() && s.find_first_not_of("0123456789") == std::string_view::npos) return kMax;
      return std::nullopt;
    }
    std::int64_t n = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), n);
    if (ec != std::errc() || end != s.data() + s.size() || s.front() == '-' || s.front() == '+') {
      return std::nullopt;
    }
    return n;
  };
  std::int64_t attempt = 1;
  if (const auto n = parse(headers.keel_attempt)) attempt = std::max(attempt, *n);
  if (const auto n = parse(headers.envoy_attempt_count)) attempt = std::max(attempt, *n);
  if (const auto n = parse(headers.grpc_previous_rpc_attempts)) {
    attempt = std::max(attempt, std::min(*n, kMax - 1) + 1);
  }
  return static_cast<int>(std::min(attempt, kMax));
}

}  // namespace keel
