// Circuit breakers shared by a fleet of processes on one PostgreSQL database: when any process's
// breaker for a dependency opens, every process's breaker for it opens until the same probe
// time; the fleet sends one half-open probe per break, and the probe's result closes (or
// re-opens) the breaker everywhere. docs/fleet.md has the design and the drill's figures.
//
// What is shared and what stays local:
//   - Each process keeps its own BreakerRegistry and decides on its own calls as before: the
//     local breaker is the fast path, and no call waits for the database, except the one call
//     per break that would be the fleet's probe, which waits at most round_trip_limit for the
//     answer to its probe-lease request (BreakerOptions::trial_gate) and otherwise probes as if
//     alone.
//   - A state change of a local breaker (opened by its own calls, a probe's result) is written
//     to the table keel_breakers and announced with NOTIFY from a background thread; the other
//     processes apply it to their breakers (CircuitBreaker::force_open, reset). The table is the
//     truth for processes that start later or missed a notification while disconnected.
//   - Each process judges a dependency after its share of the breaker's minimum calls (the
//     fleet's size comes from a heartbeat every few seconds), so the fleet trips after about
//     the calls one process would make, not one process's worth per process.
//   - After a successful probe each process closes its breaker at a random moment within
//     release_spread, so that the recovered dependency is not met by the whole fleet at once.
//   - When the database is slow or unreachable, each process falls back to its own breakers
//     and says so once (on_notice); it reconnects with core's jittered backoff, reads the table
//     and publishes what its breakers learnt meanwhile. Sharing never blocks or fails a call.
//   - What it reads back is checked against its domain, never obeyed blindly: a row of the
//     tables outside it (a hand edit, a restore, a bug elsewhere: an open row without an end or
//     until 'infinity', a probe lease longer than probe_lease or held by a process that is not
//     in the fleet, an unknown state, counts out of range, member rows seen in the future) is
//     repaired or ignored and said once per row and kind; a breaker is never held open longer
//     than its max_break_duration, nor for a probe lease longer than probe_lease.
//   - Nothing it sets on a connection outlives the transaction that needed it (statement and
//     lock timeouts are set for each transaction alone), so its connection may come from a
//     pool that hands the same server session to other clients.
//   - A schema of its tables newer than this program's (a later keel migrated them) is refused
//     once, by name, with both versions: the process keeps its own breakers, not shared, and
//     does not try again (stats().refused).
//
// Rate limits and pauses (SharedBreakersOptions::rate_limits, docs/fleet.md "Rate limits"): the
// same object shares a keel::RateLimitRegistry with the fleet. Each dependency's rate is one
// schedule in the row of table keel_rate_limits, decided by keel::decide_rate_lease in the row's
// transaction: a process leases chunks of its slots (at most a tenth of a second's worth, sized
// by what it spends: keel::RateLimit::lease_size) and spends them locally, asking for the next
// chunk in the background before the last is spent when it spends a few a chunk; a call waits
// on the database at most round_trip_limit (RateLimitFleet::lease). A process that dies
// takes only its unspent chunk with it. A pause (a 429 or 503 with Retry-After any process got)
// is written to the row and announced on the channel like a breaker's opening; every process
// holds its calls to that dependency until then (each released within the limit's
// release_spread). When the database is out, each process keeps an equal share of each rate
// (1 / the fleet's last known size) and says so once.
//
// PostgreSQL only: a SQLite database has no notifications, and on it breakers stay
// per-process (the constructor refuses a SQLite URL).
//
// Thread-safety: safe for concurrent use. The registry's breakers may be used from any thread
// while a SharedBreakers is attached; the registry must outlive it. Every statement runs on its
// background thread.
//
// Example:
//   keel::BreakerRegistry breakers;
//   keel::store::SharedBreakers shared(breakers, keel::store::parse_database_url(url).value());
//   options.brakes.breakers = &breakers;  // an http::Client's brakes, as without sharing
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "keel/core/backoff.hpp"
#include "keel/core/breaker.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/random.hpp"
#include "keel/core/rate_limit.hpp"
#include "keel/db/database.hpp"

