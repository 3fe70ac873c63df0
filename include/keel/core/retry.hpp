// The retry engine: a state machine that decides, after each attempt, whether to try again,
// after how long, or why to stop; and keel::retry(), a thin blocking loop over it.
//
// Rules (each tested in tests/unit/retry_test.cpp):
//  - max_attempts counts the first try. An overall deadline wins over the attempt count: the
//    engine never sleeps past it and does not start an attempt that could not get
//    min_attempt_time before it.
//  - Each attempt's timeout is min(per_try_timeout, time left before the deadline).
//  - The deadline is the earliest of the caller's (CallOptions::deadline), the policy's
//    overall_timeout and an upper bound handed down from the caller's own caller
//    (CallOptions::ceiling: the deadline a request handler received, Keel-Deadline-Ms).
//  - A server's delay (Retry-After) replaces the backoff, capped at retry_after_cap; a delay that
//    does not fit before the deadline stops the operation with StopReason::kDeadline.
//  - Ambiguous failures (the request may have taken effect) are retried only when the operation
//    is safe to repeat (idempotent, or it carries an idempotency key).
//  - Outcomes with a retry_limit (HTTP 500: 1) cause at most that many retries per operation.
//  - With CallOptions::breaker, every attempt first asks the circuit breaker (open: stop with
//    StopReason::kCircuitOpen) and reports its outcome to it.
//  - With CallOptions::budget, every retry first asks the retry budget (refused: stop with
//    StopReason::kBudgetExhausted); every attempt's outcome is reported to it.
//  - One retrying layer: a keel retry loop started while another one runs on this thread (or in
//    the same RetryContext) makes a single attempt, unless CallOptions::nested says kRetry. Three
//    nested layers of 3 attempts reach the bottom 3 times, not 27.
////  - Nothing sent is not an attempt's failure: a breaker refusal before any attempt stops with
//    kCircuitOpen and RetryResult::outcome is kNotAttempted (with the breaker's retry_in), a
//    budget grant whose retry the breaker then refuses is given back (RetryBudget::cancel), and a
//    cancelled attempt is released from the breaker uncounted (cancel()).
//  - The same rules decide durable retries: decide_retry() is the pure function RetryState::next
//    applies, and the job queue calls it with the progress it stores per job.
//
// The engine's parts, each in its own header that this one includes: what an operation reports
// (retry_events.hpp: StopReason, AttemptInfo, RetryEvent, GiveUpEvent), its configuration
// (retry_policy.hpp: RetryOptions, RetryPolicy), retries at one layer only (retry_layers.hpp:
// NestedRetries, RetryContext, RetryScope) and the pure decision a durable driver calls
// (retry_decision.hpp: decide_retry). This header holds the engine itself: CallOptions,
// RetryState and keel::retry.
//
// Thread-safety: a RetryPolicy is immutable and safe to share between threads and calls. A
// RetryState belongs to one logical operation and is not thread-safe.
//
// Example:
//   keel::RetryPolicy policy({.max_attempts = 4, .overall_timeout = 15s,
//                             .backoff = {.base = 200ms, .cap = 5s}});
//   auto result = keel::retry(policy, [&](const keel::AttemptInfo& a) {
//     return call_dependency(a.timeout);            // returns a keel::Outcome
//   });
//   if (!result.ok()) log(keel::to_string(result.reason));
#pragma once

#include <atomic>
#include <chrono>
#include <concepts>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "keel/core/backoff.hpp"
#include "keel/core/breaker.hpp"
#include "keel/core/budget.hpp"
#include "keel/core/classify.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/random.hpp"
#include "keel/core/retry_decision.hpp"
#include "keel/core/retry_events.hpp"
#include "keel/core/retry_layers.hpp"
#include "keel/core/retry_policy.hpp"

