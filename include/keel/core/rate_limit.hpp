// A dependency's rate limit on the calling side: a token bucket per dependency ("host:port" or a
// name) that spaces calls so that the dependency is never sent more than it allows, and a pause
// that holds every call to it until a time the dependency named (a 429 or 503 with Retry-After).
// A call asks for a slot before it is sent: it goes at once, goes after a short wait (its slot
// is reserved), or is told when to ask again; nothing is sent and no attempt is spent meanwhile.
//
// The bucket is a schedule (GCRA, the virtual-scheduling form of a token bucket): slot k goes at
// t0 + k / rate, and up to `burst` slots (none by default) may be taken early. So no window of
// one second holds more than rate + burst calls, and waiting callers go in order, spaced, not
// together.
//
// A fleet (keel::store::SharedBreakers with rate limits attached) keeps one schedule for all its
// processes: each process leases small chunks of slots from the fleet's row and spends them
// locally (add_chunk); it asks for the next chunk before the last is spent (RateLimitFleet::
// want), so a call waits on the fleet only when a chunk is late, and then at most one bounded
// round trip (RateLimitFleet::lease). When the fleet cannot answer, each process keeps its
// equal share of the rate (set_share) until it can. A pause published by any process holds
// every process's calls; each caller is released at a random moment within release_spread after
// its end, so the dependency is not met by the whole fleet at once.
//
// Thread-safety: RateLimit and RateLimitRegistry are safe for concurrent use (one mutex per
// dependency, held for a few instructions: a rate limit is for calls that go at most thousands
// of times a second; see AdaptiveConcurrencyLimit for a lock-free limit).
//
// Example:
//   keel::RateLimitRegistry limits({.rate_per_s = 50});
//   auto limit = limits.get("api.example.com:443");
//   for (;;) {
//     const keel::RateDecision d = limit->reserve(clock.now(), /*max_wait=*/2s, rng);
//     if (d.go) { clock.sleep_for(d.wait); send(); break; }
//     if (d.wait > 2s) { defer(d.wait); break; }  // over the limit for longer than we wait
//     clock.sleep_for(d.wait);                       // paused: ask again then
//   }
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>

#include "keel/core/classify.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/random.hpp"