namespace keel::store {

namespace detail {
class Listener;
}

struct SharedBreakersOptions {
  /// How long the process that takes a break's probe holds it. When it has not reported by then
  /// (it died, or its call hangs) the next process whose breaker asks takes the probe over.
  /// Requires: >= 10 ms. Default 10 s.
  Duration probe_lease = std::chrono::seconds(10);
  /// While another process holds the probe, this process's breaker stays open and asks again
  /// after at most this long (or when the lease ends, if sooner); the probe's result usually
  /// arrives first, by notification. The hold is what a queue defers its jobs and pauses its
  /// worker by, so a hold of the whole lease would keep them waiting after the fleet has closed.
  /// Requires: >= 1 ms. Default 1 s.
  Duration probe_wait = std::chrono::seconds(1);
  /// The longest a call waits for the fleet's answer to its probe-lease request (a frozen or
  /// unreachable database included); over it the call probes as if alone, and the calls after it
  /// do so at once until the database answers again. Also each statement's bound on the server
  /// (statement_timeout and lock_timeout, set for its transaction only). Requires: >= 1 ms.
  /// Default 250 ms.
  Duration round_trip_limit = std::chrono::milliseconds(250);
  /// After the fleet's probe succeeded, this process closes its breaker at a uniformly random
  /// moment within this spread. Requires: >= 0. Default 1 s.
  Duration release_spread = std::chrono::seconds(1);
  /// How often this process tells the table it is alive; the fleet's size (processes seen
  /// within 3 heartbeats) sets each breaker's share of the minimum calls
  /// (BreakerRegistry::set_fleet_size), so that the fleet trips after about as many calls as
  /// one process would. Jittered by +-50%. Requires: >= 10 ms. Default 5 s.
  Duration heartbeat = std::chrono::seconds(5);
  /// The wait between reconnections to an unreachable database (core's full jitter). Default
  /// base 100 ms, cap 10 s.
  BackoffOptions reconnect = {};
  /// Connection options of the two connections it holds (one listens, one writes).
  ConnectOptions connect = {};
  /// Opens the connection it writes and reads the tables with (not the listening one), for
  /// instance to wrap it: tests check what is left set on it. Called from the background thread
  /// at each (re)connection; throws as open_database does. Default none: open_database(url,
  /// connect).
  std::function<std::unique_ptr<Connection>(const DatabaseUrl&, const ConnectOptions&)> open;
  /// Where the listening connection goes, when the URL cannot carry LISTEN: a direct URL of the
  /// same database beside a URL through a transaction pooler (keel_pooler=transaction), where
  /// PgBouncer would hand the notifications to another client. With such a URL and no listen_url
  /// the breakers are not shared (said once, as for a newer schema). Default none: the URL.
  std::optional<DatabaseUrl> listen_url;
  /// Rate limits shared with the fleet, with their pauses (see above). Non-owning; Requires:
  /// outlives this object. Default none: breakers only.
  RateLimitRegistry* rate_limits = nullptr;
  /// How far ahead of now the fleet's schedule of a rate may be leased: a lease that would start
  /// later is refused, and the limit asks again when there is room. Requires: >= 100 ms.
  /// Default 1 s.
  Duration rate_horizon = std::chrono::seconds(1);
  /// This process's name in the table and the notifications. Requires: no whitespace.
  /// Default "hostname:pid:random".
  std::string process;
  /// Told, once per change, when sharing stops (the process falls back to its own breakers) and
  /// when it starts again; once when the tables' schema is refused; once per row and kind when
  /// a row read back is outside its domain (what was wrong and whether it was repaired or
  /// ignored). Called from the background thread. Default: a line on stderr.
  std::function<void(std::string_view message)> on_notice;
};

/// Counters, for tests, metrics and the drill.
struct SharedBreakersStats {
  bool sharing = false;              // connected, listening and the table read
  std::uint64_t published = 0;       // state changes this process wrote to the table
  std::uint64_t applied_opens = 0;   // breakers opened for another process
  std::uint64_t applied_closes = 0;  // breakers closed after another process's probe
  std::uint64_t probes_taken = 0;    // probe leases this process took
  std::uint64_t probes_held = 0;     // trials refused: another process holds the probe
  std::uint64_t fallbacks = 0;       // trials decided locally: no answer within round_trip_limit
  std::uint64_t reconnects = 0;      // times sharing started again after a failure
  bool refused = false;  // the tables' schema is newer than this program's: never shared
  std::uint64_t rows_out_of_domain = 0;  // rows read outside their domain, once per row and kind
  std::uint64_t rows_repaired = 0;       // rows this process rewrote into their domain
  int fleet_size = 1;                   // processes sharing, this one included (1 when not sharing)
  std::uint64_t chunks_leased = 0;      // chunks of a rate's schedule this process leased
  std::uint64_t leases_waited = 0;      // of those, asked by a call that had no slot left
  std::uint64_t leases_full = 0;        // lease requests refused: the schedule was full
  std::uint64_t pauses_published = 0;   // pauses this process wrote to the table
  std::uint64_t pauses_applied = 0;     // pauses of other processes applied here
  std::uint64_t lease_failures = 0;     // leases that failed other than by a lost connection
  std::uint64_t rates_disagreeing = 0;  // dependencies another process limits at a lower rate
};

class SharedBreakers {
 public:
  /// Attaches to `registry` (a listener and its trial gate) and starts the background thread,
  /// which connects, creates the table on first use, listens and reads the fleet's state. An
  /// unreachable database is not an error: the process shares once it is back. Neither is a
  /// schema newer than this program's: the process does not share (said once). Throws
  /// std::invalid_argument for invalid options or a database without notifications (SQLite).
  SharedBreakers(BreakerRegistry& registry, DatabaseUrl url, SharedBreakersOptions options = {});
  /// Detaches from the registry and stops the thread. Publications not yet written are dropped.
  ~SharedBreakers();
  SharedBreakers(const SharedBreakers&) = delete;
  /// Creates or upgrades the tables (component "breakers" in keel_schema), as the background
  /// thread does on first use. PostgreSQL only. Throws DatabaseError or SchemaVersionError.
  static void migrate(Connection& connection);
  /// The tables' schema component ("breakers"), for a program that migrates every component (its
  /// `migrate` applies it).
  [[nodiscard]] static SchemaComponent schema() noexcept;
  /// The rate limits' table (component "rate_limits"), for migrations; created on first use
  /// when rate_limits is set.
  [[nodiscard]] static SchemaComponent rate_limit_schema() noexcept;
  SharedBreakers& operator=(const SharedBreakers&) = delete;

