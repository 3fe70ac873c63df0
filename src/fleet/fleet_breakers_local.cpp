// SharedBreakers and this process's own breakers: the registry's listener, which queues each
// state change for the background thread to publish; the registry's trial gate, which asks the
// fleet whether a half-open trial may be the fleet's probe and waits for the answer at most
// round_trip_limit; and the fleet's state applied to the breakers (opened for the rest of the
// fleet's break, closed at a random moment within release_spread after the fleet's probe
// succeeded). The statements on keel_breakers are fleet_breakers.cpp.
#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "db/detail/listener.hpp"
#include "fleet/detail/fleet_sql.hpp"
#include "keel/core/random.hpp"
#include "keel/fleet/shared_breakers.hpp"

namespace keel::store {

using detail::shareable;

namespace {

// Set on a thread while it applies the fleet's state to a breaker, so that the change it causes
// is not published back.
thread_local const SharedBreakers* t_applying = nullptr;
// Set by the trial gate when it holds a breaker open for another process's probe: the
// half-open -> open change that follows is this process's own echo of the fleet's state.
thread_local const SharedBreakers* t_held_by = nullptr;
thread_local std::string t_held_key;

}  // namespace

// A local breaker changed state: queue the change for the background thread (latest per key).
void SharedBreakers::on_change(std::string_view key, BreakerState from, BreakerState to) {
  if (t_applying == this) return;  // the fleet's own state being applied here
  if (t_held_by == this && from == BreakerState::kHalfOpen && to == BreakerState::kOpen &&
      t_held_key == key) {
    t_held_by = nullptr;  // held open for another process's probe: nothing new to tell
    return;
  }
  if (to == BreakerState::kHalfOpen || !shareable(key)) return;
  Publication publication;
  if (to == BreakerState::kOpen) {
    const auto breaker = registry_.find(key);
    publication.open = true;
    publication.until =
        std::chrono::steady_clock::now() + (breaker ? breaker->retry_in() : Duration::zero());
  }
  {
    std::lock_guard lock(mu_);
    pending_.insert_or_assign(std::string(key), publication);
    releases_.erase(std::string(key));
    if (listener_ != nullptr) listener_->interrupt();
  }
}

// The trial gate: may this process's half-open trial be the fleet's probe? Asked of the
// background thread, and waited for at most round_trip_limit.
Duration SharedBreakers::gate(std::string_view key) {
  t_held_by = nullptr;
  if (!shareable(key)) return Duration::zero();
  const auto request = std::make_shared<GateRequest>();
  request->key = std::string(key);
  Duration hold{};
  {
    std::unique_lock lock(mu_);
    if (!sharing_.load() || !answering_ || listener_ == nullptr) {
      lock.unlock();
      fallbacks_.fetch_add(1);
      return Duration::zero();
    }
    gates_.push_back(request);
    listener_->interrupt();
    // wait: bound: an answer from the background thread, at most round_trip_limit
    if (!answered_cv_.wait_for(lock, options_.round_trip_limit,
                               [&] { return request->answered; })) {
      // No answer in time (a slow or frozen database): this trial is decided locally, and so
      // are the next ones, at once, until the background thread answers again.
      request->abandoned = true;
      answering_ = false;
      lock.unlock();
      fallbacks_.fetch_add(1);
      return Duration::zero();
    }
    hold = request->hold;
  }
  if (hold > Duration::zero()) {
    t_held_by = this;
    t_held_key = std::string(key);
  }
  return hold;
}

// When this process closes `key`'s breaker after the fleet's probe succeeded: a random moment
// within release_spread, drawn once per close (by the notification or by the trial gate,
// whichever comes first). Returns the time left until then.
Duration SharedBreakers::release_in(const std::string& key) {
  std::lock_guard lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  auto it = releases_.find(key);
  if (it == releases_.end()) {
    const Duration after = uniform_duration(Duration::zero(), options_.release_spread, rng_);
    it = releases_.emplace(key, now + after).first;
    if (listener_ != nullptr) listener_->interrupt();  // the background thread's next wait
  }
  return it->second > now ? Duration(it->second - now) : Duration::zero();
}

// Opens `key`'s breaker for the fleet, for the rest of its break, never longer than the
// breaker's longest break.
void SharedBreakers::apply_open(const std::string& key, Duration remaining) {
  {
    std::lock_guard lock(mu_);
    releases_.erase(key);
  }
  const auto breaker = registry_.get(key);
  if (!breaker) return;  // the registry is full of open breakers
  t_applying = this;
  breaker->force_open(std::min(remaining, breaker->options().max_break_duration));
  t_applying = nullptr;
  applied_opens_.fetch_add(1);
}

// Closes the breakers whose release is due; returns how long until the next one.
Duration SharedBreakers::release_due() {
  std::vector<std::pair<std::string, Instant>> due;
  Duration next = kInfinite;
  {
    std::lock_guard lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    for (const auto& [key, at] : releases_) {
      if (at <= now) {
        due.emplace_back(key, at);
      } else {
        next = std::min<Duration>(next, at - now);
      }
    }
  }
  for (const auto& [key, at] : due) {
    const auto breaker = registry_.find(key);
    if (breaker && breaker->state() != BreakerState::kClosed) {
      t_applying = this;
      breaker->reset();
      t_applying = nullptr;
      applied_closes_.fetch_add(1);
    }
    // Forgotten only once the breaker is closed: a trial asked for meanwhile is held, not run.
    std::lock_guard lock(mu_);
    if (const auto it = releases_.find(key); it != releases_.end() && it->second == at) {
      releases_.erase(it);
    }
  }
  return next;
}

}  // namespace keel::store
