// Circuit breakers: stop calling a dependency that is failing, give it room to recover, then
// probe it with a few trial calls. One breaker per dependency (host, or host plus endpoint
// group), never one global breaker: one broken endpoint must not block another.
//
//   closed     calls run; their outcomes fill a sliding window. The breaker trips (opens) when
//              the window holds >= minimum_calls AND (failure rate >= failure_rate_threshold OR
//              slow-call rate >= slow_call_rate_threshold). A call counts only in the closed
//              period it was admitted in: one admitted before the breaker last opened (in flight
//              across a break, or across a fleet's close) is not counted when it reports later.
//   open       calls are refused without running, for break_duration (optionally growing on
//              repeated trips, capped at max_break_duration).
//   half-open  exactly half_open_trials calls are admitted; when all have reported, a failure
//              rate >= the threshold re-opens the breaker, anything else closes it. If the trials
//              do not all report within half_open_timeout the breaker re-opens (it never sticks).
//
// Permanent failures (a 400: the caller's fault) count as calls that did not fail; throttling
// (429, 503), transient and ambiguous failures count as failures (keel::is_dependency_failure).
// See docs/breakers.md for the windows and the defaults of resilience4j and Polly.
//
// Thread-safety: CircuitBreaker is safe for concurrent use and lock-free. In closed state,
// try_acquire() is one atomic load and record() of a success touches per-thread stripes of the
// time window (or the ring of a count window), takes no lock and allocates nothing.
// BreakerRegistry is safe for concurrent use (a shared mutex around its map; cache the returned
// pointer on hot paths).
//
// Example:
//   // "more than half of the calls in the last 30 s failed" -> fail fast
//   keel::CircuitBreaker breaker(keel::BreakerOptions::more_than_half_failed(30s, 10));
//   keel::CallOptions call;
//   call.breaker = &breaker;                  // r.reason == kCircuitOpen while it is open
//   auto r = keel::retry(policy, attempt, call);
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "keel/core/classify.hpp"
#include "keel/core/clock.hpp"

namespace keel {

enum class BreakerState : unsigned char { kClosed, kOpen, kHalfOpen };

/// "closed", "open", "half-open".
[[nodiscard]] std::string_view to_string(BreakerState state) noexcept;

/// How the closed state's window is measured.
enum class BreakerWindow : unsigned char {
  kCount,  // the last window_calls calls
  kTime,   // the calls of the last window_length, in window_buckets steps
};

struct BreakerOptions {
  /// Count-based or time-based window. Default kTime.
  BreakerWindow window = BreakerWindow::kTime;
  /// Size of a count window. Requires: in [1, 100000]. Default 100 (resilience4j).
  int window_calls = 100;
  /// Length of a time window. Requires: >= 1 ms. Default 30 s (Polly's sampling duration).
  Duration window_length = std::chrono::seconds(30);
  /// A time window slides in this many steps. Requires: in [1, 1000]. Default 10 (Polly).
  int window_buckets = 10;
  /// No trip before the window holds this many calls. Requires: >= 1. Default 20.
  int minimum_calls = 20;
  /// Trip when failures / calls >= this. Requires: in (0, 1]. Default 0.5 (resilience4j).
  double failure_rate_threshold = 0.5;
  /// Trip only when the rate is strictly above the threshold ("more than half"). Default false.
  bool trip_only_above_threshold = false;
  /// A call at least this long is slow. Requires: > 0. Default kInfinite (slow calls not
  /// tracked; no clock read when the call starts).
  Duration slow_call_duration = kInfinite;
  /// Trip when slow calls / calls >= this. Requires: in (0, 1]. Default 1.0 (resilience4j).
  double slow_call_rate_threshold = 1.0;
  /// How long the breaker stays open after a trip. Requires: >= 1 ms. Default 5 s (Polly).
  Duration break_duration = std::chrono::seconds(5);
  /// Each consecutive trip without a close multiplies the break by this. Requires: >= 1.
  /// Default 1 (fixed break).
  double break_growth = 1.0;
  /// Cap on the grown break. Requires: >= break_duration. Default 60 s.
  Duration max_break_duration = std::chrono::seconds(60);
  /// Trial calls admitted in half-open. Requires: in [1, 10000]. Default 1 (Polly).
  int half_open_trials = 1;
  /// Half-open gives up waiting for its trials after this and re-opens. Requires: >= 1 ms.
  /// Default 30 s.
  Duration half_open_timeout = std::chrono::seconds(30);
  /// Where time comes from. keel::coarse_clock() suffices for second-long windows and is much
  /// cheaper to read. Default keel::steady_clock(); with it, record() places a call in a time
  /// window's buckets of 100 ms or more by keel::coarse_clock() (the same monotonic time at the
  /// kernel tick's resolution, 1-10 ms), while breaks, trial timeouts and slow calls keep the
  /// steady clock's precision. Requires: outlives the breaker.
  Clock* clock = nullptr;
  /// Called on every state change, on the thread that made it, with no lock held. Default none.
  std::function<void(BreakerState from, BreakerState to)> on_state_change;
  /// Asked, on the calling thread with no lock held, each time the breaker is about to admit a
  /// half-open trial: zero lets the trial run; a positive duration means somebody else runs the
  /// trial (a fleet's one probe per break, see keel::store::SharedBreakers), and the breaker goes
  /// back to open for that long without counting a trip, refusing the call. It may block for one
  /// bounded round trip; it must not call back into this breaker. An exception counts as zero.
  /// Default none (every trial runs).
  std::function<Duration()> trial_gate;

