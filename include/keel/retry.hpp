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

#include "keel/backoff.hpp"
#include "keel/breaker.hpp"
#include "keel/budget.hpp"
#include "keel/classify.hpp"
#include "keel/clock.hpp"
#include "keel/random.hpp"

namespace keel {

class EventStream;  // keel/events.hpp

/// Why an operation stopped. Every brake has its own value so callers can switch on it.
enum class StopReason : unsigned char {
  kSuccess,            // the last attempt succeeded
  kPermanent,          // a failure a retry cannot fix (400, 401, 403, 404, 422, ...)
  kNotSafeToRetry,     // ambiguous failure of an operation that is not safe to repeat
  kAttemptsExhausted,  // max_attempts used (or the outcome's retry_limit)
  kDeadline,           // the next attempt could not start, or its delay not end, in time
  kBudgetExhausted,    // the retry budget refused the retry
  kCircuitOpen,        // the dependency's circuit breaker refused the attempt
  kCancelled,          // the caller cancelled the operation
  /// The operation failed, and its write was handed to a durable queue to be delivered later
  /// with the same idempotency key (keel/fallback.hpp). Never returned by the engine itself:
  /// only an adapter's fallback sets it.
  kQueued,
  /// A limit on calls to the dependency (its rate limit, a pause after its 429 or 503 with
  /// Retry-After, its concurrency limit) would hold the call longer than it may wait: nothing
  /// was sent, and the outcome (kNotAttempted) says when it may go (server_delay). Never
  /// returned by the engine itself: the HTTP clients set it before an attempt.
  kLimited,
};

/// "success", "permanent", "not safe to retry", "attempts exhausted", "deadline",
/// "budget exhausted", "circuit open", "cancelled", "queued", "limited".
[[nodiscard]] std::string_view to_string(StopReason reason) noexcept;

/// What an attempt is told before it runs.
struct AttemptInfo {
  int number = 1;                // 1 for the first attempt
  Duration timeout = kInfinite;  // min(per-try timeout, time left before the deadline)
  /// The operation's deadline (the earliest of CallOptions::deadline, the policy's
  /// overall_timeout and CallOptions::ceiling): what an attempt tells its receiver is left
  /// (Keel-Deadline-Ms, keel/deadline_header.hpp). Infinite when there is none.
  Deadline deadline = Deadline::infinite();
  [[nodiscard]] bool is_retry() const noexcept { return number > 1; }
};

/// Passed to on_retry after a failed attempt that will be retried.
struct RetryEvent {
  int attempt = 0;  // the attempt that just failed
  Outcome outcome;
  Duration delay{};  // the wait chosen before the next attempt
  bool server_delay_used = false;
};

/// Passed to on_give_up when an operation stops for any reason but success.
struct GiveUpEvent {
  int attempts = 0;
  Duration elapsed{};  // RetryState::elapsed() when it stopped
  StopReason reason = StopReason::kAttemptsExhausted;
  Outcome last;  // the last attempt's outcome (default for a stop before any attempt)
};

/// One log line: "keel: gave up after 3 attempts in 1.25s: attempts exhausted (last: HTTP 503
/// (throttled))". `what` names the operation when non-empty.
[[nodiscard]] std::string format_give_up(const GiveUpEvent& event, std::string_view what = {});

struct RetryOptions {
  /// Attempts in all, counting the first. Requires: >= 1. Default 3.
  int max_attempts = 3;
  /// Timeout of one attempt. Requires: > 0. Default none (kInfinite).
  Duration per_try_timeout = kInfinite;
  /// Deadline of the whole operation, from its start. Requires: > 0. Default none.
  Duration overall_timeout = kInfinite;
  /// Delay between attempts. Default full jitter, base 100 ms, cap 10 s.
  BackoffOptions backoff = {};
  /// Largest server-requested delay honoured. Requires: >= 0. Default 60 s.
  Duration retry_after_cap = std::chrono::seconds(60);
  /// An attempt is not started with less than this before the deadline. Requires: >= 0.
  /// Default 1 ms.
  Duration min_attempt_time = std::chrono::milliseconds(1);
  /// Called before each wait. Default none.
  std::function<void(const RetryEvent&)> on_retry;
  /// Called once when the operation stops without success. Default none.
  std::function<void(const GiveUpEvent&)> on_give_up;
  /// Where the operations of this policy publish their attempts, budget refusals and give-ups
  /// (keel/events.hpp). Non-owning; Requires: outlives the policy. Default none.
  EventStream* events = nullptr;
  /// Names the operations of this policy in their events (Event::operation). Default empty.
  std::string operation;
};

/// Validated, immutable retry configuration, shared by many operations.
class RetryPolicy {
 public:
  /// Throws std::invalid_argument naming the field and value when a Requires line is broken.
  explicit RetryPolicy(RetryOptions options = {});

  [[nodiscard]] const RetryOptions& options() const noexcept { return options_; }
  [[nodiscard]] const Backoff& backoff() const noexcept { return backoff_; }

