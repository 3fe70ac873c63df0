// Private to keel::asio: the hedged operations of keel::asio::HttpClient. A round's attempts run
// at once as coroutines on the client's executor, each with a cancellation signal of its own
// (cancelling one removes its transfer from libcurl at once); the loop sleeps on one
// steady_timer until an attempt finishes or the next hedge is due. keel::HedgeState decides when
// a hedge goes and which result ends the round, keel::RetryState what follows it, and
// keel::http::detail::finish_hedged_attempt does what both clients do with a finished attempt.
//
// Cancelling the awaiting operation cancels every attempt in flight and any wait, and reports
// kCancelled. The loop returns only once every attempt it started has completed, since they
// refer to the caller's request.
//
// Thread-safety: not thread-safe; runs on the client's executor, as the client does.
#pragma once

#include <array>
#include <asio/any_io_executor.hpp>
#include <asio/bind_cancellation_slot.hpp>
#include <asio/cancellation_signal.hpp>
#include <asio/cancellation_state.hpp>
#include <asio/co_spawn.hpp>
#include <asio/post.hpp>
#include <asio/redirect_error.hpp>
#include <asio/steady_timer.hpp>
#include <asio/this_coro.hpp>
#include <asio/use_awaitable.hpp>
#include <deque>
#include <exception>
#include <optional>
#include <system_error>
#include <utility>

#include "keel/asio/retry.hpp"
#include "keel/core/hedge.hpp"
#include "keel/http/detail/attempt.hpp"

namespace keel::asio::detail {

/// What a hedged operation runs with besides its attempts. Non-owning.
struct HedgedContext {
  const http::ClientOptions& options;
  const http::Request& request;
  const DuplicateSuccessRule* duplicate;  // nullptr: none
  AdaptiveTimeout* timeout;               // the host's; nullptr: none
};

/// Runs `retry`'s operation round by round with the hedges `hedge` allows (it must be enabled).
/// `attempt(info)` returns an ::asio::awaitable<AttemptResult> of one attempt, cancellable
/// through its cancellation slot. The result's value is the winner's attempt (outcome, response,
/// error); attempts counts every request sent.
template <class Attempt>
::asio::awaitable<RetryResult<http::detail::AttemptResult>> hedged_loop(
    ::asio::any_io_executor ex, const HedgePolicy& policy, HedgeState& hedge, RetryState& retry,
    HedgedContext context, Attempt attempt) {
  using http::detail::AttemptResult;
  const bool caller_throws = co_await ::asio::this_coro::throw_if_cancelled();
  co_await ::asio::this_coro::throw_if_cancelled(false);
  const ::asio::cancellation_state cancel = co_await ::asio::this_coro::cancellation_state;

  struct Slot {
    ::asio::cancellation_signal signal;
    bool running = false;
    AttemptInfo info;  // what the attempt's coroutine reads, which outlives the call
    TimePoint began{};
    int number = 0;
  };
  std::array<Slot, HedgePolicy::kMaxHedges + 1> slots;
  std::deque<std::pair<int, AttemptResult>> completed;
  std::exception_ptr failure;  // an exception of an attempt, rethrown once all have ended
  ::asio::steady_timer wake(ex);
  Clock& clock = retry.clock();

  const auto launch = [&](int index, const AttemptInfo& info) {
    Slot& s = slots[static_cast<std::size_t>(index)];
    s.running = true;
    s.began = clock.now();
    s.number = info.number;
    s.info = info;
    ::asio::co_spawn(ex, attempt(std::as_const(s.info)),
                     ::asio::bind_cancellation_slot(
                         s.signal.slot(), [&, index](std::exception_ptr e, AttemptResult r) {
                           slots[static_cast<std::size_t>(index)].running = false;
                           if (e) {
                             if (!failure) failure = e;
                           } else {
                             completed.emplace_back(index, std::move(r));
                           }
                           wake.cancel();
                         }));
  };
  const auto any_running = [&] {
    for (const Slot& s : slots) {
      if (s.running) return true;
    }
    return false;
  };
  const auto sleep_until_woken = [&](Duration d) -> ::asio::awaitable<void> {
    wake.expires_after(to_timer_duration(d));
    std::error_code ignored;
    co_await wake.async_wait(::asio::redirect_error(::asio::use_awaitable, ignored));
  };

  http::Result winner;
  bool cancelled = false;
  for (AttemptStart start = retry.start_attempt(); start.proceed; start = retry.start_attempt()) {
    if (is_cancelled(cancel)) {
      cancelled = true;
      break;
    }
    bool done = false;
    Decision decision;
    launch(0, hedge.begin_round(start.attempt,
                                http::detail::hedge_delay(policy, context.timeout, clock.now())));
    while (!done) {
      while (!done && !completed.empty()) {
        auto [index, result] = std::move(completed.front());
        completed.pop_front();
        const Slot& s = slots[static_cast<std::size_t>(index)];
        const TimePoint ended = clock.now();
        const http::detail::HedgedAttempt what{
            .index = index, .number = s.number, .took = ended - s.began, .ended = ended};
        const HedgeVerdict verdict = http::detail::finish_hedged_attempt(
            hedge, retry, what, std::move(result), context.options, context.request,
            context.duplicate, context.timeout, winner);
        if (verdict.done) {
          done = true;
          decision = verdict.decision;
        }
      }
      if (done) break;
      if (failure || is_cancelled(cancel)) {
        cancelled = !failure;
        break;
      }
      const std::optional<TimePoint> due = hedge.next_hedge_at();
      if (due && clock.now() >= *due) {
        const HedgeStart h = hedge.start_hedge();
        if (h.proceed) launch(h.index, h.attempt);
        continue;
      }
      co_await sleep_until_woken(due ? *due - clock.now() : kInfinite);
    }
    // The round is over: the attempts still in flight lost (or the operation stops).
    for (Slot& s : slots) {
      if (s.running) s.signal.emit(::asio::cancellation_type::terminal);
    }
    while (any_running()) co_await sleep_until_woken(kInfinite);
    completed.clear();
    for (int i = 0; i <= HedgePolicy::kMaxHedges; ++i) hedge.cancel(i);
    if (failure || cancelled || !decision.retry) break;

    co_await sleep_until_woken(clock.begin_timer_wait(decision.delay));
    if (is_cancelled(cancel)) {
      cancelled = true;
      break;
    }
  }
  if (failure) {
    hedge.cancel_operation();
    std::rethrow_exception(failure);
  }
  if (cancelled) hedge.cancel_operation();

  RetryResult<AttemptResult> out;
  if (hedge.sent() > 0 && !cancelled) {
    out.value.emplace(AttemptResult{.outcome = winner.outcome,
                                    .response = std::move(winner.response),
                                    .error = std::move(winner.error)});
  }
  out.attempts = hedge.sent();
  out.outcome = out.attempts == 0 ? retry.last_outcome() : winner.outcome;
  out.elapsed = retry.elapsed();
  out.reason = retry.stop_reason();
  co_await ::asio::this_coro::throw_if_cancelled(caller_throws);
  co_return out;
}

}  // namespace keel::asio::detail
