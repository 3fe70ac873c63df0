// keel::asio::retry: the retry engine (keel::RetryState) driven by an Asio event loop with C++20
// coroutines, so that an operation waiting to be retried holds a timer, not a thread.
//
//   co_await keel::asio::retry(executor, policy, op, call)
//
// `op` is called once per attempt with a keel::AttemptInfo and returns an ::asio::awaitable:
// either of keel::Outcome, or of any T together with a classifier `Outcome(const T&)` (the same
// two shapes as the blocking keel::retry in keel/core/retry.hpp). The rules are the engine's, not
// re-implemented here: RetryState decides whether to start an attempt, its timeout, whether to
// try again and after how long, and why it stopped. This file only does the waiting:
//
//  - Waits between attempts use an ::asio::steady_timer on `executor`, for as long as the call's
//    clock says (Clock::begin_timer_wait): the delay on real time; on a clock with time of its
//    own, such as keel::ManualClock, that clock advances and the timer only yields once to the
//    event loop (virtual time for tests: a 30 s Retry-After takes microseconds).
//  - A finite attempt timeout (AttemptInfo::timeout: the per-try timeout, capped by the time
//    left before the deadline) races the attempt against a steady_timer. When the timer wins the
//    attempt is cancelled through its Asio cancellation slot (every asynchronous operation it is
//    awaiting completes with operation_aborted) and the attempt counts as a timeout after the
//    request was sent: keel::classify_network(NetError::kTimedOut, true) with timed_out set,
//    i.e. ambiguous, retried only when CallOptions::safe_to_repeat.
//  - Cancelling the outer operation (an ::asio::cancellation_signal bound to the co_spawn
//    completion token, or the cancellation of an enclosing parallel group) stops the current
//    attempt and any pending wait at once; the result reports StopReason::kCancelled and
//    RetryOptions::on_give_up is called with that reason. An attempt that had already
//    succeeded when the cancellation arrived keeps its success.
//
// Budgets, breakers and the one-retrying-layer rule come with the CallOptions, exactly as for
// the blocking helper (RetryState applies them): CallOptions::budget is asked before every
// retry (kBudgetExhausted), CallOptions::breaker before every attempt (kCircuitOpen), and both
// are told every outcome. There is no thread to hang "a retry loop is running" on, so the
// one-layer rule needs CallOptions::context: give the outer and the inner operations the same
// keel::RetryContext; the outer loop marks it while it runs, and an inner loop in it makes a
// single attempt (unless CallOptions::nested is kRetry). Without a context, concurrent
// operations on one thread are independent (none of them is "inside" another). An attempt
// cancelled by the caller is not reported to the breaker (RetryState has no outcome for it);
// a half-open trial lost that way is recovered by the breaker's half_open_timeout.
//
// Exceptions thrown by `op` or the classifier propagate to the awaiting coroutine, as in the
// blocking helper (except the operation_aborted of an attempt keel itself cancelled).
//
// Thread-safety: one call to retry() is one logical operation and runs on `executor`; run it
// on one thread or a strand. Many calls may run concurrently on the same executor. The policy is
// immutable and may be shared by any number of calls on any threads.
//
// Example:
//   keel::RetryPolicy policy({.max_attempts = 4, .per_try_timeout = 2s,
//                             .overall_timeout = 10s, .backoff = {.base = 100ms}});
//   ::asio::co_spawn(io, [&]() -> ::asio::awaitable<void> {
//     auto ex = co_await ::asio::this_coro::executor;
//     auto r = co_await keel::asio::retry(ex, policy,
//         [&](keel::AttemptInfo a) { return fetch(a.timeout); },   // awaitable<Outcome>
//         {.safe_to_repeat = true});
//     if (!r.ok()) log(keel::to_string(r.reason));
//   }, ::asio::detached);
#pragma once

#include <array>
#include <asio/any_io_executor.hpp>
#include <asio/associated_cancellation_slot.hpp>
#include <asio/awaitable.hpp>
#include <asio/cancellation_state.hpp>
#include <asio/co_spawn.hpp>
#include <asio/error.hpp>
#include <asio/experimental/deferred.hpp>
#include <asio/experimental/parallel_group.hpp>
#include <asio/post.hpp>
#include <asio/redirect_error.hpp>
#include <asio/steady_timer.hpp>
#include <asio/this_coro.hpp>
#include <asio/use_awaitable.hpp>
#include <chrono>
#include <concepts>
#include <exception>
#include <functional>
#include <optional>
#include <system_error>
#include <type_traits>
#include <utility>

