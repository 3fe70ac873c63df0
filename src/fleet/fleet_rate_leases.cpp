// SharedBreakers' rate leases: each dependency's rate is one schedule in its row of
// keel_rate_limits (next_slot, the first slot not leased yet), decided by
// keel::decide_rate_lease in the row's transaction. A process leases chunks of the schedule and
// spends them locally, each slot at its store time less the store clock's offset from this
// process's steady clock. When the fleet does not answer, the limits go on this process's equal
// share of each rate.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "db/detail/listener.hpp"
#include "fleet/detail/fleet_sql.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "keel/db/row_cursor.hpp"
#include "keel/fleet/shared_breakers.hpp"

namespace keel::store {

using detail::clamped_ms;
using detail::integer_cell;
using detail::kLimits;
using detail::kMaxCount;
using detail::kSlack;
using detail::ms;
using detail::sane_count;
using detail::shareable;
using detail::text_cell;

namespace {

// The kinds of a row of keel_rate_limits outside its domain.
enum RateFlag : int {
  kSlotOutOfDomain = 1,  // next_slot not finite or beyond the horizon: read as now; rewritten
  kPauseTooLong = 2,     // paused_until not finite or beyond max_pause: obeyed as at most that
  kBadRateCount = 4,     // leases or pauses outside [0, 2^53]: read as 0; rewritten
};

std::string us(const std::string& place) { return "(" + place + " * interval '1 microsecond')"; }

// `column` in us since the epoch, NULL when it is not a time within a century of now.
std::string epoch_us(const std::string& column) {
  return "CASE WHEN isfinite(" + column + ") AND " + column +
         " BETWEEN now() - interval '100 years' AND now() + interval '100 years' THEN"
         " floor(extract(epoch FROM " +
         column + ") * 1000000)::bigint END";
}

// The lease runs keel::decide_rate_lease in the row's transaction: lease_row locks the row
// (made first when new) and reads it, lease_write stores the decision.
struct LeaseStatements {
  std::string lease_insert;
  std::string lease_row;
  std::string lease_write;
};

// $1 key, $2 process.
constexpr std::string_view kLeaseInsert =
    "INSERT INTO keel_rate_limits (key, updated_by, updated_at) VALUES ($1, $2, now())"
    " ON CONFLICT (key) DO NOTHING";

// $1 key, $2 the longest pause in ms. Columns (LeaseRow): now, next_slot and rate_at in us since
// the epoch (NULL when not a time), whether next_slot is set but not a time, rate_per_s, the
// flags of the pause and the counts, next_slot and paused_until as text (for the notices).
std::string lease_row_sql() {
  const std::string bound = std::to_string(kMaxCount);
  return "SELECT floor(extract(epoch FROM now()) * 1000000)::bigint, " + epoch_us("r.next_slot") +
         ", " + epoch_us("r.rate_at") +
         ", (r.next_slot IS NOT NULL AND NOT (isfinite(r.next_slot) AND r.next_slot BETWEEN"
         " now() - interval '100 years' AND now() + interval '100 years')),"
         " r.rate_per_s, (CASE WHEN (NOT isfinite(r.paused_until) OR r.paused_until >"
         " statement_timestamp() + " +
         ms("$2") + " + " + kSlack +
         ") IS TRUE THEN 2 ELSE 0 END + CASE WHEN r.leases NOT BETWEEN 0 AND " + bound +
         " OR r.pauses NOT BETWEEN 0 AND " + bound +
         " THEN 4 ELSE 0 END), r.next_slot::text, r.paused_until::text"
         " FROM keel_rate_limits r WHERE r.key = $1 FOR UPDATE";
}

// $1 key, $2 next_slot in us since the epoch, $3 rate_per_s, $4 rate_at in us, $5 1 when a
// chunk was leased, $6 process.
std::string lease_write_sql() {
  return "UPDATE keel_rate_limits SET next_slot = timestamptz 'epoch' + " + us("$2") +
         ", rate_per_s = $3::double precision, rate_at = timestamptz 'epoch' + " + us("$4") +
         ", leases = " + sane_count("leases") + " + $5, pauses = " + sane_count("pauses") +
         ", updated_by = $6, updated_at = now() WHERE key = $1";
}

const LeaseStatements& lease_statements() {
  static const LeaseStatements statements{.lease_insert = std::string(kLeaseInsert),
                                          .lease_row = lease_row_sql(),
                                          .lease_write = lease_write_sql()};
  return statements;
}

// A rate as a person writes it: "50/s", "30/m", "120/h".
std::string format_rate(double per_s) {
  const auto number = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.4g", v);
    return std::string(buf);
  };
  if (per_s >= 1) return number(per_s) + "/s";
  if (per_s * 60 >= 1) return number(per_s * 60) + "/m";
  return number(per_s * 3600) + "/h";
}

}  // namespace

