// A job of keel::store::JobQueue as it is stored and as a worker receives it: its state, its
// attempts' history, why it died, and the counts per queue (keel/queue/queue.hpp has the
// queue itself and the life of a job).
//
// Thread-safety: value types; distinct objects may be used concurrently.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/clock.hpp"
#include "keel/core/expected.hpp"

namespace keel::store {

enum class JobState : unsigned char { kReady, kRunning, kRetryScheduled, kDone, kDead };

/// "ready", "running", "retry_scheduled", "done", "dead" (as stored).
[[nodiscard]] std::string_view to_string(JobState state) noexcept;
/// Inverse of to_string; nullopt for anything else.
[[nodiscard]] std::optional<JobState> parse_job_state(std::string_view text) noexcept;

/// A queue name is 1-64 characters of [A-Za-z0-9_.-]. Nothing when valid, else an Error with
/// the field "queue name" and the quoted name (rename it with `.in("--queue")`).
[[nodiscard]] Expected<void> check_queue_name(std::string_view name);

/// A new idempotency key: a random (version 4) UUID in its 36-character text form, from OpenSSL's
/// CSPRNG, formatted by keel::uuid_v4 (the same generator as keel::http::make_idempotency_key,
/// kept here so that keel::store needs no keel::http). Throws std::runtime_error when the CSPRNG
/// cannot supply bytes.
[[nodiscard]] std::string new_job_key();

/// One attempt in a job's history.
struct JobAttempt {
  /// How many replays preceded the attempt (0 before the first replay).
  int round = 0;
  /// 1 for the first attempt (counted again from 1 after a replay). A deferral carries the
  /// number of the attempt it postponed.
  int attempt = 0;
  /// Calendar milliseconds when the attempt's lease was taken, and when it ended.
  std::int64_t started_ms = 0;
  std::int64_t finished_ms = 0;
  /// "success", "transient", "throttled", "ambiguous", "permanent", "lease_expired", "released",
  /// or "deferred" (nothing was sent: a breaker or budget refused; not counted as an attempt).
  std::string outcome;
  /// What went wrong (the handler's text); empty on success.
  std::string error;
  /// The backoff delay chosen before the next attempt; nullopt when none was scheduled.
  std::optional<std::int64_t> delay_ms;
  /// The worker that held the lease.
  std::string worker;
};

/// Why a job moved to the dead-letter queue, decided by JobQueue from keel::core's StopReason.
enum class DeadReason : unsigned char {
  kPermanent,          // the outcome was permanent: repeating cannot help
  kAttemptsExhausted,  // its attempts (or the retries its last outcome allowed) were spent
  kMaxAge,             // it outlived QueueOptions::max_age
  /// Its attempts were spent, the last by a run whose worker died (or lost its database for
  /// longer than its lease): the expired-lease sweep charged it.
  kCrashed,
};

/// "permanent", "attempts_exhausted", "max_age", "crashed": also the job's stored dead_kind.
[[nodiscard]] std::string_view to_string(DeadReason reason) noexcept;
/// The kind named by `text`: to_string's names, and "exhausted" and "max-age" for the two with
/// an underscore. None for anything else.
[[nodiscard]] std::optional<DeadReason> parse_dead_reason(std::string_view text) noexcept;

/// A job as stored.
struct Job {
  std::int64_t id = 0;
  std::string queue;
  std::string payload;
  std::string idempotency_key;
  JobState state = JobState::kReady;
  int attempts = 0;
  int max_attempts = 0;
  /// Calendar ms: when it is due (ready, retry_scheduled) or its lease expires (running).
  std::int64_t run_at_ms = 0;
  /// The worker holding the lease while the job runs; empty in every other state.
  std::string lease_owner;
  std::optional<std::int64_t> lease_expires_ms;
  /// The fencing token of the current (or last) lease.
  std::int64_t fence = 0;
  /// Why the job is dead ("permanent: ...", "attempts exhausted: ..."); empty otherwise.
  std::string dead_reason;
  /// Why it died, as a kind (state kDead); none otherwise, and for a job that died before kinds
  /// were stored whose reason did not say.
  std::optional<DeadReason> dead_kind;
  /// The last attempt's error text; empty when none.
  std::string last_error;
  /// Why the job waits without having been attempted (a breaker or budget refused: "circuit open
  /// for api.example.com:443, next probe in 4.2s"); empty unless its last event was a deferral.
  std::string deferred_reason;
  /// Deferrals since it was enqueued (or last replayed).
  int deferrals = 0;
  /// How many times it was replayed from the dead-letter queue.
  int replays = 0;
  /// Leases of a batch it was in that expired unstarted (LeasedJob::crashed_batches).
  int crashed_batches = 0;
  std::int64_t created_ms = 0;
  std::int64_t updated_ms = 0;
  /// Oldest first; filled by get() only.
  std::vector<JobAttempt> history;
};

/// A job handed to a worker by lease().
struct LeasedJob {
  std::int64_t id = 0;
  std::string queue;
  std::string payload;
  std::string idempotency_key;
  /// This attempt's number (1 for the first).
  int attempt = 0;
  int max_attempts = 0;
  /// The fencing token to pass to start(), heartbeat(), complete() and release().
  std::int64_t fence = 0;
  std::int64_t lease_expires_ms = 0;
  /// Whether the lease started this attempt (it counts, and a crash from now on charges it).
  /// false: nothing is charged until an outcome is recorded (or JobQueue::start() is called), and
  /// a lease that expires first gives the job back uncharged, counted in crashed_batches.
  bool started = true;
  /// The leases this job was in that expired unstarted, with no outcome recorded: batches whose
  /// worker died (or lost its database) before this job's outcome was recorded. The job may have
  /// run in any of them, or caused the crash. A Worker runs such a job alone, its start committed
  /// before its handler (docs/queue.md, "What a crash costs").
  int crashed_batches = 0;
};

/// Counts for one queue.
struct QueueStats {
  std::string queue;
  std::int64_t ready = 0;
  std::int64_t running = 0;
  std::int64_t retry_scheduled = 0;
  std::int64_t done = 0;
  std::int64_t dead = 0;
  /// Of retry_scheduled: jobs that wait because a brake (breaker or budget) refused them, not
  /// because an attempt failed.
  std::int64_t deferred = 0;
  /// Age of the oldest job that is due and waiting for a worker (ready or retry_scheduled with
  /// its time reached); zero when none.
  Duration oldest_ready_age{};
  /// Of dead: jobs that prune_dead() deletes within QueueOptions::dead_letter_warning (those
  /// already past the retention included); zero when no dead-letter retention is set.
  std::int64_t dead_expiring = 0;
};

}  // namespace keel::store