namespace keel {

class EventStream;  // keel/core/events.hpp

/// Per-call inputs that are not policy: where time and randomness come from, the caller's
/// deadline, and whether the operation is safe to repeat.
struct CallOptions {
  /// Default: keel::steady_clock().
  Clock* clock = nullptr;
  /// Combined with the policy's overall_timeout (the earlier wins). Default infinite.
  Deadline deadline = Deadline::infinite();
  /// An upper bound on the operation's deadline that does not come from this caller: the
  /// deadline of the incoming request whose handler runs this operation (its Keel-Deadline-Ms,
  /// keel::store::current_request_deadline()). The engine applies min(deadline,
  /// overall_timeout, ceiling), so a retry loop inside a handler stops when its caller stops
  /// waiting. Default infinite (no bound).
  Deadline ceiling = Deadline::infinite();
  /// Idempotent, or carries an idempotency key. Default false: an ambiguous failure is then not
  /// retried, which is the safe choice for an operation keel knows nothing about.
  bool safe_to_repeat = false;
  /// Default: keel::thread_rng().
  Rng* rng = nullptr;
  /// The dependency's retry budget, asked before every retry and told every outcome. Non-owning;
  /// Requires: outlives the operation (budgets normally live as long as the client). Default
  /// none.
  RetryBudget* budget = nullptr;
  /// The dependency's circuit breaker, asked before every attempt and told every outcome.
  /// Non-owning; Requires: outlives the operation (hold the registry's shared_ptr). Default none.
  CircuitBreaker* breaker = nullptr;
  /// For asynchronous code: the context that says whether an outer keel retry loop is running.
  /// Default none: this thread's retry depth is used. Requires: outlives the operation.
  RetryContext* context = nullptr;
  /// What this operation does when it starts inside another keel retry loop. Default
  /// kSingleAttempt (one retrying layer).
  NestedRetries nested = NestedRetries::kSingleAttempt;
  /// Attempts of this logical operation that a durable layer (a job queue) already made. When
  /// > 0, the first attempt here is a retry: the budget is asked before it (refused: stop with
  /// kBudgetExhausted, nothing sent) instead of counting a first attempt. Requires: >= 0.
  /// Default 0.
  int prior_attempts = 0;
};

/// Whether to start an attempt.
struct AttemptStart {
  bool proceed = false;
  AttemptInfo attempt;
  StopReason reason = StopReason::kSuccess;  // meaningful when !proceed
};

/// What to do after an attempt.
struct Decision {
  bool retry = false;
  Duration delay{};                          // when retry
  StopReason reason = StopReason::kSuccess;  // when !retry
};

/// The engine for one logical operation. Drive it as:
///   for (auto start = state.start_attempt(); start.proceed; start = state.start_attempt()) {
///     Decision d = state.next(run(start.attempt));
///     if (!d.retry) break;
///     clock.sleep_for(d.delay);        // or an event loop's timer
///   }
/// Requires: the policy, and the call's clock, rng, budget and breaker, outlive the state.
class RetryState {
 public:
  explicit RetryState(const RetryPolicy& policy, const CallOptions& call = {});

  /// Tag for a driver that calls start_attempt() right after constructing the state.
  struct StartsAtOnce {};
  /// As above; the first start_attempt() checks the deadline against the clock read made here
  /// (when there is a deadline) instead of reading the clock again. keel::retry uses it; a
  /// driver that may start its first attempt later must not.
  RetryState(const RetryPolicy& policy, const CallOptions& call, StartsAtOnce);

  /// Checks the deadline, then the circuit breaker, before an attempt. When it may proceed,
  /// returns the attempt's number and timeout; otherwise the reason to stop (kDeadline,
  /// kCircuitOpen; the give-up hook has been called).
  [[nodiscard]] AttemptStart start_attempt();

  /// Classifies the end of the current attempt into retry-after-delay or stop-with-reason
  /// (decide_retry). Reports the outcome to the breaker and the budget, and asks the budget
  /// before a retry.
  [[nodiscard]] Decision next(const Outcome& outcome);

  /// The caller cancelled the operation: it stops with kCancelled (the give-up hook is called).
  /// An attempt in flight is released from the breaker uncounted (a half-open trial is free
  /// again) and its budget permit is kept (the request may have been sent); a budget grant for
  /// a retry that has not started is given back. No-op once stopped.
  void cancel();

  [[nodiscard]] int attempts() const noexcept { return attempts_; }
  /// Time since the operation started. The engine reads the clock at construction only when
  /// the operation has a deadline or a per-try timeout; otherwise nothing needs the time until
  /// an attempt fails, and elapsed() counts from the end of that attempt (zero until then, so a
  /// first-try success reads no clock at all).
  [[nodiscard]] Duration elapsed() const noexcept {
    return timed_ ? clock_->now() - started_ : Duration::zero();
  }
  [[nodiscard]] Deadline deadline() const noexcept { return deadline_; }
  [[nodiscard]] Clock& clock() const noexcept { return *clock_; }
  /// The last outcome passed to next(); kNotAttempted before any (with the breaker's retry_in
  /// when the breaker refused the first attempt).
  [[nodiscard]] const Outcome& last_outcome() const noexcept { return last_; }
  /// Why the operation stopped (kSuccess until it has stopped).
  [[nodiscard]] StopReason stop_reason() const noexcept { return reason_; }
  [[nodiscard]] bool stopped() const noexcept { return stopped_; }
  /// Started inside another keel retry loop, and so limited to one attempt.
  [[nodiscard]] bool nested() const noexcept { return nested_; }
  /// Attempts this operation may make: the policy's max_attempts, or 1 when nested.
  [[nodiscard]] int max_attempts() const noexcept { return max_attempts_; }