 private:
  RetryOptions options_;
  Backoff backoff_;
};

/// What a keel retry loop does when it starts inside another keel retry loop.
enum class NestedRetries : unsigned char {
  kSingleAttempt,  // one attempt; the outer loop does the retrying (the default)
  kRetry,          // retry as configured: the layers multiply (3 x 3 x 3 = 27 calls)
};

/// Marks "a keel retry loop is running" for asynchronous code, where a thread-local cannot follow
/// the operation from thread to thread. Give the outer and the inner operations the same context
/// (CallOptions::context); the outer one enters it (RetryScope, or keel::retry does) while it
/// runs. Safe for concurrent use. Requires: outlives the operations that use it.
class RetryContext {
 public:
  /// Retry loops currently inside this context.
  [[nodiscard]] int depth() const noexcept { return depth_.load(std::memory_order_acquire); }
  void enter() noexcept { depth_.fetch_add(1, std::memory_order_acq_rel); }
  void leave() noexcept { depth_.fetch_sub(1, std::memory_order_acq_rel); }

 private:
  std::atomic<int> depth_{0};
};

/// While alive, marks a keel retry loop as running on this thread (or in `context` when given).
/// keel::retry opens one around its loop; code that drives RetryState by hand opens one around
/// the calls that may start inner keel operations. Not copyable; in the thread mode it must be
/// destroyed on the thread that created it.
class RetryScope {
 public:
  explicit RetryScope(RetryContext* context = nullptr) noexcept;
  ~RetryScope();
  RetryScope(const RetryScope&) = delete;
  RetryScope& operator=(const RetryScope&) = delete;

 private:
  RetryContext* context_;
};

/// Keel retry loops running around the caller: in `context` when given, else on this thread.
[[nodiscard]] int retry_depth(const RetryContext* context = nullptr) noexcept;

namespace detail {
// This thread's retry depth. Inline, with a constant initializer, so that the retry loop's
// scope and depth check are a plain thread-local access where they are used.
inline thread_local constinit int t_retry_depth = 0;
}  // namespace detail

inline RetryScope::RetryScope(RetryContext* context) noexcept : context_(context) {
  if (context_ != nullptr) {
    context_->enter();
  } else {
    ++detail::t_retry_depth;
  }
}

inline RetryScope::~RetryScope() {
  if (context_ != nullptr) {
    context_->leave();
  } else {
    --detail::t_retry_depth;
  }
}

inline int retry_depth(const RetryContext* context) noexcept {
  return context != nullptr ? context->depth() : detail::t_retry_depth;
}

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

/// Where an operation stands between two attempts: what RetryState keeps in memory, and what a
/// durable driver (the job queue) stores with each operation and passes back to decide_retry.
struct RetryProgress {
  /// Attempts made, counting the one that just ended. Requires: >= 1.
  int attempts = 1;
  /// Retries already caused by outcomes that carry a retry_limit (HTTP 500).
  int limited_retries = 0;
  /// The delay chosen before the previous retry (decorrelated jitter grows from it).
  Duration previous_delay{};
};

/// What decide_retry needs to know about the operation besides its progress.
struct RetryLimits {
  /// The operation's attempt limit: the policy's max_attempts, 1 when nested, or a job's own.
  /// Requires: >= 1.
  int max_attempts = 1;
  /// Idempotent, or carries an idempotency key (ambiguous failures may then be retried).
  bool safe_to_repeat = false;
  /// Time left before the operation's deadline, now. Default none (kInfinite).
  Duration time_left = kInfinite;
};

/// The verdict on one attempt's outcome.
struct RetryVerdict {
  bool retry = false;
  /// The wait before the next attempt (when retry).
  Duration delay{};
  /// The delay is the server's (Retry-After, or the refusing brake's retry_in), capped.
  bool server_delay_used = false;
  /// False for a deferral: the outcome was kNotAttempted (a breaker or budget refused before
  /// anything was sent), so a durable driver does not charge an attempt. Drivers that run in
  /// memory count every attempt they started anyway.
  bool counts_attempt = true;
  /// Why the operation stops (when !retry).
  StopReason reason = StopReason::kSuccess;
  /// The progress to keep for the next decision (limited_retries and previous_delay updated).
  RetryProgress progress;
};

/// The retry decision, as a pure function of the policy, the operation and its progress: what
/// RetryState::next applies before it consults the budget, and what a durable driver calls
/// after each attempt. In order: success and permanent stop; an ambiguous outcome stops unless
/// safe to repeat; a kNotAttempted outcome is deferred (not charged) until the brake's retry_in
/// (capped by retry_after_cap), or a backoff draw when it gave none; the attempt limit and the
/// outcome's retry_limit stop; the wait is the server's delay capped by retry_after_cap when it
/// gave one, else a backoff draw; a wait that does not leave min_attempt_time before the deadline
/// stops with kDeadline. Requires: progress.attempts >= 1, limits.max_attempts >= 1.
[[nodiscard]] RetryVerdict decide_retry(const RetryPolicy& policy, const RetryLimits& limits,
                                        const RetryProgress& progress, const Outcome& outcome,
                                        Rng& rng);

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
  // Event publishing (keel/events.hpp), called only when events_ is set.
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