  /// Waits until sharing (connected, listening, the fleet's state applied), refused (a newer
  /// schema) or `timeout`. Returns whether it is sharing. A short-lived caller uses it to start
  /// with the fleet's state.
  [[nodiscard]] bool wait_until_sharing(Duration timeout);
  /// Waits until every state change published so far is written, or `timeout`. Returns whether
  /// it is. For tests and for a process about to exit.
  [[nodiscard]] bool flush(Duration timeout);

  [[nodiscard]] SharedBreakersStats stats() const;
  [[nodiscard]] const std::string& process() const noexcept { return options_.process; }

 private:
  using Instant = std::chrono::steady_clock::time_point;
  struct Publication {
    bool open = false;  // else closed
    Instant until{};    // when open: the end of the break
  };
  // A trial's probe-lease request, answered by the background thread.
  struct GateRequest {
    std::string key;
    bool answered = false;   // guarded by mu_
    bool abandoned = false;  // guarded by mu_: the caller stopped waiting
    Duration hold{};         // guarded by mu_: the answer (zero: the trial runs)
  };
  struct RowRead;
  // A call's request for a chunk of a rate's schedule, answered by the background thread.
  struct LeaseRequest {
    std::string key;
    bool answered = false;   // guarded by mu_
    bool abandoned = false;  // guarded by mu_
  };
  // The fleet's side of the rate limits (keel::RateLimitFleet), calling back into this object.
  class RateFleet final : public RateLimitFleet {
   public:
    explicit RateFleet(SharedBreakers& self) : self_(self) {}
    void want(std::string_view key) override { self_.want_chunk(key); }
    bool lease(std::string_view key) override { return self_.lease_chunk(key); }
    void paused(std::string_view key, TimePoint until) override { self_.paused(key, until); }

   private:
    SharedBreakers& self_;
  };

  void on_change(std::string_view key, BreakerState from, BreakerState to);
  [[nodiscard]] Duration gate(std::string_view key);
  void run();
  void share(detail::Listener& listener);
  [[nodiscard]] Rows bounded(std::string_view sql, std::span<const Value> params);
  void serve_gates();
  [[nodiscard]] Duration ask_fleet(const std::string& key);
  void answer_every_gate();
  void apply(std::string_view payload);
  void apply_open(const std::string& key, Duration remaining);
  [[nodiscard]] Duration release_due();
  [[nodiscard]] Duration release_in(const std::string& key);
  void publish_pending();
  void read_fleet_state();
  void heartbeat();
  void note_row(const std::string& key, const RowRead& row);
  void want_chunk(std::string_view key);
  [[nodiscard]] bool lease_chunk(std::string_view key);
  void paused(std::string_view key, TimePoint until);
  void serve_leases();
  void lease_one(const std::string& key);
  void lease_failed(const std::string& key, const std::exception& e);
  struct LeaseRow;
  [[nodiscard]] static LeaseRow read_lease(const Rows& rows);
  void say_lease_row(const std::string& key, const RateLimit& limit, const LeaseRow& row,
                     const RateLeaseAnswer& answer);
  void publish_pauses();
  void read_pauses();
  void apply_pause(const std::string& key, std::int64_t ms);
  void set_rate_sharing(bool sharing);
  void repair_rows();
  [[nodiscard]] bool first_time(std::string what);
  void notice(const std::string& message);

