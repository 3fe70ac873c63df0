// What a retrying operation reports (part of the retry engine, keel/core/retry.hpp): why it stopped
// (StopReason), what each attempt is told (AttemptInfo), and the events a policy's callbacks
// receive (RetryEvent before a wait, GiveUpEvent when it stops without success), with the one
// log line for a give-up.
//
// Thread-safety: plain values; format_give_up is a pure function.
#pragma once

#include <string>
#include <string_view>

#include "keel/core/classify.hpp"
#include "keel/core/clock.hpp"

namespace keel {

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
  /// with the same idempotency key (keel/core/fallback.hpp). Never returned by the engine itself:
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
  /// (Keel-Deadline-Ms, keel/core/deadline_header.hpp). Infinite when there is none.
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

}  // namespace keel
