#include "keel/core/rate_limit.hpp"

#include <algorithm>
#include <cmath>

#include "detail/invalid.hpp"
#include "keel/core/backoff.hpp"
#include "keel/core/classify.hpp"
#include "keel/core/duration.hpp"

namespace keel {
namespace {

std::string text(double v) { return detail::format_number(v); }
std::string text(Duration d) { return format_duration(d); }

void validate(const RateLimitOptions& o) {
  constexpr detail::OptionsCheck reject("RateLimitOptions");
  if (!(o.rate_per_s == 0 || (o.rate_per_s >= kMinRatePerS && o.rate_per_s <= 1e6))) {
    reject("rate_per_s", "0 (no rate) or in [1/86400 (one a day), 1e6]", text(o.rate_per_s));
  }
  if (!(o.burst == 0 || (o.burst >= 1 && o.burst <= 1e6))) {
    reject("burst", "0 (none) or in [1, 1e6]", text(o.burst));
  }
  if (!(o.headroom >= 0 && o.headroom < 0.5)) reject("headroom", "in [0, 0.5)", text(o.headroom));
  if (o.max_pause <= Duration::zero()) reject("max_pause", "> 0", text(o.max_pause));
  if (o.release_spread < Duration::zero()) {
    reject("release_spread", ">= 0", text(o.release_spread));
  }
}

std::int64_t ns_of(TimePoint t) { return t.time_since_epoch().count(); }

}  // namespace

std::optional<Duration> pause_asked(const Outcome& outcome) noexcept {
  if (outcome.kind != OutcomeKind::kThrottled) return std::nullopt;
  if (outcome.source == OutcomeSource::kHttp && outcome.code != 429 && outcome.code != 503) {
    return std::nullopt;
  }
  if (!outcome.has_server_delay() || outcome.server_delay <= Duration::zero()) return std::nullopt;
  return outcome.server_delay;
}

bool waits_in_line(const RateDecision& refused, Duration max_wait) noexcept {
  return !refused.go && !refused.paused && refused.wait <= max_wait;
}

std::int64_t rate_chunk(double rate_per_s) noexcept {
  return std::clamp<std::int64_t>(std::llround(rate_per_s / 10), 1, 1000);
}

std::int64_t rate_life_us(double rate_per_s) noexcept {
  const double chunk_us = static_cast<double>(rate_chunk(rate_per_s)) * 1e6 / rate_per_s;
  return static_cast<std::int64_t>(std::clamp(3 * chunk_us, 10e6, 1e15));
}

RateLeaseAnswer decide_rate_lease(const RateScheduleRow& row, const RateLeaseAsk& ask) noexcept {
  RateLeaseAnswer out;
  out.row = row;
  const std::int64_t now = ask.now_us;
  // The rate: the lowest asserted within its life. This process's own renews or replaces it.
  const bool stored_valid = std::isfinite(row.rate_per_s) && row.rate_per_s > 0 &&
                            row.rate_per_s <= 1e6 && row.rate_at_us <= now + 1'000'000;
  out.rate_out_of_domain = row.rate_per_s != 0 && !stored_valid;
  const bool stored_live = stored_valid && now - row.rate_at_us <= rate_life_us(row.rate_per_s);
  double rate = ask.rate_per_s;
  if (stored_live && row.rate_per_s < ask.rate_per_s) {
    rate = row.rate_per_s;  // another process's lower rate, kept
    out.lower_rate_kept = true;
  } else {
    out.row.rate_per_s = ask.rate_per_s;
    out.row.rate_at_us = now;
  }
  out.rate_per_s = rate;
  const double interval_us = 1e6 / rate;
  const std::int64_t count = std::clamp<std::int64_t>(ask.count, 1, rate_chunk(rate));
  const auto span = static_cast<std::int64_t>(std::ceil(static_cast<double>(count) * interval_us));
  const auto burst = static_cast<std::int64_t>(std::max(0.0, ask.burst) * interval_us);
  // The furthest next_slot a lease leaves: a chunk starting at the horizon, of the longest span.
  const auto longest =
      static_cast<std::int64_t>(std::ceil(static_cast<double>(rate_chunk(rate)) * interval_us));
  const std::int64_t bound = now + ask.horizon_us + longest + 1'000'000;  // a second's slack
  std::int64_t slot = now;
  if (row.next_slot_us.has_value() && *row.next_slot_us <= bound) {
    slot = *row.next_slot_us;
  } else if (row.next_slot_us.has_value() || row.rate_at_us != 0) {
    out.slot_out_of_domain = true;  // not a time the schedule holds: read as now
  }
  const std::int64_t start = std::max(slot, now - burst);
  // The furthest a chunk may start: the horizon, or the calls' reach when shorter (a slot they
  // could not wait for stays in the schedule for a process whose calls can).
  const std::int64_t reach = std::clamp<std::int64_t>(ask.reach_us, 0, ask.horizon_us);
  if (start > now + reach) {
    // Full as far as the reach: room for a chunk when the schedule's end comes within it.
    out.retry_in_us = std::max<std::int64_t>(1000, start - now - reach);
    out.row.next_slot_us = slot;
    return out;
  }
  out.granted = true;
  out.start_us = start;
  out.count = count;
  out.interval_ns = std::max<std::int64_t>(1, std::llround(interval_us * 1000));
  out.row.next_slot_us = start + span;
  return out;
}

RateLimit::RateLimit(RateLimitOptions options, std::string key)
    : options_(std::move(options)), key_(std::move(key)) {
  validate(options_);
  if (options_.rate_per_s > 0) {
    interval_ns_ = std::max<std::int64_t>(1, std::llround(1e9 / spaced_rate()));
    burst_ns_ = static_cast<std::int64_t>(options_.burst * static_cast<double>(interval_ns_));
    // Half the headroom's share of the shortest window the dependency may count the rate over:
    // a second, or one slot's time at a rate under one a second (an API allowing 120 calls an
    // hour counts them over a minute or an hour, not a second). The other half is for the time
    // between a slot and the dependency's count of it (a timer that wakes late, the network). A
    // millisecond at least. At 120/h it is 0.45 s: a slot leased from the fleet in a round trip
    // that took longer than 15 ms (a loaded database) is still spent, not lost for 30 s.
    const double window_ns = std::max(1e9, static_cast<double>(interval_ns_));
    late_ns_ = std::max<std::int64_t>(
        {burst_ns_, std::llround(options_.headroom * 0.5 * window_ns), 1'000'000});
    chunk_ = rate_chunk(options_.rate_per_s);
  }
}

std::int64_t RateLimit::next_slot(std::int64_t now_ns) {
  const std::int64_t earliest = now_ns - late_ns_;
  while (!chunks_.empty()) {
    Chunk& c = chunks_.front();
    if (c.next < c.count) {
      const std::int64_t at = c.start_ns + c.next * c.interval_ns;
      if (at >= earliest) return at;
      // Slots that passed unused are not saved up: a burst is at most `burst`.
      const std::int64_t skip =
          std::min(c.count - c.next, (earliest - at + c.interval_ns - 1) / c.interval_ns);
      c.next += std::max<std::int64_t>(skip, 1);
      stats_.slots_lost += static_cast<std::uint64_t>(std::max<std::int64_t>(skip, 1));
      continue;
    }
    chunks_.pop_front();
  }
  return -1;
}

namespace {
constexpr std::int64_t kPaceWindowNs = 500'000'000;  // half a second
constexpr std::int64_t kAheadSize = 4;               // the smallest lease asked for ahead of need
}  // namespace

void RateLimit::count_pace(std::int64_t now_ns) {
  if (now_ns - pace_window_ns_ >= kPaceWindowNs) {
    // A window with no slot taken ends the pace too.
    pace_last_ = now_ns - pace_window_ns_ >= 2 * kPaceWindowNs ? 0 : pace_now_;
    pace_now_ = 0;
    pace_window_ns_ = now_ns;
  }
  ++pace_now_;
}

std::int64_t RateLimit::lease_size_locked(std::int64_t now_ns) const {
  if (interval_ns_ == 0) return 1;
  // Before a pace is known (the first half second): the calls waiting, one at least.
  std::int64_t size = 1;
  if (pace_last_ >= 0) {
    size = chunk_;
    // The slots per second this process spent lately (the current window's when higher).
    const double window = std::max<double>(1, static_cast<double>(now_ns - pace_window_ns_));
    const double pace = std::max(static_cast<double>(pace_last_) * 1e9 / kPaceWindowNs,
                                 static_cast<double>(pace_now_) * 1e9 / std::max(window, 1e8));
    // At that pace a chunk of n slots, spaced at the rate's interval, is spent over n / pace;
    // its last slot is late by n / pace - n x interval, and at most late_ns_ may be.
    const double rate_s = 1e9 / static_cast<double>(interval_ns_);
    // Half the allowance is used: a call also waits for its slot, and its pace varies.
    if (pace < rate_s) {
      const double per_slot_late_s = 1 / std::max(pace, 1e-9) - 1 / rate_s;
      const double fits = (static_cast<double>(late_ns_) / 2e9) / per_slot_late_s;
      size = std::clamp<std::int64_t>(static_cast<std::int64_t>(fits) + 1, 1, chunk_);
    }
  }
  // The calls waiting now each take one at once.
  return std::clamp<std::int64_t>(std::max<std::int64_t>(size, waiting_), 1, chunk_);
}

Duration RateLimit::queued_wait(std::int64_t now_ns, std::int64_t wait_ns, BitGenRef gen) {
  // The calls told to come back within one share of a slot's time (this process's share of the
  // rate, at most a second) are counted: a lone call comes back when the fleet has room; when
  // several were told, each comes back at least that share later, jittered in [1, 2) of it, so
  // that they do not come back together nor poll faster than their share of the rate comes.
  const double share = std::clamp(share_, 1e-6, 1.0);
  const Duration floor(std::min<std::int64_t>(
      1'000'000'000, static_cast<std::int64_t>(static_cast<double>(interval_ns_) / share)));
  if (now_ns - told_window_ns_ >= floor.count()) {
    told_window_ns_ = now_ns;
    told_ = 0;
  }
  ++told_;
  const Duration raw(std::max<std::int64_t>(wait_ns, 0));
  if (told_ <= 1) return raw;
  return std::max(raw, floor + uniform_duration(Duration::zero(), floor, gen));
}

std::int64_t RateLimit::lease_size(TimePoint now) const {
  std::lock_guard lock(mu_);
  return lease_size_locked(ns_of(now));
}

Duration RateLimit::lease_reach(TimePoint now) const {
  std::lock_guard lock(mu_);
  if (waiting_ == 0) return Duration::max();
  return Duration(std::max<std::int64_t>(0, reach_until_ns_ - ns_of(now)));
}

RateDecision RateLimit::take_share_locked(std::int64_t t, std::int64_t max_wait_ns) {
  // This process's share of the rate: all of it alone, the fleet's equal share when the fleet
  // cannot answer.
  const double share = std::clamp(share_, 1e-6, 1.0);
  const auto interval = static_cast<std::int64_t>(static_cast<double>(interval_ns_) / share);
  const auto burst = static_cast<std::int64_t>(static_cast<double>(burst_ns_) / share);
  const std::int64_t at = std::max(tat_ns_, t - burst);
  const std::int64_t wait = std::max<std::int64_t>(0, at - t);
  if (wait > max_wait_ns) {
    ++stats_.refused;
    return {.go = false, .wait = Duration(wait)};
  }
  tat_ns_ = at + interval;
  ++stats_.went;
  if (wait > 0) ++stats_.waited;
  if (sharing_) ++stats_.on_share;
  // A slot taken early (the burst) is due now: the allowance counts from the later of the two.
  return {.go = true,
          .wait = Duration(wait),
          .spend_by = TimePoint(Duration(std::max(at, t) + late_ns_))};
}

RateDecision RateLimit::take_leased_locked(std::int64_t now_ns, std::int64_t at,
                                           std::int64_t max_wait_ns, bool& ahead) {
  const std::int64_t wait = std::max<std::int64_t>(0, at - now_ns);
  if (wait > max_wait_ns) {
    ++stats_.refused;
    return {.go = false, .wait = Duration(wait)};
  }
  ++chunks_.front().next;
  ++stats_.went;
  if (wait > 0) ++stats_.waited;
  count_pace(now_ns);
  std::int64_t left = 0;
  for (const Chunk& c : chunks_) left += c.count - c.next;
  // The next chunk is leased ahead when half of one is left, by a process whose pace fills a few
  // slots of a chunk; a slower one leases when it has none (a chunk leased ahead would pass
  // while its calls are busy, and be lost to the fleet).
  const std::int64_t size = lease_size_locked(now_ns);
  if (2 * left < size && !wanted_ && size >= kAheadSize && full_until_ns_ <= now_ns) {
    wanted_ = true;
    ahead = true;
  }
  return {.go = true, .wait = Duration(wait), .spend_by = TimePoint(Duration(at + late_ns_))};
}

void RateLimit::wait_for_lease_locked(std::int64_t now_ns, std::int64_t max_wait_ns) {
  // The reach of the calls waiting: the longest any of them may still wait.
  const std::int64_t until = max_wait_ns > INT64_MAX - now_ns ? INT64_MAX : now_ns + max_wait_ns;
  reach_until_ns_ = waiting_ == 0 ? until : std::max(reach_until_ns_, until);
  ++waiting_;
}

std::int64_t RateLimit::leased_end_locked(std::int64_t now_ns) const {
  // Each lease answered and other calls took the slots: ask again when this process's leased
  // slots are spent (its calls queue there), at least a slot's time from now.
  std::int64_t end = now_ns + interval_ns_ * std::max(1, waiting_);
  if (!chunks_.empty()) {
    const Chunk& c = chunks_.back();
    end = std::max(end, c.start_ns + c.count * c.interval_ns);
  }
  return end;
}

RateDecision RateLimit::reserve(TimePoint now, Duration max_wait, BitGenRef gen) {
  const std::int64_t t = ns_of(now);
  const std::int64_t max_wait_ns = std::max<Duration>(max_wait, Duration::zero()).count();
  // Leases asked for by this call. The fleet answers each: with a chunk, its schedule's room, or
  // a failure (the share for a while). A chunk another call took first is asked for again, a
  // few times; then this call is told to come back after a slot's interval: never the whole
  // rate on its own.
  constexpr int kMaxLeases = 3;
  int leases = 0;
  bool unanswered = false;  // the fleet did not answer in time: this call goes on the share
  bool counted_waiting = false;
  const auto stop_waiting = [&] {
    if (counted_waiting) --waiting_;
    counted_waiting = false;
  };
  std::uint64_t answers_seen = 0;  // the fleet's answers counted when the lease was asked
  for (;;) {
    enum class Next { kDone, kWant, kLease } next = Next::kDone;
    RateDecision d;
    {
      std::lock_guard lock(mu_);
      answers_seen = answers_;
      if (paused_until_ns_ > t) {
        stop_waiting();
        ++stats_.refused;
        const Duration spread = uniform_duration(Duration::zero(), options_.release_spread, gen);
        return {.go = false, .wait = Duration(paused_until_ns_ - t) + spread, .paused = true};
      }
      if (interval_ns_ == 0) {
        stop_waiting();
        ++stats_.went;
        return {};
      }
      bool on_share = !sharing_ || unanswered || local_until_ns_ > t;
      if (!on_share) {
        // Slots held are spent first: a full or busy answer holds back new leases, not them.
        const std::int64_t at = next_slot(t);
        if (at < 0 && full_until_ns_ > t) {
          stop_waiting();
          ++stats_.refused;
          return {.go = false, .wait = queued_wait(t, full_until_ns_ - t, gen)};
        }
        if (at >= 0) {
          stop_waiting();
          bool ahead = false;
          d = take_leased_locked(t, at, max_wait_ns, ahead);
          if (!ahead) return d;
          next = Next::kWant;
        } else if (leases < kMaxLeases) {
          if (!counted_waiting) wait_for_lease_locked(t, max_wait_ns);
          counted_waiting = true;
          next = Next::kLease;
        } else {
          stop_waiting();
          ++stats_.refused;
          return {.go = false, .wait = queued_wait(t, leased_end_locked(t) - t, gen)};
        }
      }
      if (on_share) {
        stop_waiting();
        return take_share_locked(t, max_wait_ns);
      }
    }
    // The fleet is called without the lock held.
    std::shared_lock fleet_lock(fleet_->mu);
    if (next == Next::kWant) {
      if (fleet_->fleet != nullptr) fleet_->fleet->want(key_);
      return d;
    }
    // No leased slot left: ask for a chunk (at most one bounded round trip), then look again.
    ++leases;
    if (fleet_->fleet == nullptr) {
      unanswered = true;  // no fleet to ask: the share
      continue;
    }
    if (fleet_->fleet->lease(key_)) continue;
    fleet_lock.unlock();
    // No answer in time. The other processes may still be leasing the schedule (this one's
    // round trip was slow: a busy row, a loaded machine), so slots on the share would come on
    // top of theirs: the calls are told to come back, as when the schedule is full, until the
    // fleet has answered nothing for kUnansweredBeforeShare; then on the share.
    std::lock_guard lock(mu_);
    // The background thread may have answered since the wait ended (a chunk, the schedule's
    // room, a failure): look again rather than hold its answer back.
    if (answers_ != answers_seen) continue;
    if (unanswered_since_ns_ == kNever) unanswered_since_ns_ = t;
    if (t - unanswered_since_ns_ >= kUnansweredBeforeShare.count()) {
      unanswered = true;
      continue;
    }
    stop_waiting();
    ++stats_.refused;
    ++stats_.fleet_busy;
    full_until_locked(t, kUnansweredRetry);
    return {.go = false, .wait = queued_wait(t, full_until_ns_ - t, gen)};
  }
}

bool RateLimit::on_time(const RateDecision& d, TimePoint now) {
  if (now <= d.spend_by) return true;
  std::lock_guard lock(mu_);
  ++stats_.slots_late;
  return false;
}

bool RateLimit::pause(TimePoint now, Duration duration, bool announce) {
  const std::int64_t t = ns_of(now);
  const Duration d = std::clamp<Duration>(duration, Duration::zero(), options_.max_pause);
  const std::int64_t until = t + d.count();
  bool say_cut = false;
  {
    std::lock_guard lock(mu_);
    if (duration > options_.max_pause && announce) {
      ++stats_.pauses_cut;
      say_cut = !cut_said_;
      cut_said_ = true;
    }
    if (until <= paused_until_ns_ || d <= Duration::zero()) return false;
    paused_until_ns_ = until;
    ++stats_.pauses;
    if (!announce) ++stats_.pauses_from_fleet;
  }
  if (say_cut && options_.on_pause_cut) options_.on_pause_cut(key_, duration, options_.max_pause);
  if (announce) {
    std::shared_lock fleet_lock(fleet_->mu);
    if (fleet_->fleet != nullptr) fleet_->fleet->paused(key_, TimePoint(Duration(until)));
  }
  return true;
}

TimePoint RateLimit::paused_until() const {
  std::lock_guard lock(mu_);
  return TimePoint(Duration(paused_until_ns_));
}

void RateLimit::add_chunk(TimePoint now, Duration start_in, std::int64_t count, Duration interval) {
  std::lock_guard lock(mu_);
  wanted_ = false;
  full_until_ns_ = 0;
  busy_in_a_row_ = 0;
  answered_locked();
  if (count <= 0 || interval_ns_ == 0) return;
  // A chunk spaced at the fleet's rate, never faster than this process's own.
  const std::int64_t spacing = std::max(interval_ns_, interval.count());
  chunks_.push_back({.start_ns = ns_of(now) + start_in.count(),
                     .count = count,
                     .next = 0,
                     .interval_ns = spacing});
  ++stats_.chunks;
}

bool RateLimit::fleet_failed(TimePoint now, Duration in, DatabaseFailure failure) {
  const bool busy = failure == DatabaseFailure::kBusy || failure == DatabaseFailure::kConflict;
  std::lock_guard lock(mu_);
  answered_locked();
  if (busy && busy_in_a_row_ < kBusyLeasesInARow) {
    ++busy_in_a_row_;
    ++stats_.fleet_busy;
    full_until_locked(ns_of(now), in);
    return false;
  }
  wanted_ = false;
  ++stats_.fleet_failures;
  local_until_ns_ = ns_of(now) + std::max<Duration>(in, Duration::zero()).count();
  return true;
}

void RateLimit::full_until(TimePoint now, Duration in) {
  std::lock_guard lock(mu_);
  busy_in_a_row_ = 0;
  answered_locked();
  full_until_locked(ns_of(now), in);
}

void RateLimit::answered_locked() {
  unanswered_since_ns_ = kNever;
  ++answers_;
}

void RateLimit::full_until_locked(std::int64_t now_ns, Duration in) {
  wanted_ = false;
  // Not before this process's share of a slot's time (at most a second): a process does not
  // ask a full schedule faster than its share of it frees.
  const double share = std::clamp(share_, 1e-6, 1.0);
  const std::int64_t floor = std::min<std::int64_t>(
      1'000'000'000, static_cast<std::int64_t>(static_cast<double>(interval_ns_) / share));
  full_until_ns_ = now_ns + std::max<std::int64_t>(in.count(), floor);
}

std::int64_t RateLimit::slots_left(TimePoint now) const {
  std::lock_guard lock(mu_);
  const std::int64_t earliest = ns_of(now) - late_ns_;
  std::int64_t left = 0;
  for (const Chunk& c : chunks_) {
    for (std::int64_t k = c.next; k < c.count; ++k) {
      if (c.start_ns + k * c.interval_ns >= earliest) ++left;
    }
  }
  return left;
}

void RateLimit::set_sharing(bool sharing) {
  std::lock_guard lock(mu_);
  sharing_ = sharing;
  wanted_ = false;
  // A new start: nothing is owed to an answer or a failure from before.
  answered_locked();
  busy_in_a_row_ = 0;
  full_until_ns_ = 0;
  if (!sharing) chunks_.clear();  // leased slots are given up: the share decides now
}

void RateLimit::set_share(double share) {
  std::lock_guard lock(mu_);
  share_ = std::clamp(share, 1e-6, 1.0);
}

RateLimitStats RateLimit::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

RateLimitRegistry::RateLimitRegistry(RateLimitOptions defaults, std::size_t max_keys)
    : defaults_(defaults), max_keys_(max_keys) {
  validate(defaults_);
}

RateLimitRegistry::~RateLimitRegistry() = default;

void RateLimitRegistry::set_options(std::string_view key, const RateLimitOptions& options) {
  validate(options);
  std::lock_guard lock(mu_);
  options_.insert_or_assign(std::string(key), options);
}

std::shared_ptr<RateLimit> RateLimitRegistry::get(std::string_view key) {
  std::lock_guard lock(mu_);
  if (const auto it = limits_.find(key); it != limits_.end()) return it->second;
  if (limits_.size() >= max_keys_) return nullptr;
  const auto o = options_.find(key);
  auto limit =
      std::make_shared<RateLimit>(o != options_.end() ? o->second : defaults_, std::string(key));
  limit->fleet_ = fleet_;
  limit->sharing_ = sharing_;
  limit->share_ = share_;
  limits_.emplace(std::string(key), limit);
  return limit;
}

void RateLimitRegistry::set_fleet_state(bool sharing, double share) {
  std::lock_guard lock(mu_);
  sharing_ = sharing;
  share_ = std::clamp(share, 1e-6, 1.0);
  for (const auto& [key, limit] : limits_) {
    limit->set_sharing(sharing);
    limit->set_share(share_);
  }
}

std::shared_ptr<RateLimit> RateLimitRegistry::find(std::string_view key) const {
  std::lock_guard lock(mu_);
  const auto it = limits_.find(key);
  return it != limits_.end() ? it->second : nullptr;
}

std::map<std::string, std::shared_ptr<RateLimit>, std::less<>> RateLimitRegistry::all() const {
  std::lock_guard lock(mu_);
  return limits_;
}

void RateLimitRegistry::attach_fleet(RateLimitFleet* fleet) {
  std::unique_lock lock(fleet_->mu);  // waits for the fleet calls running
  fleet_->fleet = fleet;
}

}  // namespace keel