  /// The seeds' rule: open when more than half of the calls in the last `window` failed (and at
  /// least `minimum_calls` were made).
  [[nodiscard]] static BreakerOptions more_than_half_failed(
      Duration window = std::chrono::seconds(30), int minimum_calls = 10);
};

/// Whether a call may run, and what record() needs to attribute its outcome.
struct BreakerPermit {
  bool allowed = false;
  bool trial = false;            // admitted as a half-open trial
  std::uint32_t generation = 0;  // the state generation it was admitted in (closed or half-open)
  TimePoint started{};           // when slow calls are tracked
  [[nodiscard]] explicit operator bool() const noexcept { return allowed; }
};

/// A point-in-time view, for health checks and metrics.
struct BreakerSnapshot {
  BreakerState state = BreakerState::kClosed;
  std::int64_t calls = 0;     // in the window
  std::int64_t failures = 0;  // in the window
  std::int64_t slow = 0;      // in the window
  Duration open_remaining{};  // until half-open, when open
  int consecutive_trips = 0;
  /// Half-open trials that ran and reported an outcome since the breaker was made: the probes it
  /// sent. A moment held open by the trial gate, or a trial released unattempted, is not one.
  std::int64_t probes = 0;
  /// failures / calls in the window; 0 when the window is empty.
  [[nodiscard]] double failure_rate() const noexcept {
    return calls > 0 ? static_cast<double>(failures) / static_cast<double>(calls) : 0.0;
  }
};

class CircuitBreaker {
 public:
  /// Throws std::invalid_argument naming the field and value when a Requires line is broken.
  explicit CircuitBreaker(BreakerOptions options = {});
  ~CircuitBreaker();
  CircuitBreaker(const CircuitBreaker&) = delete;
  CircuitBreaker& operator=(const CircuitBreaker&) = delete;

  /// Asks to run one call. Refused while open, and in half-open once the trials are taken.
  /// May move open -> half-open (break elapsed) or half-open -> open (trials timed out).
  [[nodiscard]] BreakerPermit try_acquire() noexcept;

  /// Reports the outcome of a call run under `permit` (ignored when !permit.allowed). Latency is
  /// measured from the permit when slow calls are tracked. A call admitted while closed counts
  /// only if the breaker has not left that closed period since: a report after a trip, or after
  /// the breaker opened and closed again, is ignored (the call met the dependency as it was
  /// before the break, and a failure of it says nothing of the dependency since).
  void record(const BreakerPermit& permit, const Outcome& outcome) noexcept;
  /// As above with a latency measured by the caller.
  void record(const BreakerPermit& permit, const Outcome& outcome, Duration latency) noexcept;

