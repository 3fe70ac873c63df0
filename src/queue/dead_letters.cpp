#include "keel/queue/dead_letters.hpp"

#include <cmath>
#include <ctime>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>

#include "db/detail/commit.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "keel/db/dialect.hpp"
#include "keel/db/row_cursor.hpp"
#include "keel/db/transaction.hpp"
#include "queue/detail/queue_sql.hpp"
#include "queue/detail/queue_wakeup.hpp"

namespace keel::store::dead_letters {
namespace {

// When a dead job died: its finished time, or its update time when it has none.
constexpr std::string_view kDiedMs = "COALESCE(finished_ms, updated_ms)";

// Runs fn in one transaction, retrying lost races; throws DatabaseError when it cannot commit.
void in_transaction(Connection& conn, const std::function<bool(Connection&)>& fn) {
  detail::commit_or_throw(conn, "dead-letter", fn);
}

// "WHERE state = 'dead' AND ..." for the filter, its parameters appended to `params`.
std::string where_clause(const Connection& conn, const DeadLetterFilter& f,
                         std::vector<Value>& params) {
  std::string sql = " WHERE state = 'dead'";
  const auto param = [&](Value v) {
    params.push_back(std::move(v));
    return "$" + std::to_string(params.size());
  };
  if (!f.queue.empty()) sql += " AND queue = " + param(f.queue);
  if (!f.reason_contains.empty()) {
    // A plain substring (no LIKE patterns to escape).
    sql += " AND " + conn.dialect().substring_position("dead_reason", param(f.reason_contains)) +
           " > 0";
  }
  if (f.kind) sql += " AND dead_kind = " + param(std::string(to_string(*f.kind)));
  if (f.died_at_or_after_ms) {
    sql += " AND " + std::string(kDiedMs) + " >= " + param(*f.died_at_or_after_ms);
  }
  if (f.died_before_ms) sql += " AND " + std::string(kDiedMs) + " < " + param(*f.died_before_ms);
  if (!f.ids.empty()) {
    sql += " AND id IN (";
    for (std::size_t i = 0; i < f.ids.size(); ++i) {
      sql += (i == 0 ? "" : ", ") + param(f.ids[i]);
    }
    sql += ")";
  }
  return sql;
}

std::vector<DeadLetter> select_in(Connection& conn, const DeadLetterFilter& filter,
                                  std::int64_t limit) {
  std::vector<Value> params;
  std::string sql = "SELECT id, queue, dead_reason, " + std::string(kDiedMs) +
                    ", attempts, max_attempts, replays, dead_kind FROM keel_jobs" +
                    where_clause(conn, filter, params);
  params.emplace_back(limit);
  sql += " ORDER BY " + std::string(kDiedMs) + ", id LIMIT $" + std::to_string(params.size());
  const Rows r = conn.query(sql, params);
  return read_rows(r, [](RowCursor& c) {
    DeadLetter d;
    d.id = c.integer();
    d.queue = c.text();
    d.dead_reason = c.text_or_empty();
    d.died_ms = c.integer();
    d.attempts = static_cast<int>(c.integer());
    d.max_attempts = static_cast<int>(c.integer());
    d.replays = static_cast<int>(c.integer());
    if (const auto& kind = c.cell()) d.kind = parse_dead_reason(*kind);
    return d;
  });
}

void check_pacing(const ReplayPacing& pacing) {
  if (!(pacing.per_second >= 0) || !std::isfinite(pacing.per_second)) {
    std::ostringstream got;
    got << pacing.per_second;
    throw_invalid({.context = "keel::store::ReplayPacing",
                   .field = "per_second",
                   .problem = "must be >= 0 and finite",
                   .got = got.str()});
  }
}

void assign_run_at(std::vector<DeadLetter>& jobs, const ReplayPacing& pacing, std::int64_t now) {
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    jobs[i].run_at_ms = now + replay_offset_ms(static_cast<std::int64_t>(i), pacing.per_second);
  }
}

// Calendar ms of a civil UTC time (proleptic Gregorian).
std::int64_t utc_ms(int y, int mon, int d, int h, int min, int s) {
  const std::int64_t days =
      days_from_civil(y, static_cast<unsigned>(mon), static_cast<unsigned>(d));
  return ((days * 24 + h) * 60 + min) * 60000 + std::int64_t{s} * 1000;
}

bool digits(std::string_view t, std::size_t pos, std::size_t n, int* out) {
  if (pos + n > t.size()) return false;
  int v = 0;
  for (std::size_t i = pos; i < pos + n; ++i) {
    if (t[i] < '0' || t[i] > '9') return false;
    v = v * 10 + (t[i] - '0');
  }
  *out = v;
  return true;
}

std::optional<std::int64_t> parse_rfc3339(std::string_view t) {
  int y = 0, mon = 0, d = 0, h = 0, min = 0, s = 0;
  if (!digits(t, 0, 4, &y) || t.size() < 20 || t[4] != '-' || !digits(t, 5, 2, &mon) ||
      t[7] != '-' || !digits(t, 8, 2, &d) || (t[10] != 'T' && t[10] != 't') ||
      !digits(t, 11, 2, &h) || t[13] != ':' || !digits(t, 14, 2, &min) || t[16] != ':' ||
      !digits(t, 17, 2, &s)) {
    return std::nullopt;
  }
  if (mon < 1 || mon > 12 || d < 1 ||
      static_cast<unsigned>(d) > days_in_month(y, static_cast<unsigned>(mon)) || h > 23 ||
      min > 59 || s > 60) {
    return std::nullopt;
  }
  std::size_t pos = 19;
  std::int64_t frac_ms = 0;
  if (pos < t.size() && t[pos] == '.') {
    ++pos;
    const std::size_t start = pos;
    std::int64_t scale = 100;
    while (pos < t.size() && t[pos] >= '0' && t[pos] <= '9') {
      frac_ms += (t[pos] - '0') * scale;
      scale /= 10;
      ++pos;
    }
    if (pos == start) return std::nullopt;
  }
  std::int64_t offset_ms = 0;
  if (pos < t.size() && (t[pos] == 'Z' || t[pos] == 'z')) {
    ++pos;
  } else if (pos < t.size() && (t[pos] == '+' || t[pos] == '-')) {
    int oh = 0, om = 0;
    if (!digits(t, pos + 1, 2, &oh) || pos + 3 >= t.size() || t[pos + 3] != ':' ||
        !digits(t, pos + 4, 2, &om) || oh > 23 || om > 59) {
      return std::nullopt;
    }
    offset_ms = (std::int64_t{oh} * 60 + om) * 60000 * (t[pos] == '+' ? 1 : -1);
    pos += 6;
  } else {
    return std::nullopt;
  }
  if (pos != t.size()) return std::nullopt;
  return utc_ms(y, mon, d, h, min, s) + frac_ms - offset_ms;
}

}  // namespace

