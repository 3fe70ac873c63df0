// SharedBreakers' fleet membership: the table keel_breaker_members, one row per process with
// the time of its last heartbeat. The fleet is the processes seen within three heartbeats; its
// size sets each breaker's share of the minimum calls (BreakerRegistry::set_fleet_size) and
// each rate's share while the database is out. A row seen in the future is no heartbeat: it is
// removed and said.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "fleet/detail/fleet_sql.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "keel/db/row_cursor.hpp"
#include "keel/fleet/shared_breakers.hpp"

namespace keel::store {

using detail::integer_cell;
using detail::kSlack;
using detail::ms;
using detail::text_cell;

namespace {

constexpr std::int64_t kMaxFleet = 10000;  // processes sharing one database

// $1 process, $2 the members' window in ms, $3 the notification a process sends when it joins
// (so that the others count it at once, not at their next heartbeat). The first row: the
// fleet's size (this process included), whether it joined, the rows seen in the future it
// removed; then up to 3 of those rows (process, seen_at).
const std::string& heartbeat_sql() {
  static const std::string statement =
      "WITH beat AS (INSERT INTO keel_breaker_members (process, seen_at) VALUES ($1, now())"
      "  ON CONFLICT (process) DO UPDATE SET seen_at = now() RETURNING (xmax = 0) AS joined),"
      " gone AS (DELETE FROM keel_breaker_members WHERE process <> $1 AND (seen_at < now() - " +
      ms("$2") + " OR seen_at > statement_timestamp() + " + kSlack +
      ") RETURNING process, seen_at::text AS seen, seen_at > now() AS ahead),"
      " hello AS (SELECT pg_notify('keel_breakers', $3) FROM beat WHERE joined)"
      " SELECT 0 AS part, (count(*) FILTER (WHERE process <> $1) + 1)::text,"
      "  (SELECT count(*) FROM hello)::text, (SELECT count(*) FROM gone WHERE ahead)::text"
      " FROM keel_breaker_members WHERE seen_at >= now() - " +
      ms("$2") + " AND seen_at <= statement_timestamp() + " + kSlack +
      " UNION ALL (SELECT 1, process, seen, NULL FROM gone WHERE ahead LIMIT 3)"
      " ORDER BY 1";
  return statement;
}

// heartbeat_sql()'s first row (part 0).
struct HeartbeatCounts {
  std::int64_t size = 0;     // the fleet's size, this process included
  std::int64_t removed = 0;  // rows seen in the future, removed
};
HeartbeatCounts read_heartbeat_counts(const Rows& rows) {
  RowCursor c(rows, 0);
  c.skip();  // part
  HeartbeatCounts r;
  r.size = integer_cell(c.cell());
  c.skip();  // whether this process joined
  r.removed = integer_cell(c.cell());
  return r;
}

// One of heartbeat_sql()'s later rows (part 1): a member row seen in the future, removed.
struct RemovedMember {
  std::string process, seen_at;  // as text, for the notice
};
RemovedMember read_removed_member(const Rows& rows, std::size_t i) {
  RowCursor c(rows, i);
  c.skip();  // part
  RemovedMember r;
  r.process = text_cell(c.cell());
  r.seen_at = text_cell(c.cell());
  return r;
}

}  // namespace

// Requires: the background thread.
void SharedBreakers::heartbeat() {
  const std::string hello = schema_ + "\nmembers\n0\n" + options_.process + "\n*";
  const Value params[] = {options_.process, members_ms_, hello};
  const Rows rows = bounded(heartbeat_sql(), params);
  if (rows.empty()) return;
  const HeartbeatCounts counts = read_heartbeat_counts(rows);
  const std::int64_t size = counts.size;
  if (const std::int64_t removed = counts.removed; removed > 0) {
    std::string which;
    for (std::size_t i = 1; i < rows.size(); ++i) {
      const RemovedMember member = read_removed_member(rows, i);
      which += (i > 1 ? ", " : "") + quote_value(member.process) + " (seen_at " +
               quote_value(member.seen_at) + ")";
    }
    if (removed > static_cast<std::int64_t>(rows.size()) - 1) which += ", ...";
    rows_out_of_domain_.fetch_add(static_cast<std::uint64_t>(removed));
    rows_repaired_.fetch_add(static_cast<std::uint64_t>(removed));
    notice("keel_breaker_members: removed " + std::to_string(removed) +
           " row(s) seen in the future, not a heartbeat: " + which +
           "; the fleet's size counts the processes seen within " +
           format_duration(std::chrono::milliseconds(members_ms_)));
  }
  if (size < 1 || size > kMaxFleet) {
    if (first_time("members\n")) {
      rows_out_of_domain_.fetch_add(1);
      notice("keel_breaker_members: " + std::to_string(size) + " processes seen within " +
             format_duration(std::chrono::milliseconds(members_ms_)) + ", more than the " +
             std::to_string(kMaxFleet) + " a fleet on one database can be; ignored (the fleet's " +
             "size stays " + std::to_string(registry_.fleet_size()) + ")");
    }
    return;
  }
  registry_.set_fleet_size(static_cast<int>(size));
  if (last_fleet_size_ != static_cast<int>(size)) {
    last_fleet_size_ = static_cast<int>(size);
    if (sharing_.load()) set_rate_sharing(true);  // the share a lease failure falls back on
  }
}

}  // namespace keel::store