// lease_statements().lease_row's row.
struct SharedBreakers::LeaseRow {
  RateScheduleRow schedule;
  std::int64_t now_us = 0;
  bool slot_unreadable = false;         // next_slot set, but not a time
  int flags = 0;                        // of the pause and the counts
  std::string next_slot, paused_until;  // as text, for the notices
};
SharedBreakers::LeaseRow SharedBreakers::read_lease(const Rows& rows) {
  RowCursor c(rows, 0);
  SharedBreakers::LeaseRow r;
  r.now_us = integer_cell(c.cell());
  if (const auto& slot = c.cell()) r.schedule.next_slot_us = integer_cell(slot);
  r.schedule.rate_at_us = integer_cell(c.cell());
  const auto& unreadable = c.cell();
  r.slot_unreadable = unreadable && *unreadable == "t";
  if (const auto& rate = c.cell()) {
    const char* end = rate->data() + rate->size();
    double value = 0;
    if (std::from_chars(rate->data(), end, value).ec == std::errc{}) {
      r.schedule.rate_per_s = value;
    } else {
      r.schedule.rate_per_s = -1;  // NaN, Infinity: out of the domain
    }
  }
  r.flags = static_cast<int>(integer_cell(c.cell()));
  r.next_slot = text_cell(c.cell());
  r.paused_until = text_cell(c.cell());
  return r;
}

// ---------------------------------------------------------------------------------------------
// The calls' side (any thread).

// A limit has few slots left: its next chunk is leased in the background.
void SharedBreakers::want_chunk(std::string_view key) {
  std::lock_guard lock(mu_);
  if (!sharing_.load() || listener_ == nullptr) return;
  wanted_.emplace(key);
  listener_->interrupt();
}

