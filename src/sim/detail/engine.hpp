// What the engine's source files share (src/sim/engine*.cpp, one file per concern of one
// Engine): the events and their order, an operation's state, and the Engine class whose member
// functions those files define. Private to keel::sim; a run's Engine lives on one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <queue>
#include <unordered_map>
#include <vector>

#include "keel/core/admission.hpp"
#include "keel/core/breaker.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/concurrency_limit.hpp"
#include "keel/core/random.hpp"
#include "keel/core/rate_limit.hpp"
#include "keel/core/retry.hpp"
#include "keel/sim/engine.hpp"

namespace keel::sim::detail {

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
  Engine(const Scenario& s, const ClientPolicy& p, std::uint64_t seed);

  Result run();

 private:
  // --- time and events (engine.cpp) -----------------------------------------------------
  // The small ones are defined here: every file's events are scheduled and counted by them.

  void advance_to(std::int64_t at) {
    const std::int64_t now = (clock_.now() - base_).count();
    if (at > now) clock_.advance(Duration(at - now));
  }
  [[nodiscard]] std::int64_t now() const { return (clock_.now() - base_).count(); }

  void schedule(std::int64_t at, EventType type, std::uint32_t op, std::uint32_t attempt_id,
                bool fails = false) {
    queue_.push(Event{at, order_++, op, attempt_id, type, fails});
  }
  std::int64_t next_interarrival();

  Slice& slice_at(std::int64_t at) {
    auto i = static_cast<std::size_t>(at / slice_ns_);
    if (i >= slices_.size()) i = slices_.size() - 1;
    return slices_[i];
  }
  void sample_breakers(std::size_t index);

  // --- operations (engine_client.cpp) ----------------------------------------------------

  std::uint32_t new_op(std::uint8_t layer, std::int32_t process, std::uint32_t parent);
  void start_top_level(std::int64_t at);
  bool pass_limits(std::uint32_t index);
  void wake(std::size_t process);
  void end_limits(Op& op, const Outcome& outcome);
  void begin_attempt(std::uint32_t index);
  void deliver(std::uint32_t index, const Outcome& outcome);
  void finish(std::uint32_t index);

  // --- breakers (engine_breakers.cpp): what each process's breaker did, and the fleet's ---

  // What the engine last saw of a process's breaker. Breakers change state only inside a
  // RetryState's start_attempt() and next() (and when the fleet forces them), so looking after
  // each of those sees every break: consecutive_trips grows by one per opening.
  struct Watched {
    CircuitBreaker* breaker = nullptr;
    BreakerState state = BreakerState::kClosed;
    int trips = 0;
    std::uint32_t adopted = 0;  // the fleet break this process was forced into (0: none)
  };
  void look(Watched& w);
  void watch(std::size_t process);
  void fleet_opened(std::size_t process, Duration open_remaining);
  void claim_probe(std::size_t process);
  void fleet_closed();
  void hold(std::size_t process);
  void fleet_word(std::uint32_t id, bool close);

  // --- the dependency (engine_dependency.cpp) ---------------------------------------------

  std::int64_t server_limit(std::int64_t t) const;
  bool draw_failure(std::int64_t t);
  void arrive(std::uint32_t index, std::uint32_t attempt_id, std::int64_t t, bool retry);
  void service_done(const Event& ev);
  void serve_queue(std::int64_t t);

  // --- summary (engine_summary.cpp) -------------------------------------------------------

  bool healthy(const Slice& sl) const;
  Result summarize(std::int64_t events);

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

}  // namespace keel::sim::detail
