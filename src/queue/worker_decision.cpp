// The Worker's decisions about one job of a batch (queue/detail/worker_decision.hpp).
#include "queue/detail/worker_decision.hpp"

namespace keel::store::detail {

StartDecision decide_start(const StartFacts& facts) noexcept {
  // Paused: nothing is sent; the buffer is recorded now, as no start or lease will follow soon.
  if (facts.paused) return {.defer = true, .flush = facts.buffered};
  if (facts.suspect && !facts.started) {
    return {.start = true, .alone = true, .buffer_with_start = facts.buffered};
  }
  return {.flush = facts.buffered && facts.buffer_due};
}

Recording decide_recording(const RecordingFacts& facts) noexcept {
  if (facts.recorded_by_handler) return Recording::kRecorded;
  if (facts.in_doubt) return Recording::kSettle;
  // A stopping or paused worker starts and leases nothing for an outcome to ride on, and a
  // brake's refusal pauses the worker when it is recorded: recorded now.
  if (facts.stopping || facts.paused || facts.refused) return Recording::kAlone;
  // The batch's last: a success rides on the next lease; a failure is recorded now, with the
  // buffer (the lease's statement records successes only).
  if (facts.last_of_batch) return facts.success ? Recording::kWithNextLease : Recording::kAlone;
  // An outcome of a job that ran alone is recorded while the worker still runs nothing else.
  if (facts.ran_alone) return Recording::kAlone;
  // Any other outcome of the batch, a failure too, waits in the buffer: a flush records
  // successes and failures together, in a few statements whatever their number.
  return Recording::kBuffered;
}

}  // namespace keel::store::detail