  /// Gives a permit back for a call that did not run or was cancelled before it ended: nothing
  /// is counted, and a half-open trial's slot is free for another call. record() of an outcome
  /// that is not attempted does the same. Ignored when !permit.allowed.
  void release(const BreakerPermit& permit) noexcept;

  /// How long until the breaker may admit a call: zero when closed or when a half-open trial is
  /// free; the rest of the break when open; while every half-open trial is out, a tenth of the
  /// break (the trials' answers decide soon), at most what is left of half_open_timeout.
  [[nodiscard]] Duration retry_in() const noexcept;

  /// The state now (an open breaker whose break has elapsed reports half-open).
  [[nodiscard]] BreakerState state() const noexcept;
  [[nodiscard]] BreakerSnapshot snapshot() const noexcept;
  /// Forces the closed state with an empty window.
  void reset() noexcept;
  /// Forces the open state for `break_for` from now, whatever the state: for a fleet whose
  /// processes share what their breakers learn (another process's breaker for this dependency
  /// opened, or the fleet's one probe failed), so this process stops calling without tripping
  /// on its own calls. It counts as a trip (consecutive_trips + 1); on_state_change is called
  /// unless the breaker was already open. When the break is over the breaker goes half-open as
  /// after any trip. A break <= 0 leaves the breaker open with its break already over (the next
  /// call is a half-open trial).
  void force_open(Duration break_for) noexcept;

  /// Makes this breaker one of `processes` that share what their breakers learn (a fleet, see
  /// keel::store::SharedBreakers): its window holds about 1/processes of the fleet's calls to
  /// the dependency, so it judges after ceil(minimum_calls / processes) calls of its own (never
  /// fewer than 3, nor than minimum_calls when that is smaller) and the fleet as a whole trips
  /// after about minimum_calls calls, as one process would. The failure rate is still measured
  /// over every call in the window. Values < 1 count as 1 (alone, the default).
  void set_fleet_size(int processes) noexcept;
  /// The calls this breaker needs in its window before it may trip: minimum_calls, or less in a
  /// fleet (set_fleet_size).
  [[nodiscard]] int minimum_calls() const noexcept {
    return minimum_calls_.load(std::memory_order_relaxed);
  }

  [[nodiscard]] const BreakerOptions& options() const noexcept { return options_; }

 private:
  struct Window;
  void record_closed(const BreakerPermit& permit, bool failure, bool slow, TimePoint now) noexcept;
  void record_trial(const BreakerPermit& permit, bool failure) noexcept;
  bool transition(std::uint64_t from_word, BreakerState to, TimePoint now) noexcept;
  [[nodiscard]] bool gate_allows_trial(std::uint64_t half_open_word) noexcept;
  [[nodiscard]] bool should_trip(std::int64_t calls, std::int64_t failures,
                                 std::int64_t slow) const noexcept;
  [[nodiscard]] Duration break_for(int trips) const noexcept;
  [[nodiscard]] std::uint64_t to_ticks(TimePoint t) const noexcept;
  [[nodiscard]] TimePoint from_ticks(std::uint64_t ticks) const noexcept;

