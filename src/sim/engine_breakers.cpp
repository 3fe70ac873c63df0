// The breakers: what each process's breaker did (opens counted, probes seen) and, with shared
// breakers, the fleet's one break: its probe, the other processes held open, and the word of a
// break or a close reaching them after the propagation delay.
#include <cstddef>
#include <cstdint>

#include "detail/engine.hpp"
#include "keel/core/breaker.hpp"
#include "keel/core/duration.hpp"

namespace keel::sim::detail {

void Engine::look(Watched& w) {
  const BreakerSnapshot snap = w.breaker->snapshot();
  w.state = snap.state;
  w.trips = snap.consecutive_trips;
}

void Engine::watch(std::size_t process) {
  Watched& w = watched_[process];
  const BreakerState before = w.state;
  const int trips_before = w.trips;
  const BreakerSnapshot snap = w.breaker->snapshot();
  w.state = snap.state;
  w.trips = snap.consecutive_trips;
  if (snap.consecutive_trips > trips_before) {
    if (!shared_) {
      ++breaker_opens_;
      return;
    }
    fleet_opened(process, snap.open_remaining);
  } else if (shared_ && before != BreakerState::kClosed && snap.state == BreakerState::kClosed) {
    fleet_closed();
  }
}

// A process's breaker opened by itself. The prober's re-open (a failed probe) or the first
// opening while the fleet is closed starts a fleet break; anyone else adopts the current one.
void Engine::fleet_opened(std::size_t process, Duration open_remaining) {
  if (!fleet_open_ || process == prober_) {
    fleet_open_ = true;
    prober_ = process;
    probe_claimed_ = false;
    ++fleet_break_;
    ++breaker_opens_;
    probe_at_ = now() + open_remaining.count();
    watched_[process].adopted = fleet_break_;
    schedule(now() + propagation_ns_, EventType::kFleetWord, 0, fleet_break_);
    return;
  }
  watched_[process].adopted = 0;  // opened by itself after its hold ran out: hold it again
  hold(process);
}

// The fleet shares one probe time: the first process to call after it sends the fleet's one
// probe (in the real design, the process that claims the probe in the shared store). When that
// is not the process whose break set the time, the probe moves: the claimer's breaker is
// forced open with its break over (its call is the half-open trial) and the former prober is
// held open like every other process.
void Engine::claim_probe(std::size_t process) {
  probe_claimed_ = true;
  if (process == prober_) return;
  const std::size_t former = prober_;
  prober_ = process;
  if (former != kNoProcess) {
    watched_[former].adopted = 0;
    hold(former);
  }
  Watched& w = watched_[process];
  w.breaker->force_open(Duration::zero());
  w.adopted = fleet_break_;
  look(w);
}

// The fleet's probe (or, after a lost word, any process's) closed a breaker.
void Engine::fleet_closed() {
  if (!fleet_open_) return;
  fleet_open_ = false;
  prober_ = kNoProcess;
  ++fleet_break_;
  schedule(now() + propagation_ns_, EventType::kFleetWord, 1, fleet_break_);
}

// Keeps a non-probing process open until the probe's answer reaches it: the fleet's probe time
// plus the breaker's half_open_timeout and the propagation (a safety net, then it probes).
void Engine::hold(std::size_t process) {
  Watched& w = watched_[process];
  if (w.adopted == fleet_break_) return;
  const std::int64_t until =
      probe_at_ + w.breaker->options().half_open_timeout.count() + propagation_ns_;
  w.breaker->force_open(Duration(until - now()));
  w.adopted = fleet_break_;
  look(w);
}

void Engine::fleet_word(std::uint32_t id, bool close) {
  if (id != fleet_break_) return;  // overtaken by a newer break or close
  for (std::size_t i = 0; i < watched_.size(); ++i) {
    Watched& w = watched_[i];
    if (w.breaker == nullptr) continue;
    if (close) {
      if (w.breaker->state() != BreakerState::kClosed) w.breaker->reset();
      w.adopted = 0;
      look(w);
    } else if (i != prober_) {
      hold(i);
    }
  }
}

}  // namespace keel::sim::detail
