// SharedBreakers (keel/store/fleet/shared_breakers.hpp): the table keel_breakers, one row per
// dependency that has ever opened in the fleet, and the channel keel_breakers, whose payload is
// "schema\nstate\nmilliseconds\nprocess\nkey".
//
// The rules, each in one statement:
//   - open: a process's breaker opened. The row becomes open until now + its break, unless the
//     fleet's break is still running or another process holds a live probe lease (then nothing
//     changes: the fleet keeps one probe time and one probe).
//   - probe: the call that would be a half-open trial asks for the lease. It gets it when the
//     row is open, the break is over and no other process holds a live lease.
//   - closed: the probe succeeded. The row becomes closed and the lease is dropped.
// Every change that took effect is announced with NOTIFY in the same statement.
#include "keel/store/fleet/shared_breakers.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <random>
#include <stdexcept>
#include <utility>

#include "db/detail/listener.hpp"
#include "keel/duration.hpp"
#include "keel/store/db/dialect.hpp"

namespace keel::store {
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

// $1 process, $2 how long a member counts without a heartbeat, in ms. Returns the fleet's size,
// this process included.
// $1 process, $2 how long a member counts without a heartbeat, in ms, $3 the notification a
// process sends when it joins (so that the others count it at once, not at their next
// heartbeat). Returns the fleet's size, this process included.
constexpr std::string_view kHeartbeat =
    "WITH beat AS (INSERT INTO keel_breaker_members (process, seen_at) VALUES ($1, now())"
    "  ON CONFLICT (process) DO UPDATE SET seen_at = now() RETURNING (xmax = 0) AS joined),"
    " gone AS (DELETE FROM keel_breaker_members"
    "  WHERE seen_at < now() - $2 * interval '1 millisecond'),"
    " hello AS (SELECT pg_notify('keel_breakers', $3) FROM beat WHERE joined)"
    " SELECT count(*) FILTER (WHERE process <> $1) + 1, (SELECT count(*) FROM hello)"
    " FROM keel_breaker_members WHERE seen_at >= now() - $2 * interval '1 millisecond'";

constexpr std::string_view kLeave = "DELETE FROM keel_breaker_members WHERE process = $1";

// $1 key, $2 break in ms, $3 process, $4 notification payload.
constexpr std::string_view kPublishOpen =
    "WITH up AS ("
    " INSERT INTO keel_breakers AS b (key, state, open_until, breaks, updated_by, updated_at)"
    " VALUES ($1, 'open', now() + $2 * interval '1 millisecond', 1, $3, now())"
    " ON CONFLICT (key) DO UPDATE SET state = 'open', open_until = EXCLUDED.open_until,"
    "  breaks = b.breaks + 1, probe_holder = NULL, probe_until = NULL, updated_by = $3,"
    "  updated_at = now()"
    " WHERE b.state <> 'open' OR (b.open_until <= now() AND (b.probe_holder IS NULL"
    "  OR b.probe_holder = $3 OR b.probe_until <= now()))"
    " RETURNING 1)"
    " SELECT pg_notify('keel_breakers', $4) FROM up";

// $1 key, $2 process, $3 notification payload.
constexpr std::string_view kPublishClosed =
    "WITH up AS ("
    " UPDATE keel_breakers SET state = 'closed', open_until = NULL, probe_holder = NULL,"
    "  probe_until = NULL, updated_by = $2, updated_at = now()"
    " WHERE key = $1 AND state = 'open' RETURNING 1)"
    " SELECT pg_notify('keel_breakers', $3) FROM up";

// $1 key, $2 process, $3 lease in ms. A row comes back when this process holds the probe.
constexpr std::string_view kTakeProbe =
    "UPDATE keel_breakers SET probe_holder = $2,"
    " probe_until = now() + $3 * interval '1 millisecond',"
    " probes = probes + CASE WHEN probe_holder IS NOT DISTINCT FROM $2 THEN 0 ELSE 1 END"
    " WHERE key = $1 AND state = 'open' AND open_until <= now()"
    " AND (probe_holder IS NULL OR probe_until <= now() OR probe_holder = $2)"
    " RETURNING 1";

constexpr std::string_view kFleetState =
    "SELECT state,"
    " CASE WHEN open_until > now()"
    "  THEN ceil(extract(epoch FROM open_until - now()) * 1000)::bigint ELSE 0 END,"
    " CASE WHEN probe_until > now()"
    "  THEN ceil(extract(epoch FROM probe_until - now()) * 1000)::bigint ELSE 0 END"
    " FROM keel_breakers WHERE key = $1";

constexpr std::string_view kOpenRows =
    "SELECT key, CASE WHEN open_until > now()"
    "  THEN ceil(extract(epoch FROM open_until - now()) * 1000)::bigint ELSE 0 END"
    " FROM keel_breakers WHERE state = 'open'";

// The longest key shared (NOTIFY payloads are limited to 8,000 bytes).
constexpr std::size_t kMaxKey = 1000;

// Set on a thread while it applies the fleet's state to a breaker, so that the change it causes
// is not published back.
thread_local const SharedBreakers* t_applying = nullptr;
// Set by the trial gate when it holds a breaker open for another process's probe: the
// half-open -> open change that follows is this process's own echo of the fleet's state.
thread_local const SharedBreakers* t_held_by = nullptr;
thread_local std::string t_held_key;

bool shareable(std::string_view key) {
  return !key.empty() && key.size() <= kMaxKey && key.find('\n') == std::string_view::npos;
}

std::string default_process() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  std::string name = host[0] != '\0' ? host : "localhost";
  std::replace_if(
      name.begin(), name.end(), [](char c) { return c == ' ' || c == '\n'; }, '_');
  std::random_device rd;
  char tail[16];
  std::snprintf(tail, sizeof tail, "%04x", static_cast<unsigned>(rd() & 0xffffu));
  return name + ":" + std::to_string(::getpid()) + ":" + tail;
}

