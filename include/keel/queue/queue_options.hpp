// keel::store::QueueOptions: a JobQueue's attempts, backoff, lease, clock, retention of dead
// jobs and the callback on a move to the dead-letter queue, each with its contract and default.
//
// Thread-safety: a value type; copied into the JobQueue at construction.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>

#include "keel/core/backoff.hpp"
#include "keel/core/clock.hpp"
#include "keel/queue/completion.hpp"

namespace keel::store {

struct QueueOptions {
  /// Default attempts per job (when an enqueue gives none). Requires: >= 1. Default 25.
  int max_attempts = 25;
  /// Delay between attempts: full jitter, base 1 s, cap 1 h by default. Requires: a valid
  /// keel::BackoffOptions.
  BackoffOptions backoff = {.base = std::chrono::seconds(1), .cap = std::chrono::hours(1)};
  /// Lease duration: how long a leased job stays with its worker without a heartbeat.
  /// Requires: >= 1 ms (expiries are stored in whole milliseconds). Default 30 s.
  Duration lease = std::chrono::seconds(30);
  /// Time source (wall_now) for run times, leases and history. Default keel::steady_clock().
  Clock* clock = nullptr;
  /// Seed for the backoff jitter; 0 seeds from std::random_device. Default 0.
  std::uint64_t seed = 0;
  /// Largest server-requested delay (Retry-After) honoured, as RetryOptions::retry_after_cap.
  /// Requires: >= 0. Default 1 h.
  Duration retry_after_cap = std::chrono::hours(1);
  /// A job older than this (since it was enqueued or last replayed) is dead instead of being
  /// retried or deferred again. Requires: > 0. Default none (kInfinite): only real attempts
  /// make a job dead.
  Duration max_age = kInfinite;
  /// Called after a job moved to the dead-letter queue (by complete(), release() or an expired
  /// lease on its last attempt), with the job's id and why: the reason's kind and its text (a
  /// DeadLetterReason converts to the text, so (id, std::string_view) callbacks work too). Must
  /// be safe to call from any thread. Default none.
  std::function<void(std::int64_t job_id, const DeadLetterReason& dead)> on_dead_letter;
  /// How long a job stays in the dead-letter queue (since it died) before prune_dead() deletes
  /// it. Requires: > 0. Default none (kInfinite): dead jobs are kept until replayed or discarded.
  Duration dead_letter_retention = kInfinite;
  /// How far ahead dead_expiring in stats() looks: the jobs deleted within this window are
  /// counted, so that someone can replay them first. Requires: >= 0, and shorter than
  /// dead_letter_retention (a window as long as the retention would count jobs already gone by
  /// the time anyone looks). Default none: min(24 h, dead_letter_retention / 2), filled in by
  /// the JobQueue, so its options() always hold the window in force.
  std::optional<Duration> dead_letter_warning;
  /// Whether a job that succeeds stays, as done, until a prune deletes it (prune_done,
  /// WorkerOptions::done_retention). false: the statement that records the success deletes the
  /// job with its history, as graphile-worker does with a finished job: no done row for a later
  /// pass to delete (a quarter less WAL per job on PostgreSQL, a table the size of its live
  /// jobs), but get() finds nothing of it and its key no longer makes an enqueue of the same
  /// key a repeat. `keel jobs work --retain-done 0s` sets it. Default true.
  bool keep_done = true;
};

}  // namespace keel::store