namespace keel {

struct Outcome;

struct RateLimitOptions {
  /// Calls per second allowed to the dependency (the whole fleet's, when shared). 0: no rate
  /// limit, only pauses. Requires: 0, or in [kMinRatePerS, 1e6]. Default 0.
  double rate_per_s = 0;
  /// Slots that may be taken ahead of the schedule (a burst after a quiet spell): no window of
  /// one second holds more than rate_per_s + burst calls. A dependency that counts its limit per
  /// second answers 429 to what goes over it, so the default is none: a call never goes before
  /// its slot, and no sliding second holds more than the rate (one call, at the lowest rates).
  /// Requires: 0 or in [1, 1e6]. Default 0.
  double burst = 0;
  /// The part of the rate left unused, for the jitter between a call's slot and its arrival at
  /// the dependency (a timer that wakes late, a busy network): calls are spaced at
  /// rate_per_s x (1 - headroom), so that a dependency that counts strictly per second does not
  /// see a late call and an early one in the same second. Requires: in [0, 0.5). Default 0.03
  /// (2% let 8 processes sharing 50/s on a loaded 2-core machine draw 0.7-2.6% 429s from an
  /// API counting strictly per second; 3% drew 0-0.3%).
  double headroom = 0.03;
  /// The longest pause a Retry-After (or a fleet's row) can impose; a longer one is cut to this.
  /// Requires: > 0. Default 60 s.
  Duration max_pause = std::chrono::seconds(60);
  /// Callers held by a pause go at a uniformly random moment within this after its end (core's
  /// jitter, drawn per caller). Requires: >= 0. Default 1 s.
  Duration release_spread = std::chrono::seconds(1);
  /// Called once per limit, the first time a pause asked for is longer than max_pause and cut
  /// to it (the dependency's advice, the cap): for a log line. Optional; called without the
  /// limit's lock held.
  std::function<void(std::string_view key, Duration asked, Duration cap)> on_pause_cut;
};

/// The smallest rate RateLimitOptions::rate_per_s may have other than 0: one call a day. A lower
/// rate is refused rather than kept (its interval is longer than any process lives, and far
/// lower ones overflow a clock's range: no limit in practice).
inline constexpr double kMinRatePerS = 1.0 / 86400;

/// The pause a dependency's answer asks of its rate limit: a throttled answer (HTTP 429 or 503,
/// or a user's throttled outcome) with a Retry-After longer than zero. None for anything else: a
/// Retry-After of 0 or none pauses nothing, and the attempt is charged and backed off by core's
/// retry decision like any other throttled answer (so that "come back at once" cannot become an
/// endless loop of uncharged attempts). The one rule for every driver of a RateLimit.
[[nodiscard]] std::optional<Duration> pause_asked(const Outcome& outcome) noexcept;

/// The answer to RateLimit::reserve.
struct RateDecision {
  /// true: a slot is reserved; send after `wait` (zero: now). false: nothing is reserved; ask
  /// again after `wait` (the pause's end with its jitter, or when a slot would come).
  bool go = true;
  Duration wait{};
  /// false and paused: held by a pause (Retry-After), not by the rate.
  bool paused = false;
  /// go: the latest moment the call may leave on this slot (the slot's time plus the limit's
  /// lateness; TimePoint::max() without a rate). A call that would leave later gives the slot
  /// up and asks again (RateLimit::on_time): sent that late, it would land in the next
  /// window beside that window's own calls.
  TimePoint spend_by = TimePoint::max();
};

/// Whether a call that a limit refused (RateLimit::reserve: not go, its turn further than the
/// call has left of its wait) gave up in the limit's line: not paused, and its turn within
/// `max_wait`, a call's whole wait, so that a new call would wait for its own turn. The one rule
/// for every driver of a RateLimit, and what Outcome::in_line says:
/// - In line: the call's job comes back at its turn, and its queue's worker goes on leasing, so
///   that the line keeps calls in it. Held for the turn instead, every worker of a fleet whose
///   jobs began together stopped leasing for 1-2 s at once, and 0.6-0.9 s of a 5/s schedule
///   passed with no call asking.
/// - Not in line (a pause, or a turn longer than any call waits: an hourly quota's next slot):
///   every new call would be refused until then, and the worker holds its leasing.
[[nodiscard]] bool waits_in_line(const RateDecision& refused, Duration max_wait) noexcept;

/// What a fleet does for a RateLimit (keel::store::SharedBreakers implements it). Called
/// without the limit's lock held.
class RateLimitFleet {
 public:
  virtual ~RateLimitFleet() = default;
  /// The limit has few slots left: lease the next chunk in the background (never blocks).
  virtual void want(std::string_view key) = 0;
  /// The limit has no slot: lease a chunk now, waiting at most one bounded round trip; returns
  /// whether a chunk was added (RateLimit::add_chunk) or the fleet's schedule is full for a
  /// while (RateLimit::full_until). false: the fleet did not answer in time; the call is told to
  /// come back, and goes on this process's share of the rate once the fleet has answered nothing
  /// for RateLimit::kUnansweredBeforeShare (RateLimit::reserve).
  virtual bool lease(std::string_view key) = 0;
  /// The limit was paused by this process (a Retry-After): tell the fleet (never blocks).
  virtual void paused(std::string_view key, TimePoint until) = 0;
};

/// Counters since the limit was built.
struct RateLimitStats {
  std::uint64_t went = 0;     // slots reserved
  std::uint64_t waited = 0;   // of those, with a wait
  std::uint64_t refused = 0;  // calls told to ask again later (paused, or too long a wait)
  std::uint64_t pauses = 0;   // pauses this limit started or extended (own or the fleet's)
  std::uint64_t pauses_from_fleet = 0;  // of those, told by the fleet (another process's)
  std::uint64_t chunks = 0;             // chunks of the fleet's schedule added
  std::uint64_t on_share = 0;        // slots taken on the local share (fleet out or not answering)
  std::uint64_t slots_lost = 0;      // leased slots that passed unused
  std::uint64_t slots_late = 0;      // slots given up: their call could not leave in time
  std::uint64_t pauses_cut = 0;      // pauses asked for longer than max_pause, cut to it
  std::uint64_t fleet_failures = 0;  // leases the fleet answered with a failure (on the share)
  std::uint64_t fleet_busy = 0;      // busy answers, and calls whose lease had no answer in
                                     // time: told to come back, not on the share
};

// ---------------------------------------------------------------------------------------------
// The fleet's schedule of one rate, decided here and stored by a driver (keel::store::
// SharedBreakers keeps it in a row of keel_rate_limits and runs this decision in the row's
// transaction). Times are microseconds on the store's clock.

/// A stored schedule.
struct RateScheduleRow {
  /// The first slot not leased yet; none for a new row, or one whose value is not a time.
  std::optional<std::int64_t> next_slot_us;
  /// The lowest rate (calls per second, spaced) a process asserted within the assertion's
  /// life (rate_life); 0 when none (a new row, or one written by an older keel).
  double rate_per_s = 0;
  /// When that rate was last asserted.
  std::int64_t rate_at_us = 0;
};

/// One process's request for a chunk of the schedule.
struct RateLeaseAsk {
  std::int64_t now_us = 0;
  /// This process's rate, spaced (RateLimit::spaced_rate). Requires: > 0.
  double rate_per_s = 0;
  /// Slots wanted; the chunk holds at most the rate's chunk (rate_chunk). Requires: >= 1.
  std::int64_t count = 1;
  /// Slots the schedule may start behind now (a quiet spell's burst; RateLimitOptions::burst).
  /// Requires: >= 0.
  double burst = 0;
  /// How far ahead of now a chunk may start. Requires: > 0.
  std::int64_t horizon_us = 1'000'000;
  /// How far ahead of now the calls waiting for this lease can take a slot
  /// (RateLimit::lease_reach): a chunk starting later is not granted, and left in the schedule
  /// for a process whose calls can wait for it. The schedule's room is then asked for again
  /// when its end comes within the reach. At most horizon_us counts.
  std::int64_t reach_us = INT64_MAX;
};

/// The decision: the row to store, and the chunk granted or when to ask again.
struct RateLeaseAnswer {
  RateScheduleRow row;
  bool granted = false;
  std::int64_t start_us = 0;     // granted: the chunk's first slot
  std::int64_t interval_ns = 0;  // granted: between its slots (the fleet's rate)
  std::int64_t count = 0;        // granted: its slots
  std::int64_t retry_in_us = 0;  // not granted: when the schedule has room for a chunk
  double rate_per_s = 0;         // the rate the fleet keeps: the lowest asserted
  /// next_slot was not a time the schedule can hold (beyond the horizon and the longest chunk,
  /// or absent from an existing row): read as now and rewritten.
  bool slot_out_of_domain = false;
  /// The stored rate was not a rate (<= 0, not finite, above 1e6): replaced by this process's.
  bool rate_out_of_domain = false;
  /// Another process asserts a lower rate for this dependency: the fleet keeps it.
  bool lower_rate_kept = false;
};

/// The slots of the longest chunk of a rate: max(1, min(1000, rate / 10)), a tenth of a second.
[[nodiscard]] std::int64_t rate_chunk(double rate_per_s) noexcept;
/// How long a process's assertion of its rate is kept without being renewed: ten seconds, or
/// three of the rate's longest chunks when longer (an hourly quota's process leases rarely).
[[nodiscard]] std::int64_t rate_life_us(double rate_per_s) noexcept;
/// A lease of `ask` against `row`: pure, for a driver to run in the row's transaction.
[[nodiscard]] RateLeaseAnswer decide_rate_lease(const RateScheduleRow& row,
                                                const RateLeaseAsk& ask) noexcept;

class RateLimitRegistry;

/// One dependency's bucket and pause.
class RateLimit {
 public:
  /// Throws std::invalid_argument naming the field and value when a Requires line is broken.
  explicit RateLimit(RateLimitOptions options = {}, std::string key = {});
  RateLimit(const RateLimit&) = delete;
  RateLimit& operator=(const RateLimit&) = delete;

