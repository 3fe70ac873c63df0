// JobQueue's dead-letter administration by id or by queue: list_dead, replay, replay_all,
// discard, discard_all. Selecting by filter and paced replays are dead_letters.cpp.
#include "keel/queue/queue.hpp"
#include "queue/detail/queue_sql.hpp"
#include "queue/detail/queue_wakeup.hpp"

namespace keel::store {

using detail::in_transaction;
using detail::kJobColumns;
using detail::queue_filter;
using detail::read_job;

std::vector<Job> JobQueue::list_dead(Connection& connection, std::string_view queue,
                                     int limit) const {
  const std::string sql = "SELECT " + std::string(kJobColumns) +
                          " FROM keel_jobs WHERE state = 'dead'" + queue_filter(queue, 2) +
                          " ORDER BY updated_ms, id LIMIT $1";
  const Rows r =
      queue.empty() ? connection.query(sql, {limit}) : connection.query(sql, {limit, queue});
  std::vector<Job> out;
  out.reserve(r.size());
  for (std::size_t i = 0; i < r.size(); ++i) out.push_back(read_job(r, i));
  return out;
}

std::vector<std::int64_t> JobQueue::replay(Connection& connection,
                                           const std::vector<std::int64_t>& ids) const {
  std::vector<std::int64_t> out;
  in_transaction(connection, [&](Connection& tx) {
    out.clear();
    const std::int64_t now = now_ms();
    for (std::int64_t id : ids) {
      const Rows r = tx.query(detail::replay_update("$2", "$2", "id = $1"), {id, now});
      if (r.affected() == 1) out.push_back(id);
    }
    return true;
  });
  if (!out.empty()) detail::wake_local_workers(connection, std::string_view{});  // any queue
  return out;
}

std::int64_t JobQueue::replay_all(Connection& connection, std::string_view queue) const {
  std::int64_t n = 0;
  in_transaction(connection, [&](Connection& tx) {
    const std::int64_t now = now_ms();
    const std::string sql = detail::replay_update("$1", "$1", "") + queue_filter(queue, 2);
    const Rows r = queue.empty() ? tx.query(sql, {now}) : tx.query(sql, {now, queue});
    n = r.affected();
    return true;
  });
  if (n > 0) detail::wake_local_workers(connection, queue);
  return n;
}

std::vector<std::int64_t> JobQueue::discard(Connection& connection,
                                            const std::vector<std::int64_t>& ids) const {
  std::vector<std::int64_t> out;
  in_transaction(connection, [&](Connection& tx) {
    out.clear();
    for (std::int64_t id : ids) {
      if (detail::discard_dead(tx, id)) out.push_back(id);
    }
    return true;
  });
  return out;
}

std::int64_t JobQueue::discard_all(Connection& connection, std::string_view queue) const {
  std::int64_t n = 0;
  in_transaction(connection, [&](Connection& tx) {
    const std::string filter = queue_filter(queue, 1);
    const std::string attempts_sql =
        "DELETE FROM keel_job_attempts WHERE job_id IN (SELECT id FROM keel_jobs"
        " WHERE state = 'dead'" +
        filter + ")";
    const std::string jobs_sql = "DELETE FROM keel_jobs WHERE state = 'dead'" + filter;
    if (queue.empty()) {
      tx.query(attempts_sql);
      n = tx.query(jobs_sql).affected();
    } else {
      tx.query(attempts_sql, {queue});
      n = tx.query(jobs_sql, {queue}).affected();
    }
    return true;
  });
  return n;
}

}  // namespace keel::store
