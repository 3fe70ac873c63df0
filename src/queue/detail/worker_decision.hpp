// The Worker's decisions about one job of a batch, as pure functions (queue_worker.cpp acts on
// them; tests/unit/worker_decision_test.cpp holds their tables): how the job starts, and how its
// outcome is recorded.
//
// The crash rule. A job leased alone (batch 1) starts with its lease: a crash charges it. A batch
// starts none of its jobs: their outcomes wait in the slot's buffer and ride on the batch's next
// statement (the next lease, a committed start, or a flush once the oldest has waited the flush
// window), so a batch costs a share of one statement per job. A crash then charges none of them:
// the sweep gives the batch back uncharged, each job counted in crashed_batches, and the jobs it
// finished and had not recorded run again (at most a flush window's worth). A job so counted runs
// alone: after the rest of its batch, its start committed before its handler, with no other
// handler of the worker running; a crash then is charged to it and to no other.
#pragma once

namespace keel::store::detail {

/// What a slot knows about a leased job before running it.
struct StartFacts {
  /// A brake refused a call meanwhile: the worker is paused.
  bool paused = false;
  /// Its lease recorded its start already (a job leased alone).
  bool started = false;
  /// It was in a batch that crashed before its outcome was recorded (LeasedJob::crashed_batches).
  bool suspect = false;
  /// Successes of the batch wait in the slot's buffer.
  bool buffered = false;
  /// ... and the oldest of them finished a flush window ago or more.
  bool buffer_due = false;
};

struct StartDecision {
  /// Deferred with the pause's report: nothing sent, no start recorded.
  bool defer = false;
  /// A committed start before the handler, so that a crash charges this job and no other.
  bool start = false;
  /// Run with no other handler of the worker running (a suspect's start and handler).
  bool alone = false;
  /// The buffered successes are recorded by the start's own statement (a crash in between re-runs
  /// none of them).
  bool buffer_with_start = false;
  /// The buffered successes are recorded on their own, before the handler runs.
  bool flush = false;
};

[[nodiscard]] StartDecision decide_start(const StartFacts& facts) noexcept;

/// What a slot knows once a job's handler has returned.
struct RecordingFacts {
  /// The handler's transaction recorded the outcome with its writes (done, or found stale).
  bool recorded_by_handler = false;
  /// The handler's transaction's COMMIT is in doubt.
  bool in_doubt = false;
  bool success = false;
  /// Nothing was sent: a brake refused the call (a deferral), and the pause it may bring is due
  /// when it is recorded.
  bool refused = false;
  /// The worker is stopping, or paused by a brake: no more of the batch runs, nothing is leased.
  bool stopping = false;
  bool paused = false;
  /// The job is the last of its batch.
  bool last_of_batch = false;
  /// It ran alone, its start committed (a suspect): its outcome is recorded before any other
  /// handler of the worker runs, or a crash of theirs would charge it.
  bool ran_alone = false;
};

enum class Recording : unsigned char {
  kRecorded,       // nothing to do: the handler's transaction recorded it
  kSettle,         // only the job's row can say whether the COMMIT applied: settle it
  kBuffered,       // an outcome with more of the batch to run, not run alone: in the buffer
  kWithNextLease,  // the batch's last success: recorded, with the buffer, by the next lease
  kAlone,          // recorded now, after the buffer and in one transaction with it (outcomes
                   // are recorded in the order their handlers ran): the batch's last failure,
                   // an outcome of a job run alone, or of a stopping or paused worker
};

[[nodiscard]] Recording decide_recording(const RecordingFacts& facts) noexcept;

}  // namespace keel::store::detail
