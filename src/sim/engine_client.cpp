// The clients' operations: a top-level operation and its chain of calls down the layers, each
// attempt through the client's own limits (a rate limit's slot, a concurrency permit) and its
// RetryState, and an outcome delivered back up the chain.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>

#include "detail/engine.hpp"
#include "keel/core/concurrency_limit.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/random.hpp"
#include "keel/core/rate_limit.hpp"
#include "keel/core/retry.hpp"

namespace keel::sim::detail {

std::uint32_t Engine::new_op(std::uint8_t layer, std::int32_t process, std::uint32_t parent) {
  std::uint32_t index = 0;
  if (!free_.empty()) {
    index = free_.back();
    free_.pop_back();
  } else {
    index = static_cast<std::uint32_t>(ops_.size());
    ops_.emplace_back();
  }
  Op& op = ops_[index];
  op.started = now();
  op.layer = layer;
  op.process = process;
  op.parent = parent;
  op.root = parent == kNone ? index : ops_[parent].root;
  op.first_chain = parent == kNone || (ops_[parent].first_chain && ops_[parent].state &&
                                       ops_[parent].state->attempts() <= 1);
  op.waiting = false;
  op.attempt_id = ++attempt_counter_;  // also invalidates events of the slot's previous user
  CallOptions call;
  call.clock = &clock_;
  call.rng = &jitter_rng_;
  call.safe_to_repeat = true;
  if (one_retrying_layer_) {
    call.nested = NestedRetries::kSingleAttempt;
    call.context = &ops_[op.root].context;
  } else {
    call.nested = NestedRetries::kRetry;
  }
  if (auto& ctx = processes_[static_cast<std::size_t>(process)]) ctx->apply(call, layer);
  op.state.emplace(policy_, call);
  if (one_retrying_layer_ && parent == kNone) op.context.enter();
  return index;
}

void Engine::start_top_level(std::int64_t at) {
  const auto process = process_rng_
                           ? static_cast<std::int32_t>(std::min(
                                 processes_.size() - 1,
                                 static_cast<std::size_t>(uniform01(*process_rng_) *
                                                          static_cast<double>(processes_.size()))))
                           : static_cast<std::int32_t>(next_process_++ % processes_.size());
  const std::uint32_t index = new_op(0, process, kNone);
  ++slice_at(at).first_attempts;
  ++first_attempts_;
  begin_attempt(index);
}

// The client's own limits on its calls to the dependency (layer 0): a rate limit's slot, then
// a concurrency permit. Returns false when the attempt is held back (rescheduled, not spent).
bool Engine::pass_limits(std::uint32_t index) {
  Op& op = ops_[index];
  if (op.layer != 0) return true;
  const auto process = static_cast<std::size_t>(op.process);
  const std::int64_t t = now();
  if (!rates_.empty() && !op.slot_reserved) {
    const RateDecision d = rates_[process]->reserve(clock_.now(), kInfinite, jitter_rng_);
    if (!d.go || d.wait > Duration::zero()) {
      op.slot_reserved = d.go;
      ++slice_at(t).limited;
      ++limited_;
      op.attempt_id = ++attempt_counter_;
      schedule(t + std::max<std::int64_t>(1, d.wait.count()), EventType::kAttempt, index,
               op.attempt_id);
      return false;
    }
  }
  op.slot_reserved = false;
  if (!limits_.empty()) {
    AdaptiveConcurrencyLimit& limit = *limits_[process];
    op.permit = limit.try_acquire();
    if (!op.permit) {
      // Held until a call of this process ends (in order), as a caller blocked on the limit
      // is: a released permit wakes the first held attempt.
      ++slice_at(t).limited;
      ++limited_;
      op.attempt_id = ++attempt_counter_;
      held_[process].push_back({index, op.attempt_id});
      return false;
    }
  }
  op.attempt_started = t;
  return true;
}

// Wakes the held attempts of `process` that its limit lets go now.
void Engine::wake(std::size_t process) {
  if (limits_.empty()) return;
  auto& held = held_[process];
  const AdaptiveConcurrencyLimit& limit = *limits_[process];
  std::int64_t room = limit.limit() - limit.in_flight() - woken_[process];
  while (room > 0 && !held.empty()) {
    const Held h = held.front();
    held.pop_front();
    if (ops_[h.op].attempt_id != h.attempt_id) continue;  // gone meanwhile
    schedule(now(), EventType::kAttempt, h.op, h.attempt_id);
    ++woken_[process];
    --room;
  }
}

// The attempt in flight of a layer-0 operation ended with `outcome`: its permit learns the
// latency (or the drop), and a 429's Retry-After pauses the process's rate limit.
void Engine::end_limits(Op& op, const Outcome& outcome) {
  if (op.layer != 0) return;
  if (op.permit) {
    if (outcome.timed_out || outcome.kind == OutcomeKind::kThrottled) {
      op.permit.drop(clock_.now());
    } else {
      op.permit.release(Duration(now() - op.attempt_started), clock_.now());
    }
    wake(static_cast<std::size_t>(op.process));
  }
  if (const std::optional<Duration> pause = pause_asked(outcome); !rates_.empty() && pause) {
    (void)rates_[static_cast<std::size_t>(op.process)]->pause(clock_.now(), *pause, false);
  }
}

void Engine::begin_attempt(std::uint32_t index) {
  if (!limits_.empty() && ops_[index].layer == 0) {
    // A woken attempt has come: it no longer counts against the room of the others.
    auto& woken = woken_[static_cast<std::size_t>(ops_[index].process)];
    if (woken > 0) --woken;
  }
  if ((!limits_.empty() || !rates_.empty()) && !pass_limits(index)) return;
  Op* op = &ops_[index];
  if (shared_ && fleet_open_ && !probe_claimed_ && op->layer == 0 && now() >= probe_at_ &&
      watched_[static_cast<std::size_t>(op->process)].breaker != nullptr) {
    claim_probe(static_cast<std::size_t>(op->process));
  }
  const AttemptStart start = op->state->start_attempt();
  CircuitBreaker* breaker =
      op->layer == 0 ? watched_[static_cast<std::size_t>(op->process)].breaker : nullptr;
  if (breaker != nullptr) {
    // A half-open breaker admits only trials: an attempt that proceeds now is a probe.
    if (start.proceed && breaker->state() == BreakerState::kHalfOpen) ++probes_;
    watch(static_cast<std::size_t>(op->process));
    op = &ops_[index];
  }
  if (!start.proceed) {
    op->permit.ignore();
    finish(index);
    return;
  }
  const std::uint32_t attempt_id = ++attempt_counter_;
  op->attempt_id = attempt_id;
  op->waiting = true;
  ++layer_calls_;
  const std::int64_t t = now();
  if (start.attempt.timeout < kInfinite) {
    schedule(t + start.attempt.timeout.count(), EventType::kTimeout, index, attempt_id);
  }
  if (op->layer < bottom_) {
    const std::uint8_t child_layer = static_cast<std::uint8_t>(op->layer + 1);
    const std::int32_t process = op->process;
    const std::uint32_t child = new_op(child_layer, process, index);
    ops_[child].parent_attempt = attempt_id;
    begin_attempt(child);
    return;
  }
  Slice& sl = slice_at(t);
  ++sl.offered;
  ++total_calls_;
  // At a lower layer, a first attempt caused by an upper layer's retry is a retry too.
  const bool retry = start.attempt.is_retry() || !op->first_chain;
  if (retry) ++sl.retries;
  arrive(index, attempt_id, t, retry);
}

void Engine::deliver(std::uint32_t index, const Outcome& outcome) {
  Op& op = ops_[index];
  op.waiting = false;
  end_limits(op, outcome);
  if (op.layer == bottom_) {
    Slice& sl = slice_at(now());
    if (outcome.kind == OutcomeKind::kSuccess) {
      ++sl.successes;
    } else {
      ++sl.failures;
    }
  }
  const Decision d = op.state->next(outcome);
  if (op.layer == 0 && watched_[static_cast<std::size_t>(op.process)].breaker != nullptr) {
    watch(static_cast<std::size_t>(op.process));
  }
  if (d.retry) {
    op.attempt_id = ++attempt_counter_;
    schedule(now() + d.delay.count(), EventType::kAttempt, index, op.attempt_id);
    return;
  }
  finish(index);
}

void Engine::finish(std::uint32_t index) {
  Op& op = ops_[index];
  const bool ok = op.state->stop_reason() == StopReason::kSuccess;
  const std::uint32_t parent = op.parent;
  const std::uint32_t parent_attempt = op.parent_attempt;
  if (op.layer == 0) {
    Slice& sl = slice_at(now());
    if (ok) {
      ++sl.ops_succeeded;
      latencies_.push_back(now() - op.started);
    } else {
      ++sl.ops_failed;
    }
  }
  if (one_retrying_layer_ && parent == kNone) op.context.leave();
  if (op.permit) {
    op.permit.ignore();
    wake(static_cast<std::size_t>(op.process));
  }
  op.slot_reserved = false;
  op.state.reset();
  op.attempt_id = ++attempt_counter_;
  free_.push_back(index);
  if (parent != kNone) {
    Op& p = ops_[parent];
    if (p.waiting && p.attempt_id == parent_attempt) {
      deliver(parent, ok ? Outcome::success() : Outcome::transient());
    }
  }
}

}  // namespace keel::sim::detail