std::int64_t replay_offset_ms(std::int64_t i, double per_second) noexcept {
  if (!(per_second > 0)) return 0;
  return static_cast<std::int64_t>(std::floor(static_cast<double>(i) * 1000.0 / per_second));
}

std::vector<DeadLetter> select(Connection& connection, const DeadLetterFilter& filter,
                               std::int64_t limit) {
  return select_in(connection, filter, limit);
}

std::vector<DeadLetter> plan_replay(Connection& connection, const DeadLetterFilter& filter,
                                    const ReplayPacing& pacing, Clock& clock) {
  check_pacing(pacing);
  std::vector<DeadLetter> jobs = select_in(connection, filter, INT64_MAX);
  assign_run_at(jobs, pacing, wall_ms(clock));
  return jobs;
}

std::vector<DeadLetter> replay(Connection& connection, const DeadLetterFilter& filter,
                               const ReplayPacing& pacing, Clock& clock) {
  check_pacing(pacing);
  std::vector<DeadLetter> out;
  in_transaction(connection, [&](Connection& tx) {
    out.clear();
    const std::int64_t now = wall_ms(clock);
    std::vector<DeadLetter> jobs = select_in(tx, filter, INT64_MAX);
    assign_run_at(jobs, pacing, now);
    for (DeadLetter& job : jobs) {
      // JobQueue::replay's update, with the paced run_at.
      const Rows r =
          tx.query(detail::replay_update("$3", "$2", "id = $1"), {job.id, now, job.run_at_ms});
      if (r.affected() == 1) out.push_back(std::move(job));
    }
    return true;
  });
  if (!out.empty()) detail::wake_local_workers(connection, filter.queue);
  return out;
}

std::vector<std::int64_t> discard(Connection& connection, const DeadLetterFilter& filter) {
  std::vector<std::int64_t> out;
  in_transaction(connection, [&](Connection& tx) {
    out.clear();
    for (const DeadLetter& job : select_in(tx, filter, INT64_MAX)) {
      if (detail::discard_dead(tx, job.id)) out.push_back(job.id);
    }
    return true;
  });
  return out;
}

Expected<std::int64_t> parse_time_bound(std::string_view text, std::int64_t now_ms) {
  if (text.size() >= 20 && text[4] == '-') {
    if (auto t = parse_rfc3339(text)) return *t;
    return Error{.field = "time",
                 .problem =
                     "is not an RFC 3339 timestamp (expected e.g. 2026-12-01T10:00:00Z or "
                     "2026-12-01T11:00:00+01:00)",
                 .got = quote_value(text)};
  }
  const auto ago = parse_duration(text);
  if (!ago) {
    return Error{.field = "time",
                 .problem =
                     "must be an RFC 3339 timestamp (2026-12-01T10:00:00Z) or a duration "
                     "ago (1h)",
                 .got = quote_value(text)};
  }
  return now_ms - keel::to_ms(*ago);
}

}  // namespace keel::store::dead_letters
