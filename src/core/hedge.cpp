#include "keel/core/hedge.hpp"

#include <string>

#include "detail/invalid.hpp"
#include "keel/core/duration.hpp"

namespace keel {

std::string_view to_string(HedgeRefusal refusal) noexcept {
  switch (refusal) {
    case HedgeRefusal::kNone:
      return "sent";
    case HedgeRefusal::kNotHedged:
      return "not hedged";
    case HedgeRefusal::kLimit:
      return "limit";
    case HedgeRefusal::kNothingInFlight:
      return "nothing in flight";
    case HedgeRefusal::kNotDue:
      return "not due";
    case HedgeRefusal::kDeadline:
      return "deadline";
    case HedgeRefusal::kCircuitOpen:
      return "circuit open";
    case HedgeRefusal::kBudgetExhausted:
      return "budget exhausted";
  }
  return "unknown";
}

HedgePolicy::HedgePolicy(HedgeOptions options) : options_(std::move(options)) {
  if (options_.delay < Duration::zero()) {
    detail::reject("HedgePolicy", "delay", ">= 0", format_duration(options_.delay));
  }
  if (options_.max_hedges < 1 || options_.max_hedges > kMaxHedges) {
    detail::reject("HedgePolicy", "max_hedges", "in [1, 10]", std::to_string(options_.max_hedges));
  }
  if (options_.latency_quantile &&
      !(*options_.latency_quantile > 0.0 && *options_.latency_quantile < 1.0)) {
    detail::reject("HedgePolicy", "latency_quantile", "in (0, 1)",
                   detail::format_number(*options_.latency_quantile));
  }
  if (options_.min_samples < 1) {
    detail::reject("HedgePolicy", "min_samples", ">= 1", std::to_string(options_.min_samples));
  }
}

Duration HedgePolicy::delay(const LatencyTracker* latencies, TimePoint now) const noexcept {
  if (options_.latency_quantile && latencies != nullptr) {
    if (auto q = latencies->quantile(*options_.latency_quantile, now, options_.min_samples)) {
      return *q;
    }
  }
  return options_.delay;
}

HedgeState::HedgeState(const HedgePolicy* hedge, const RetryPolicy& policy, const CallOptions& call,
                       RetryState& retry) noexcept
    : hedge_(hedge),
      policy_(&policy),
      retry_(&retry),
      budget_(call.budget),
      breaker_(call.breaker),
      enabled_(hedge != nullptr && call.safe_to_repeat && !retry.nested()) {}

AttemptInfo HedgeState::begin_round(const AttemptInfo& primary, Duration delay) {
  primary_ = primary;
  delay_ = delay;
  last_start_ = retry_->clock().now();
  flying_.fill(false);
  flying_[0] = true;
  in_flight_ = 1;
  pooled_ = 0;
  round_hedges_ = 0;
  hedging_ = enabled_;
  ++sent_;
  AttemptInfo out = primary;
  out.number = sent_;
  return out;
}

std::optional<TimePoint> HedgeState::next_hedge_at() const noexcept {
  if (!hedging_ || in_flight_ == 0 || round_hedges_ >= hedge_->options().max_hedges) {
    return std::nullopt;
  }
  return saturating_add(last_start_, delay_);
}

HedgeStart HedgeState::start_hedge() {
  HedgeStart start;
  const auto refuse = [&](HedgeRefusal why, bool ends) {
    if (ends) hedging_ = false;
    start.refusal = why;
    return start;
  };
  if (!enabled_) return refuse(HedgeRefusal::kNotHedged, false);
  if (!hedging_ || round_hedges_ >= hedge_->options().max_hedges) {
    return refuse(HedgeRefusal::kLimit, false);
  }
  if (in_flight_ == 0) return refuse(HedgeRefusal::kNothingInFlight, false);
  const TimePoint now = retry_->clock().now();
  if (now < saturating_add(last_start_, delay_)) return refuse(HedgeRefusal::kNotDue, false);
  const Deadline deadline = retry_->deadline();
  const Duration left = deadline.is_infinite() ? kInfinite : deadline.remaining(now);
  if (left <= Duration::zero() || left < policy_->options().min_attempt_time) {
    return refuse(HedgeRefusal::kDeadline, true);
  }
  Permits permits;
  if (breaker_ != nullptr) {
    permits.breaker = breaker_->try_acquire();
    if (!permits.breaker.allowed) return refuse(HedgeRefusal::kCircuitOpen, true);
  }
  if (budget_ != nullptr) {
    // A hedge is charged as a retry after a transient failure: the attempt in flight is late,
    // not known to have failed.
    permits.budget = budget_->try_acquire_retry(Outcome::transient());
    if (!permits.budget.granted) {
      if (breaker_ != nullptr) breaker_->release(permits.breaker);
      return refuse(HedgeRefusal::kBudgetExhausted, true);
    }
  }
  int slot = 1;
  while (flying_[static_cast<std::size_t>(slot)]) ++slot;
  flying_[static_cast<std::size_t>(slot)] = true;
  pool_[static_cast<std::size_t>(pooled_++)] = permits;
  ++in_flight_;
  ++round_hedges_;
  ++hedges_;
  ++sent_;
  last_start_ = now;
  start.proceed = true;
  start.index = slot;
  start.attempt = primary_;
  start.attempt.number = sent_;
  start.attempt.timeout = primary_.timeout < left ? primary_.timeout : left;
  return start;
}

HedgeVerdict HedgeState::finish(int index, const Outcome& outcome) {
  HedgeVerdict verdict;
  flying_[static_cast<std::size_t>(index)] = false;
  --in_flight_;
  const bool answer =
      outcome.kind == OutcomeKind::kSuccess || outcome.kind == OutcomeKind::kPermanent;
  if (answer || in_flight_ == 0 || pooled_ == 0) {
    hedging_ = false;
    verdict.done = true;
    verdict.winner = index;
    verdict.decision = retry_->next(outcome);
    return verdict;
  }
  // Not the round's end: told to the brakes on a hedge's permits; RetryState's stay for the
  // attempt that ends the round.
  const Permits permits = pool_[static_cast<std::size_t>(--pooled_)];
  if (breaker_ != nullptr) breaker_->record(permits.breaker, outcome);
  if (budget_ != nullptr) budget_->record(outcome, permits.budget);
  if (outcome.kind == OutcomeKind::kThrottled || outcome.has_server_delay()) hedging_ = false;
  return verdict;
}

void HedgeState::release(const Permits& permits) noexcept {
  if (breaker_ != nullptr && permits.breaker.allowed) breaker_->release(permits.breaker);
}

void HedgeState::cancel(int index) noexcept {
  if (index < 0 || index > HedgePolicy::kMaxHedges || !flying_[static_cast<std::size_t>(index)]) {
    return;
  }
  flying_[static_cast<std::size_t>(index)] = false;
  --in_flight_;
  if (pooled_ > 0) release(pool_[static_cast<std::size_t>(--pooled_)]);
}

void HedgeState::cancel_operation() noexcept {
  while (pooled_ > 0) release(pool_[static_cast<std::size_t>(--pooled_)]);
  flying_.fill(false);
  in_flight_ = 0;
  hedging_ = false;
  retry_->cancel();
}

}  // namespace keel