 private:
  Decision stop(StopReason reason);
  // Event publishing (keel/core/events.hpp), called only when events_ is set.
  void publish_started() const;
  void publish_finished(const Decision& decision);
  void publish_refused(const Outcome& failure) const;
  void publish_stop(StopReason reason, bool ended_attempt);

  const RetryPolicy* policy_;
  Clock* clock_;
  Rng* rng_;
  Deadline deadline_;
  TimePoint started_;
  Duration previous_delay_{};
  Outcome last_;
  int attempts_ = 0;
  int limited_retries_ = 0;
  int max_attempts_;
  int prior_attempts_;
  RetryBudget* budget_;
  CircuitBreaker* breaker_;
  RetryPermit budget_permit_;
  BreakerPermit breaker_permit_;
  bool safe_to_repeat_;
  bool nested_ = false;
  bool stopped_ = false;
  bool in_attempt_ = false;
  bool timed_ = false;         // started_ holds a clock read
  bool start_is_now_ = false;  // StartsAtOnce: the first attempt starts at started_
  StopReason reason_ = StopReason::kSuccess;
  EventStream* events_ = nullptr;
  int finished_ = 0;  // the last attempt whose kAttemptFinished event was published
};

/// The result of keel::retry: the last attempt's value, its outcome and why the loop stopped.
template <class T>
struct RetryResult {
  std::optional<T> value;  // the last attempt's result (empty only if no attempt ran)
  /// Its classification. When no attempt ran (the deadline had passed, the circuit was open, the
  /// budget refused): kNotAttempted, with the breaker's retry_in when it refused.
  Outcome outcome;
  StopReason reason = StopReason::kSuccess;
  int attempts = 0;
  /// From the start to the stop (RetryState::elapsed): without a deadline or a per-try timeout
  /// it counts from the end of the first failed attempt, and is zero for a first-try success.
  Duration elapsed{};
  [[nodiscard]] bool ok() const noexcept { return reason == StopReason::kSuccess; }
};

namespace detail {
template <class Fn>
decltype(auto) invoke_attempt(Fn& fn, const AttemptInfo& info) {
  if constexpr (std::is_invocable_v<Fn&, const AttemptInfo&>) {
    return fn(info);
  } else {
    return fn();
  }
}
template <class Fn>
using attempt_result_t =
    std::decay_t<decltype(invoke_attempt(std::declval<Fn&>(), std::declval<const AttemptInfo&>()))>;
}  // namespace detail

/// Runs fn until it succeeds or a rule says stop, sleeping on the call's clock between attempts.
/// fn takes `const AttemptInfo&` (or nothing) and returns T; classify maps `const T&` to an
/// Outcome. Exceptions from fn or classify propagate (keel does not swallow them).
template <class Fn, class Classify>
requires std::is_invocable_r_v < Outcome, Classify&, const detail::attempt_result_t<Fn>
& > [[nodiscard]] RetryResult<detail::attempt_result_t<Fn>> retry(const RetryPolicy& policy,
                                                                  Fn&& fn, Classify&& classify,
                                                                  const CallOptions& call = {}) {
  using T = detail::attempt_result_t<Fn>;
  RetryResult<T> result;
  RetryState state(policy, call, RetryState::StartsAtOnce{});
  const RetryScope scope(call.context);  // loops started inside fn are nested in this one
  for (AttemptStart start = state.start_attempt(); start.proceed; start = state.start_attempt()) {
    result.value.emplace(detail::invoke_attempt(fn, start.attempt));
    const Outcome outcome = std::invoke(classify, std::as_const(*result.value));
    // Whole (the compiler's member copy overlaps its two halves), as RetryState::next copies it:
    // its loads then match these stores instead of waiting for them to reach the cache.
    static_assert(std::is_trivially_copyable_v<Outcome>);
    std::memcpy(&result.outcome, &outcome, sizeof(Outcome));
    const Decision decision = state.next(result.outcome);
    if (!decision.retry) break;
    state.clock().sleep_for(decision.delay);
  }
  result.attempts = state.attempts();
  // After an attempt the outcome is already state.last_outcome(); copy it only when none ran.
  if (result.attempts == 0) result.outcome = state.last_outcome();
  result.elapsed = state.elapsed();
  result.reason = state.stop_reason();
  return result;
}

/// As above, for an fn that returns its own Outcome.
template <class Fn>
requires std::same_as<detail::attempt_result_t<Fn>, Outcome>
[[nodiscard]] RetryResult<Outcome> retry(const RetryPolicy& policy, Fn&& fn,
                                         const CallOptions& call = {}) {
  return retry(
      policy, std::forward<Fn>(fn), [](const Outcome& o) { return o; }, call);
}

}  // namespace keel
