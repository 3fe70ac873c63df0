// keel::sim: a discrete-event simulator of clients retrying against a dependency, in virtual time.
//
// The clients are driven by keel::core's own policy objects: every logical operation owns a
// keel::RetryState built from a keel::RetryPolicy (attempts, per-attempt timeout, keel::Backoff
// with its jitter kind), with a keel::ManualClock as its clock and a seeded keel::Rng for jitter.
// The simulator never computes a delay or a retry decision itself: what it shows is what the
// production retry engine does.
//
// Model: clients (open-loop arrivals at a rate, or a fixed population that all start at t=0) call
// a dependency made of `capacity * service_time` servers and a bounded FIFO queue. An attempt
// that finds the queue full is shed at once; one that waits past the client's per-attempt timeout
// is abandoned by the client but still served (the wasted work behind metastable failures). The
// dependency's failure model varies over time: a failure fraction, a capacity drop for a window,
// a full outage for a window. Calls may go through several layers, each retrying with the same
// policy (retry amplification multiplies across layers).
//
// Output: one Slice of counters per `slice` of virtual time, and a Summary.
//
// Thread-safety: run() is a pure function of its inputs (and the seed); concurrent calls with
// different inputs are safe. A Scenario or ClientPolicy may be shared between concurrent runs.
//
// Example:
//   keel::sim::Scenario s;
//   s.clients.arrivals_per_s = 10'000;
//   s.dependency.capacity_per_s = 12'000;
//   s.dependency.failure_fraction = 0.5;
//   keel::sim::ClientPolicy naive{.name = "naive", .retry = {.max_attempts = 4}};
//   auto result = keel::sim::run(s, naive, /*seed=*/1);
//   result.summary.offered_per_s;   // about 18,750
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "keel/core/breaker.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/concurrency_limit.hpp"
#include "keel/core/rate_limit.hpp"
#include "keel/core/retry.hpp"