  /// Asks for a slot at `now`. Takes the slot only when it comes within `max_wait` of now
  /// (go, with its wait); otherwise nothing is taken (not go, with when to ask again). While
  /// paused: not go, with the pause's end plus a uniform draw on [0, release_spread) from
  /// `gen`. With a fleet attached and sharing, the slot comes from the fleet's chunks, and an
  /// empty bucket asks the fleet (RateLimitFleet::lease) before it falls back on its share.
  [[nodiscard]] RateDecision reserve(TimePoint now, Duration max_wait, BitGenRef gen);

  /// The call that reserved `d` leaves at `now`: whether it still may (now <= d.spend_by). A
  /// slot whose call cannot leave in time (a thread woken late, a wait for a concurrency
  /// permit) is given up, counted in stats().slots_late, and the call asks reserve() again.
  /// So every call leaves within the lateness after its slot, however late its thread runs,
  /// and no window holds more than the rate. The one rule for every driver of a RateLimit.
  [[nodiscard]] bool on_time(const RateDecision& d, TimePoint now);

  /// Holds every call until now + `duration` (cut to max_pause), unless already held longer.
  /// `announce`: this process learnt it (a Retry-After) and tells the fleet; false when the
  /// fleet told it. Returns whether the pause started or grew.
  bool pause(TimePoint now, Duration duration, bool announce = true);
  /// The end of the pause; a time not after now when none.
  [[nodiscard]] TimePoint paused_until() const;

