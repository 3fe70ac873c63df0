// The dependency: its outage, its own rate limit and admission limiter, its failures, and its
// servers and bounded FIFO queue (a request abandoned by its client is still served: wasted).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "detail/engine.hpp"
#include "keel/core/admission.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/random.hpp"
#include "keel/core/retry.hpp"

namespace keel::sim::detail {

std::int64_t Engine::server_limit(std::int64_t t) const {
  const auto& dep = s_.dependency;
  if (dep.capacity_drop.contains(Duration(t))) {
    return std::llround(static_cast<double>(servers_) * dep.capacity_drop_factor);
  }
  return servers_;
}

bool Engine::draw_failure(std::int64_t t) {
  const auto& dep = s_.dependency;
  double p = 0;
  if (dep.failure_window.empty() || dep.failure_window.contains(Duration(t))) {
    p = dep.failure_fraction;
  }
  if (dep.overload_failure > 0 && busy_ >= server_limit(t)) p += dep.overload_failure;
  if (p <= 0) return false;
  return uniform01(dependency_rng_) < p;
}

void Engine::arrive(std::uint32_t index, std::uint32_t attempt_id, std::int64_t t, bool retry) {
  const auto& dep = s_.dependency;
  if (dep.outage.contains(Duration(t))) {
    ++outage_calls_;
    deliver(index, Outcome::transient());
    return;
  }
  if (dep.rate_limit_per_s > 0) {
    // The dependency's own rate limit: 429 over rate_limit_per_s accepted in the last second.
    while (!accepted_.empty() && accepted_.front() <= t - 1'000'000'000) accepted_.pop_front();
    if (static_cast<double>(accepted_.size()) >= dep.rate_limit_per_s) {
      ++slice_at(t).throttled;
      ++throttled_;
      deliver(index, Outcome::throttled(dep.rate_limit_retry_after));
      return;
    }
    accepted_.push_back(t);
  }
  if (admission_) {
    // The receiver's own limiter: retries are refused first, for free, with Retry-After.
    Admission admission = admission_->admit(retry ? 2 : 1, admission_rng_);
    if (!admission) {
      ++slice_at(t).shed;
      deliver(index, Outcome::throttled(admission.retry_after()));
      return;
    }
    admitted_.emplace(attempt_id, Admitted{std::move(admission), t});
  }
  if (admission_) arrived_.emplace(attempt_id, t);
  const bool fails = draw_failure(t);
  if (fails && dep.failures_are_free) {
    admitted_.erase(attempt_id);
    arrived_.erase(attempt_id);
    deliver(index, Outcome::transient());
    return;
  }
  if (busy_ < server_limit(t)) {
    ++busy_;
    schedule(t + dep.service_time.count(), EventType::kServiceDone, index, attempt_id, fails);
    return;
  }
  if (static_cast<std::int64_t>(waiting_.size()) < dep.queue_limit) {
    waiting_.push_back(Pending{Request{index, attempt_id}, fails});
    Slice& sl = slice_at(t);
    sl.queue_max = std::max(sl.queue_max, static_cast<std::int64_t>(waiting_.size()));
    return;
  }
  ++slice_at(t).shed;
  admitted_.erase(attempt_id);
  arrived_.erase(attempt_id);
  deliver(index, dep.shed_retry_after >= Duration::zero() ? Outcome::throttled(dep.shed_retry_after)
                                                          : Outcome::throttled());
}

void Engine::service_done(const Event& ev) {
  --busy_;
  if (const auto it = arrived_.find(ev.attempt_id); it != arrived_.end()) {
    served_latencies_.push_back(ev.at - it->second);
    arrived_.erase(it);
  }
  if (!ev.fails) ++slice_at(ev.at).served_ok;
  // The admission slot is free once the request is served; it tells the limit how long the
  // request was in the dependency.
  if (const auto it = admitted_.find(ev.attempt_id); it != admitted_.end()) {
    it->second.admission.release(Duration(ev.at - it->second.at), clock_.now());
    admitted_.erase(it);
  }
  Op& op = ops_[ev.op];
  if (op.waiting && op.attempt_id == ev.attempt_id) {
    deliver(ev.op, ev.fails ? Outcome::transient() : Outcome::success());
  } else {
    ++slice_at(ev.at).wasted;
    ++wasted_;
  }
  serve_queue(ev.at);
}

void Engine::serve_queue(std::int64_t t) {
  const std::int64_t limit = server_limit(t);
  while (busy_ < limit && !waiting_.empty()) {
    const Pending p = waiting_.front();
    waiting_.pop_front();
    ++busy_;
    schedule(t + s_.dependency.service_time.count(), EventType::kServiceDone, p.request.op,
             p.request.attempt_id, p.fails);
  }
}

}  // namespace keel::sim::detail