namespace keel::sim {

/// [start, end) in virtual time from the start of the run. Empty (start == end) by default.
struct Window {
  Duration start{};
  Duration end{};
  [[nodiscard]] constexpr bool empty() const noexcept { return end <= start; }
  [[nodiscard]] constexpr bool contains(Duration t) const noexcept { return t >= start && t < end; }
};

/// The called service.
struct DependencyConfig {
  /// Requests per second it can serve. Requires: > 0. Default 1,000.
  double capacity_per_s = 1000;
  /// Time one request occupies a server. Requires: > 0. Default 10 ms.
  Duration service_time = std::chrono::milliseconds(10);
  /// Requests that may wait for a server; beyond it they are shed at once. Requires: >= 0.
  /// Default 1,000.
  std::int64_t queue_limit = 1000;
  /// Fraction of requests that fail. Requires: in [0, 1]. Default 0.
  double failure_fraction = 0;
  /// When the failure fraction applies. Default: empty, meaning the whole run.
  Window failure_window{};
  /// Failing requests are refused at once without using capacity (true), or cost a full service
  /// time like any other request (false: retries then eat capacity). Default false.
  bool failures_are_free = false;
  /// The failure fraction grows with overload: a request that arrives while the dependency is
  /// saturated (every server busy) fails with probability failure_fraction + overload_failure.
  /// Requires: in [0, 1]. Default 0.
  double overload_failure = 0;
  /// A window during which capacity is multiplied by capacity_drop_factor. Default none.
  Window capacity_drop{};
  /// Requires: in [0, 1]. Default 1.
  double capacity_drop_factor = 1.0;
  /// A window during which every request is refused at once. Default none.
  Window outage{};
  /// When >= 0, requests shed because the queue is full carry this Retry-After. Default none.
  Duration shed_retry_after = Outcome::kNoServerDelay;
  /// Receiver-side admission control, keel::AdmissionLimiter (keel/core/admission.hpp) at the
  /// dependency's front door: when > 0, a retry that arrives while this many requests are in the
  /// dependency (served or queued) is shed at once, without using capacity, with a full-jitter
  /// Retry-After on [0, admission_retry_after_max); a first attempt only once
  /// admission_limit + admission_queue are. Requires: >= 0. Default 0 (none).
  std::int64_t admission_limit = 0;
  /// First attempts admitted beyond admission_limit. Requires: >= 0. Default 0.
  std::int64_t admission_queue = 0;
  /// Upper end of the shed requests' Retry-After. Requires: > 0. Default 1 s.
  Duration admission_retry_after_max = std::chrono::seconds(1);
  /// Adaptive admission (AdmissionOptions::adaptive): the limit retries are shed at is found
  /// from the latency of the requests it admitted (arrival to served), not admission_limit;
  /// first attempts are admitted admission_queue beyond it. Default none.
  std::optional<ConcurrencyLimitOptions> admission_adaptive;
  /// A rate limit at the dependency's front door: a request that arrives when this many were
  /// accepted in the last second is answered 429 at once, without using capacity, with
  /// Retry-After rate_limit_retry_after. Requires: >= 0. Default 0 (none).
  double rate_limit_per_s = 0;
  /// The Retry-After of those 429s. Requires: >= 0. Default 1 s.
  Duration rate_limit_retry_after = std::chrono::seconds(1);
};

/// Who calls.
struct ClientConfig {
  /// Open loop: new operations per second (Poisson arrivals), used when population == 0.
  /// Requires: > 0 when population == 0. Default 1,000.
  double arrivals_per_s = 1000;
  /// Fixed population: this many clients each start one operation at t = 0. Requires: >= 0.
  /// Default 0 (open loop).
  std::int64_t population = 0;
  /// Independent client processes (pods); operations are spread over them round-robin, and each
  /// has its own budget and breaker. Requires: >= 1. Default 1.
  int processes = 1;
  /// Each operation goes to a process drawn uniformly at random (a load balancer's spread, from
  /// its own seeded generator) instead of round-robin. Default false.
  bool random_process = false;
  /// Layers of services between the client and the dependency, each retrying with the same
  /// policy (1: the client calls the dependency directly). Requires: in [1, 8]. Default 1.
  int layers = 1;
};

/// Per-process state a policy may attach to each call (budget, breaker): built once per client
/// process by ClientPolicy::make_call_context, and asked to fill the CallOptions of each
/// operation. Not thread-safe: one per process of one run.
class CallContext {
 public:
  virtual ~CallContext() = default;
  /// Adds this process's shared objects (a budget, a breaker) to an operation's options.
  virtual void apply(CallOptions& call, int layer) = 0;
  /// 0 closed, 1 open, 2 half-open; -1 when the context has no breaker.
  [[nodiscard]] virtual int breaker_state() const { return -1; }
  /// The breaker apply() hands to the process's calls to the dependency; nullptr for none.
  [[nodiscard]] virtual CircuitBreaker* breaker() { return nullptr; }
};

/// Breakers a fleet shares (the processes of a run learn from each other through a shared
/// store, as keel's PostgreSQL-shared breakers do). When one process's breaker opens by itself
/// (a trip, or a failed half-open probe), that process becomes the fleet's prober and every other
/// process's breaker is forced open (CircuitBreaker::force_open) `propagation` later, until the
/// prober's probe time plus the breaker's half_open_timeout (a safety net: by then the probe's
/// answer has normally arrived). The fleet shares that one probe time: the first process to call
/// after it takes the probe (its breaker is forced open with the break over, so its call is the
/// half-open trial, and the former prober is held like the rest), so the fleet sends one probe per
/// break; when the probe closes its breaker, every other breaker is closed (reset) `propagation`
/// later; when the probe fails, the new break is propagated the same way. A process whose own
/// breaker trips while the fleet is already open adopts the fleet's break at once. Each process
/// keeps its own core CircuitBreaker: only these forced transitions are added.
struct SharedBreakers {
  /// How long the word takes to reach the other processes. Requires: >= 0 and < the breaker's
  /// break_duration. Default 500 ms (the real design's bound is 1 s).
  Duration propagation = std::chrono::milliseconds(500);
};

/// How each client retries: a name and core's RetryOptions (its on_retry and on_give_up hooks are
/// called as in production, in virtual time), plus optional per-process state (budgets and
/// breakers from keel::core).
struct ClientPolicy {
  std::string name;
  RetryOptions retry{};
  /// Builds the per-process context; empty for none. Called with the run's clock.
  std::function<std::unique_ptr<CallContext>(Clock& clock)> make_call_context;
  /// keel's one-retrying-layer rule: operations of lower layers start inside their top-level
  /// operation's keel::RetryContext and so make a single attempt (CallOptions::nested
  /// kSingleAttempt). When false, every layer retries as configured (NestedRetries::kRetry) and
  /// the layers multiply. Default false.
  bool one_retrying_layer = false;
  /// The processes' breakers (CallContext::breaker) behave as one fleet breaker; see
  /// SharedBreakers. Default none: each process's breaker decides alone.
  std::optional<SharedBreakers> shared_breakers;
  /// Each process limits its calls in flight to the dependency with a keel::
  /// AdaptiveConcurrencyLimit of these options (a fixed limit: min_limit = max_limit =
  /// initial_limit). An attempt over the limit is not sent and not spent: it asks again after
  /// the limit's retry_in, jittered (keel::jittered). Default none.
  std::optional<ConcurrencyLimitOptions> concurrency_limit;
  /// Each process spaces its calls to the dependency with a keel::RateLimit of these options,
  /// and pauses it for a 429's Retry-After; an attempt waits for its slot (not spent).
  /// Default none.
  std::optional<RateLimitOptions> rate_limit;
  /// With rate_limit: one bucket and one pause for the whole fleet (the shared bucket of
  /// keel::store::SharedBreakers, without its chunks' granularity), instead of one per process.
  /// Default false.
  bool shared_rate_limit = false;
};

struct Scenario {
  std::string name = "custom";
  DependencyConfig dependency{};
  ClientConfig clients{};
  /// Virtual time simulated. Requires: > 0. Default 60 s.
  Duration duration = std::chrono::seconds(60);
  /// Width of one time-series slice. Requires: > 0 and <= duration. Default 1 s.
  Duration slice = std::chrono::seconds(1);
  /// The part of the run averaged for offered_per_s. Default empty: the whole run.
  Window steady{};
  /// When the trigger (outage, capacity drop) ends; recovery is measured from here. Default 0:
  /// no trigger, and Summary::recovered then means every slice was healthy.
  Duration trigger_end{};
  /// A slice is healthy when at least this fraction of the attempts that ended in it succeeded
  /// (a slice where none ended is healthy). Requires: in (0, 1]. Default 0.9.
  double healthy_ratio = 0.9;
};

/// Counters for one slice of virtual time. "Attempts" are calls that reach the dependency.
struct Slice {
  std::int64_t offered = 0;          // attempts sent to the dependency
  std::int64_t first_attempts = 0;   // operations started by the top-level clients
  std::int64_t retries = 0;          // attempts at the dependency that were not a first attempt
  std::int64_t successes = 0;        // attempts that succeeded (as the client saw them)
  std::int64_t failures = 0;         // attempts that failed (refused, failed, shed, timed out)
  std::int64_t timeouts = 0;         // of the failures, attempts abandoned at their timeout
  std::int64_t shed = 0;             // of the failures, refused: queue full or admission limit
  std::int64_t wasted = 0;           // requests served after their client had given up on them
  std::int64_t ops_succeeded = 0;    // top-level operations that ended in success
  std::int64_t ops_failed = 0;       // top-level operations that gave up
  std::int64_t queue_max = 0;        // longest queue seen in the slice
  std::int64_t breakers_closed = 0;  // client processes whose breaker was closed at slice end
  std::int64_t breakers_open = 0;
  std::int64_t breakers_half_open = 0;
  std::int64_t limited = 0;    // attempts held back by the client's own limits (not sent)
  std::int64_t throttled = 0;  // requests answered 429 by the dependency's rate limit
  std::int64_t served_ok = 0;  // requests the dependency served successfully (goodput)
};

struct Summary {
  std::int64_t first_attempts = 0;  // top-level operations started
  std::int64_t total_calls = 0;     // attempts that reached the dependency (the bottom layer)
  std::int64_t layer_calls = 0;     // attempts at every layer, bottom included
  double amplification = 0;         // total_calls / first_attempts
  double offered_per_s = 0;         // mean attempts per second over the steady window
  std::int64_t peak_per_slice = 0;
  std::int64_t peak_retries_per_slice = 0;
  Duration peak_slice_start{};  // start of the slice with the most attempts
  std::int64_t ops_succeeded = 0;
  std::int64_t ops_failed = 0;
  std::int64_t wasted = 0;
  std::int64_t outage_calls = 0;     // attempts that reached the dependency during its outage
  std::int64_t probes = 0;           // attempts admitted as a breaker's half-open trial
  std::int64_t breaker_opens = 0;    // breaks: a process's breaker opening by itself (a trip or a
                                     // failed probe); with shared breakers, the fleet's breaks
  bool recovered = false;            // every slice from some point after trigger_end was healthy
  std::optional<Duration> recovery;  // from trigger_end to the first slice of that healthy run
  /// The same for operations: from trigger_end to the first slice from which every slice has at
  /// least healthy_ratio of the top-level operations that ended in it succeeding (an operation
  /// refused by an open breaker counts as failed). nullopt when that never happens.
  std::optional<Duration> ops_recovery;
  std::optional<Duration> p50_latency;  // of successful top-level operations
  std::optional<Duration> p99_latency;
  /// Of the requests the dependency served (arrival to served: its queue and service time).
  std::optional<Duration> served_p50_latency;
  std::optional<Duration> served_p99_latency;
  double goodput_per_s = 0;    // served_ok per second over the steady window
  std::int64_t limited = 0;    // attempts held back by the client's own limits
  std::int64_t throttled = 0;  // 429s of the dependency's rate limit
  std::int64_t events = 0;     // events processed (for benchmarks)
};

struct Result {
  std::vector<Slice> slices;
  Summary summary;
};

/// The seed of a run's jitter generator (the keel::Rng handed to every RetryState through
/// CallOptions::rng) for run seed `seed`: replaying it through keel::retry gives the same delays.
[[nodiscard]] std::uint64_t jitter_seed(std::uint64_t seed) noexcept;

/// Throws std::invalid_argument naming the field and value when a Requires line is broken.
void validate(const Scenario& scenario);

/// Runs the scenario with every client following `policy`. Deterministic for a given seed.
/// Throws std::invalid_argument for an invalid scenario or policy (see validate()).
[[nodiscard]] Result run(const Scenario& scenario, const ClientPolicy& policy, std::uint64_t seed);

}  // namespace keel::sim