  /// The fleet's answer to a lease: `count` slots of its schedule, the first `start_in` from
  /// `now` (negative: already due), one every `interval` (0: this limit's spaced rate; the
  /// fleet's when it keeps a lower rate than this process's).
  void add_chunk(TimePoint now, Duration start_in, std::int64_t count, Duration interval = {});
  /// The fleet could not lease (an error other than no answer), for `failure` (the error's
  /// class: classify_database_sqlstate). The one rule for every driver:
  /// - kBusy or kConflict (a row lock or statement timeout, a lost race): other processes are
  ///   leasing the schedule, so it is live, and slots taken on a share would come on top of the
  ///   ones they spend. The calls are told to come back, and the fleet is asked again, at
  ///   `now + in`, as when the schedule is full; for kBusyLeasesInARow failures in a row at most.
  /// - Any other failure (a permission, the schema, an unreachable database), and busy past that
  ///   (a lock held, not contended): the calls go on this process's share until `now + in`.
  /// Returns whether the calls went on the share.
  bool fleet_failed(TimePoint now, Duration in,
                    DatabaseFailure failure = DatabaseFailure::kUnavailable);
  /// Busy leases in a row (no chunk nor room answered between them) after which the next one
  /// goes on the share: at the default round_trip_limit, each waited 250 ms for the row, and the
  /// lease backoff between them is drawn under 250 ms, 500 ms and 1 s.
  static constexpr int kBusyLeasesInARow = 3;
  /// A lease the fleet did not answer in time (RateLimitFleet::lease false): the calls are told
  /// to come back kUnansweredRetry later at least (this process's share of a slot's time when
  /// longer, jittered when several), as when the schedule is full; once the fleet has answered
  /// nothing for kUnansweredBeforeShare, they go on the share. Slots already held are spent.
  static constexpr Duration kUnansweredRetry = std::chrono::milliseconds(100);
  static constexpr Duration kUnansweredBeforeShare = std::chrono::seconds(1);
  /// The fleet's schedule has no room until `now + in`: the next lease is asked for then, and
  /// calls until then are told to ask again.
  void full_until(TimePoint now, Duration in);
  /// Slots leased and not yet spent, from `now` on.
  [[nodiscard]] std::int64_t slots_left(TimePoint now) const;
  /// Whether the fleet's chunks are used (sharing) or the local share of the rate
  /// (not sharing: 1 / fleet size, 1 when alone). Set by the fleet.
  void set_sharing(bool sharing);
  void set_share(double share);