std::int64_t to_ms(Duration d) {
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(d).count();
  return ms < 0 ? 0 : ms;
}

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
  if (o.process.find_first_of(" \t\r\n") != std::string::npos) {
    reject("process", "a name without whitespace", "\"" + o.process + "\"");
  }
}

}  // namespace

void SharedBreakers::TimedLock::lock() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return !held_; });
  held_ = true;
}

void SharedBreakers::TimedLock::unlock() {
  {
    std::lock_guard lock(mu_);
    held_ = false;
  }
  cv_.notify_one();
}

bool SharedBreakers::TimedLock::try_lock_for(Duration timeout) {
  std::unique_lock lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return !held_; })) return false;
  held_ = true;
  return true;
}

SharedBreakers::SharedBreakers(BreakerRegistry& registry, DatabaseUrl url,
                               SharedBreakersOptions options)
    : registry_(registry),
      url_(std::move(url)),
      options_(std::move(options)),
      reconnect_((validate(options_), options_.reconnect)),
      rng_(std::random_device{}()) {
  if (!dialect_of(url_.backend).listen_notify()) {
    throw std::invalid_argument(
        "SharedBreakers: " + url_.redacted +
        " has no notifications; breakers are shared through PostgreSQL only (on SQLite each "
        "process keeps its own)");
  }
  if (options_.process.empty()) options_.process = default_process();
  if (!options_.on_notice) {
    options_.on_notice = [](std::string_view message) {
      std::fprintf(stderr, "keel: shared breakers: %.*s\n", static_cast<int>(message.size()),
                   message.data());
    };
  }
  listener_id_ = registry_.add_listener([this](std::string_view key, BreakerState from,
                                               BreakerState to) { on_change(key, from, to); });
  registry_.set_trial_gate([this](std::string_view key) { return gate(key); });
  thread_ = std::thread([this] { run(); });
}

SharedBreakers::~SharedBreakers() {
  stopping_.store(true);
  registry_.set_trial_gate(nullptr);  // waits for a gate that is running
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
  return cv_.wait_for(lock, timeout, [&] { return sharing_.load() || stopping_.load(); }) &&
         sharing_.load();
}

bool SharedBreakers::flush(Duration timeout) {
  std::unique_lock lock(mu_);
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
          .fleet_size = registry_.fleet_size()};
}

