#include "keel/core/principal_rate_limiter.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>

#include "detail/invalid.hpp"
#include "keel/core/expected.hpp"

namespace keel {

PrincipalRateLimiter::PrincipalRateLimiter(double rate, std::size_t capacity, Clock& clock)
    : rate_(rate),
      burst_(std::max(1.0, rate)),
      capacity_(capacity),
      clock_(&clock),
      shared_{burst_, {}} {
  constexpr detail::OptionsCheck reject("PrincipalRateLimiter");
  if (!(rate > 0) || !std::isfinite(rate)) reject("rate", "> 0 and finite", std::to_string(rate));
  if (capacity < 1) reject("capacity", ">= 1", capacity);
  shared_.last = clock_->now();
}

Duration PrincipalRateLimiter::admit(std::string_view scope) {
  const TimePoint now = clock_->now();
  std::lock_guard lock(mu_);
  if (!scope.empty()) {
    if (const auto it = index_.find(scope); it != index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);  // most recently used first
      return take(it->second->second, now);
    }
  }
  const Duration wait = take(shared_, now);
  if (wait > Duration::zero() || scope.empty()) return wait;
  // Admitted through the shared bucket: the principal gets a bucket of its own, the token it
  // just used already spent.
  if (lru_.size() >= capacity_) {
    index_.erase(lru_.back().first);
    lru_.pop_back();
  }
  lru_.emplace_front(std::string(scope), Bucket{burst_ - 1.0, now});
  index_.emplace(lru_.front().first, lru_.begin());
  return Duration::zero();
}

std::size_t PrincipalRateLimiter::size() {
  std::lock_guard lock(mu_);
  return lru_.size();
}

Duration PrincipalRateLimiter::take(Bucket& b, TimePoint now) const {
  const double elapsed = std::chrono::duration<double>(now - b.last).count();
  b.tokens = std::min(burst_, b.tokens + std::max(0.0, elapsed) * rate_);
  b.last = now;
  if (b.tokens >= 1.0) {
    b.tokens -= 1.0;
    return Duration::zero();
  }
  return std::chrono::duration_cast<Duration>(
      std::chrono::duration<double>((1.0 - b.tokens) / rate_));
}

}  // namespace keel