  BreakerRegistry& registry_;
  DatabaseUrl url_;
  SharedBreakersOptions options_;
  BackoffSequence reconnect_;  // the background thread's
  std::uint64_t listener_id_ = 0;
  // The bounds of what is read back, in ms: the breakers' longest break, the probe lease, the
  // window within which a member counts (3 heartbeats); and round_trip_limit as a setting.
  std::int64_t max_break_ms_ = 0;
  std::int64_t lease_ms_ = 0;
  std::int64_t members_ms_ = 0;
  std::string limit_setting_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable answered_cv_;
  std::map<std::string, Publication, std::less<>> pending_;  // guarded by mu_
  std::map<std::string, Instant, std::less<>> releases_;     // guarded by mu_
  std::deque<std::shared_ptr<GateRequest>> gates_;           // guarded by mu_
  std::deque<std::shared_ptr<LeaseRequest>> leases_;         // guarded by mu_
  std::set<std::string, std::less<>> wanted_;                // guarded by mu_
  std::map<std::string, Instant, std::less<>> pauses_;       // guarded by mu_: to publish
  RateFleet rate_fleet_{*this};
  std::int64_t horizon_ms_ = 0;
  int last_fleet_size_ = 1;  // the background thread's: the share when the database is out
  // Guarded by mu_: false from a trial that stopped waiting for its answer until the background
  // thread serves trials again; meanwhile trials decide at once, without asking.
  bool answering_ = true;
  detail::Listener* listener_ = nullptr;  // guarded by mu_
  bool writing_ = false;                  // guarded by mu_: publications taken but not yet written
  Rng rng_;                               // guarded by mu_
  // The background thread's own: the writing connection, the tables' schema (notifications of
  // other schemas are ignored), the failures since sharing last worked, the next heartbeat, the
  // keys whose rows are to be rewritten into their domain and the rows said out of it.
  std::unique_ptr<Connection> work_;
  std::string schema_;
  int failures_ = 0;
  Instant next_beat_{};
  std::set<std::string, std::less<>> repairs_;
  std::set<std::string, std::less<>> said_;
  // Leases that failed other than by a lost connection, in a row: the limits go on their share
  // for core's next backoff delay before the fleet is asked again.
  BackoffSequence lease_backoff_;
  // The store's clock less this process's steady clock, in us: the least of the last samples
  // (a lease's transaction start less the moment it was asked), as NTP keeps its least-delay
  // sample; a chunk's slots are spent at their store time less it. The background thread's.
  std::array<std::int64_t, 64> clock_samples_{};
  std::size_t clock_samples_taken_ = 0;
  [[nodiscard]] std::int64_t store_clock_offset(std::int64_t sample);
  void sample_store_clock();

  std::atomic<bool> sharing_{false};
  std::atomic<bool> stopping_{false};
  std::atomic<bool> refused_{false};
  std::atomic<std::uint64_t> published_{0};
  std::atomic<std::uint64_t> applied_opens_{0};
  std::atomic<std::uint64_t> applied_closes_{0};
  std::atomic<std::uint64_t> probes_taken_{0};
  std::atomic<std::uint64_t> probes_held_{0};
  std::atomic<std::uint64_t> fallbacks_{0};
  std::atomic<std::uint64_t> reconnects_{0};
  std::atomic<std::uint64_t> rows_out_of_domain_{0};
  std::atomic<std::uint64_t> rows_repaired_{0};
  std::atomic<std::uint64_t> chunks_leased_{0};
  std::atomic<std::uint64_t> leases_waited_{0};
  std::atomic<std::uint64_t> leases_full_{0};
  std::atomic<std::uint64_t> pauses_published_{0};
  std::atomic<std::uint64_t> pauses_applied_{0};
  std::atomic<std::uint64_t> lease_failures_{0};
  std::atomic<std::uint64_t> rates_disagreeing_{0};
  std::thread thread_;
};

}  // namespace keel::store