void SharedBreakers::notice(const std::string& message) {
  try {
    options_.on_notice(message);
  } catch (...) {
    // A notice is advice: a listener that throws changes nothing.
  }
}

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

// The trial gate: may this process's half-open trial be the fleet's probe?
Duration SharedBreakers::gate(std::string_view key) {
  t_held_by = nullptr;
  if (!shareable(key)) return Duration::zero();
  if (!sharing_.load()) {
    fallbacks_.fetch_add(1);
    return Duration::zero();
  }
  std::unique_lock work(work_mu_, std::defer_lock);
  if (!work.try_lock_for(options_.round_trip_limit) || work_ == nullptr || work_->broken()) {
    fallbacks_.fetch_add(1);
    return Duration::zero();
  }
  try {
    const Value take[] = {std::string(key), options_.process, to_ms(options_.probe_lease)};
    if (!work_->query(kTakeProbe, take).empty()) {
      probes_taken_.fetch_add(1);
      return Duration::zero();
    }
    const Value which[] = {std::string(key)};
    const Rows row = work_->query(kFleetState, which);
    // No row: the fleet has not heard of this break yet; the trial runs.
    if (row.empty()) return Duration::zero();
    if (row.text(0, 0) != "open") {
      // Closed: the fleet's probe succeeded. Stay open until this process's release time, so
      // that the fleet comes back spread over release_spread rather than at once.
      // A release that is due is being applied by the background thread: a few ms more.
      const Duration release = release_in(std::string(key));
      t_held_by = this;
      t_held_key = std::string(key);
      return std::max<Duration>(release, std::chrono::milliseconds(5));
    }
    const std::int64_t open_ms = row.integer(0, 1);
    const std::int64_t lease_ms = row.integer(0, 2);
    // Re-opened by the fleet (a notification missed): hold for the rest of its break. Another
    // process holds the probe: ask again within probe_wait, when its result has likely come
    // (a hold of the whole lease would outlast the fleet's close by up to the lease). Neither
    // and no lease taken means the lease was freed in between: ask again soon.
    const std::int64_t hold = std::max<std::int64_t>(
        1, open_ms > 0 ? open_ms : std::min(lease_ms, to_ms(options_.probe_wait)));
    probes_held_.fetch_add(1);
    t_held_by = this;
    t_held_key = std::string(key);
    return std::chrono::milliseconds(hold);
  } catch (const std::exception&) {
    // Slow (statement_timeout) or gone: this trial is decided locally.
    fallbacks_.fetch_add(1);
    if (work_->broken()) {
      broken_.store(true);
      std::lock_guard lock(mu_);
      if (listener_ != nullptr) listener_->interrupt();
    }
    return Duration::zero();
  }
}

void SharedBreakers::run() {
  Duration delay{};
  while (!stopping_.load()) {
    std::unique_ptr<detail::Listener> listener;
    try {
      listener = detail::open_listener(url_, options_.connect);
      {
        std::lock_guard lock(mu_);
        if (stopping_.load()) break;
        listener_ = listener.get();
      }
      share(*listener);
    } catch (const std::exception& e) {
      if (failures_++ == 0) {
        notice(std::string("the database is unreachable (") + e.what() +
               "); each process keeps its own breakers until it is back");
      }
    }
    sharing_.store(false);
    registry_.set_fleet_size(1);  // alone until the fleet is back
    {
      std::lock_guard lock(mu_);
      listener_ = nullptr;
    }
    listener.reset();
    {
      std::lock_guard work(work_mu_);
      work_.reset();
    }
    if (stopping_.load()) break;
    // Reconnect after core's full jitter.
    std::unique_lock lock(mu_);
    delay = reconnect_.delay(std::max(0, failures_ - 1), delay, rng_);
    cv_.wait_for(lock, delay, [&] { return stopping_.load(); });
  }
  {
    std::lock_guard lock(mu_);
    sharing_.store(false);
  }
  cv_.notify_all();
}

