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
  // Only a success while the worker goes on rides on a later statement: a failure is recorded at
  // once (its retry is scheduled, its brakes told), and a stopping or paused worker starts and
  // leases nothing for it to ride on.
  if (!facts.success || facts.stopping || facts.paused) return Recording::kAlone;
  if (facts.last_of_batch) return Recording::kWithNextLease;
  // A success that ran alone is recorded while the worker still runs nothing else.
  return facts.ran_alone ? Recording::kAlone : Recording::kBuffered;
}

}  // namespace keel::store::detail
