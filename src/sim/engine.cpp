#include "keel/sim/engine.hpp"

#include <algorithm>
#include <cmath>
#include <deque>
#include <optional>
#include <queue>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "keel/admission.hpp"
#include "keel/backoff.hpp"
#include "keel/breaker.hpp"
#include "keel/concurrency_limit.hpp"
#include "keel/duration.hpp"
#include "keel/expected.hpp"
#include "keel/random.hpp"
#include "keel/rate_limit.hpp"

namespace keel::sim {

namespace {

[[noreturn]] void reject(const std::string& field, const std::string& requirement,
                         const std::string& got) {
  throw_invalid({.context = "keel::sim::Scenario",
                 .field = field,
                 .problem = "must be " + requirement,
                 .got = got});
}

std::string num(double v) {
  std::string s = std::to_string(v);
  while (s.size() > 1 && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

enum class EventType : std::uint8_t {
  kArrival,       // a new top-level operation (open loop)
  kAttempt,       // an operation starts its next attempt
  kServiceDone,   // a server finishes a request
  kTimeout,       // an attempt reaches its per-attempt timeout
  kCapacityEdge,  // capacity changes (drop window start or end): serve the queue
  kFleetWord,     // shared breakers: a break (op 0) or a close (op 1) reaches the other processes
};

struct Event {
  std::int64_t at;      // ns since the start of the run
  std::uint64_t order;  // ties broken by scheduling order: the run is deterministic
  std::uint32_t op;
  std::uint32_t attempt_id;
  EventType type;
  bool fails;  // kServiceDone: the request fails
};

struct Later {
  bool operator()(const Event& a, const Event& b) const noexcept {
    return a.at != b.at ? a.at > b.at : a.order > b.order;
  }
};

struct Request {
  std::uint32_t op;
  std::uint32_t attempt_id;
};

constexpr std::uint32_t kNone = 0xffffffffu;

struct Op {
  std::optional<RetryState> state;
  RetryContext context;  // entered while a top-level operation runs (one retrying layer)
  std::int64_t started = 0;
  std::uint32_t parent = kNone;
  std::uint32_t root = kNone;        // the top-level operation of the chain
  std::uint32_t parent_attempt = 0;  // the parent's attempt this operation serves
  std::uint32_t attempt_id = 0;      // current attempt (unique over the run)
  std::int32_t process = 0;
  std::uint8_t layer = 0;
  bool waiting = false;        // an attempt is outstanding
  bool first_chain = true;     // this operation and its ancestors are on their first attempt
  bool slot_reserved = false;  // the rate limit's slot for the next attempt is taken
  std::int64_t attempt_started = 0;
  ConcurrencyPermit permit;  // the process's concurrency limit, for the attempt in flight
};

class Engine {
 public:
  Engine(const Scenario& s, const ClientPolicy& p, std::uint64_t seed)
      : s_(s),
        policy_(p.retry),
        arrival_rng_(seed * 0x9e3779b97f4a7c15ULL + 1),
        dependency_rng_(seed * 0xbf58476d1ce4e5b9ULL + 2),
        jitter_rng_(jitter_seed(seed)),
        base_(clock_.now()),
        duration_ns_(s.duration.count()),
        slice_ns_(s.slice.count()),
        bottom_(static_cast<std::uint8_t>(s.clients.layers - 1)) {
    const auto slices = static_cast<std::size_t>((duration_ns_ + slice_ns_ - 1) / slice_ns_);
    slices_.resize(slices);
    servers_ = std::max<std::int64_t>(
        1, std::llround(s.dependency.capacity_per_s *
                        std::chrono::duration<double>(s.dependency.service_time).count()));
    processes_.resize(static_cast<std::size_t>(s.clients.processes));
    if (p.make_call_context) {
      for (auto& ctx : processes_) ctx = p.make_call_context(clock_);
    }
    watched_.resize(processes_.size());
    for (std::size_t i = 0; i < processes_.size(); ++i) {
      if (processes_[i]) watched_[i].breaker = processes_[i]->breaker();
    }
    if (p.shared_breakers) {
      shared_ = true;
      propagation_ns_ = p.shared_breakers->propagation.count();
    }
    if (s.clients.random_process) process_rng_.emplace(seed * 0x2545f4914f6cdd1dULL + 5);
    one_retrying_layer_ = p.one_retrying_layer;
    if (s.dependency.admission_limit > 0 || s.dependency.admission_adaptive) {
      admission_rng_ = Rng(seed * 0xd6e8feb86659fd93ULL + 4);
      admission_.emplace(AdmissionOptions{
          .max_concurrency = std::max<std::int64_t>(1, s.dependency.admission_limit),
          .queue_bound = s.dependency.admission_queue,
          .retry_after_max = s.dependency.admission_retry_after_max,
          .adaptive = s.dependency.admission_adaptive});
    }
    if (p.concurrency_limit) {
      for (std::size_t i = 0; i < processes_.size(); ++i) {
        limits_.push_back(std::make_unique<AdaptiveConcurrencyLimit>(*p.concurrency_limit));
      }
      held_.resize(processes_.size());
      woken_.resize(processes_.size());
    }
    if (p.rate_limit) {
      for (std::size_t i = 0; i < processes_.size(); ++i) {
        rates_.push_back(p.shared_rate_limit && i > 0 ? rates_.front()
                                                      : std::make_shared<RateLimit>(*p.rate_limit));
      }
    }
  }

  Result run() {
    if (s_.clients.population > 0) {
      for (std::int64_t i = 0; i < s_.clients.population; ++i) start_top_level(0);
    } else {
      schedule(next_interarrival(), EventType::kArrival, kNone, 0);
    }
    const auto& dep = s_.dependency;
    if (!dep.capacity_drop.empty()) {
      schedule(dep.capacity_drop.start.count(), EventType::kCapacityEdge, kNone, 0);
      schedule(dep.capacity_drop.end.count(), EventType::kCapacityEdge, kNone, 0);
    }
    std::int64_t events = 0;
    std::size_t sampled_slice = 0;
    while (!queue_.empty()) {
      const Event ev = queue_.top();
      if (ev.at >= duration_ns_) break;
      queue_.pop();
      ++events;
      advance_to(ev.at);
      const auto slice = static_cast<std::size_t>(ev.at / slice_ns_);
      while (sampled_slice < slice) sample_breakers(sampled_slice++);
      switch (ev.type) {
        case EventType::kArrival:
          start_top_level(ev.at);
          schedule(ev.at + next_interarrival(), EventType::kArrival, kNone, 0);
          break;
        case EventType::kAttempt:
          if (ops_[ev.op].attempt_id == ev.attempt_id) begin_attempt(ev.op);
          break;
        case EventType::kServiceDone:
          service_done(ev);
          break;
        case EventType::kTimeout: {
          Op& op = ops_[ev.op];
          if (op.waiting && op.attempt_id == ev.attempt_id) {
            Outcome o = Outcome::transient();
            o.timed_out = true;
            ++slice_at(ev.at).timeouts;
            deliver(ev.op, o);
          }
          break;
        }
        case EventType::kCapacityEdge:
          serve_queue(ev.at);
          break;
        case EventType::kFleetWord:
          fleet_word(ev.attempt_id, ev.op == 1);
          break;
      }
    }
    while (sampled_slice < slices_.size()) sample_breakers(sampled_slice++);
    return summarize(events);
  }

 private:
  // --- time and events -------------------------------------------------------------------

  void advance_to(std::int64_t at) {
    const std::int64_t now = (clock_.now() - base_).count();
    if (at > now) clock_.advance(Duration(at - now));
  }
  [[nodiscard]] std::int64_t now() const { return (clock_.now() - base_).count(); }

  void schedule(std::int64_t at, EventType type, std::uint32_t op, std::uint32_t attempt_id,
                bool fails = false) {
    queue_.push(Event{at, order_++, op, attempt_id, type, fails});
  }

  std::int64_t next_interarrival() {
    const double u = uniform01(arrival_rng_);
    const double seconds = -std::log1p(-u) / s_.clients.arrivals_per_s;
    return std::max<std::int64_t>(1, std::llround(seconds * 1e9));
  }

  Slice& slice_at(std::int64_t at) {
    auto i = static_cast<std::size_t>(at / slice_ns_);
    if (i >= slices_.size()) i = slices_.size() - 1;
    return slices_[i];
  }

  void sample_breakers(std::size_t index) {
    if (index >= slices_.size()) return;
    Slice& sl = slices_[index];
    for (const auto& ctx : processes_) {
      const int state = ctx ? ctx->breaker_state() : -1;
      if (state == 0) ++sl.breakers_closed;
      if (state == 1) ++sl.breakers_open;
      if (state == 2) ++sl.breakers_half_open;
    }
  }

  // --- operations ------------------------------------------------------------------------

  std::uint32_t new_op(std::uint8_t layer, std::int32_t process, std::uint32_t parent) {
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

  void start_top_level(std::int64_t at) {
    const auto process =
        process_rng_ ? static_cast<std::int32_t>(std::min(
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
  bool pass_limits(std::uint32_t index) {
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
  void wake(std::size_t process) {
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
  void end_limits(Op& op, const Outcome& outcome) {
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

  void begin_attempt(std::uint32_t index) {
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

  void deliver(std::uint32_t index, const Outcome& outcome) {
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

  void finish(std::uint32_t index) {
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

  // --- breakers: what each process's breaker did, and the fleet's shared breaker -----------

  // What the engine last saw of a process's breaker. Breakers change state only inside a
  // RetryState's start_attempt() and next() (and when the fleet forces them), so looking after
  // each of those sees every break: consecutive_trips grows by one per opening.
  struct Watched {
    CircuitBreaker* breaker = nullptr;
    BreakerState state = BreakerState::kClosed;
    int trips = 0;
    std::uint32_t adopted = 0;  // the fleet break this process was forced into (0: none)
  };

  void look(Watched& w) {
    const BreakerSnapshot snap = w.breaker->snapshot();
    w.state = snap.state;
    w.trips = snap.consecutive_trips;
  }

  void watch(std::size_t process) {
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
  void fleet_opened(std::size_t process, Duration open_remaining) {
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
  void claim_probe(std::size_t process) {
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
  void fleet_closed() {
    if (!fleet_open_) return;
    fleet_open_ = false;
    prober_ = kNoProcess;
    ++fleet_break_;
    schedule(now() + propagation_ns_, EventType::kFleetWord, 1, fleet_break_);
  }

  // Keeps a non-probing process open until the probe's answer reaches it: the fleet's probe time
  // plus the breaker's half_open_timeout and the propagation (a safety net, then it probes).
  void hold(std::size_t process) {
    Watched& w = watched_[process];
    if (w.adopted == fleet_break_) return;
    const std::int64_t until =
        probe_at_ + w.breaker->options().half_open_timeout.count() + propagation_ns_;
    w.breaker->force_open(Duration(until - now()));
    w.adopted = fleet_break_;
    look(w);
  }

  void fleet_word(std::uint32_t id, bool close) {
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

  // --- the dependency --------------------------------------------------------------------

  std::int64_t server_limit(std::int64_t t) const {
    const auto& dep = s_.dependency;
    if (dep.capacity_drop.contains(Duration(t))) {
      return std::llround(static_cast<double>(servers_) * dep.capacity_drop_factor);
    }
    return servers_;
  }

  bool draw_failure(std::int64_t t) {
    const auto& dep = s_.dependency;
    double p = 0;
    if (dep.failure_window.empty() || dep.failure_window.contains(Duration(t))) {
      p = dep.failure_fraction;
    }
    if (dep.overload_failure > 0 && busy_ >= server_limit(t)) p += dep.overload_failure;
    if (p <= 0) return false;
    return uniform01(dependency_rng_) < p;
  }

  void arrive(std::uint32_t index, std::uint32_t attempt_id, std::int64_t t, bool retry) {
    const auto& dep = s_.dependency;
    if (dep.outage.contains(Duration(t))) {
      ++outage_calls_;
      deliver(index, Outcome::transient());
      return;
    }
    if (dep.rate_limit_per_s > 0) {
      // The dependency's own rate limit: 429 over rate_limit_per_s accepted in the last second.
      while (!accepted_.empty() && accepted_.front() <= t - 1'000'000'000) accepted_.pop_front();
      if (static_cast<double>(accepted_.size()) >= dep.rate_limit_per_s) {
        ++slice_at(t).throttled;
        ++throttled_;
        deliver(index, Outcome::throttled(dep.rate_limit_retry_after));
        return;
      }
      accepted_.push_back(t);
    }
    if (admission_) {
      // The receiver's own limiter: retries are refused first, for free, with Retry-After.
      Admission admission = admission_->admit(retry ? 2 : 1, admission_rng_);
      if (!admission) {
        ++slice_at(t).shed;
        deliver(index, Outcome::throttled(admission.retry_after()));
        return;
      }
      admitted_.emplace(attempt_id, Admitted{std::move(admission), t});
    }
    if (admission_) arrived_.emplace(attempt_id, t);
    const bool fails = draw_failure(t);
    if (fails && dep.failures_are_free) {
      admitted_.erase(attempt_id);
      arrived_.erase(attempt_id);
      deliver(index, Outcome::transient());
      return;
    }
    if (busy_ < server_limit(t)) {
      ++busy_;
      schedule(t + dep.service_time.count(), EventType::kServiceDone, index, attempt_id, fails);
      return;
    }
    if (static_cast<std::int64_t>(waiting_.size()) < dep.queue_limit) {
      waiting_.push_back(Pending{Request{index, attempt_id}, fails});
      Slice& sl = slice_at(t);
      sl.queue_max = std::max(sl.queue_max, static_cast<std::int64_t>(waiting_.size()));
      return;
    }
    ++slice_at(t).shed;
    admitted_.erase(attempt_id);
    arrived_.erase(attempt_id);
    deliver(index, dep.shed_retry_after >= Duration::zero()
                       ? Outcome::throttled(dep.shed_retry_after)
                       : Outcome::throttled());
  }

  void service_done(const Event& ev) {
    --busy_;
    if (const auto it = arrived_.find(ev.attempt_id); it != arrived_.end()) {
      served_latencies_.push_back(ev.at - it->second);
      arrived_.erase(it);
    }
    if (!ev.fails) ++slice_at(ev.at).served_ok;
    // The admission slot is free once the request is served; it tells the limit how long the
    // request was in the dependency.
    if (const auto it = admitted_.find(ev.attempt_id); it != admitted_.end()) {
      it->second.admission.release(Duration(ev.at - it->second.at), clock_.now());
      admitted_.erase(it);
    }
    Op& op = ops_[ev.op];
    if (op.waiting && op.attempt_id == ev.attempt_id) {
      deliver(ev.op, ev.fails ? Outcome::transient() : Outcome::success());
    } else {
      ++slice_at(ev.at).wasted;
      ++wasted_;
    }
    serve_queue(ev.at);
  }

  void serve_queue(std::int64_t t) {
    const std::int64_t limit = server_limit(t);
    while (busy_ < limit && !waiting_.empty()) {
      const Pending p = waiting_.front();
      waiting_.pop_front();
      ++busy_;
      schedule(t + s_.dependency.service_time.count(), EventType::kServiceDone, p.request.op,
               p.request.attempt_id, p.fails);
    }
  }

  // --- summary ---------------------------------------------------------------------------

  bool healthy(const Slice& sl) const {
    const std::int64_t ended = sl.successes + sl.failures;
    if (ended == 0) return true;
    return static_cast<double>(sl.successes) >= s_.healthy_ratio * static_cast<double>(ended);
  }

  Result summarize(std::int64_t events) {
    Result r;
    Summary& m = r.summary;
    m.events = events;
    m.first_attempts = first_attempts_;
    m.total_calls = total_calls_;
    m.layer_calls = layer_calls_;
    m.amplification = first_attempts_ > 0
                          ? static_cast<double>(total_calls_) / static_cast<double>(first_attempts_)
                          : 0.0;
    m.wasted = wasted_;
    const Window steady = s_.steady.empty() ? Window{Duration::zero(), s_.duration} : s_.steady;
    std::int64_t steady_calls = 0;
    std::int64_t steady_served_ok = 0;
    for (std::size_t i = 0; i < slices_.size(); ++i) {
      const Slice& sl = slices_[i];
      const Duration start(static_cast<std::int64_t>(i) * slice_ns_);
      if (steady.contains(start)) {
        steady_calls += sl.offered;
        steady_served_ok += sl.served_ok;
      }
      if (sl.offered > m.peak_per_slice) {
        m.peak_per_slice = sl.offered;
        m.peak_slice_start = start;
      }
      m.peak_retries_per_slice = std::max(m.peak_retries_per_slice, sl.retries);
      m.ops_succeeded += sl.ops_succeeded;
      m.ops_failed += sl.ops_failed;
    }
    const double steady_s = std::chrono::duration<double>(steady.end - steady.start).count();
    m.offered_per_s = steady_s > 0 ? static_cast<double>(steady_calls) / steady_s : 0.0;
    m.goodput_per_s = steady_s > 0 ? static_cast<double>(steady_served_ok) / steady_s : 0.0;
    m.limited = limited_;
    m.throttled = throttled_;
    if (!served_latencies_.empty()) {
      auto pick = [&](double q) {
        const auto k =
            static_cast<std::size_t>(q * static_cast<double>(served_latencies_.size() - 1));
        std::nth_element(served_latencies_.begin(),
                         served_latencies_.begin() + static_cast<std::ptrdiff_t>(k),
                         served_latencies_.end());
        return Duration(served_latencies_[k]);
      };
      m.served_p50_latency = pick(0.50);
      m.served_p99_latency = pick(0.99);
    }

    // Recovery: the first slice at or after trigger_end from which every slice is healthy.
    const auto first = static_cast<std::size_t>(s_.trigger_end.count() / slice_ns_);
    std::optional<std::size_t> healthy_from;
    for (std::size_t i = slices_.size(); i-- > first;) {
      if (!healthy(slices_[i])) break;
      healthy_from = i;
    }
    // Without a trigger there is nothing to recover from: recovered means healthy throughout.
    if (s_.trigger_end <= Duration::zero() && healthy_from && *healthy_from != 0) {
      healthy_from.reset();
    }
    if (healthy_from) {
      m.recovered = true;
      const Duration at(static_cast<std::int64_t>(*healthy_from) * slice_ns_);
      m.recovery = at > s_.trigger_end ? at - s_.trigger_end : Duration::zero();
    }
    std::optional<std::size_t> ops_healthy_from;
    for (std::size_t i = slices_.size(); i-- > first;) {
      const Slice& sl = slices_[i];
      const std::int64_t ended = sl.ops_succeeded + sl.ops_failed;
      if (ended > 0 &&
          static_cast<double>(sl.ops_succeeded) < s_.healthy_ratio * static_cast<double>(ended)) {
        break;
      }
      ops_healthy_from = i;
    }
    if (ops_healthy_from) {
      const Duration at(static_cast<std::int64_t>(*ops_healthy_from) * slice_ns_);
      m.ops_recovery = at > s_.trigger_end ? at - s_.trigger_end : Duration::zero();
    }
    m.outage_calls = outage_calls_;
    m.probes = probes_;
    m.breaker_opens = breaker_opens_;
    if (!latencies_.empty()) {
      auto pick = [&](double q) {
        const auto k = static_cast<std::size_t>(q * static_cast<double>(latencies_.size() - 1));
        std::nth_element(latencies_.begin(), latencies_.begin() + static_cast<std::ptrdiff_t>(k),
                         latencies_.end());
        return Duration(latencies_[k]);
      };
      m.p50_latency = pick(0.50);
      m.p99_latency = pick(0.99);
    }
    r.slices = std::move(slices_);
    return r;
  }

  struct Pending {
    Request request;
    bool fails;
  };

  const Scenario& s_;
  RetryPolicy policy_;
  bool one_retrying_layer_ = false;
  ManualClock clock_;
  Rng arrival_rng_;
  Rng dependency_rng_;
  Rng jitter_rng_;
  TimePoint base_;
  std::int64_t duration_ns_;
  std::int64_t slice_ns_;
  std::uint8_t bottom_;
  std::int64_t servers_ = 1;
  std::int64_t busy_ = 0;
  std::deque<Pending> waiting_;
  std::optional<AdmissionLimiter> admission_;
  struct Admitted {
    Admission admission;
    std::int64_t at = 0;  // arrival
  };
  std::unordered_map<std::uint32_t, Admitted> admitted_;  // by attempt id, while in the dependency
  std::unordered_map<std::uint32_t, std::int64_t> arrived_;  // arrival of requests not yet served
  std::vector<std::int64_t> served_latencies_;
  std::deque<std::int64_t> accepted_;  // the dependency's rate limit: accepted in the last second
  std::vector<std::unique_ptr<AdaptiveConcurrencyLimit>> limits_;  // per process
  struct Held {
    std::uint32_t op;
    std::uint32_t attempt_id;
  };
  std::vector<std::deque<Held>> held_;             // per process: attempts waiting for a permit
  std::vector<std::int64_t> woken_;                // per process: woken, not yet begun
  std::vector<std::shared_ptr<RateLimit>> rates_;  // per process (one shared by all: shared)
  std::int64_t limited_ = 0;
  std::int64_t throttled_ = 0;
  Rng admission_rng_{0};  // Retry-After draws of the admission limiter
  std::priority_queue<Event, std::vector<Event>, Later> queue_;
  std::uint64_t order_ = 0;
  std::deque<Op> ops_;  // a deque: references stay valid while operations are added
  std::vector<std::uint32_t> free_;
  std::vector<std::unique_ptr<CallContext>> processes_;
  std::size_t next_process_ = 0;
  std::optional<Rng> process_rng_;  // random_process: which process an operation goes to
  static constexpr std::size_t kNoProcess = static_cast<std::size_t>(-1);
  std::vector<Watched> watched_;  // per process
  bool shared_ = false;
  std::int64_t propagation_ns_ = 0;
  bool fleet_open_ = false;
  std::size_t prober_ = kNoProcess;
  bool probe_claimed_ = false;     // a process has taken this break's probe
  std::uint32_t fleet_break_ = 0;  // grows with every fleet break and close
  std::int64_t probe_at_ = 0;      // the prober's break ends here (ns)
  std::int64_t outage_calls_ = 0;
  std::int64_t probes_ = 0;
  std::int64_t breaker_opens_ = 0;
  std::uint32_t attempt_counter_ = 0;
  std::vector<Slice> slices_;
  std::vector<std::int64_t> latencies_;
  std::int64_t first_attempts_ = 0;
  std::int64_t total_calls_ = 0;
  std::int64_t layer_calls_ = 0;
  std::int64_t wasted_ = 0;
};

}  // namespace

std::uint64_t jitter_seed(std::uint64_t seed) noexcept { return seed * 0x94d049bb133111ebULL + 3; }

void validate(const Scenario& s) {
  const auto& d = s.dependency;
  const auto& c = s.clients;
  if (!(d.capacity_per_s > 0) || !std::isfinite(d.capacity_per_s)) {
    reject("dependency.capacity_per_s", "> 0", num(d.capacity_per_s));
  }
  if (d.service_time <= Duration::zero()) {
    reject("dependency.service_time", "> 0", format_duration(d.service_time));
  }
  if (d.queue_limit < 0) reject("dependency.queue_limit", ">= 0", std::to_string(d.queue_limit));
  if (!(d.failure_fraction >= 0 && d.failure_fraction <= 1)) {
    reject("dependency.failure_fraction", "in [0, 1]", num(d.failure_fraction));
  }
  if (!(d.overload_failure >= 0 && d.overload_failure <= 1)) {
    reject("dependency.overload_failure", "in [0, 1]", num(d.overload_failure));
  }
  if (!(d.capacity_drop_factor >= 0 && d.capacity_drop_factor <= 1)) {
    reject("dependency.capacity_drop_factor", "in [0, 1]", num(d.capacity_drop_factor));
  }
  if (d.admission_limit < 0) {
    reject("dependency.admission_limit", ">= 0", std::to_string(d.admission_limit));
  }
  if (d.admission_queue < 0) {
    reject("dependency.admission_queue", ">= 0", std::to_string(d.admission_queue));
  }
  if (d.admission_limit > 0 && d.admission_retry_after_max <= Duration::zero()) {
    reject("dependency.admission_retry_after_max", "> 0",
           format_duration(d.admission_retry_after_max));
  }
  if (!(d.rate_limit_per_s >= 0) || !std::isfinite(d.rate_limit_per_s)) {
    reject("dependency.rate_limit_per_s", ">= 0", num(d.rate_limit_per_s));
  }
  if (d.rate_limit_retry_after < Duration::zero()) {
    reject("dependency.rate_limit_retry_after", ">= 0", format_duration(d.rate_limit_retry_after));
  }
  if (c.population < 0) reject("clients.population", ">= 0", std::to_string(c.population));
  if (c.population == 0 && (!(c.arrivals_per_s > 0) || !std::isfinite(c.arrivals_per_s))) {
    reject("clients.arrivals_per_s", "> 0 for open-loop clients", num(c.arrivals_per_s));
  }
  if (c.processes < 1) reject("clients.processes", ">= 1", std::to_string(c.processes));
  if (c.layers < 1 || c.layers > 8) reject("clients.layers", "in [1, 8]", std::to_string(c.layers));
  if (s.duration <= Duration::zero()) reject("duration", "> 0", format_duration(s.duration));
  if (s.slice <= Duration::zero() || s.slice > s.duration) {
    reject("slice", "> 0 and <= duration", format_duration(s.slice));
  }
  if (!(s.healthy_ratio > 0 && s.healthy_ratio <= 1)) {
    reject("healthy_ratio", "in (0, 1]", num(s.healthy_ratio));
  }
  // A run's event count grows with arrivals x duration; keep a bound so a typo cannot hang.
  const double seconds = std::chrono::duration<double>(s.duration).count();
  const double operations =
      c.population > 0 ? static_cast<double>(c.population) : c.arrivals_per_s * seconds;
  if (operations > 50e6) {
    reject("clients", "at most 50,000,000 operations per run",
           num(operations) + " (arrivals_per_s x duration or population)");
  }
}

Result run(const Scenario& scenario, const ClientPolicy& policy, std::uint64_t seed) {
  validate(scenario);
  if (policy.shared_breakers && policy.shared_breakers->propagation < Duration::zero()) {
    throw_invalid({.context = "keel::sim::ClientPolicy",
                   .field = "shared_breakers.propagation",
                   .problem = "must be >= 0",
                   .got = format_duration(policy.shared_breakers->propagation)});
  }
  Engine engine(scenario, policy, seed);
  return engine.run();
}

}  // namespace keel::sim
