// What a worker reports for an attempt of a keel::store::JobQueue job (AttemptReport, a
// keel::Outcome and its text) and what the queue recorded: done, retry scheduled, deferred
// (nothing was sent), dead, or stale (the lease was taken over); with the next jobs when the
// report and the next lease share a statement (complete_and_lease, complete_and_start).
//
// Thread-safety: value types; distinct objects may be used concurrently.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/classify.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/retry_events.hpp"
#include "keel/queue/job.hpp"

namespace keel::store {

/// What a worker reports for an attempt.
struct AttemptReport {
  /// The classified result (keel::core's taxonomy). Default kNotAttempted, never success: a
  /// handler that forgets to classify defers the job (visible in stats) rather than losing it.
  Outcome outcome;
  /// What went wrong, recorded in the history and, for a dead job, its reason; for a deferral,
  /// why nothing was sent.
  std::string error;

  [[nodiscard]] static AttemptReport success() {
    return {.outcome = Outcome::success(), .error = {}};
  }
  /// The report of a delivery (an HTTP request, a gRPC call) whose client stopped before it sent
  /// anything (`outcome` not attempted, `reason` why): the queue defers the job without charging
  /// an attempt, and error says why, naming `dependency` ("circuit open for api.example:443, next
  /// probe in 2s", "held by the rate limit of ...", "budget exhausted for ...").
  [[nodiscard]] static AttemptReport not_sent(const Outcome& outcome, StopReason reason,
                                              std::string_view dependency);
};

enum class CompleteStatus : unsigned char {
  kDone,            // success recorded
  kRetryScheduled,  // transient failure recorded; due again at retry_at_ms
  kDeferred,        // nothing was sent (a brake refused): due again at retry_at_ms, not charged
  kDead,            // permanent failure, or attempts exhausted: now in the dead-letter queue
  kStale,           // the fencing token is no longer current: nothing recorded
};

/// "done", "retry_scheduled", "deferred", "dead", "stale".
[[nodiscard]] std::string_view to_string(CompleteStatus status) noexcept;

/// A move to the dead-letter queue as QueueOptions::on_dead_letter sees it: the reason's kind
/// and the text stored as the job's dead_reason. Converts to that text, so a callback written
/// as (std::int64_t, std::string_view) still compiles.
struct DeadLetterReason {
  DeadReason reason = DeadReason::kAttemptsExhausted;
  /// The dead_reason stored with the job ("permanent: HTTP 400 ..."). Valid during the call.
  std::string_view text;

  // NOLINTNEXTLINE(google-explicit-constructor): kept implicit for (id, text) callbacks.
  operator std::string_view() const noexcept { return text; }
};

struct CompleteResult {
  CompleteStatus status = CompleteStatus::kDone;
  /// kRetryScheduled, kDeferred: the delay chosen and the time it is due.
  Duration delay{};
  std::int64_t retry_at_ms = 0;
  /// kDead: the reason recorded.
  std::string dead_reason;
  /// kDead: the reason's kind.
  DeadReason dead_kind = DeadReason::kAttemptsExhausted;
};

/// One finished attempt of a leased job, for JobQueue::complete_batch: the lease (id, fencing
/// token) and its report.
struct BatchOutcome {
  std::int64_t job_id = 0;
  std::int64_t fence = 0;
  AttemptReport report;
};

/// What JobQueue::complete_and_lease did.
struct DoneAndLeased {
  /// How many of the finished jobs were current (the stale ones are skipped).
  int current = 0;
  /// Their ids, in no particular order.
  std::vector<std::int64_t> current_ids;
  /// The jobs leased next, in the order to run them (as JobQueue::lease returns them).
  std::vector<LeasedJob> leased;
  /// When fewer jobs than asked for were leased, on PostgreSQL: the same statement's reading of
  /// when the queue's earliest job comes due (a ready or retrying job's run time, or a running
  /// job's lease expiry; nullopt: none), as JobQueue::next_due answers, so that an idle worker
  /// need not ask again. next_due_known says whether it was read.
  std::optional<std::int64_t> next_due_ms;
  bool next_due_known = false;
};

/// What JobQueue::complete_and_start did.
struct DoneAndStarted {
  /// How many of the finished jobs were current (the stale ones are skipped).
  int current = 0;
  /// Their ids, in no particular order.
  std::vector<std::int64_t> current_ids;
  /// Whether the job to start was current (start()'s answer).
  bool started = false;
};

}  // namespace keel::store
