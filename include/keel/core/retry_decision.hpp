// The retry decision as a pure function (part of the retry engine, keel/core/retry.hpp):
// decide_retry, what RetryState::next applies and what a durable driver (the job queue) calls
// after each attempt with the progress it stores per operation.
//
// Thread-safety: decide_retry is a pure function of its arguments (the generator is the
// caller's).
#pragma once

#include "keel/core/clock.hpp"
#include "keel/core/random.hpp"
#include "keel/core/retry_events.hpp"
#include "keel/core/retry_policy.hpp"

namespace keel {

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
/// gave one longer than zero, else a backoff draw (a Retry-After of 0 is no advice: charged and
/// backed off, never an immediate retry); a wait that does not leave min_attempt_time before the
/// deadline stops with kDeadline. Requires: progress.attempts >= 1, limits.max_attempts >= 1.
[[nodiscard]] RetryVerdict decide_retry(const RetryPolicy& policy, const RetryLimits& limits,
                                        const RetryProgress& progress, const Outcome& outcome,
                                        Rng& rng);

}  // namespace keel