// A call has no slot left: a chunk is asked of the background thread, and waited for at most
// round_trip_limit. Returns whether the fleet answered (a chunk, or the schedule's room).
bool SharedBreakers::lease_chunk(std::string_view key) {
  const auto request = std::make_shared<LeaseRequest>();
  request->key = std::string(key);
  std::unique_lock lock(mu_);
  if (!sharing_.load() || !answering_ || listener_ == nullptr) return false;
  leases_.push_back(request);
  listener_->interrupt();
  leases_waited_.fetch_add(1);
  // wait: bound: an answer from the background thread, at most round_trip_limit
  if (!answered_cv_.wait_for(lock, options_.round_trip_limit, [&] { return request->answered; })) {
    // No answer in time: core decides (RateLimit::reserve: told to come back, on the share once
    // the fleet has not answered for a while); the next calls do not wait here until the
    // background thread answers again.
    request->abandoned = true;
    answering_ = false;
    return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// The background thread's side.

// Every limit's mode: the fleet's chunks while sharing, else this process's share of each rate
// (an equal share of the fleet it last knew, all of it when it never knew one).
void SharedBreakers::set_rate_sharing(bool sharing) {
  if (options_.rate_limits == nullptr) return;
  // The share is this process's when the fleet does not answer a lease, sharing or not.
  options_.rate_limits->set_fleet_state(sharing, 1.0 / std::max(1, last_fleet_size_));
}

// Leases the chunks asked for (by calls waiting, and ahead of need), one statement each.
// Throws when the connection is lost (each waiting call answered: it goes on its share).
void SharedBreakers::serve_leases() {
  if (options_.rate_limits == nullptr) return;
  for (;;) {
    std::string key;
    {
      std::lock_guard lock(mu_);
      answering_ = true;
      while (!leases_.empty() && leases_.front()->abandoned) leases_.pop_front();
      if (!leases_.empty()) {
        key = leases_.front()->key;
      } else if (!wanted_.empty()) {
        key = *wanted_.begin();
      } else {
        return;
      }
      wanted_.erase(key);
    }
    bool lost = false;
    try {
      lease_one(key);
      lease_backoff_.reset();
    } catch (const std::exception& e) {
      lost = work_->broken();  // gone: every call goes on its share until the fleet is back
      if (!lost) lease_failed(key, e);
    }
    {
      std::lock_guard lock(mu_);
      for (auto& request : leases_) {
        if (request->key == key) request->answered = true;
      }
      std::erase_if(leases_, [](const auto& r) { return r->answered; });
    }
    answered_cv_.notify_all();
    if (lost) throw std::runtime_error("the connection was lost");
  }
}

// One chunk of `key`'s schedule for this process, or the schedule's room: core's
// decide_rate_lease, run in the row's transaction (two round trips: the row locked and read,
// then the decision written with COMMIT).
void SharedBreakers::lease_one(const std::string& key) {
  const auto limit = options_.rate_limits->find(key);
  if (!limit || limit->options().rate_per_s <= 0 || !shareable(key)) return;
  const std::int64_t max_pause_ms = clamped_ms(limit->options().max_pause);
  const TimePoint asked = steady_clock().now();
  const Value limit_param[] = {limit_setting_};
  const Value insert_params[] = {key, options_.process};
  const Value row_params[] = {key, max_pause_ms};
  const Statement statements[] = {{.sql = kLimits, .params = limit_param},
                                  {.sql = lease_statements().lease_insert, .params = insert_params},
                                  {.sql = lease_statements().lease_row, .params = row_params}};
  const std::vector<Rows> read = work_->begin_then_query(Isolation::kReadCommitted, statements);
  LeaseRow row;
  try {
    if (read.back().empty()) throw std::runtime_error("the row was not found after its insert");
    row = read_lease(read.back());
  } catch (...) {
    work_->rollback();
    throw;
  }
  const RateLeaseAsk ask{
      .now_us = row.now_us,
      .rate_per_s = limit->spaced_rate(),
      .count = limit->lease_size(asked),
      .burst = limit->options().burst,
      .horizon_us = horizon_ms_ * 1000,
      .reach_us =
          std::chrono::duration_cast<std::chrono::microseconds>(limit->lease_reach(asked)).count()};
  RateScheduleRow stored = row.schedule;
  if (row.slot_unreadable) stored.next_slot_us.reset();
  const RateLeaseAnswer answer = decide_rate_lease(stored, ask);
  char rate[32];
  std::snprintf(rate, sizeof rate, "%.17g", answer.row.rate_per_s);
  const Value write[] = {key,
                         answer.row.next_slot_us.value_or(row.now_us),
                         std::string(rate),
                         answer.row.rate_at_us,
                         std::int64_t{answer.granted ? 1 : 0},
                         options_.process};
  (void)work_->query_then_commit(lease_statements().lease_write, write);
  const TimePoint now = steady_clock().now();
  say_lease_row(key, *limit, row, answer);
  if (answer.granted) {
    // The store's clock and this one differ: the chunk's store time less the clocks' offset,
    // the same for every chunk this process leases (so that slots of chunks leased by different
    // processes keep their spacing, whatever each lease's round trip was).
    const auto asked_us =
        std::chrono::duration_cast<std::chrono::microseconds>(asked.time_since_epoch()).count();
    const std::int64_t offset = store_clock_offset(row.now_us - asked_us);
    limit->add_chunk(TimePoint{}, std::chrono::microseconds(answer.start_us - offset), answer.count,
                     std::chrono::nanoseconds(answer.interval_ns));
    chunks_leased_.fetch_add(1);
    return;
  }
  // The schedule is full as far as the horizon: ask again when it has room for a chunk.
  limit->full_until(now, std::chrono::microseconds(answer.retry_in_us));
  leases_full_.fetch_add(1);
}

// A few samples of the store's clock before the first lease (a lease's own sample may carry a
// cold connection's delay): each the store's time less the moment it was asked.
void SharedBreakers::sample_store_clock() {
  if (options_.rate_limits == nullptr) return;
  for (int i = 0; i < 4; ++i) {
    const auto asked = std::chrono::duration_cast<std::chrono::microseconds>(
                           steady_clock().now().time_since_epoch())
                           .count();
    const Rows rows =
        work_->query("SELECT floor(extract(epoch FROM clock_timestamp()) * 1000000)::bigint");
    if (rows.empty()) return;
    (void)store_clock_offset(RowCursor(rows, 0).integer() - asked);
  }
}

std::int64_t SharedBreakers::store_clock_offset(std::int64_t sample) {
  clock_samples_[clock_samples_taken_ % clock_samples_.size()] = sample;
  ++clock_samples_taken_;
  const std::size_t n = std::min(clock_samples_taken_, clock_samples_.size());
  return *std::min_element(clock_samples_.begin(), clock_samples_.begin() + static_cast<long>(n));
}

// What a lease found outside the row's domain, or a rate other than this process's: said once.
void SharedBreakers::say_lease_row(const std::string& key, const RateLimit& limit,
                                   const LeaseRow& row, const RateLeaseAnswer& answer) {
  const std::string name = "keel_rate_limits row " + quote_value(key) + ": ";
  if ((answer.slot_out_of_domain || row.slot_unreadable) && first_time("slot\n" + key)) {
    rows_out_of_domain_.fetch_add(1);
    rows_repaired_.fetch_add(1);
    notice(name + "next_slot " + quote_value(row.next_slot) +
           " is not a time within rate_horizon (" + format_duration(options_.rate_horizon) +
           ") and a chunk from now; read as now, and rewritten");
  }
  if (answer.rate_out_of_domain && first_time("rate\n" + key)) {
    rows_out_of_domain_.fetch_add(1);
    rows_repaired_.fetch_add(1);
    notice(name + "rate_per_s is not a rate; rewritten with this process's");
  }
  if ((row.flags & kPauseTooLong) != 0 && first_time("pause\n" + key)) {
    rows_out_of_domain_.fetch_add(1);
    notice(name + "paused_until " + quote_value(row.paused_until) +
           " is not a time within max_pause (" + format_duration(limit.options().max_pause) +
           ") from now; obeyed as at most that");
  }
  if ((row.flags & kBadRateCount) != 0 && first_time("count\n" + key)) {
    rows_out_of_domain_.fetch_add(1);
    rows_repaired_.fetch_add(1);
    notice(name + "leases or pauses out of range (0 to 2^53); reset to 0");
  }
  if (answer.lower_rate_kept && first_time("lower-rate\n" + key)) {
    rates_disagreeing_.fetch_add(1);
    const double headroom = 1 - limit.options().headroom;
    notice("rate limit of " + quote_value(key) + ": another process of the fleet keeps " +
           format_rate(answer.rate_per_s / headroom) + ", lower than this process's " +
           format_rate(limit.options().rate_per_s) + "; the fleet keeps the lower rate");
  }
}

// A lease that failed with the connection still up: core's rule (RateLimit::fleet_failed) says
// what the key's calls do until core's next backoff delay. A busy schedule (a row lock or the
// statement's time ran out, a lost race: other processes are leasing) has them told to come
// back; any other failure (a permission, the table's schema), or a lock held through several
// leases, puts them on this process's equal share. Said once per key, cause and answer.
void SharedBreakers::lease_failed(const std::string& key, const std::exception& e) {
  lease_failures_.fetch_add(1);
  const auto* db = dynamic_cast<const DatabaseError*>(&e);
  const std::string cause = db != nullptr ? db->details().sqlstate : std::string("other");
  const DatabaseFailure failure = db != nullptr ? db->failure() : DatabaseFailure::kPermanent;
  const Duration delay = lease_backoff_.next();
  const auto limit = options_.rate_limits->find(key);
  if (!limit) return;
  const bool on_share = limit->fleet_failed(steady_clock().now(), delay, failure);
  if (!first_time("lease-failed\n" + key + "\n" + cause + (on_share ? "\nshare" : "\nbusy"))) {
    return;
  }
  if (on_share) {
    notice("rate limit of " + quote_value(key) + ": the fleet's schedule cannot be leased (" +
           e.what() + "); this process keeps 1/" + std::to_string(std::max(1, last_fleet_size_)) +
           " of the rate, and asks again after a backoff");
  } else {
    notice("rate limit of " + quote_value(key) + ": the fleet's schedule is busy (" + e.what() +
           "); this process's calls wait for it and it asks again after a backoff");
  }
}

}  // namespace keel::store