  BreakerOptions options_;
  Clock* clock_;
  Clock* window_clock_;  // places calls in a time window's buckets (see BreakerOptions::clock)
  TimePoint origin_{};
  std::int64_t failure_ppm_ = 0;
  std::int64_t slow_ppm_ = 0;
  bool track_slow_ = false;
  std::unique_ptr<Window> window_;
  // [state:2][generation:22][ms:40]: the state, a counter of transitions, and when the state
  // ends (open: end of the break; half-open: trial timeout), in ms since origin_ (34 years).
  alignas(64) std::atomic<std::uint64_t> state_word_;
  // [generation:22][admitted:14][successes:14][failures:14] of the current half-open round.
  alignas(64) std::atomic<std::uint64_t> trials_word_{0};
  std::atomic<int> consecutive_trips_{0};
  std::atomic<std::int64_t> probes_{0};
  std::atomic<int> minimum_calls_;  // options_.minimum_calls, or less in a fleet
};

// ---------------------------------------------------------------------------------------------

struct BreakerRegistryOptions {
  /// Options of every breaker the registry creates (its on_state_change is replaced by the
  /// registry's listeners).
  BreakerOptions breaker = {};
  /// At most this many keys. At the bound, the least recently created closed breaker is
  /// evicted (holders keep theirs alive); when every breaker is open or half-open, get()
  /// returns nullptr rather than share a breaker between dependencies. Requires: >= 1.
  /// Default 1024.
  std::size_t max_keys = 1024;
};

/// A listener on a registry: key, old state, new state.
using BreakerListener =
    std::function<void(std::string_view key, BreakerState from, BreakerState to)>;

/// A registry-wide trial gate: BreakerOptions::trial_gate for the breaker of `key`.
using BreakerTrialGate = std::function<Duration(std::string_view key)>;

/// Breakers keyed by dependency: "host" or "host/endpoint-group". Each key gets its own
/// breaker, so one broken endpoint cannot block another.
class BreakerRegistry {
 public:
  /// Throws std::invalid_argument when options are invalid (see BreakerOptions, max_keys).
  explicit BreakerRegistry(BreakerRegistryOptions options = {});
  ~BreakerRegistry();
  BreakerRegistry(const BreakerRegistry&) = delete;
  BreakerRegistry& operator=(const BreakerRegistry&) = delete;

  /// The breaker of `key`, created on first use. nullptr only when the registry is full of
  /// open or half-open breakers (see max_keys). The pointer stays valid while held.
  [[nodiscard]] std::shared_ptr<CircuitBreaker> get(std::string_view key);
  /// The breaker of `key` if it exists.
  [[nodiscard]] std::shared_ptr<CircuitBreaker> find(std::string_view key) const;
  /// The state of `key` (nullopt when unknown), for health checks.
  [[nodiscard]] std::optional<BreakerState> state(std::string_view key) const;
  /// Every key with its snapshot, sorted by key.
  [[nodiscard]] std::vector<std::pair<std::string, BreakerSnapshot>> snapshot() const;
  [[nodiscard]] std::size_t size() const;
  /// Breakers evicted at the key bound so far.
  [[nodiscard]] std::uint64_t evictions() const noexcept {
    return evictions_.load(std::memory_order_relaxed);
  }

  /// Adds a listener called on every state change of every breaker, on the thread that made the
  /// change, and returns its id for remove_listener. Requires: the listener does not call
  /// add_listener or remove_listener.
  std::uint64_t add_listener(BreakerListener listener);
  /// Removes the listener `id` (nothing when unknown). When it returns, the listener is not
  /// running and will not be called again. Requires: not called from a listener.
  void remove_listener(std::uint64_t id);

  /// The options it was made with: BreakerRegistryOptions::breaker are every breaker's (a shared
  /// state read back from elsewhere is bounded by them: keel::store::SharedBreakers).
  [[nodiscard]] const BreakerRegistryOptions& options() const noexcept { return options_; }

  /// set_fleet_size(processes) on every breaker of the registry, those created later included.
  void set_fleet_size(int processes);
  [[nodiscard]] int fleet_size() const noexcept { return fleet_size_.load(); }

  /// Installs the trial gate of every breaker of the registry, those created already included
  /// (BreakerOptions::trial_gate; the registry's options' own gate is replaced). An empty gate
  /// removes it; when it returns, the old gate is not running. Requires: not called from a gate.
  void set_trial_gate(BreakerTrialGate gate);

 private:
  struct Entry {
    std::shared_ptr<CircuitBreaker> breaker;
    std::uint64_t created = 0;
  };
  struct Listeners;
  struct Gate;
  struct StringHash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const noexcept {
      return std::hash<std::string_view>{}(s);
    }
  };
  BreakerRegistryOptions options_;
  std::shared_ptr<Listeners> listeners_;
  std::shared_ptr<Gate> gate_;
  mutable std::shared_mutex mutex_;
  // Guarded by mutex_.
  std::unordered_map<std::string, Entry, StringHash, std::equal_to<>> entries_;
  std::uint64_t created_ = 0;  // guarded by mutex_
  std::atomic<std::uint64_t> evictions_{0};
  std::atomic<int> fleet_size_{1};
};

}  // namespace keel
