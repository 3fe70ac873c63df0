#include "keel/rate_limit.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "keel/backoff.hpp"
#include "keel/expected.hpp"

namespace keel {
namespace {

template <class T>
std::string text(T v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

[[noreturn]] void reject(const char* field, const std::string& requirement,
                         const std::string& got) {
  throw_invalid({.context = "keel::RateLimitOptions",
                 .field = field,
                 .problem = "must be " + requirement,
                 .got = got});
}

void validate(const RateLimitOptions& o) {
  if (!(o.rate_per_s >= 0 && o.rate_per_s <= 1e6)) {
    reject("rate_per_s", "in [0, 1e6]", text(o.rate_per_s));
  }
  if (!(o.burst == 0 || (o.burst >= 1 && o.burst <= 1e6))) {
    reject("burst", "0 (one slot) or in [1, 1e6]", text(o.burst));
  }
  if (!(o.headroom >= 0 && o.headroom < 0.5)) reject("headroom", "in [0, 0.5)", text(o.headroom));
  if (o.max_pause <= Duration::zero()) {
    reject("max_pause", "> 0", text(o.max_pause.count()) + " ns");
  }
  if (o.release_spread < Duration::zero()) {
    reject("release_spread", ">= 0", text(o.release_spread.count()) + " ns");
  }
}

std::int64_t ns_of(TimePoint t) { return t.time_since_epoch().count(); }

}  // namespace

RateLimit::RateLimit(RateLimitOptions options, std::string key)
    : options_(options), key_(std::move(key)) {
  validate(options_);
  if (options_.rate_per_s > 0) {
    interval_ns_ = std::max<std::int64_t>(1, std::llround(1e9 / spaced_rate()));
    const double burst = options_.burst > 0 ? options_.burst : 1.0;
    burst_ns_ = static_cast<std::int64_t>(burst * static_cast<double>(interval_ns_));
    chunk_ = std::clamp<std::int64_t>(std::llround(options_.rate_per_s / 10), 1, 1000);
  }
}

std::int64_t RateLimit::next_slot(std::int64_t now_ns) {
  const std::int64_t earliest = now_ns - burst_ns_;
  while (!chunks_.empty()) {
    Chunk& c = chunks_.front();
    if (c.next < c.count) {
      const std::int64_t at = c.start_ns + c.next * interval_ns_;
      if (at >= earliest) return at;
      // Slots that passed unused are not saved up: a burst is at most `burst`.
      const std::int64_t skip =
          std::min(c.count - c.next, (earliest - at + interval_ns_ - 1) / interval_ns_);
      c.next += std::max<std::int64_t>(skip, 1);
      stats_.slots_lost += static_cast<std::uint64_t>(std::max<std::int64_t>(skip, 1));
      continue;
    }
    chunks_.pop_front();
  }
  return -1;
}

RateDecision RateLimit::reserve(TimePoint now, Duration max_wait, BitGenRef gen) {
  const std::int64_t t = ns_of(now);
  const std::int64_t max_wait_ns = std::max<Duration>(max_wait, Duration::zero()).count();
  bool leased = false;  // the fleet was asked for a chunk during this call
  for (;;) {
    enum class Next { kDone, kWant, kLease } next = Next::kDone;
    RateDecision d;
    {
      std::lock_guard lock(mu_);
      if (paused_until_ns_ > t) {
        ++stats_.refused;
        const Duration spread = uniform_duration(Duration::zero(), options_.release_spread, gen);
        return {.go = false, .wait = Duration(paused_until_ns_ - t) + spread, .paused = true};
      }
      if (interval_ns_ == 0) {
        ++stats_.went;
        return {};
      }
      bool on_share = !sharing_;
      if (sharing_) {
        if (full_until_ns_ > t) {
          ++stats_.refused;
          return {.go = false, .wait = Duration(full_until_ns_ - t)};
        }
        const std::int64_t at = next_slot(t);
        if (at >= 0) {
          const std::int64_t wait = std::max<std::int64_t>(0, at - t);
          if (wait > max_wait_ns) {
            ++stats_.refused;
            return {.go = false, .wait = Duration(wait)};
          }
          ++chunks_.front().next;
          ++stats_.went;
          if (wait > 0) ++stats_.waited;
          std::int64_t left = 0;
          for (const Chunk& c : chunks_) left += c.count - c.next;
          d = {.go = true, .wait = Duration(wait)};
          if (2 * left >= chunk_ || wanted_) return d;  // half a chunk left: the next one
          wanted_ = true;
          next = Next::kWant;
        } else if (!leased) {
          next = Next::kLease;
        } else {
          on_share = true;  // the fleet gave no chunk in time: this call goes on the share
        }
      }
      if (on_share) {
        // This process's share of the rate: all of it alone, the fleet's equal share when the
        // fleet cannot answer.
        const double share = std::clamp(share_, 1e-6, 1.0);
        const auto interval = static_cast<std::int64_t>(static_cast<double>(interval_ns_) / share);
        const auto burst = static_cast<std::int64_t>(static_cast<double>(burst_ns_) / share);
        const std::int64_t at = std::max(tat_ns_, t - burst);
        const std::int64_t wait = std::max<std::int64_t>(0, at - t);
        if (wait > max_wait_ns) {
          ++stats_.refused;
          return {.go = false, .wait = Duration(wait)};
        }
        tat_ns_ = at + interval;
        ++stats_.went;
        if (wait > 0) ++stats_.waited;
        if (sharing_) ++stats_.on_share;
        return {.go = true, .wait = Duration(wait)};
      }
    }
    // The fleet is called without the lock held.
    std::shared_lock fleet_lock(fleet_->mu);
    if (next == Next::kWant) {
      if (fleet_->fleet != nullptr) fleet_->fleet->want(key_);
      return d;
    }
    // No leased slot left: ask for a chunk (at most one bounded round trip), then look again.
    if (fleet_->fleet != nullptr) (void)fleet_->fleet->lease(key_);
    leased = true;
  }
}

bool RateLimit::pause(TimePoint now, Duration duration, bool announce) {
  const std::int64_t t = ns_of(now);
  const Duration d = std::clamp<Duration>(duration, Duration::zero(), options_.max_pause);
  const std::int64_t until = t + d.count();
  {
    std::lock_guard lock(mu_);
    if (until <= paused_until_ns_ || d <= Duration::zero()) return false;
    paused_until_ns_ = until;
    ++stats_.pauses;
  }
  if (announce) {
    std::shared_lock fleet_lock(fleet_->mu);
    if (fleet_->fleet != nullptr) fleet_->fleet->paused(key_, TimePoint(Duration(until)));
  }
  return true;
}

TimePoint RateLimit::paused_until() const {
  std::lock_guard lock(mu_);
  return TimePoint(Duration(paused_until_ns_));
}

void RateLimit::add_chunk(TimePoint now, Duration start_in, std::int64_t count) {
  std::lock_guard lock(mu_);
  wanted_ = false;
  full_until_ns_ = 0;
  if (count <= 0 || interval_ns_ == 0) return;
  chunks_.push_back({.start_ns = ns_of(now) + start_in.count(), .count = count, .next = 0});
  ++stats_.chunks;
}

void RateLimit::full_until(TimePoint now, Duration in) {
  std::lock_guard lock(mu_);
  wanted_ = false;
  full_until_ns_ = ns_of(now) + std::max<Duration>(in, Duration::zero()).count();
}

std::int64_t RateLimit::slots_left(TimePoint now) const {
  std::lock_guard lock(mu_);
  const std::int64_t earliest = ns_of(now) - burst_ns_;
  std::int64_t left = 0;
  for (const Chunk& c : chunks_) {
    for (std::int64_t k = c.next; k < c.count; ++k) {
      if (c.start_ns + k * interval_ns_ >= earliest) ++left;
    }
  }
  return left;
}

void RateLimit::set_sharing(bool sharing) {
  std::lock_guard lock(mu_);
  sharing_ = sharing;
  wanted_ = false;
  if (!sharing) chunks_.clear();  // leased slots are given up: the share decides now
}

void RateLimit::set_share(double share) {
  std::lock_guard lock(mu_);
  share_ = std::clamp(share, 1e-6, 1.0);
}

RateLimitStats RateLimit::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

RateLimitRegistry::RateLimitRegistry(RateLimitOptions defaults, std::size_t max_keys)
    : defaults_(defaults), max_keys_(max_keys) {
  validate(defaults_);
}

RateLimitRegistry::~RateLimitRegistry() = default;

void RateLimitRegistry::set_options(std::string_view key, const RateLimitOptions& options) {
  validate(options);
  std::lock_guard lock(mu_);
  options_.insert_or_assign(std::string(key), options);
}

std::shared_ptr<RateLimit> RateLimitRegistry::get(std::string_view key) {
  std::lock_guard lock(mu_);
  if (const auto it = limits_.find(key); it != limits_.end()) return it->second;
  if (limits_.size() >= max_keys_) return nullptr;
  const auto o = options_.find(key);
  auto limit =
      std::make_shared<RateLimit>(o != options_.end() ? o->second : defaults_, std::string(key));
  limit->fleet_ = fleet_;
  limit->sharing_ = sharing_;
  limit->share_ = share_;
  limits_.emplace(std::string(key), limit);
  return limit;
}

void RateLimitRegistry::set_fleet_state(bool sharing, double share) {
  std::lock_guard lock(mu_);
  sharing_ = sharing;
  share_ = std::clamp(share, 1e-6, 1.0);
  for (const auto& [key, limit] : limits_) {
    limit->set_sharing(sharing);
    limit->set_share(share_);
  }
}

std::shared_ptr<RateLimit> RateLimitRegistry::find(std::string_view key) const {
  std::lock_guard lock(mu_);
  const auto it = limits_.find(key);
  return it != limits_.end() ? it->second : nullptr;
}

std::map<std::string, std::shared_ptr<RateLimit>, std::less<>> RateLimitRegistry::all() const {
  std::lock_guard lock(mu_);
  return limits_;
}

void RateLimitRegistry::attach_fleet(RateLimitFleet* fleet) {
  std::unique_lock lock(fleet_->mu);  // waits for the fleet calls running
  fleet_->fleet = fleet;
}

}  // namespace keel