  [[nodiscard]] const RateLimitOptions& options() const noexcept { return options_; }
  [[nodiscard]] const std::string& key() const noexcept { return key_; }
  /// The rate calls are spaced at: rate_per_s x (1 - headroom).
  [[nodiscard]] double spaced_rate() const noexcept {
    return options_.rate_per_s * (1 - options_.headroom);
  }
  /// The slots a chunk holds at most: rate_chunk(rate_per_s) (a tenth of a second).
  [[nodiscard]] std::int64_t chunk_size() const noexcept { return chunk_; }
  /// The slots to lease next: as many as this process spends before they pass (its pace over
  /// the last half second against the fleet's rate, and the calls waiting now), within
  /// [1, chunk_size()]. A process that spends slots slower than the fleet's rate leases small
  /// chunks, so that the fleet's schedule is not given to a process that cannot use it.
  [[nodiscard]] std::int64_t lease_size(TimePoint now) const;
  /// How far ahead of `now` a slot leased now can still be taken (RateLeaseAsk::reach_us): the
  /// longest wait left to a call waiting for the lease (its max_wait), Duration::max() when no
  /// call waits (a lease ahead of need). A call that cannot wait for the slot a lease would
  /// grant is told to come back rather than hold a slot no call of this process may take.
  [[nodiscard]] Duration lease_reach(TimePoint now) const;
  [[nodiscard]] RateLimitStats stats() const;

 private:
  friend class RateLimitRegistry;
  struct Chunk {
    std::int64_t start_ns = 0;  // the first slot's time
    std::int64_t count = 0;
    std::int64_t next = 0;  // the next slot not taken
    std::int64_t interval_ns = 0;
  };
  // Requires: mu_ held. The next leased slot at or after now - lateness; -1 when none.
  std::int64_t next_slot(std::int64_t now_ns);
  // Requires: mu_ held. Counts a slot taken at now for the pace.
  void count_pace(std::int64_t now_ns);
  // Requires: mu_ held.
  std::int64_t lease_size_locked(std::int64_t now_ns) const;
  // Requires: mu_ held, `at` a leased slot (next_slot). Takes it when it comes within max_wait;
  // `ahead` set when the next chunk is to be leased now, ahead of need.
  RateDecision take_leased_locked(std::int64_t now_ns, std::int64_t at, std::int64_t max_wait_ns,
                                  bool& ahead);
  // Requires: mu_ held. A call waits for a lease: counted, with its reach (lease_reach).
  void wait_for_lease_locked(std::int64_t now_ns, std::int64_t max_wait_ns);
  // Requires: mu_ held. When the slots this process leased are spent, a slot's time per call
  // waiting from now at least.
  [[nodiscard]] std::int64_t leased_end_locked(std::int64_t now_ns) const;
  // Requires: mu_ held. The wait of a call told to come back when the fleet gave no slot.
  Duration queued_wait(std::int64_t now_ns, std::int64_t wait_ns, BitGenRef gen);
  // Requires: mu_ held. The fleet answered a lease (a chunk, the schedule's room, a failure) or
  // sharing started again: a call waiting for an answer uses it, and the wait without one ends.
  void answered_locked();
  // Requires: mu_ held. The schedule has no room for this process until now + in.
  void full_until_locked(std::int64_t now_ns, Duration in);
  // Requires: mu_ held. A slot of this process's share of the rate (the whole rate alone, an
  // equal share when the fleet cannot answer), by its own GCRA.
  RateDecision take_share_locked(std::int64_t now_ns, std::int64_t max_wait_ns);

  RateLimitOptions options_;
  std::string key_;
  std::int64_t interval_ns_ = 0;  // 1 / rate, 0 without a rate
  std::int64_t burst_ns_ = 0;     // burst x interval
  // How late a leased slot may still be spent: the burst, or half the headroom's share of a
  // second (of one slot's time, under one call a second) when longer (a slot spent that late is
  // paid for by the headroom left unused).
  std::int64_t late_ns_ = 0;
  std::int64_t chunk_ = 1;
  // The registry's fleet, shared by its limits: read under a shared lock for each call to it,
  // so that detaching waits for the calls running (each at most one bounded round trip).
  struct FleetSlot {
    std::shared_mutex mu;
    RateLimitFleet* fleet = nullptr;  // guarded by mu
  };
  std::shared_ptr<FleetSlot> fleet_ = std::make_shared<FleetSlot>();