// Connected: set up, then publish, apply notifications and release breakers until something
// fails or the object is destroyed. Throws on any database error.
void SharedBreakers::share(detail::Listener& listener) {
  schema_ = listener.scalar("SELECT current_schema()");
  listener.listen(kChannel);  // before the table is read: no change falls in between
  {
    auto conn = open_database(url_, options_.connect);
    migrate(*conn, "breakers", kMigrations);
    // From now on every statement is bounded: a slow database makes callers decide locally.
    conn->execute("SET statement_timeout = " + std::to_string(to_ms(options_.round_trip_limit)));
    std::lock_guard work(work_mu_);
    work_ = std::move(conn);
    broken_.store(false);
    publish_pending();  // what this process learnt while it could not share
    read_fleet_state();
  }
  {
    std::lock_guard lock(mu_);  // a waiter checks sharing_ under mu_: no wakeup is lost
    sharing_.store(true);
  }
  cv_.notify_all();
  if (failures_ > 0) {
    reconnects_.fetch_add(1);
    notice("sharing again: the database is back");
  }
  failures_ = 0;
  next_beat_ = std::chrono::steady_clock::now();
  while (!stopping_.load() && !broken_.load()) {
    {
      std::lock_guard work(work_mu_);
      publish_pending();
      if (std::chrono::steady_clock::now() >= next_beat_) {
        heartbeat();
        std::lock_guard lock(mu_);
        next_beat_ = std::chrono::steady_clock::now() +
                     uniform_duration(options_.heartbeat / 2, options_.heartbeat / 2 * 3, rng_);
      }
    }
    const Duration wait =
        std::min<Duration>(release_due(), next_beat_ - std::chrono::steady_clock::now());
    for (const detail::Notification& n : listener.wait(std::max<Duration>(wait, Duration{}))) {
      apply(n.payload);
    }
  }
  if (broken_.load()) throw std::runtime_error("the connection was lost");
  // Leaving: the others count one process fewer at their next heartbeat.
  try {
    std::lock_guard work(work_mu_);
    const Value me[] = {options_.process};
    (void)work_->query(kLeave, me);
  } catch (const std::exception&) {
    // The row expires after three heartbeats.
  }
}

// Requires: work_mu_ held.
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
      if (it->second.open) {
        const auto left = it->second.until - std::chrono::steady_clock::now();
        const std::int64_t ms = to_ms(std::max<Duration>(left, Duration::zero()));
        const std::string payload =
            schema_ + "\nopen\n" + std::to_string(ms) + "\n" + options_.process + "\n" + key;
        const Value params[] = {key, ms, options_.process, payload};
        (void)work_->query(kPublishOpen, params);
      } else {
        const std::string payload = schema_ + "\nclosed\n0\n" + options_.process + "\n" + key;
        const Value params[] = {key, options_.process, payload};
        (void)work_->query(kPublishClosed, params);
      }
      published_.fetch_add(1);
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

// Requires: work_mu_ held.
void SharedBreakers::heartbeat() {
  const std::string hello = schema_ + "\nmembers\n0\n" + options_.process + "\n*";
  const Value params[] = {options_.process, to_ms(options_.heartbeat * 3), hello};
  const Rows rows = work_->query(kHeartbeat, params);
  registry_.set_fleet_size(static_cast<int>(std::min<std::int64_t>(rows.integer(0, 0), 1 << 20)));
}

// Requires: work_mu_ held.
void SharedBreakers::read_fleet_state() {
  const Rows rows = work_->query(kOpenRows, {});
  for (std::size_t i = 0; i < rows.size(); ++i) {
    apply_open(rows.text(i, 0), std::chrono::milliseconds(rows.integer(i, 1)));
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
      if (c < '0' || c > '9' || ms > 1'000'000'000'000) return;
      ms = ms * 10 + (c - '0');
    }
    apply_open(key, std::chrono::milliseconds(ms));
  } else if (parts[1] == "closed") {
    (void)release_in(key);
  } else if (parts[1] == "members") {
    next_beat_ = std::chrono::steady_clock::now();  // a process joined: count again now
  }
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

void SharedBreakers::apply_open(const std::string& key, Duration remaining) {
  {
    std::lock_guard lock(mu_);
    releases_.erase(key);
  }
  const auto breaker = registry_.get(key);
  if (!breaker) return;  // the registry is full of open breakers
  t_applying = this;
  breaker->force_open(remaining);
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
