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
// Every statement runs on the background thread. This process's own breakers (the registry's
// listener and trial gate, the fleet's state applied to them) are fleet_breakers_local.cpp.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "fleet/detail/fleet_sql.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "keel/core/random.hpp"
#include "keel/db/row_cursor.hpp"
#include "keel/fleet/shared_breakers.hpp"

namespace keel::store {

using detail::clamped_ms;
using detail::integer_cell;
using detail::kMaxCount;
using detail::kMaxKey;
using detail::kSlack;
using detail::ms;
using detail::ms_until;
using detail::sane_count;
using detail::shareable;
using detail::text_cell;
using detail::value_error;

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

// Whether the row's break has run out and no other process of the fleet holds its probe: the
// condition on which a process may take the probe, or open the breaker again.
std::string break_over_unheld(const Places& p) {
  return break_end(p) + " <= now() AND NOT " + held_by_other(p);
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
         break_over_unheld(p) +
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
         break_over_unheld(p) +
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

}  // namespace keel::store