  mutable std::mutex mu_;
  // Guarded by mu_:
  std::int64_t tat_ns_ =
      INT64_MIN / 4;  // the local schedule's next slot (GCRA's theoretical arrival time)
  std::int64_t paused_until_ns_ = 0;
  std::int64_t full_until_ns_ = 0;
  std::deque<Chunk> chunks_;
  bool sharing_ = false;
  bool wanted_ = false;  // a chunk is asked for and not yet added
  double share_ = 1.0;
  std::int64_t local_until_ns_ = 0;  // the fleet failed: on the share until then
  int busy_in_a_row_ = 0;            // busy leases since the fleet last answered
  static constexpr std::int64_t kNever = INT64_MIN;
  std::uint64_t answers_ = 0;  // the fleet's answers (chunks, room, failures) and new starts
  std::int64_t unanswered_since_ns_ = kNever;  // the first lease not answered in time, since
                                               // the fleet last answered
  int waiting_ = 0;                            // calls in reserve() with no slot yet
  std::int64_t reach_until_ns_ = 0;  // the latest a call waiting since waiting_ was 0 may leave
  // The pace: slots taken in the current and the last window of half a second.
  std::int64_t pace_window_ns_ = 0;
  std::int64_t pace_now_ = 0;
  std::int64_t pace_last_ = -1;  // -1: no full window yet
  bool cut_said_ = false;
  std::int64_t told_window_ns_ = INT64_MIN / 4;  // calls told to come back: since when
  int told_ = 0;                                 // and how many
  RateLimitStats stats_;
};

/// The rate limits of a client's dependencies: one RateLimit per key, built on first use with
/// the options for that key (set_options) or the defaults. At most max_keys (past it get()
/// returns nullptr: no limit). Safe for concurrent use.
class RateLimitRegistry {
 public:
  explicit RateLimitRegistry(RateLimitOptions defaults = {}, std::size_t max_keys = 10000);
  ~RateLimitRegistry();
  RateLimitRegistry(const RateLimitRegistry&) = delete;
  RateLimitRegistry& operator=(const RateLimitRegistry&) = delete;

  /// The options of one key (a dependency with its own rate). Before its first get() only.
  /// Throws std::invalid_argument for invalid options.
  void set_options(std::string_view key, const RateLimitOptions& options);
  /// The key's limit; nullptr when the registry is full.
  [[nodiscard]] std::shared_ptr<RateLimit> get(std::string_view key);
  /// The key's limit when it exists.
  [[nodiscard]] std::shared_ptr<RateLimit> find(std::string_view key) const;
  /// Every limit built so far.
  [[nodiscard]] std::map<std::string, std::shared_ptr<RateLimit>, std::less<>> all() const;
  /// Attaches a fleet (or detaches it: nullptr); limits built before and after use it.
  /// Requires: `fleet` outlives its attachment.
  void attach_fleet(RateLimitFleet* fleet);
  /// Sets every limit's sharing and share (RateLimit::set_sharing, set_share), those built
  /// later included. Called by the fleet when it starts or stops answering.
  void set_fleet_state(bool sharing, double share);
  [[nodiscard]] const RateLimitOptions& defaults() const noexcept { return defaults_; }

 private:
  RateLimitOptions defaults_;
  std::size_t max_keys_;
  mutable std::mutex mu_;
  std::map<std::string, RateLimitOptions, std::less<>> options_;           // guarded by mu_
  std::map<std::string, std::shared_ptr<RateLimit>, std::less<>> limits_;  // guarded by mu_
  std::shared_ptr<RateLimit::FleetSlot> fleet_ = std::make_shared<RateLimit::FleetSlot>();
  bool sharing_ = false;  // guarded by mu_
  double share_ = 1.0;    // guarded by mu_
};

}  // namespace keel
