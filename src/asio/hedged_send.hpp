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

/// The attempts of one hedged operation in flight on the executor, a slot each: the results they
/// finished with, in order, the first exception one ended with, and the timer the loop sleeps on
/// until one finishes. An attempt's completion refers to this object: it is neither copied nor
/// moved, and outlives every attempt it starts (end_round waits for them).
template <class Attempt>
class HedgedAttempts {
  using AttemptResult = http::detail::AttemptResult;

 public:
  HedgedAttempts(::asio::any_io_executor ex, Clock& clock, Attempt attempt)
      : ex_(ex), clock_(clock), attempt_(std::move(attempt)), wake_(ex) {}
  HedgedAttempts(const HedgedAttempts&) = delete;
  HedgedAttempts& operator=(const HedgedAttempts&) = delete;

  /// Starts attempt `info` in slot `index`, which must be free.
  void launch(int index, const AttemptInfo& info) {
    Slot& s = slot(index);
    s.running = true;
    s.began = clock_.now();
    s.number = info.number;
    s.info = info;
    ::asio::co_spawn(ex_, attempt_(std::as_const(s.info)),
                     ::asio::bind_cancellation_slot(
                         s.signal.slot(), [this, index](std::exception_ptr e, AttemptResult r) {
                           slot(index).running = false;
                           if (e) {
                             if (!failure_) failure_ = e;
                           } else {
                             completed_.emplace_back(index, std::move(r));
                           }
                           wake_.cancel();
                         }));
  }

  /// The next attempt that finished with a result, with what finish_hedged_attempt needs to know
  /// of it; nullopt when there is none waiting.
  std::optional<std::pair<http::detail::HedgedAttempt, AttemptResult>> next_finished() {
    if (completed_.empty()) return std::nullopt;
    auto [index, result] = std::move(completed_.front());
    completed_.pop_front();
    const Slot& s = slot(index);
    const TimePoint ended = clock_.now();
    return std::pair{
        http::detail::HedgedAttempt{
            .index = index, .number = s.number, .took = ended - s.began, .ended = ended},
        std::move(result)};
  }

  /// The first exception an attempt ended with; null while none has.
  [[nodiscard]] std::exception_ptr failure() const { return failure_; }

  /// Sleeps for `d`, or less when an attempt finishes.
  ::asio::awaitable<void> sleep(Duration d) {
    wake_.expires_after(to_timer_duration(d));
    std::error_code ignored;
    co_await wake_.async_wait(::asio::redirect_error(::asio::use_awaitable, ignored));
  }

  /// Cancels the attempts still in flight (they lost the round, or the operation stops), waits
  /// until every one has ended and forgets the results not read.
  ::asio::awaitable<void> end_round() {
    for (Slot& s : slots_) {
      if (s.running) s.signal.emit(::asio::cancellation_type::terminal);
    }
    while (any_running()) co_await sleep(kInfinite);
    completed_.clear();
  }

 private:
  struct Slot {
    ::asio::cancellation_signal signal;
    bool running = false;
    AttemptInfo info;  // what the attempt's coroutine reads, which outlives the call
    TimePoint began{};
    int number = 0;
  };

  Slot& slot(int index) { return slots_[static_cast<std::size_t>(index)]; }

  bool any_running() const {
    for (const Slot& s : slots_) {
      if (s.running) return true;
    }
    return false;
  }

  ::asio::any_io_executor ex_;
  Clock& clock_;
  Attempt attempt_;
  std::array<Slot, HedgePolicy::kMaxHedges + 1> slots_;
  std::deque<std::pair<int, AttemptResult>> completed_;
  std::exception_ptr failure_;  // rethrown by hedged_loop once all attempts have ended
  ::asio::steady_timer wake_;
};

/// One hedged operation, round by round: what hedged_loop runs once it has set up the
/// cancellation. Lives in hedged_loop's frame.
template <class Attempt>
class HedgedLoop {
 public:
  HedgedLoop(::asio::any_io_executor ex, const HedgePolicy& policy, HedgeState& hedge,
             RetryState& retry, HedgedContext context, Attempt attempt,
             ::asio::cancellation_state cancel)
      : policy_(policy),
        hedge_(hedge),
        retry_(retry),
        context_(context),
        cancel_(cancel),
        attempts_(ex, retry.clock(), std::move(attempt)) {}