#include "keel/core/classify.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/retry.hpp"

namespace keel::asio {

/// The outcome given to the engine for an attempt that ran out of its timeout: a network
/// timeout after the request may have been sent (ambiguous), with timed_out set.
[[nodiscard]] inline Outcome attempt_timeout_outcome() noexcept {
  Outcome o = classify_network(NetError::kTimedOut, /*request_sent=*/true);
  o.timed_out = true;
  return o;
}

namespace detail {

template <class Op>
using attempt_awaitable_t = std::decay_t<std::invoke_result_t<Op&, const AttemptInfo&>>;

template <class A>
struct awaitable_value;
template <class T, class E>
struct awaitable_value<::asio::awaitable<T, E>> {
  using type = T;
};

/// T for an op returning ::asio::awaitable<T>.
template <class Op>
using attempt_value_t = typename awaitable_value<attempt_awaitable_t<Op>>::type;

/// A keel::Duration as a steady_timer duration, saturating (kInfinite stays huge, not negative).
[[nodiscard]] inline std::chrono::steady_clock::duration to_timer_duration(Duration d) noexcept {
  using TimerDuration = std::chrono::steady_clock::duration;
  if (d <= Duration::zero()) return TimerDuration::zero();
  // A year is "forever" for a timer and leaves room for the timer's now() + d.
  constexpr Duration kLongest = std::chrono::hours(24 * 365);
  return std::chrono::duration_cast<TimerDuration>(d < kLongest ? d : kLongest);
}

/// How one attempt ended.
template <class T>
struct AttemptRun {
  std::optional<T> value;  // set when the op completed with a value
  bool timed_out = false;  // the attempt's timer won the race
};

template <class T, class Op>
::asio::awaitable<std::optional<T>> run_op(Op& op, AttemptInfo info) {
  co_return std::optional<T>(co_await std::invoke(op, std::as_const(info)));
}

/// The `grace` of an op that ends itself at its attempt's timeout, with a backstop of its own
/// (keel::asio::HttpClient's libcurl transfers): run_attempt runs it without a race.
inline constexpr Duration kNoRace = kInfinite;

/// Runs op(info), racing it against `timer` when the attempt's timeout is finite (and `grace` is
/// not kNoRace). Exceptions of the op propagate unless it lost the race (it was then cancelled by
/// keel).
template <class T, class Op>
::asio::awaitable<AttemptRun<T>> run_attempt(::asio::any_io_executor ex,
                                             ::asio::steady_timer& timer, Op& op, AttemptInfo info,
                                             Duration grace) {
  AttemptRun<T> run;
  if (info.timeout >= kInfinite || grace >= kNoRace) {
    run.value = co_await run_op<T>(op, info);
    co_return run;
  }
  timer.expires_after(to_timer_duration(saturating_add(info.timeout, grace)));
  auto [order, op_error, value, timer_error] =
      co_await ::asio::experimental::make_parallel_group(
          ::asio::co_spawn(ex, run_op<T>(op, info), ::asio::experimental::deferred),
          timer.async_wait(::asio::experimental::deferred))
          .async_wait(::asio::experimental::wait_for_one(), ::asio::use_awaitable);
  if (order[0] == 0) {
    if (op_error) std::rethrow_exception(op_error);
    run.value = std::move(value);
  } else if (!timer_error) {
    run.timed_out = true;  // the op was cancelled through its slot; its result is discarded
  }
  // else: the timer was cancelled by an outer cancellation, which the caller checks.
  co_return run;
}

inline bool is_cancelled(const ::asio::cancellation_state& state) {
  return state.cancelled() != ::asio::cancellation_type::none;
}

/// Does nothing; the default observer of retry_loop.
struct NoObserver {
  void operator()(const AttemptInfo&, const Outcome&, const Decision&, Duration) const noexcept {}
};

/// The loop shared by the public overloads and keel::asio::HttpClient. `observer(attempt,
/// outcome, decision, took)` is called after every attempt that completed or timed out.
/// `grace` is added to the attempt's timeout before the race cancels it (an op that enforces the
/// timeout itself, like a libcurl transfer, then reports its own, better classified, timeout);
/// kNoRace runs each attempt without the race.
template <class T, class Op, class Classify, class Observer = NoObserver>
::asio::awaitable<RetryResult<T>> retry_loop(::asio::any_io_executor ex, const RetryPolicy& policy,
                                             Op op, Classify classify, CallOptions call,
                                             Observer observer = {},
                                             Duration grace = Duration::zero()) {
  // Observe a cancellation as a state rather than as an exception from the next co_await (the
  // caller's setting is restored before returning).
  const bool caller_throws = co_await ::asio::this_coro::throw_if_cancelled();
  co_await ::asio::this_coro::throw_if_cancelled(false);
  const ::asio::cancellation_state cancel = co_await ::asio::this_coro::cancellation_state;

  RetryResult<T> result;
  RetryState state(policy, call);
  // One retrying layer: loops started inside `op` with the same context see this one. Only an
  // explicit context: a thread-local mark would leak to every coroutine on the thread.
  std::optional<RetryScope> scope;
  if (call.context != nullptr) scope.emplace(call.context);
  ::asio::steady_timer timer(ex);
  bool cancelled = false;

  for (AttemptStart start = state.start_attempt(); start.proceed; start = state.start_attempt()) {
    if (is_cancelled(cancel)) {
      cancelled = true;
      break;
    }
    AttemptRun<T> run;
    Duration took{};
    try {
      const TimePoint began = state.clock().now();
      run = co_await run_attempt<T>(ex, timer, op, start.attempt, grace);
      took = state.clock().now() - began;
    } catch (const std::system_error& e) {
      if (!is_cancelled(cancel)) throw;
      cancelled = true;  // the op reported the cancellation as an exception
      break;
    }
    Outcome outcome;
    if (run.value) {
      outcome = std::invoke(classify, std::as_const(*run.value));
      result.value = std::move(run.value);
      result.outcome = outcome;
      if (is_cancelled(cancel) && outcome.kind != OutcomeKind::kSuccess) {
        cancelled = true;
        break;
      }
    } else if (run.timed_out && !is_cancelled(cancel)) {
      outcome = attempt_timeout_outcome();
      result.value.reset();
      result.outcome = outcome;
    } else {
      cancelled = true;
      break;
    }
    const Decision decision = state.next(outcome);
    observer(std::as_const(start.attempt), std::as_const(outcome), decision, took);
    if (!decision.retry) break;

    // The clock says how long the timer waits: the delay on real time, nothing on a clock whose
    // time moves only when told (it has moved by the delay).
    timer.expires_after(to_timer_duration(state.clock().begin_timer_wait(decision.delay)));
    std::error_code ignored;
    co_await timer.async_wait(::asio::redirect_error(::asio::use_awaitable, ignored));
    if (is_cancelled(cancel)) {
      cancelled = true;
      break;
    }
  }

  if (cancelled) state.cancel();  // kCancelled, the give-up hook, and what the brakes see
  result.attempts = state.attempts();
  if (result.attempts == 0) result.outcome = state.last_outcome();
  result.elapsed = state.elapsed();
  result.reason = state.stop_reason();
  scope.reset();
  co_await ::asio::this_coro::throw_if_cancelled(caller_throws);
  co_return result;
}

}  // namespace detail

/// Retries `op` (awaitable<T> per attempt) until it succeeds or a rule says stop; `classify`
/// maps `const T&` to an Outcome. The result is as keel::retry's, except that `value` is empty
/// when the last attempt timed out or was cancelled.
/// Requires: the policy outlives the returned awaitable; op and classify are moved into it.
template <class Executor, class Op, class Classify>
requires std::is_invocable_r_v < Outcome, Classify&, const detail::attempt_value_t<Op>
& > [[nodiscard]] ::asio::awaitable<RetryResult<detail::attempt_value_t<Op>>> retry(
        Executor executor, const RetryPolicy& policy, Op op, Classify classify,
        CallOptions call = {}) {
  return detail::retry_loop<detail::attempt_value_t<Op>>(
      ::asio::any_io_executor(std::move(executor)), policy, std::move(op), std::move(classify),
      call);
}

/// As above, for an op whose awaitable yields its own keel::Outcome.
template <class Executor, class Op>
requires std::same_as<detail::attempt_value_t<Op>, Outcome>
[[nodiscard]] ::asio::awaitable<RetryResult<Outcome>> retry(Executor executor,
                                                            const RetryPolicy& policy, Op op,
                                                            CallOptions call = {}) {
  return detail::retry_loop<Outcome>(
      ::asio::any_io_executor(std::move(executor)), policy, std::move(op),
      [](const Outcome& o) { return o; }, call);
}

}  // namespace keel::asio
