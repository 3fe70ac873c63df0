// SharedBreakers (keel/store/fleet/shared_breakers.hpp): what its concepts share. The
// constructor and its options, the schema of the tables, the stats and the notices, and the
// background thread: its connection, its reconnect loop and the loop that serves the calls'
// requests, publishes, and applies the notifications of channel keel_breakers, whose payload is
// "schema\nstate\nmilliseconds\nprocess\nkey". Each concept's statements are named beside their row
// readers, in a file of its own (fleet_membership.cpp, fleet_pauses.cpp, fleet_rate_leases.cpp) or
// in a section of its own below.
//
// Every statement runs on the background thread, in a transaction of its own whose
// statement_timeout and lock_timeout are set with set_config(..., true): nothing outlives it.
#include "keel/store/fleet/shared_breakers.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "db/detail/listener.hpp"
#include "db/detail/process.hpp"
#include "fleet/detail/fleet_sql.hpp"
#include "keel/duration.hpp"
#include "keel/expected.hpp"
#include "keel/random.hpp"
#include "keel/store/db/dialect.hpp"
#include "keel/store/db/row_cursor.hpp"

namespace keel::store {

using detail::clamped_ms;
using detail::integer_cell;
using detail::kLimits;
using detail::kMaxCount;
using detail::kMaxKey;
using detail::kMaxMs;
using detail::kSlack;
using detail::ms;
using detail::ms_until;
using detail::sane_count;
using detail::shareable;
using detail::text_cell;
using detail::value_error;

namespace {

constexpr std::string_view kChannel = "keel_breakers";

constexpr Migration kMigrations[] = {
    {.sql = "CREATE TABLE keel_breakers ("
            " key TEXT PRIMARY KEY,"
            " state TEXT NOT NULL,"               // 'open' or 'closed'
            " open_until TIMESTAMPTZ,"            // when open: the fleet's probe time
            " breaks BIGINT NOT NULL DEFAULT 0,"  // times the fleet opened it
            " probes BIGINT NOT NULL DEFAULT 0,"  // probe leases granted
            " probe_holder TEXT,"
            " probe_until TIMESTAMPTZ,"
            " updated_by TEXT,"
            " updated_at TIMESTAMPTZ NOT NULL DEFAULT now());"
            "CREATE TABLE keel_breaker_members ("
            " process TEXT PRIMARY KEY,"
            " seen_at TIMESTAMPTZ NOT NULL)"}};

// The rate limits' table (component "rate_limits"): one row per dependency whose rate or pause
// the fleet shares. next_slot is the fleet's schedule (the first slot not leased yet);
// paused_until the fleet's pause.
constexpr Migration kRateMigrations[] = {
    {.sql = "CREATE TABLE keel_rate_limits ("
            " key TEXT PRIMARY KEY,"
            " next_slot TIMESTAMPTZ,"
            " paused_until TIMESTAMPTZ,"
            " leases BIGINT NOT NULL DEFAULT 0,"  // chunks leased
            " pauses BIGINT NOT NULL DEFAULT 0,"  // pauses written
            " updated_by TEXT,"
            " updated_at TIMESTAMPTZ NOT NULL DEFAULT now())"},
    // 2: the lowest rate a process asserted, and when (keel::decide_rate_lease).
    {.sql = "ALTER TABLE keel_rate_limits ADD COLUMN rate_per_s DOUBLE PRECISION,"
            " ADD COLUMN rate_at TIMESTAMPTZ"}};

constexpr std::size_t kMaxSaid = 1000;  // rows said out of their domain

// The statement a process leaves the fleet with, when it stops: $1 process.
constexpr std::string_view kLeave = "DELETE FROM keel_breaker_members WHERE process = $1";

void validate(const SharedBreakersOptions& o) {
  const auto reject = [](std::string_view field, std::string_view rule, const std::string& value) {
    throw std::invalid_argument("SharedBreakers: " + std::string(field) + " must be " +
                                std::string(rule) + ", got " + value);
  };
  if (o.probe_lease < std::chrono::milliseconds(10)) {
    reject("probe_lease", ">= 10ms", format_duration(o.probe_lease));
  }
  if (o.probe_wait < std::chrono::milliseconds(1)) {
    reject("probe_wait", ">= 1ms", format_duration(o.probe_wait));
  }
  if (o.round_trip_limit < std::chrono::milliseconds(1)) {
    reject("round_trip_limit", ">= 1ms", format_duration(o.round_trip_limit));
  }
  if (o.heartbeat < std::chrono::milliseconds(10)) {
    reject("heartbeat", ">= 10ms", format_duration(o.heartbeat));
  }
  if (o.release_spread < Duration::zero()) {
    reject("release_spread", ">= 0", format_duration(o.release_spread));
  }
  if (o.rate_horizon < std::chrono::milliseconds(100)) {
    reject("rate_horizon", ">= 100ms", format_duration(o.rate_horizon));
  }
  if (o.process.find_first_of(" \t\r\n") != std::string::npos) {
    reject("process", "a name without whitespace", "\"" + o.process + "\"");
  }
}

}  // namespace

void SharedBreakers::migrate(Connection& connection) {
  (void)store::migrate(connection, "breakers", kMigrations);
}

SchemaComponent SharedBreakers::rate_limit_schema() noexcept {
  return {.name = "rate_limits",
          .version = static_cast<int>(std::size(kRateMigrations)),
          .migrate = [](Connection& connection) {
            (void)store::migrate(connection, "rate_limits", kRateMigrations);
          }};
}

SchemaComponent SharedBreakers::schema() noexcept {
  return {.name = "breakers",
          .version = static_cast<int>(std::size(kMigrations)),
          .migrate = &SharedBreakers::migrate};
}

SharedBreakers::SharedBreakers(BreakerRegistry& registry, DatabaseUrl url,
                               SharedBreakersOptions options)
    : registry_(registry),
      url_(std::move(url)),
      options_(std::move(options)),
      reconnect_((validate(options_), options_.reconnect), random_seed()),
      max_break_ms_(clamped_ms(registry.options().breaker.max_break_duration)),
      lease_ms_(clamped_ms(options_.probe_lease)),
      members_ms_(clamped_ms(options_.heartbeat * 3)),
      limit_setting_(std::to_string(clamped_ms(options_.round_trip_limit)) + "ms"),
      rng_(random_seed()),
      lease_backoff_(
          BackoffOptions{.base = std::chrono::seconds(1), .cap = std::chrono::seconds(60)},
          random_seed()) {
  if (!dialect_of(url_.backend).listen_notify()) {
    throw std::invalid_argument(
        "SharedBreakers: " + url_.redacted +
        " has no notifications; breakers are shared through PostgreSQL only (on SQLite each "
        "process keeps its own)");
  }
  if (options_.process.empty()) options_.process = detail::process_name();
  if (!options_.on_notice) {
    options_.on_notice = [](std::string_view message) {
      std::fprintf(stderr, "keel: shared breakers: %.*s\n", static_cast<int>(message.size()),
                   message.data());
    };
  }
  listener_id_ = registry_.add_listener([this](std::string_view key, BreakerState from,
                                               BreakerState to) { on_change(key, from, to); });
  registry_.set_trial_gate([this](std::string_view key) { return gate(key); });
  horizon_ms_ = clamped_ms(options_.rate_horizon);
  if (options_.rate_limits != nullptr) options_.rate_limits->attach_fleet(&rate_fleet_);
  thread_ = std::thread([this] { run(); });
}

SharedBreakers::~SharedBreakers() {
  stopping_.store(true);
  if (options_.rate_limits != nullptr) {
    options_.rate_limits->attach_fleet(nullptr);  // waits for a lease running (round_trip_limit)
    options_.rate_limits->set_fleet_state(false, 1.0);
  }
  registry_.set_trial_gate(nullptr);  // waits for a gate that is running (round_trip_limit)
  registry_.remove_listener(listener_id_);
  {
    std::lock_guard lock(mu_);
    if (listener_ != nullptr) listener_->interrupt();
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

bool SharedBreakers::wait_until_sharing(Duration timeout) {
  std::unique_lock lock(mu_);
  // wait: bound: the caller's timeout for sharing to start
  return cv_.wait_for(lock, timeout, [&] {
    return sharing_.load() || stopping_.load() || refused_.load();
  }) && sharing_.load();
}

bool SharedBreakers::flush(Duration timeout) {
  std::unique_lock lock(mu_);
  // wait: bound: the caller's timeout for publications to be written
  return cv_.wait_for(lock, timeout, [&] { return pending_.empty() && !writing_; });
}

SharedBreakersStats SharedBreakers::stats() const {
  return {.sharing = sharing_.load(),
          .published = published_.load(),
          .applied_opens = applied_opens_.load(),
          .applied_closes = applied_closes_.load(),
          .probes_taken = probes_taken_.load(),
          .probes_held = probes_held_.load(),
          .fallbacks = fallbacks_.load(),
          .reconnects = reconnects_.load(),
          .refused = refused_.load(),
          .rows_out_of_domain = rows_out_of_domain_.load(),
          .rows_repaired = rows_repaired_.load(),
          .fleet_size = registry_.fleet_size(),
          .chunks_leased = chunks_leased_.load(),
          .leases_waited = leases_waited_.load(),
          .leases_full = leases_full_.load(),
          .pauses_published = pauses_published_.load(),
          .pauses_applied = pauses_applied_.load(),
          .lease_failures = lease_failures_.load(),
          .rates_disagreeing = rates_disagreeing_.load()};
}

void SharedBreakers::notice(const std::string& message) {
  try {
    options_.on_notice(message);
  } catch (...) {
    // A notice is advice: a listener that throws changes nothing.
  }
}

// Whether `what` (a row and a kind) is said for the first time. The background thread's.
bool SharedBreakers::first_time(std::string what) {
  if (said_.contains(what)) return false;
  if (said_.size() >= kMaxSaid) {
    if (said_.size() == kMaxSaid) {
      said_.emplace("");  // said once: the bound is reached
      notice("more than " + std::to_string(kMaxSaid) +
             " rows were out of their domain; no more are said");
    }
    return false;
  }
  said_.insert(std::move(what));
  return true;
}

// Runs `sql` in a transaction of its own, bounded on the server by round_trip_limit (set for
// that transaction only), and commits. Two round trips: BEGIN with the bounds, then the statement
// with COMMIT. Requires: the background thread.
Rows SharedBreakers::bounded(std::string_view sql, std::span<const Value> params) {
  const Value limit[] = {limit_setting_};
  const Statement limits[] = {{.sql = kLimits, .params = limit}};
  (void)work_->begin_then_query(Isolation::kReadCommitted, limits);
  return work_->query_then_commit(sql, params);
}

// Sharing stopped: every trial waiting is decided locally.
void SharedBreakers::answer_every_gate() {
  {
    std::lock_guard lock(mu_);
    for (const auto& request : gates_) {
      if (!request->abandoned) fallbacks_.fetch_add(1);
      request->hold = Duration::zero();
      request->answered = true;
    }
    gates_.clear();
    for (const auto& request : leases_) request->answered = true;  // on the share
    leases_.clear();
    wanted_.clear();
    answering_ = true;
  }
  answered_cv_.notify_all();
}

void SharedBreakers::run() {
  if (url_.transaction_pooler && !options_.listen_url) {
    // A pooler lends its server connections a transaction at a time: LISTEN would stay on one of
    // them and its notifications reach whichever client holds it next.
    notice(
        "breakers are shared through LISTEN/NOTIFY, which a transaction pooler does not carry "
        "(keel_pooler=transaction in " +
        url_.redacted +
        "); give a direct URL to listen on (listen_url, keel jobs work --listen-db); until "
        "then each process keeps its own breakers");
    {
      std::lock_guard lock(mu_);
      refused_.store(true);
    }
    cv_.notify_all();
    return;
  }
  // Core's reconnect loop: a session that shared for a while starts the backoff over; each
  // failure in a row waits core's next full-jitter delay.
  const auto session = [&]() -> SessionEnd {
    std::unique_ptr<detail::Listener> listener;
    try {
      listener = detail::open_listener(options_.listen_url.value_or(url_), options_.connect);
      {
        std::lock_guard lock(mu_);
        if (stopping_.load()) return SessionEnd::kStop;
        listener_ = listener.get();
      }
      share(*listener);
    } catch (const SchemaVersionError& e) {
      // Not an outage: no retry changes the schema. Said once; this process keeps its own
      // breakers.
      notice(std::string(e.what()) +
             "; breakers are not shared: each process keeps its own, and this one does not try "
             "again");
      std::lock_guard lock(mu_);
      refused_.store(true);
    } catch (const std::exception& e) {
      if (failures_++ == 0) {
        notice(std::string("the database is unreachable (") + e.what() +
               "); each process keeps its own breakers" +
               (options_.rate_limits != nullptr
                    ? " and 1/" + std::to_string(std::max(1, last_fleet_size_)) +
                          " of each shared rate limit"
                    : std::string()) +
               " until it is back");
      }
    }
    sharing_.store(false);
    answer_every_gate();
    set_rate_sharing(false);      // an equal share of each rate until the fleet is back
    registry_.set_fleet_size(1);  // alone until the fleet is back
    {
      std::lock_guard lock(mu_);
      listener_ = nullptr;
    }
    listener.reset();
    work_.reset();
    cv_.notify_all();
    if (stopping_.load() || refused_.load()) return SessionEnd::kStop;
    // share() set failures_ to 0 once it worked: this is the first failure since.
    return failures_ == 1 ? SessionEnd::kLost : SessionEnd::kFailed;
  };
  keep_reconnecting(reconnect_, session, [&](Duration delay) {
    std::unique_lock lock(mu_);
    // wait: core: keep_reconnecting's delay
    return !cv_.wait_for(lock, delay, [&] { return stopping_.load(); });
  });
  {
    std::lock_guard lock(mu_);
    sharing_.store(false);
  }
  cv_.notify_all();
}

// Connected: set up, then answer trials, publish, apply notifications and release breakers until
// something fails or the object is destroyed. Throws on any database error but a trial's (which
// that trial decides locally) and a value's in one row (said, and that row left).
void SharedBreakers::share(detail::Listener& listener) {
  schema_ = listener.scalar("SELECT current_schema()");
  listener.listen(kChannel);  // before the table is read: no change falls in between
  work_ =
      options_.open ? options_.open(url_, options_.connect) : open_database(url_, options_.connect);
  SharedBreakers::migrate(*work_);
  if (options_.rate_limits != nullptr) (void)store::migrate(*work_, "rate_limits", kRateMigrations);
  // A member before anything else: a probe lease it takes is then never a stranger's.
  heartbeat();
  {
    std::lock_guard lock(mu_);
    next_beat_ = std::chrono::steady_clock::now() + jittered(options_.heartbeat, rng_);
  }
  publish_pending();  // what this process learnt while it could not share
  read_fleet_state();
  repair_rows();
  publish_pauses();
  read_pauses();
  sample_store_clock();
  {
    std::lock_guard lock(mu_);  // a waiter checks sharing_ under mu_: no wakeup is lost
    sharing_.store(true);
  }
  set_rate_sharing(true);
  cv_.notify_all();
  if (failures_ > 0) {
    reconnects_.fetch_add(1);
    notice("sharing again: the database is back");
  }
  failures_ = 0;
  while (!stopping_.load()) {
    serve_gates();
    serve_leases();
    repair_rows();
    publish_pending();
    publish_pauses();
    if (std::chrono::steady_clock::now() >= next_beat_) {
      heartbeat();
      std::lock_guard lock(mu_);
      next_beat_ = std::chrono::steady_clock::now() + jittered(options_.heartbeat, rng_);
    }
    const Duration wait =
        std::min<Duration>(release_due(), next_beat_ - std::chrono::steady_clock::now());
    for (const detail::Notification& n : listener.wait(std::max<Duration>(wait, Duration{}))) {
      apply(n.payload);
    }
  }
  // Leaving: the others count one process fewer at their next heartbeat.
  try {
    const Value me[] = {options_.process};
    (void)bounded(kLeave, me);
  } catch (const std::exception&) {
    // The row expires after three heartbeats.
  }
}

void SharedBreakers::apply(std::string_view payload) {
  // schema \n state \n ms \n process \n key
  std::string_view parts[5];
  for (int i = 0; i < 4; ++i) {
    const auto nl = payload.find('\n');
    if (nl == std::string_view::npos) return;  // not ours
    parts[i] = payload.substr(0, nl);
    payload.remove_prefix(nl + 1);
  }
  parts[4] = payload;
  if (parts[0] != schema_ || parts[3] == options_.process || !shareable(parts[4])) return;
  const std::string key(parts[4]);
  if (parts[1] == "open") {
    std::int64_t ms = 0;
    for (const char c : parts[2]) {
      if (c < '0' || c > '9' || ms > kMaxMs) return;
      ms = ms * 10 + (c - '0');
    }
    apply_open(key, std::chrono::milliseconds(ms));
  } else if (parts[1] == "closed") {
    (void)release_in(key);
  } else if (parts[1] == "pause") {
    std::int64_t ms = 0;
    for (const char c : parts[2]) {
      if (c < '0' || c > '9' || ms > kMaxMs) return;
      ms = ms * 10 + (c - '0');
    }
    apply_pause(key, ms);
  } else if (parts[1] == "members") {
    next_beat_ = std::chrono::steady_clock::now();  // a process joined: count again now
  }
}

// ---------------------------------------------------------------------------------------------
// SharedBreakers' circuit breakers: the table keel_breakers, one row per dependency that has
// ever opened in the fleet.
//
// The rules, each in one statement:
//   - open: a process's breaker opened. The row becomes open until now + its break, unless the
//     fleet's break is still running or another process holds a live probe lease (then nothing
//     changes: the fleet keeps one probe time and one probe).
//   - probe: the call that would be a half-open trial asks for the lease. It gets it when the
//     row is open, the break is over and no other process holds a live lease.
//   - closed: the probe succeeded. The row becomes closed and the lease is dropped.
// Every change that took effect is announced with NOTIFY in the same statement.
//
// The domain of what is read back, in SQL (the fragments below), so that no row can make a
// statement fail or a breaker obey it: an open row's end is read as at most max_break_duration
// from now (none, or -infinity: a break that is over), a probe lease as at most probe_lease from
// now and only when its holder is a member of the fleet, a state other than open and closed as
// no row, counts outside [0, 2^53] as 0, a member seen in the future as none. Each statement
// returns which of these it met (the `flags` column), said once per row and kind; the rows that
// can be rewritten into their domain are, by the repair statement.
//
// Every statement runs on the background thread.

namespace {

// The kinds of a row of keel_breakers outside its domain: the bits of the `flags` column.
enum RowFlag : int {
  kUnknownState = 1,    // neither open nor closed: ignored
  kOpenWithoutEnd = 2,  // open, open_until NULL: read as a break that is over; rewritten
  kOpenTooLong = 4,     // open_until not finite, or beyond the longest break: bounded; rewritten
  kBadLease = 8,        // a holder without a finite lease, or one beyond probe_lease: rewritten
  kUnknownHolder = 16,  // a live lease of a process that is not in the fleet: ignored
  kBadCount = 32,       // breaks or probes outside [0, 2^53]: reset to 0
};
constexpr int kRowFlags[] = {kUnknownState, kOpenWithoutEnd, kOpenTooLong,
                             kBadLease,     kUnknownHolder,  kBadCount};

// ---------------------------------------------------------------------------------------------
// The domain in SQL, over a row `b` of keel_breakers. The placeholders of the parameters a
// fragment needs: this process's name, the probe lease, the longest break and the members'
// window, the three durations in ms.
struct Places {
  std::string process;
  std::string lease;
  std::string max_break;
  std::string members;
};

// Whether `who` is a process of the fleet: a member seen within the window, not in the future.
std::string live_member(const std::string& who, const Places& p) {
  return "EXISTS (SELECT 1 FROM keel_breaker_members m WHERE m.process = " + who +
         " AND m.seen_at >= now() - " + ms(p.members) +
         " AND m.seen_at <= statement_timestamp() + " + kSlack + ")";
}

// Each kind out of the domain, as a condition that may be NULL.
std::string unknown_state() { return "(b.state NOT IN ('open', 'closed'))"; }
std::string open_without_end() { return "(b.state = 'open' AND b.open_until IS NULL)"; }
std::string open_too_long(const Places& p) {
  return "(b.state = 'open' AND (NOT isfinite(b.open_until) OR b.open_until >"
         " statement_timestamp() + " +
         ms(p.max_break) + " + " + kSlack + "))";
}
std::string bad_lease(const Places& p) {
  return "(b.probe_holder IS NOT NULL AND (b.probe_until IS NULL OR NOT isfinite(b.probe_until)"
         " OR b.probe_until > statement_timestamp() + " +
         ms(p.lease) + " + " + kSlack + "))";
}
std::string unknown_holder(const Places& p) {
  return "(b.probe_holder IS NOT NULL AND b.probe_holder <> " + p.process +
         " AND (b.probe_until > now()) IS TRUE AND NOT " + live_member("b.probe_holder", p) + ")";
}
std::string bad_count() {
  const std::string bound = std::to_string(kMaxCount);
  return "(b.breaks NOT BETWEEN 0 AND " + bound + " OR b.probes NOT BETWEEN 0 AND " + bound + ")";
}

std::string flags(const Places& p) {
  const auto bit = [](const std::string& condition, int flag) {
    return "CASE WHEN " + condition + " IS TRUE THEN " + std::to_string(flag) + " ELSE 0 END";
  };
  return "(" + bit(unknown_state(), kUnknownState) + " + " +
         bit(open_without_end(), kOpenWithoutEnd) + " + " + bit(open_too_long(p), kOpenTooLong) +
         " + " + bit(bad_lease(p), kBadLease) + " + " + bit(unknown_holder(p), kUnknownHolder) +
         " + " + bit(bad_count(), kBadCount) + ")";
}

// The end of an open row's break as obeyed: none or -infinity is over, and never later than the
// longest break from now.
std::string break_end(const Places& p) {
  return "LEAST(COALESCE(b.open_until, now()), now() + " + ms(p.max_break) + ")";
}

// Whether another process of the fleet holds a live probe lease.
std::string held_by_other(const Places& p) {
  return "(b.probe_holder IS NOT NULL AND b.probe_holder <> " + p.process +
         " AND (b.probe_until > now()) IS TRUE AND " + live_member("b.probe_holder", p) + ")";
}

// What is read of a row (RowRead): the state, the ms left of its break and of another
// process's lease (both bounded), the flags, and the columns as text for the notices.
std::string row_columns(const Places& p) {
  return "b.state, " + ms_until(break_end(p)) + ", CASE WHEN " + held_by_other(p) + " THEN " +
         ms_until("LEAST(b.probe_until, now() + " + ms(p.lease) + ")") + " ELSE 0 END, " +
         flags(p) +
         ", b.open_until::text, b.probe_holder, b.probe_until::text, b.breaks::text,"
         " b.probes::text";
}
constexpr std::size_t kRowColumns = 9;

// ---------------------------------------------------------------------------------------------
// The statements.

struct BreakerStatements {
  std::string take_probe;
  std::string fleet_state;
  std::string publish_open;
  std::string publish_closed;
  std::string repair;
};

// $1 key, $2 process, $3 lease in ms, $4 longest break in ms, $5 members' window in ms. The
// first column is 1 when this process took the probe lease (then the rest is the row as it
// was); no row: the key has none.
std::string take_probe_sql() {
  const Places p{.process = "$2", .lease = "$3", .max_break = "$4", .members = "$5"};
  return "WITH took AS (UPDATE keel_breakers b SET probe_holder = $2,"
         " probe_until = now() + " +
         ms("$3") + ", probes = " + sane_count("b.probes") +
         " + CASE WHEN b.probe_holder IS NOT DISTINCT FROM $2 THEN 0 ELSE 1 END"
         " WHERE b.key = $1 AND b.state = 'open' AND " +
         break_end(p) + " <= now() AND NOT " + held_by_other(p) +
         " RETURNING 1)"
         " SELECT (SELECT count(*) FROM took), " +
         row_columns(p) + " FROM keel_breakers b WHERE b.key = $1";
}

// $1 process, $2 lease, $3 longest break, $4 members' window: every row not closed, and every
// row out of its domain.
std::string fleet_state_sql() {
  const Places p{.process = "$1", .lease = "$2", .max_break = "$3", .members = "$4"};
  return "SELECT b.key, " + row_columns(p) + " FROM keel_breakers b WHERE b.state <>" +
         " 'closed' OR " + flags(p) + " <> 0";
}

// $1 key, $2 break in ms, $3 process, $4 notification payload, $5 longest break, $6 members'
// window.
std::string publish_open_sql() {
  const Places p{.process = "$3", .lease = "", .max_break = "$5", .members = "$6"};
  return "WITH up AS ("
         " INSERT INTO keel_breakers AS b (key, state, open_until, breaks, updated_by, updated_at)"
         " VALUES ($1, 'open', now() + " +
         ms("$2") +
         ", 1, $3, now())"
         " ON CONFLICT (key) DO UPDATE SET state = 'open', open_until = EXCLUDED.open_until,"
         "  breaks = " +
         sane_count("b.breaks") + " + 1, probes = " + sane_count("b.probes") +
         ", probe_holder = NULL, probe_until = NULL, updated_by = $3, updated_at = now()"
         " WHERE b.state <> 'open' OR (" +
         break_end(p) + " <= now() AND NOT " + held_by_other(p) +
         ") RETURNING 1)"
         " SELECT pg_notify('keel_breakers', $4) FROM up";
}

// $1 key, $2 process, $3 notification payload. Whatever the row held.
std::string publish_closed_sql() {
  return "WITH up AS (UPDATE keel_breakers b SET state = 'closed', open_until = NULL,"
         " probe_holder = NULL, probe_until = NULL, breaks = " +
         sane_count("b.breaks") + ", probes = " + sane_count("b.probes") +
         ", updated_by = $2, updated_at = now()"
         " WHERE b.key = $1 AND b.state <> 'closed' RETURNING 1)"
         " SELECT pg_notify('keel_breakers', $3) FROM up";
}

// $1 key, $2 process, $3 lease, $4 longest break: the row rewritten into its domain, where it
// can be (an unknown state or holder is left to the next publication or lease).
std::string repair_sql() {
  const Places p{.process = "$2", .lease = "$3", .max_break = "$4", .members = ""};
  const std::string lease_over = "(b.probe_until IS NULL OR b.probe_until < now())";
  return "UPDATE keel_breakers b SET"
         " open_until = CASE WHEN (" +
         open_without_end() + " OR " + open_too_long(p) +
         ") IS TRUE THEN GREATEST(LEAST(COALESCE(b.open_until, now()), now() + " + ms("$4") +
         "), now()) ELSE b.open_until END,"
         " probe_holder = CASE WHEN " +
         bad_lease(p) + " IS TRUE AND " + lease_over +
         " THEN NULL ELSE b.probe_holder END,"
         " probe_until = CASE WHEN " +
         bad_lease(p) + " IS NOT TRUE THEN b.probe_until WHEN " + lease_over +
         " THEN NULL ELSE LEAST(b.probe_until, now() + " + ms("$3") +
         ") END,"
         " breaks = " +
         sane_count("b.breaks") + ", probes = " + sane_count("b.probes") +
         ", updated_by = $2, updated_at = now()"
         " WHERE b.key = $1 AND (" +
         open_without_end() + " OR " + open_too_long(p) + " OR " + bad_lease(p) + " OR " +
         bad_count() + ") IS TRUE RETURNING 1";
}

const BreakerStatements& breaker_statements() {
  static const BreakerStatements statements{.take_probe = take_probe_sql(),
                                            .fleet_state = fleet_state_sql(),
                                            .publish_open = publish_open_sql(),
                                            .publish_closed = publish_closed_sql(),
                                            .repair = repair_sql()};
  return statements;
}

}  // namespace

// A row of keel_breakers as read (row_columns).
struct SharedBreakers::RowRead {
  std::string state;
  std::int64_t open_ms = 0;   // the rest of its break, bounded
  std::int64_t lease_ms = 0;  // the rest of another live member's lease, bounded
  int flags = 0;
  std::string open_until, holder, probe_until, breaks, probes;  // as text, for the notices

  // The row_columns(p) under `c`, in their order.
  static RowRead from(RowCursor& c) {
    RowRead r;
    r.state = text_cell(c.cell());
    r.open_ms = integer_cell(c.cell());
    r.lease_ms = integer_cell(c.cell());
    r.flags = static_cast<int>(integer_cell(c.cell()));
    r.open_until = text_cell(c.cell());
    r.holder = text_cell(c.cell());
    r.probe_until = text_cell(c.cell());
    r.breaks = text_cell(c.cell());
    r.probes = text_cell(c.cell());
    return r;
  }
};

// ---------------------------------------------------------------------------------------------
// The background thread's statements on keel_breakers.

// Answers the trials waiting for the fleet, one statement each. Throws when the connection is
// lost (each waiting trial answered: decided locally).
void SharedBreakers::serve_gates() {
  for (;;) {
    std::shared_ptr<GateRequest> request;
    {
      std::lock_guard lock(mu_);
      answering_ = true;
      while (!gates_.empty() && gates_.front()->abandoned) gates_.pop_front();
      if (gates_.empty()) return;
      request = gates_.front();
      gates_.pop_front();
    }
    Duration hold{};
    bool lost = false;
    try {
      hold = ask_fleet(request->key);
    } catch (const std::exception&) {
      // Slow (statement_timeout, lock_timeout) or gone: this trial is decided locally.
      lost = work_->broken();
      std::lock_guard lock(mu_);
      if (!request->abandoned) fallbacks_.fetch_add(1);
    }
    {
      std::lock_guard lock(mu_);
      request->hold = hold;
      request->answered = true;
    }
    answered_cv_.notify_all();
    if (lost) throw std::runtime_error("the connection was lost");
  }
}

// One trial's question: takes the probe lease when the fleet's break is over and no other
// member holds it (zero: the trial runs), else how long to hold the breaker open.
Duration SharedBreakers::ask_fleet(const std::string& key) {
  const Value params[] = {key, options_.process, lease_ms_, max_break_ms_, members_ms_};
  const Rows rows = bounded(breaker_statements().take_probe, params);
  // No row: the fleet has not heard of this break yet; the trial runs.
  if (rows.empty() || rows.columns() < 1 + kRowColumns) return Duration::zero();
  RowCursor c(rows, 0);
  const std::int64_t took = integer_cell(c.cell());
  const RowRead row = RowRead::from(c);
  note_row(key, row);
  if (took > 0) {
    probes_taken_.fetch_add(1);
    return Duration::zero();
  }
  // A state keel does not write: ignored, the breaker decides alone.
  if ((row.flags & kUnknownState) != 0) return Duration::zero();
  if (row.state != "open") {
    // Closed: the fleet's probe succeeded. Stay open until this process's release time, so
    // that the fleet comes back spread over release_spread rather than at once.
    // A release that is due is being applied by the background thread: a few ms more.
    return std::max<Duration>(release_in(key), std::chrono::milliseconds(5));
  }
  // Re-opened by the fleet (a notification missed): hold for the rest of its break. Another
  // member holds the probe: ask again within probe_wait, when its result has likely come (a
  // hold of the whole lease would outlast the fleet's close by up to the lease). Neither and no
  // lease taken: the row changed while this statement waited for it; ask again soon.
  const std::int64_t wait_ms = clamped_ms(options_.probe_wait);
  std::int64_t hold = 0;
  if (row.open_ms > 0) {
    hold = std::min(row.open_ms, max_break_ms_);
  } else if (row.lease_ms > 0) {
    hold = std::min({row.lease_ms, lease_ms_, wait_ms});
  } else {
    hold = std::min<std::int64_t>(wait_ms, 100);
  }
  probes_held_.fetch_add(1);
  Duration held = std::chrono::milliseconds(std::max<std::int64_t>(hold, 1));
  if (row.open_ms <= 0) {
    // Asking again within the hold, at a uniform moment in its second half, so that the
    // processes held by one probe do not all ask at once (and none past probe_wait or the
    // prober's lease).
    std::lock_guard lock(mu_);
    held = std::max<Duration>(uniform_duration(held / 2, held, rng_), std::chrono::milliseconds(1));
  }
  return held;
}

// Says what of `row` is outside its domain, once per row and kind, and queues the rows that can
// be rewritten into it.
void SharedBreakers::note_row(const std::string& key, const RowRead& row) {
  if (row.flags == 0) return;
  const std::string name = "keel_breakers row " + quote_value(key) + ": ";
  for (const int flag : kRowFlags) {
    if ((row.flags & flag) == 0 || !first_time(std::to_string(flag) + "\n" + key)) continue;
    rows_out_of_domain_.fetch_add(1);
    std::string what;
    switch (flag) {
      case kUnknownState:
        what = "state " + quote_value(row.state) +
               " is neither 'open' nor 'closed'; ignored (this process's breaker decides alone) "
               "until a process publishes the key's state";
        break;
      case kOpenWithoutEnd:
        what =
            "open without an end (open_until NULL); read as a break that is over (the next "
            "trial is the fleet's probe), and rewritten";
        break;
      case kOpenTooLong:
        what = "open_until " + quote_value(row.open_until) +
               " is not a time within max_break_duration (" +
               format_duration(std::chrono::milliseconds(max_break_ms_)) +
               ") from now; obeyed as at most that, and rewritten";
        break;
      case kBadLease:
        what = "probe lease of " + quote_value(row.holder) + " until " +
               quote_value(row.probe_until) + " is not a time within probe_lease (" +
               format_duration(options_.probe_lease) +
               ") from now; obeyed as at most that, and rewritten";
        break;
      case kUnknownHolder:
        what = "the probe is held by " + quote_value(row.holder) +
               ", which is not a process of the fleet (no heartbeat within " +
               format_duration(std::chrono::milliseconds(members_ms_)) + "); its lease is ignored";
        break;
      case kBadCount:
        what = "breaks " + row.breaks + " or probes " + row.probes +
               " out of range (0 to 2^53); reset to 0";
        break;
      default:
        break;
    }
    notice(name + what);
  }
  if ((row.flags & (kOpenWithoutEnd | kOpenTooLong | kBadLease | kBadCount)) != 0) {
    repairs_.insert(key);
  }
}

// Rewrites the rows queued by note_row into their domain (each key once: a row edited out of
// it again is bounded when read, and said no more).
void SharedBreakers::repair_rows() {
  while (!repairs_.empty()) {
    const std::string key = *repairs_.begin();
    const Value params[] = {key, options_.process, lease_ms_, max_break_ms_};
    try {
      if (!bounded(breaker_statements().repair, params).empty()) rows_repaired_.fetch_add(1);
    } catch (const DatabaseError& e) {
      if (!value_error(e)) throw;  // slow or gone: repaired after the reconnection
    }
    repairs_.erase(key);
  }
}

// Requires: the background thread.
void SharedBreakers::publish_pending() {
  std::map<std::string, Publication, std::less<>> batch;
  {
    std::lock_guard lock(mu_);
    batch.swap(pending_);
    writing_ = !batch.empty();
  }
  auto it = batch.begin();
  try {
    for (; it != batch.end(); ++it) {
      const std::string& key = it->first;
      try {
        if (it->second.open) {
          const auto left = it->second.until - std::chrono::steady_clock::now();
          const std::int64_t ms =
              std::min(clamped_ms(std::max<Duration>(left, Duration::zero())), max_break_ms_);
          const std::string payload =
              schema_ + "\nopen\n" + std::to_string(ms) + "\n" + options_.process + "\n" + key;
          const Value params[] = {key, ms, options_.process, payload, max_break_ms_, members_ms_};
          (void)bounded(breaker_statements().publish_open, params);
        } else {
          const std::string payload = schema_ + "\nclosed\n0\n" + options_.process + "\n" + key;
          const Value params[] = {key, options_.process, payload};
          (void)bounded(breaker_statements().publish_closed, params);
        }
        published_.fetch_add(1);
      } catch (const DatabaseError& e) {
        // A value of this key's row that no statement can take: this change is not shared, the
        // others are.
        if (!value_error(e)) throw;
        if (first_time("publish\n" + key)) {
          notice("keel_breakers row " + quote_value(key) + ": cannot be written (" + e.what() +
                 "); this process's changes of it are not shared");
        }
      }
      serve_gates();  // a trial waiting meanwhile is answered between two publications
      serve_leases();
    }
  } catch (...) {
    // Keep what was not written, unless a newer change of the same key came meanwhile.
    std::lock_guard lock(mu_);
    for (; it != batch.end(); ++it) pending_.try_emplace(it->first, it->second);
    writing_ = false;
    cv_.notify_all();
    throw;
  }
  std::lock_guard lock(mu_);
  writing_ = false;
  cv_.notify_all();
}

// Requires: the background thread.
void SharedBreakers::read_fleet_state() {
  const Value params[] = {options_.process, lease_ms_, max_break_ms_, members_ms_};
  Rows rows;
  try {
    rows = bounded(breaker_statements().fleet_state, params);
  } catch (const DatabaseError& e) {
    if (!value_error(e)) throw;
    if (first_time("read\n")) {
      notice(std::string("keel_breakers cannot be read (") + e.what() +
             "); this process shares the changes from now on");
    }
    return;
  }
  for (std::size_t i = 0; i < rows.size(); ++i) {
    RowCursor c(rows, i);
    const std::string key = text_cell(c.cell());
    if (!shareable(key)) {
      if (first_time("key\n" + key)) {
        rows_out_of_domain_.fetch_add(1);
        notice("keel_breakers row " + quote_value(key) +
               ": not a key keel shares (empty, longer than " + std::to_string(kMaxKey) +
               " bytes or with a line break); ignored");
      }
      continue;
    }
    const RowRead row = RowRead::from(c);
    note_row(key, row);
    if ((row.flags & kUnknownState) == 0 && row.state == "open") {
      apply_open(key, std::chrono::milliseconds(row.open_ms));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// SharedBreakers and this process's own breakers: the registry's listener, which queues each
// state change for the background thread to publish; the registry's trial gate, which asks the
// fleet whether a half-open trial may be the fleet's probe and waits for the answer at most
// round_trip_limit; and the fleet's state applied to the breakers (opened for the rest of the
// fleet's break, closed at a random moment within release_spread after the fleet's probe
// succeeded).

namespace {

// Set on a thread while it applies the fleet's state to a breaker, so that the change it causes
// is not published back.
thread_local const SharedBreakers* t_applying = nullptr;
// Set by the trial gate when it holds a breaker open for another process's probe: the
// half-open -> open change that follows is this process's own echo of the fleet's state.
thread_local const SharedBreakers* t_held_by = nullptr;
thread_local std::string t_held_key;

}  // namespace

// A local breaker changed state: queue the change for the background thread (latest per key).
void SharedBreakers::on_change(std::string_view key, BreakerState from, BreakerState to) {
  if (t_applying == this) return;  // the fleet's own state being applied here
  if (t_held_by == this && from == BreakerState::kHalfOpen && to == BreakerState::kOpen &&
      t_held_key == key) {
    t_held_by = nullptr;  // held open for another process's probe: nothing new to tell
    return;
  }
  if (to == BreakerState::kHalfOpen || !shareable(key)) return;
  Publication publication;
  if (to == BreakerState::kOpen) {
    const auto breaker = registry_.find(key);
    publication.open = true;
    publication.until =
        std::chrono::steady_clock::now() + (breaker ? breaker->retry_in() : Duration::zero());
  }
  {
    std::lock_guard lock(mu_);
    pending_.insert_or_assign(std::string(key), publication);
    releases_.erase(std::string(key));
    if (listener_ != nullptr) listener_->interrupt();
  }
}

// The trial gate: may this process's half-open trial be the fleet's probe? Asked of the
// background thread, and waited for at most round_trip_limit.
Duration SharedBreakers::gate(std::string_view key) {
  t_held_by = nullptr;
  if (!shareable(key)) return Duration::zero();
  const auto request = std::make_shared<GateRequest>();
  request->key = std::string(key);
  Duration hold{};
  {
    std::unique_lock lock(mu_);
    if (!sharing_.load() || !answering_ || listener_ == nullptr) {
      lock.unlock();
      fallbacks_.fetch_add(1);
      return Duration::zero();
    }
    gates_.push_back(request);
    listener_->interrupt();
    // wait: bound: an answer from the background thread, at most round_trip_limit
    if (!answered_cv_.wait_for(lock, options_.round_trip_limit,
                               [&] { return request->answered; })) {
      // No answer in time (a slow or frozen database): this trial is decided locally, and so
      // are the next ones, at once, until the background thread answers again.
      request->abandoned = true;
      answering_ = false;
      lock.unlock();
      fallbacks_.fetch_add(1);
      return Duration::zero();
    }
    hold = request->hold;
  }
  if (hold > Duration::zero()) {
    t_held_by = this;
    t_held_key = std::string(key);
  }
  return hold;
}

// When this process closes `key`'s breaker after the fleet's probe succeeded: a random moment
// within release_spread, drawn once per close (by the notification or by the trial gate,
// whichever comes first). Returns the time left until then.
Duration SharedBreakers::release_in(const std::string& key) {
  std::lock_guard lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  auto it = releases_.find(key);
  if (it == releases_.end()) {
    const Duration after = uniform_duration(Duration::zero(), options_.release_spread, rng_);
    it = releases_.emplace(key, now + after).first;
    if (listener_ != nullptr) listener_->interrupt();  // the background thread's next wait
  }
  return it->second > now ? Duration(it->second - now) : Duration::zero();
}

// Opens `key`'s breaker for the fleet, for the rest of its break, never longer than the
// breaker's longest break.
void SharedBreakers::apply_open(const std::string& key, Duration remaining) {
  {
    std::lock_guard lock(mu_);
    releases_.erase(key);
  }
  const auto breaker = registry_.get(key);
  if (!breaker) return;  // the registry is full of open breakers
  t_applying = this;
  breaker->force_open(std::min(remaining, breaker->options().max_break_duration));
  t_applying = nullptr;
  applied_opens_.fetch_add(1);
}

// Closes the breakers whose release is due; returns how long until the next one.
Duration SharedBreakers::release_due() {
  std::vector<std::pair<std::string, Instant>> due;
  Duration next = kInfinite;
  {
    std::lock_guard lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    for (const auto& [key, at] : releases_) {
      if (at <= now) {
        due.emplace_back(key, at);
      } else {
        next = std::min<Duration>(next, at - now);
      }
    }
  }
  for (const auto& [key, at] : due) {
    const auto breaker = registry_.find(key);
    if (breaker && breaker->state() != BreakerState::kClosed) {
      t_applying = this;
      breaker->reset();
      t_applying = nullptr;
      applied_closes_.fetch_add(1);
    }
    // Forgotten only once the breaker is closed: a trial asked for meanwhile is held, not run.
    std::lock_guard lock(mu_);
    if (const auto it = releases_.find(key); it != releases_.end() && it->second == at) {
      releases_.erase(it);
    }
  }
  return next;
}

}  // namespace keel::store