  /// Runs the rounds until the retry engine stops, an attempt throws (rethrown here once every
  /// attempt has ended) or the operation is cancelled.
  ::asio::awaitable<RetryResult<http::detail::AttemptResult>> run() {
    bool cancelled = false;
    for (AttemptStart start = retry_.start_attempt(); start.proceed;
         start = retry_.start_attempt()) {
      if (is_cancelled(cancel_)) {
        cancelled = true;
        break;
      }
      const RoundEnd end = co_await round(start.attempt);
      // The round is over: the attempts still in flight lost (or the operation stops).
      co_await attempts_.end_round();
      for (int i = 0; i <= HedgePolicy::kMaxHedges; ++i) hedge_.cancel(i);
      cancelled = end.cancelled;
      if (attempts_.failure() || cancelled || !end.decision.retry) break;

      co_await attempts_.sleep(retry_.clock().begin_timer_wait(end.decision.delay));
      if (is_cancelled(cancel_)) {
        cancelled = true;
        break;
      }
    }
    if (attempts_.failure()) {
      hedge_.cancel_operation();
      std::rethrow_exception(attempts_.failure());
    }
    if (cancelled) hedge_.cancel_operation();
    co_return result(cancelled);
  }

 private:
  // How a round ended.
  struct RoundEnd {
    Decision decision;       // the verdict of the attempt that ended it
    bool cancelled = false;  // the operation was cancelled before an attempt ended it
  };

  // Runs one round from its first attempt until a finished attempt's verdict ends it, an attempt
  // throws or the operation is cancelled. The attempts still in flight are left running.
  ::asio::awaitable<RoundEnd> round(const AttemptInfo& first) {
    Clock& clock = retry_.clock();
    attempts_.launch(0, hedge_.begin_round(first, http::detail::hedge_delay(
                                                      policy_, context_.timeout, clock.now())));
    while (true) {
      while (auto finished = attempts_.next_finished()) {
        const HedgeVerdict verdict = http::detail::finish_hedged_attempt(
            hedge_, retry_, finished->first, std::move(finished->second), context_.options,
            context_.request, context_.duplicate, context_.timeout, winner_);
        if (verdict.done) co_return RoundEnd{.decision = verdict.decision};
      }
      if (attempts_.failure() || is_cancelled(cancel_)) {
        co_return RoundEnd{.cancelled = !attempts_.failure()};
      }
      const std::optional<TimePoint> due = hedge_.next_hedge_at();
      if (due && clock.now() >= *due) {
        const HedgeStart h = hedge_.start_hedge();
        if (h.proceed) attempts_.launch(h.index, h.attempt);
        continue;
      }
      co_await attempts_.sleep(due ? *due - clock.now() : kInfinite);
    }
  }

  // The operation's result: the winner's attempt (outcome, response, error) unless nothing was
  // sent or it was cancelled; attempts counts every request sent.
  RetryResult<http::detail::AttemptResult> result(bool cancelled) {
    RetryResult<http::detail::AttemptResult> out;
    if (hedge_.sent() > 0 && !cancelled) {
      out.value.emplace(http::detail::AttemptResult{.outcome = winner_.outcome,
                                                    .response = std::move(winner_.response),
                                                    .error = std::move(winner_.error)});
    }
    out.attempts = hedge_.sent();
    out.outcome = out.attempts == 0 ? retry_.last_outcome() : winner_.outcome;
    out.elapsed = retry_.elapsed();
    out.reason = retry_.stop_reason();
    return out;
  }

  const HedgePolicy& policy_;
  HedgeState& hedge_;
  RetryState& retry_;
  HedgedContext context_;
  ::asio::cancellation_state cancel_;
  HedgedAttempts<Attempt> attempts_;
  http::Result winner_;
};

/// Runs `retry`'s operation round by round with the hedges `hedge` allows (it must be enabled).
/// `attempt(info)` returns an ::asio::awaitable<AttemptResult> of one attempt, cancellable
/// through its cancellation slot. The result's value is the winner's attempt (outcome, response,
/// error); attempts counts every request sent.
template <class Attempt>
::asio::awaitable<RetryResult<http::detail::AttemptResult>> hedged_loop(
    ::asio::any_io_executor ex, const HedgePolicy& policy, HedgeState& hedge, RetryState& retry,
    HedgedContext context, Attempt attempt) {
  // Observe a cancellation as a state rather than as an exception from the next co_await (the
  // caller's setting is restored before returning).
  const bool caller_throws = co_await ::asio::this_coro::throw_if_cancelled();
  co_await ::asio::this_coro::throw_if_cancelled(false);
  const ::asio::cancellation_state cancel = co_await ::asio::this_coro::cancellation_state;
  HedgedLoop<Attempt> loop(ex, policy, hedge, retry, context, std::move(attempt), cancel);
  RetryResult<http::detail::AttemptResult> out = co_await loop.run();
  co_await ::asio::this_coro::throw_if_cancelled(caller_throws);
  co_return out;
}

}  // namespace keel::asio::detail
