#include "keel/core/retry.hpp"

#include <cstring>
#include <stdexcept>
#include <string>

#include "detail/invalid.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/events.hpp"

namespace keel {

std::string_view to_string(StopReason reason) noexcept {
  switch (reason) {
    case StopReason::kSuccess:
      return "success";
    case StopReason::kPermanent:
      return "permanent";
    case StopReason::kNotSafeToRetry:
      return "not safe to retry";
    case StopReason::kAttemptsExhausted:
      return "attempts exhausted";
    case StopReason::kDeadline:
      return "deadline";
    case StopReason::kBudgetExhausted:
      return "budget exhausted";
    case StopReason::kCircuitOpen:
      return "circuit open";
    case StopReason::kCancelled:
      return "cancelled";
    case StopReason::kQueued:
      return "queued";
    case StopReason::kLimited:
      return "limited";
  }
  return "unknown";
}

std::string format_give_up(const GiveUpEvent& e, std::string_view what) {
  std::string line = "keel: ";
  if (!what.empty()) {
    line += what;
    line += ": ";
  }
  line += "gave up after " + std::to_string(e.attempts) +
          (e.attempts == 1 ? " attempt in " : " attempts in ") + format_duration(e.elapsed) + ": " +
          std::string(to_string(e.reason));
  if (e.attempts > 0) line += " (last: " + describe(e.last) + ")";
  return line;
}

namespace {
void require(bool ok, const char* field, const char* requirement, Duration got) {
  if (!ok) detail::reject("RetryPolicy", field, requirement, format_duration(got));
}
}  // namespace

RetryPolicy::RetryPolicy(RetryOptions options)
    : options_(std::move(options)), backoff_(options_.backoff) {
  if (options_.max_attempts < 1) {
    detail::reject("RetryPolicy", "max_attempts", ">= 1", std::to_string(options_.max_attempts));
  }
  require(options_.per_try_timeout > Duration::zero(), "per_try_timeout", "> 0",
          options_.per_try_timeout);
  require(options_.overall_timeout > Duration::zero(), "overall_timeout", "> 0",
          options_.overall_timeout);
  require(options_.retry_after_cap >= Duration::zero(), "retry_after_cap", ">= 0",
          options_.retry_after_cap);
  require(options_.min_attempt_time >= Duration::zero(), "min_attempt_time", ">= 0",
          options_.min_attempt_time);
}

RetryVerdict decide_retry(const RetryPolicy& policy, const RetryLimits& limits,
                          const RetryProgress& progress, const Outcome& outcome, Rng& rng) {
  const RetryOptions& opt = policy.options();
  RetryVerdict v;
  v.progress = progress;
  const auto stop = [&](StopReason reason) {
    v.retry = false;
    v.reason = reason;
    return v;
  };
  bool deferral = false;
  switch (outcome.kind) {
    case OutcomeKind::kSuccess:
      return stop(StopReason::kSuccess);
    case OutcomeKind::kPermanent:
      return stop(StopReason::kPermanent);
    case OutcomeKind::kAmbiguous:
      if (!limits.safe_to_repeat) return stop(StopReason::kNotSafeToRetry);
      break;
    case OutcomeKind::kNotAttempted:
      deferral = true;
      break;
    case OutcomeKind::kTransient:
    case OutcomeKind::kThrottled:
      break;
  }
  const bool limited = outcome.retry_limit != Outcome::kNoRetryLimit;
  if (!deferral) {
    if (progress.attempts >= limits.max_attempts) return stop(StopReason::kAttemptsExhausted);
    if (limited && progress.limited_retries >= outcome.retry_limit) {
      return stop(StopReason::kAttemptsExhausted);
    }
  }

  // The wait: the server's (or the refusing brake's) delay when given, capped; else the backoff.
  // A dependency's delay of 0 ("now", or a Retry-After date already past) is no advice: the
  // backoff, with its jitter, so that a dependency that always says "now" is not called in a
  // tight loop. A brake of keel's own that admits again at once (kNotAttempted) is taken at its
  // word: nothing was sent.
  if (outcome.has_server_delay() && (outcome.server_delay > Duration::zero() || deferral)) {
    v.delay =
        outcome.server_delay < opt.retry_after_cap ? outcome.server_delay : opt.retry_after_cap;
    v.server_delay_used = true;
  } else {
    v.delay = policy.backoff().delay(progress.attempts > 0 ? progress.attempts - 1 : 0,
                                     progress.previous_delay, rng);
  }

  // Never wait past the deadline, nor into a window too short for an attempt.
  if (limits.time_left < kInfinite &&
      (limits.time_left <= Duration::zero() ||
       saturating_add(v.delay, opt.min_attempt_time) > limits.time_left)) {
    return stop(StopReason::kDeadline);
  }

  v.retry = true;
  v.counts_attempt = !deferral;
  if (!deferral) {
    if (limited) ++v.progress.limited_retries;
    v.progress.previous_delay = v.delay;
  }
  return v;
}

RetryState::RetryState(const RetryPolicy& policy, const CallOptions& call)
    : policy_(&policy),
      clock_(call.clock != nullptr ? call.clock : &steady_clock()),
      rng_(call.rng),  // thread_rng() is looked up at the first retry decision
      max_attempts_(policy.options().max_attempts),
      prior_attempts_(call.prior_attempts > 0 ? call.prior_attempts : 0),
      budget_(call.budget),
      breaker_(call.breaker),
      safe_to_repeat_(call.safe_to_repeat) {
  if (call.nested == NestedRetries::kSingleAttempt && retry_depth(call.context) > 0) {
    nested_ = true;
    max_attempts_ = 1;
  }
  events_ = policy.options().events;
  deadline_ = call.deadline.min(call.ceiling);
  const RetryOptions& opt = policy.options();
  // The time of the start is needed only for a deadline or a per-try timeout (elapsed() then
  // counts from here); otherwise next() reads the clock first when an attempt fails.
  if (!deadline_.is_infinite() || opt.overall_timeout < kInfinite ||
      opt.per_try_timeout < kInfinite) {
    started_ = clock_->now();
    timed_ = true;
  }
  if (opt.overall_timeout < kInfinite) {
    deadline_ = deadline_.min(Deadline::at(saturating_add(started_, opt.overall_timeout)));
  }
}

RetryState::RetryState(const RetryPolicy& policy, const CallOptions& call, StartsAtOnce)
    : RetryState(policy, call) {
  start_is_now_ = timed_;
}

Decision RetryState::stop(StopReason reason) {
  if (events_ != nullptr) publish_stop(reason, !in_attempt_ && finished_ < attempts_);
  stopped_ = true;
  in_attempt_ = false;
  reason_ = reason;
  if (reason != StopReason::kSuccess && policy_->options().on_give_up) {
    GiveUpEvent event;
    event.attempts = attempts_;
    event.elapsed = elapsed();
    event.reason = reason;
    event.last = last_;
    policy_->options().on_give_up(event);
  }
  Decision d;
  d.reason = reason;
  return d;
}

AttemptStart RetryState::start_attempt() {
  AttemptStart start;
  if (stopped_) {
    start.reason = reason_;
    return start;
  }
  const RetryOptions& opt = policy_->options();
  // Without a deadline the time left is infinite whatever the time: no clock read.
  const Duration left =
      deadline_.is_infinite()
          ? kInfinite
          : deadline_.remaining(start_is_now_ && attempts_ == 0 ? started_ : clock_->now());
  if (left <= Duration::zero() || (attempts_ > 0 && left < opt.min_attempt_time)) {
    if (budget_ != nullptr) budget_->cancel(budget_permit_);
    budget_permit_ = {};
    start.reason = stop(StopReason::kDeadline).reason;
    return start;
  }
  // A durable layer's retry: the budget is asked before anything is sent.
  if (attempts_ == 0 && prior_attempts_ > 0 && budget_ != nullptr) {
    budget_permit_ = budget_->try_acquire_retry(Outcome::transient());
    if (!budget_permit_.granted) {
      if (events_ != nullptr) publish_refused(Outcome::transient());
      start.reason = stop(StopReason::kBudgetExhausted).reason;
      return start;
    }
  }
  if (breaker_ != nullptr) {
    breaker_permit_ = breaker_->try_acquire();
    if (!breaker_permit_.allowed) {
      // The retry the budget granted never runs: give the grant back.
      if (budget_ != nullptr) budget_->cancel(budget_permit_);
      budget_permit_ = {};
      if (attempts_ == 0) last_ = Outcome::not_attempted(breaker_->retry_in());
      start.reason = stop(StopReason::kCircuitOpen).reason;
      return start;
    }
  }
  if (attempts_ == 0 && prior_attempts_ == 0 && budget_ != nullptr) budget_->on_first_attempt();
  ++attempts_;
  in_attempt_ = true;
  start.proceed = true;
  start.attempt.number = attempts_;
  start.attempt.timeout = opt.per_try_timeout < left ? opt.per_try_timeout : left;
  start.attempt.deadline = deadline_;
  if (events_ != nullptr) publish_started();
  return start;
}

void RetryState::cancel() {
  if (stopped_) return;
  if (in_attempt_) {
    if (breaker_ != nullptr) breaker_->release(breaker_permit_);
  } else if (budget_ != nullptr) {
    budget_->cancel(budget_permit_);  // granted for a retry that will not start
  }
  budget_permit_ = {};
  (void)stop(StopReason::kCancelled);
}

Decision RetryState::next(const Outcome& outcome) {
  if (stopped_) {
    Decision d;
    d.reason = reason_;
    return d;
  }
  in_attempt_ = false;
  // Whole, as keel::retry stores it (and never onto itself: next(last_outcome()) is allowed).
  if (&outcome != &last_) std::memcpy(&last_, &outcome, sizeof(Outcome));
  if (breaker_ != nullptr) breaker_->record(breaker_permit_, outcome);
  if (budget_ != nullptr) budget_->record(outcome, budget_permit_);
  budget_permit_ = {};
  // A success stops whatever the limits (decide_retry's first rule): skip building them, and the
  // deadline's clock read.
  if (outcome.kind == OutcomeKind::kSuccess) return stop(StopReason::kSuccess);
  if (!timed_) {
    started_ = clock_->now();
    timed_ = true;
  }
  if (rng_ == nullptr) rng_ = &thread_rng();

  RetryLimits limits;
  limits.max_attempts = max_attempts_;
  limits.safe_to_repeat = safe_to_repeat_;
  // In memory every attempt started counts, so an attempt that reports kNotAttempted is held to
  // the attempt limit too.
  if (!outcome.attempted() && attempts_ >= max_attempts_)
    return stop(StopReason::kAttemptsExhausted);
  if (!deadline_.is_infinite()) limits.time_left = deadline_.remaining(clock_->now());
  RetryProgress progress;
  progress.attempts = attempts_;
  progress.limited_retries = limited_retries_;
  progress.previous_delay = previous_delay_;
  const RetryVerdict verdict = decide_retry(*policy_, limits, progress, outcome, *rng_);
  if (!verdict.retry) return stop(verdict.reason);

  // Last: the budget is charged only for a retry that will happen.
  if (budget_ != nullptr) {
    budget_permit_ = budget_->try_acquire_retry(outcome);
    if (!budget_permit_.granted) {
      if (events_ != nullptr) publish_refused(outcome);
      return stop(StopReason::kBudgetExhausted);
    }
  }

  limited_retries_ = verdict.progress.limited_retries;
  previous_delay_ = verdict.delay;
  const RetryOptions& opt = policy_->options();
  if (opt.on_retry) {
    RetryEvent event;
    event.attempt = attempts_;
    event.outcome = outcome;
    event.delay = verdict.delay;
    event.server_delay_used = verdict.server_delay_used;
    opt.on_retry(event);
  }
  Decision d;
  d.retry = true;
  d.delay = verdict.delay;
  if (events_ != nullptr) publish_finished(d);
  return d;
}

// Events: each builds its Event only when someone listens.

void RetryState::publish_started() const {
  if (!events_->wants(EventKind::kAttemptStarted)) return;
  Event e;
  e.kind = EventKind::kAttemptStarted;
  e.operation = policy_->options().operation;
  e.attempt = attempts_;
  events_->publish(e);
}

void RetryState::publish_finished(const Decision& decision) {
  finished_ = attempts_;
  if (!events_->wants(EventKind::kAttemptFinished)) return;
  Event e;
  e.kind = EventKind::kAttemptFinished;
  e.operation = policy_->options().operation;
  e.attempt = attempts_;
  std::memcpy(&e.outcome, &last_, sizeof(Outcome));  // whole, as next() stores it
  e.will_retry = decision.retry;
  e.delay = decision.delay;
  e.reason = decision.reason;
  events_->publish(e);
}

void RetryState::publish_refused(const Outcome& failure) const {
  if (!events_->wants(EventKind::kBudgetRefused)) return;
  Event e;
  e.kind = EventKind::kBudgetRefused;
  e.operation = policy_->options().operation;
  e.attempt = attempts_;
  e.outcome = failure;
  events_->publish(e);
}

void RetryState::publish_stop(StopReason reason, bool ended_attempt) {
  if (ended_attempt) {
    Decision d;
    d.reason = reason;
    publish_finished(d);
  }
  if (reason == StopReason::kSuccess || !events_->wants(EventKind::kGaveUp)) return;
  Event e;
  e.kind = EventKind::kGaveUp;
  e.operation = policy_->options().operation;
  e.attempt = attempts_;
  e.outcome = last_;
  e.reason = reason;
  e.elapsed = elapsed();
  events_->publish(e);
}

}  // namespace keel
