// SharedBreakers' pauses: a 429 or 503 with Retry-After that any process got is written to the
// dependency's row of keel_rate_limits (paused_until) and announced on the channel like a
// breaker's opening; every process holds its calls to that dependency until then. A process
// that starts, or comes back, reads the pauses running. A pause read back is obeyed for at most
// the limit's max_pause.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "db/detail/listener.hpp"
#include "fleet/detail/fleet_sql.hpp"
#include "keel/core/expected.hpp"
#include "keel/db/row_cursor.hpp"
#include "keel/fleet/shared_breakers.hpp"

namespace keel::store {

using detail::kSlack;
using detail::ms;
using detail::ms_until;
using detail::sane_count;

namespace {

struct PauseStatements {
  std::string pause;
  std::string pauses;
};

// $1 key, $2 the pause in ms, $3 process, $4 notification payload, $5 the longest pause in ms.
// Extends the row's pause only (one out of its domain is replaced).
std::string pause_sql() {
  return "WITH up AS ("
         " INSERT INTO keel_rate_limits AS r (key, paused_until, pauses, updated_by, updated_at)"
         " VALUES ($1, now() + " +
         ms("$2") +
         ", 1, $3, now())"
         " ON CONFLICT (key) DO UPDATE SET paused_until = EXCLUDED.paused_until, pauses = " +
         sane_count("r.pauses") + " + 1, leases = " + sane_count("r.leases") +
         ", updated_by = $3, updated_at = now()"
         " WHERE r.paused_until IS NULL OR NOT isfinite(r.paused_until)"
         "  OR r.paused_until < EXCLUDED.paused_until"
         " OR r.paused_until > statement_timestamp() + " +
         ms("$5") + " + " + kSlack +
         " RETURNING 1)"
         " SELECT pg_notify('keel_breakers', $4) FROM up";
}

// $1 the longest pause in ms: every pause running, each at most that from now (PauseRow).
std::string pauses_sql() {
  return "SELECT r.key, " + ms_until("LEAST(r.paused_until, now() + " + ms("$1") + ")") +
         ", CASE WHEN (NOT isfinite(r.paused_until) OR r.paused_until > "
         "statement_timestamp() + " +
         ms("$1") + " + " + kSlack +
         ") IS TRUE THEN 1 ELSE 0 END, r.paused_until::text"
         " FROM keel_rate_limits r WHERE (r.paused_until > now()) IS TRUE";
}

const PauseStatements& pause_statements() {
  static const PauseStatements statements{.pause = pause_sql(), .pauses = pauses_sql()};
  return statements;
}

// A row of pause_statements().pauses.
struct PauseRow {
  std::string key;
  std::int64_t ms = 0;       // the pause left, at most the longest pause
  bool too_long = false;     // paused_until is further than the longest pause
  std::string paused_until;  // as text, for the notices
};
PauseRow read_pause(const Rows& rows, std::size_t i) {
  RowCursor c(rows, i);
  PauseRow r;
  r.key = detail::text_cell(c.cell());
  r.ms = detail::integer_cell(c.cell());
  r.too_long = detail::integer_cell(c.cell()) != 0;
  r.paused_until = detail::text_cell(c.cell());
  return r;
}

}  // namespace

// This process learnt a pause (a Retry-After): written to the fleet's row in the background.
void SharedBreakers::paused(std::string_view key, TimePoint until) {
  if (!detail::shareable(key)) return;
  const Instant at{std::chrono::duration_cast<Instant::duration>(until.time_since_epoch())};
  std::lock_guard lock(mu_);
  auto [it, added] = pauses_.try_emplace(std::string(key), at);
  if (!added && it->second < at) it->second = at;
  if (listener_ != nullptr) listener_->interrupt();
}

// Writes the pauses this process learnt, and announces them.
void SharedBreakers::publish_pauses() {
  if (options_.rate_limits == nullptr) return;
  std::map<std::string, Instant, std::less<>> batch;
  {
    std::lock_guard lock(mu_);
    batch.swap(pauses_);
  }
  auto it = batch.begin();
  try {
    for (; it != batch.end(); ++it) {
      const auto limit = options_.rate_limits->find(it->first);
      const Duration cap = limit ? limit->options().max_pause : RateLimitOptions{}.max_pause;
      const auto left = it->second - std::chrono::steady_clock::now();
      if (left <= Duration::zero()) continue;
      const std::int64_t ms = std::min(detail::clamped_ms(left), detail::clamped_ms(cap));
      const std::string payload =
          schema_ + "\npause\n" + std::to_string(ms) + "\n" + options_.process + "\n" + it->first;
      const Value params[] = {it->first, ms, options_.process, payload, detail::clamped_ms(cap)};
      try {
        (void)bounded(pause_statements().pause, params);
        pauses_published_.fetch_add(1);
      } catch (const DatabaseError& e) {
        if (!detail::value_error(e)) throw;
        if (first_time("pause-write\n" + it->first)) {
          notice("keel_rate_limits row " + quote_value(it->first) + ": cannot be written (" +
                 e.what() + "); this process's pauses of it are not shared");
        }
      }
    }
  } catch (...) {
    std::lock_guard lock(mu_);
    for (; it != batch.end(); ++it) pauses_.try_emplace(it->first, it->second);
    throw;
  }
}

// The pauses running in the fleet, applied here (a process that starts, or comes back).
void SharedBreakers::read_pauses() {
  if (options_.rate_limits == nullptr) return;
  const Value params[] = {detail::clamped_ms(options_.rate_limits->defaults().max_pause)};
  const Rows rows = bounded(pause_statements().pauses, params);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const PauseRow row = read_pause(rows, i);
    const std::string& key = row.key;
    if (!detail::shareable(key)) continue;
    if (row.too_long && first_time("pause\n" + key)) {
      rows_out_of_domain_.fetch_add(1);
      notice("keel_rate_limits row " + quote_value(key) + ": paused_until " +
             quote_value(row.paused_until) +
             " is not a time within max_pause; obeyed as at "
             "most that");
    }
    apply_pause(key, row.ms);
  }
}

void SharedBreakers::apply_pause(const std::string& key, std::int64_t ms) {
  if (options_.rate_limits == nullptr || ms <= 0) return;
  const auto limit = options_.rate_limits->get(key);
  if (!limit) return;
  if (limit->pause(steady_clock().now(), std::chrono::milliseconds(ms), /*announce=*/false)) {
    pauses_applied_.fetch_add(1);
  }
}

}  // namespace keel::store
