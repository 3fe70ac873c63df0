// The Worker's decisions about one job of a batch (queue/detail/worker_decision.hpp).
#include "queue/detail/worker_decision.hpp"

namespace keel::store::detail {

StartDecision decide_start(const StartFacts& facts) noexcept {
  if (facts.paused) return {.defer = true};
  if (facts.started) return {};
  return {.start = true, .previous_with_start = facts.previous_success};
}

Recording decide_recording(const RecordingFacts& facts) noexcept {
  if (facts.recorded_by_handler) return Recording::kRecorded;
  if (facts.in_doubt) return Recording::kSettle;
  // Only a success while the worker goes on rides on a later statement: a failure is recorded at
  // once (its retry is scheduled, its brakes told), and a stopping or paused worker starts and
  // leases nothing for it to ride on.
  if (!facts.success || facts.stopping || facts.paused) return Recording::kAlone;
  return facts.last_of_batch ? Recording::kWithNextLease : Recording::kWithNextStart;
}

}  // namespace keel::store::detail
