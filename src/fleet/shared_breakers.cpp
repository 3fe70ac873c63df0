// SharedBreakers (keel/fleet/shared_breakers.hpp): what its concepts share. The
// constructor and its options, the schema of the tables, the stats and the notices, and the
// background thread: its connection, its reconnect loop and the loop that serves the calls'
// requests, publishes, and applies the notifications of channel keel_breakers, whose payload is
// "schema\nstate\nmilliseconds\nprocess\nkey". Each concept's statements and their row readers
// are in a file of its own: fleet_membership.cpp, fleet_breakers.cpp (with this process's side of
// the breakers, fleet_breakers_local.cpp), fleet_rate_leases.cpp and fleet_pauses.cpp.
//
// Every statement runs on the background thread, in a transaction of its own whose
// statement_timeout and lock_timeout are set with set_config(..., true): nothing outlives it.
#include "keel/fleet/shared_breakers.hpp"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <utility>

#include "db/detail/listener.hpp"
#include "db/detail/process.hpp"
#include "fleet/detail/fleet_sql.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/random.hpp"
#include "keel/db/dialect.hpp"

namespace keel::store {

using detail::clamped_ms;
using detail::kLimits;
using detail::kMaxMs;
using detail::shareable;

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
  return schema_component("rate_limits", kRateMigrations, [](Connection& connection) {
    (void)store::migrate(connection, "rate_limits", kRateMigrations);
  });
}

SchemaComponent SharedBreakers::schema() noexcept {
  return schema_component("breakers", kMigrations, &SharedBreakers::migrate);
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
      lease_backoff_(BackoffOptions{.base = std::min<Duration>(options_.round_trip_limit,
                                                               std::chrono::seconds(60)),
                                    .cap = std::chrono::seconds(60)},
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

}  // namespace keel::store
