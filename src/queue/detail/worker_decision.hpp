// The Worker's decisions about one job of a batch, as pure functions (queue_worker.cpp acts on
// them; tests/unit/worker_decision_test.cpp holds their tables): how the job starts, and how its
// outcome is recorded.
#pragma once

namespace keel::store::detail {

/// What a slot knows about a leased job before running it.
struct StartFacts {
  /// A brake refused a call meanwhile: the worker is paused.
  bool paused = false;
  /// Its lease recorded its start already (the first job of a batch).
  bool started = false;
  /// The batch's previous job succeeded and its success is not recorded yet.
  bool previous_success = false;
};

struct StartDecision {
  /// Deferred with the pause's report: nothing sent, no start recorded.
  bool defer = false;
  /// A committed start before the handler runs, so that a crash charges this job and no other.
  bool start = false;
  /// The previous success is recorded by the start's own statement (a crash in between re-runs
  /// neither); otherwise it is recorded on its own, first.
  bool previous_with_start = false;
};

[[nodiscard]] StartDecision decide_start(const StartFacts& facts) noexcept;

/// What a slot knows once a job's handler has returned.
struct RecordingFacts {
  /// The handler's transaction recorded the outcome with its writes (done, or found stale).
  bool recorded_by_handler = false;
  /// The handler's transaction's COMMIT is in doubt.
  bool in_doubt = false;
  bool success = false;
  /// The worker is stopping, or paused by a brake: no more of the batch runs, nothing is leased.
  bool stopping = false;
  bool paused = false;
  /// The job is the last of its batch.
  bool last_of_batch = false;
};

enum class Recording : unsigned char {
  kRecorded,       // nothing to do: the handler's transaction recorded it
  kSettle,         // only the job's row can say whether the COMMIT applied: settle it
  kWithNextStart,  // a success with more of the batch to run: recorded by the next job's start
  kWithNextLease,  // the batch's last success: recorded by the statement that leases more
  kAlone,          // a failure, or a success with nothing to follow: its own statement
};

[[nodiscard]] Recording decide_recording(const RecordingFacts& facts) noexcept;

}  // namespace keel::store::detail
