// JobQueue's statistics and housekeeping: dead_depth, dead_expiring, stats, queue_exists, idle,
// prune_done (the only way a done job is deleted) and prune_dead (the only way a dead job is
// deleted without an operator's decision, and only under an explicit dead-letter retention).
#include <algorithm>
#include <chrono>
#include <limits>
#include <stdexcept>
#include <vector>

#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "keel/queue/queue.hpp"
#include "queue/detail/queue_sql.hpp"

namespace keel::store {

using detail::in_transaction;
using detail::queue_filter;
using detail::to_ms;

namespace {

// When a dead job died: the time of its last attempt (or of the expired lease that killed it).
constexpr std::string_view kDiedMs = "COALESCE(finished_ms, updated_ms)";

// a + b in calendar milliseconds, saturating (retentions and windows may be kInfinite).
[[nodiscard]] std::int64_t saturating_add_ms(std::int64_t a, std::int64_t b) {
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  constexpr std::int64_t kMin = std::numeric_limits<std::int64_t>::min();
  if (b > 0 && a > kMax - b) return kMax;
  if (b < 0 && a < kMin - b) return kMin;
  return a + b;
}

}  // namespace

std::int64_t JobQueue::dead_depth(Connection& connection, std::string_view queue) const {
  const std::string sql =
      "SELECT COUNT(*) FROM keel_jobs WHERE state = 'dead'" + queue_filter(queue, 1);
  const Rows r = queue.empty() ? connection.query(sql) : connection.query(sql, {queue});
  return RowCursor(r, 0).integer();
}

std::vector<QueueStats> JobQueue::stats(Connection& connection) const {
  const std::int64_t now = now_ms();
  std::vector<QueueStats> out;
  const Rows queues = connection.query("SELECT name FROM keel_queues ORDER BY name");
  for (std::size_t i = 0; i < queues.size(); ++i) {
    QueueStats s;
    s.queue = RowCursor(queues, i).text();
    out.push_back(std::move(s));
  }
  const auto find = [&](const std::string& name) -> QueueStats* {
    for (QueueStats& s : out) {
      if (s.queue == name) return &s;
    }
    return nullptr;
  };
  // Each row (queue, COUNT(*)) of `rows` into that queue's `field`.
  const auto set_counts = [&](const Rows& rows, std::int64_t QueueStats::*field) {
    for (std::size_t i = 0; i < rows.size(); ++i) {
      RowCursor c(rows, i);
      QueueStats* s = find(c.text());
      const std::int64_t n = c.integer();
      if (s != nullptr) s->*field = n;
    }
  };
  const Rows counts =
      connection.query("SELECT queue, state, COUNT(*) FROM keel_jobs GROUP BY queue, state");
  for (std::size_t i = 0; i < counts.size(); ++i) {
    RowCursor c(counts, i);
    QueueStats* s = find(c.text());
    const std::string& state = c.text();
    const std::int64_t n = c.integer();
    if (s == nullptr) continue;
    switch (parse_job_state(state).value_or(JobState::kReady)) {
      case JobState::kReady:
        s->ready = n;
        break;
      case JobState::kRunning:
        s->running = n;
        break;
      case JobState::kRetryScheduled:
        s->retry_scheduled = n;
        break;
      case JobState::kDone:
        s->done = n;
        break;
      case JobState::kDead:
        s->dead = n;
        break;
    }
  }
  set_counts(
      connection.query("SELECT queue, COUNT(*) FROM keel_jobs WHERE state = 'retry_scheduled'"
                       " AND deferred_reason IS NOT NULL GROUP BY queue"),
      &QueueStats::deferred);
  const Rows oldest = connection.query(
      "SELECT queue, MIN(run_at_ms) FROM keel_jobs WHERE state IN ('ready', 'retry_scheduled')"
      " AND run_at_ms <= $1 GROUP BY queue",
      {now});
  for (std::size_t i = 0; i < oldest.size(); ++i) {
    RowCursor c(oldest, i);
    QueueStats* s = find(c.text());
    const std::optional<std::int64_t> run_at_ms = c.optional_integer();
    if (s == nullptr || !run_at_ms) continue;
    s->oldest_ready_age = std::chrono::milliseconds(std::max<std::int64_t>(0, now - *run_at_ms));
  }
  if (options_.dead_letter_retention < kInfinite) {
    const std::int64_t before =
        saturating_add_ms(saturating_add_ms(now, -to_ms(options_.dead_letter_retention)),
                          to_ms(options_.dead_letter_warning.value_or(Duration::zero())));
    set_counts(connection.query("SELECT queue, COUNT(*) FROM keel_jobs WHERE state = 'dead' AND " +
                                    std::string(kDiedMs) + " <= $1 GROUP BY queue",
                                {before}),
               &QueueStats::dead_expiring);
  }
  return out;
}

std::int64_t JobQueue::dead_expiring(Connection& connection, std::string_view queue,
                                     Duration within) const {
  if (within < Duration::zero()) {
    throw_invalid({.context = "keel::store::JobQueue::dead_expiring",
                   .field = "within",
                   .problem = "must be >= 0",
                   .got = format_duration(within)});
  }
  if (options_.dead_letter_retention >= kInfinite) return 0;
  // Died at or before now - retention + within: pruned by then.
  const std::int64_t before = saturating_add_ms(
      saturating_add_ms(now_ms(), -to_ms(options_.dead_letter_retention)), to_ms(within));
  const std::string sql = "SELECT COUNT(*) FROM keel_jobs WHERE state = 'dead' AND " +
                          std::string(kDiedMs) + " <= $1" + queue_filter(queue, 2);
  const Rows r =
      queue.empty() ? connection.query(sql, {before}) : connection.query(sql, {before, queue});
  return RowCursor(r, 0).integer();
}

bool JobQueue::queue_exists(Connection& connection, std::string_view queue) const {
  return !connection.query("SELECT 1 FROM keel_queues WHERE name = $1", {queue}).empty();
}

bool JobQueue::idle(Connection& connection, std::string_view queue) const {
  return connection
      .query(
          "SELECT 1 FROM keel_jobs WHERE queue = $1 AND state IN ('ready', 'running',"
          " 'retry_scheduled') LIMIT 1",
          {queue})
      .empty();
}

std::int64_t JobQueue::prune_done(Connection& connection, std::string_view queue,
                                  Duration retention, int batch) const {
  constexpr std::string_view kFunction = "keel::store::JobQueue::prune_done";
  if (retention < Duration::zero()) {
    throw_invalid({.context = std::string(kFunction),
                   .field = "retention",
                   .problem = "must be >= 0",
                   .got = format_duration(retention)});
  }
  if (batch < 1) {
    throw_invalid({.context = std::string(kFunction),
                   .field = "batch",
                   .problem = "must be >= 1",
                   .got = std::to_string(batch)});
  }
  std::int64_t n = 0;
  in_transaction(connection, [&](Connection& tx) {
    const std::int64_t cutoff = now_ms() - to_ms(retention);
    // Oldest ids first, along the primary key: no index holds done jobs (schema 9), and a scan
    // in id order stops at the batch's last one instead of sorting every done job of the queue.
    const std::string pick =
        "SELECT id FROM keel_jobs WHERE queue = $1 AND state = 'done' AND finished_ms <= $2"
        " ORDER BY id LIMIT $3";
    tx.query("DELETE FROM keel_job_attempts WHERE job_id IN (" + pick + ")",
             {queue, cutoff, batch});
    n = tx.query("DELETE FROM keel_jobs WHERE id IN (" + pick + ")", {queue, cutoff, batch})
            .affected();
    return true;
  });
  return n;
}

std::int64_t JobQueue::prune_dead(Connection& connection, std::string_view queue, int batch) const {
  if (batch < 1) {
    throw_invalid({.context = "keel::store::JobQueue::prune_dead",
                   .field = "batch",
                   .problem = "must be >= 1",
                   .got = std::to_string(batch)});
  }
  if (options_.dead_letter_retention >= kInfinite) return 0;
  std::int64_t n = 0;
  in_transaction(connection, [&](Connection& tx) {
    n = 0;
    const std::int64_t cutoff = saturating_add_ms(now_ms(), -to_ms(options_.dead_letter_retention));
    const std::string died = " AND " + std::string(kDiedMs) + " <= $1";
    std::vector<Value> pick_params = {cutoff, batch};
    if (!queue.empty()) pick_params.emplace_back(queue);
    const Rows picked =
        tx.query("SELECT id FROM keel_jobs WHERE state = 'dead'" + died + queue_filter(queue, 3) +
                     " ORDER BY " + std::string(kDiedMs) + ", id LIMIT $2",
                 pick_params);
    if (picked.empty()) return true;
    // The jobs first, each still dead and past the retention (a replay that commits meanwhile
    // wins: that job is no longer dead and keeps its history), then the history of those gone.
    std::vector<Value> ids = {cutoff};
    std::string list;
    for (std::size_t i = 0; i < picked.size(); ++i) {
      ids.emplace_back(RowCursor(picked, i).integer());
      list += (i == 0 ? "$" : ", $") + std::to_string(ids.size());
    }
    n = tx.query("DELETE FROM keel_jobs WHERE state = 'dead'" + died + " AND id IN (" + list + ")",
                 ids)
            .affected();
    ids.erase(ids.begin());
    std::string orphans;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      orphans += (i == 0 ? "$" : ", $") + std::to_string(i + 1);
    }
    tx.query(
        "DELETE FROM keel_job_attempts WHERE job_id IN (" + orphans +
            ") AND NOT EXISTS (SELECT 1 FROM keel_jobs j WHERE j.id = keel_job_attempts.job_id)",
        ids);
    return true;
  });
  return n;
}

}  // namespace keel::store
