// JobQueue's statistics and housekeeping: dead_depth, stats, queue_exists, idle, and
// prune_done (the only way a done job is deleted).
#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "detail/queue_sql.hpp"
#include "keel/duration.hpp"
#include "keel/expected.hpp"
#include "keel/store/queue.hpp"

namespace keel::store {

using detail::in_transaction;
using detail::queue_filter;
using detail::to_ms;

std::int64_t JobQueue::dead_depth(Connection& connection, std::string_view queue) const {
  const std::string sql =
      "SELECT COUNT(*) FROM keel_jobs WHERE state = 'dead'" + queue_filter(queue, 1);
  const Rows r = queue.empty() ? connection.query(sql) : connection.query(sql, {queue});
  return r.integer(0, 0);
}

std::vector<QueueStats> JobQueue::stats(Connection& connection) const {
  const std::int64_t now = now_ms();
  std::vector<QueueStats> out;
  const Rows queues = connection.query("SELECT name FROM keel_queues ORDER BY name");
  for (std::size_t i = 0; i < queues.size(); ++i) {
    QueueStats s;
    s.queue = queues.text(i, 0);
    out.push_back(std::move(s));
  }
  const auto find = [&](const std::string& name) -> QueueStats* {
    for (QueueStats& s : out) {
      if (s.queue == name) return &s;
    }
    return nullptr;
  };
  const Rows counts =
      connection.query("SELECT queue, state, COUNT(*) FROM keel_jobs GROUP BY queue, state");
  for (std::size_t i = 0; i < counts.size(); ++i) {
    QueueStats* s = find(counts.text(i, 0));
    if (s == nullptr) continue;
    const std::int64_t n = counts.integer(i, 2);
    switch (parse_job_state(counts.text(i, 1)).value_or(JobState::kReady)) {
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
  const Rows deferred = connection.query(
      "SELECT queue, COUNT(*) FROM keel_jobs WHERE state = 'retry_scheduled'"
      " AND deferred_reason IS NOT NULL GROUP BY queue");
  for (std::size_t i = 0; i < deferred.size(); ++i) {
    if (QueueStats* s = find(deferred.text(i, 0))) s->deferred = deferred.integer(i, 1);
  }
  const Rows oldest = connection.query(
      "SELECT queue, MIN(run_at_ms) FROM keel_jobs WHERE state IN ('ready', 'retry_scheduled')"
      " AND run_at_ms <= $1 GROUP BY queue",
      {now});
  for (std::size_t i = 0; i < oldest.size(); ++i) {
    QueueStats* s = find(oldest.text(i, 0));
    if (s == nullptr || !oldest.cell(i, 1)) continue;
    s->oldest_ready_age =
        std::chrono::milliseconds(std::max<std::int64_t>(0, now - oldest.integer(i, 1)));
  }
  return out;
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
    const std::string pick =
        "SELECT id FROM keel_jobs WHERE queue = $1 AND state = 'done' AND finished_ms <= $2"
        " ORDER BY finished_ms LIMIT $3";
    tx.query("DELETE FROM keel_job_attempts WHERE job_id IN (" + pick + ")",
             {queue, cutoff, batch});
    n = tx.query("DELETE FROM keel_jobs WHERE id IN (" + pick + ")", {queue, cutoff, batch})
            .affected();
    return true;
  });
  return n;
}

}  // namespace keel::store
