// Stored job keys under the one idempotency key rule (see include/keel/queue/queue_keys.hpp).
#include "keel/queue/queue_keys.hpp"

#include <string>

#include "keel/core/expected.hpp"
#include "queue/detail/queue_sql.hpp"

namespace keel::store {
namespace {

constexpr std::size_t kPage = 1000;

}  // namespace

std::string_view to_string(StoredKeyIssue issue) noexcept {
  switch (issue) {
    case StoredKeyIssue::kInvalid:
      return "invalid";
    case StoredKeyIssue::kNotCanonical:
      return "not_canonical";
    case StoredKeyIssue::kCollides:
      return "collides";
  }
  return "unknown";
}

std::vector<StoredKeyProblem> check_stored_keys(Connection& connection, std::string_view queue) {
  std::vector<StoredKeyProblem> out;
  const std::string sql = "SELECT id, queue, idem_key, state FROM keel_jobs WHERE id > $1" +
                          detail::queue_filter(queue, 3) + " ORDER BY id LIMIT $2";
  std::int64_t after = 0;
  for (;;) {
    const Rows rows =
        queue.empty()
            ? connection.query(sql, {after, static_cast<std::int64_t>(kPage)})
            : connection.query(sql, {after, static_cast<std::int64_t>(kPage), std::string(queue)});
    for (std::size_t i = 0; i < rows.size(); ++i) {
      RowCursor c(rows, i);
      after = c.integer();
      const std::string& job_queue = c.text();
      const std::string& key = c.text();
      const std::string& state = c.text();
      IdempotencyKeyCheck checked = check_idempotency_key(key);
      if (checked.ok() && checked.key == key) continue;
      StoredKeyProblem p{.id = after,
                         .queue = job_queue,
                         .key = key,
                         .state = parse_job_state(state).value_or(JobState::kReady)};
      if (!checked.ok()) {
        p.issue = StoredKeyIssue::kInvalid;
        p.problem = checked.problem;
        p.reason = checked.error.problem;
      } else {
        p.canonical = std::move(checked.key);
        // The only other form of a valid key is its quoted string, so at most one other job.
        // Along the index of given keys: a key keel made is a UUID it made, which no other
        // job's key is read as.
        const Rows same = connection.query(
            "SELECT id FROM keel_jobs WHERE queue = $1 AND idem_key = $2 AND key_made = 0",
            {p.queue, p.canonical});
        if (same.empty()) {
          p.issue = StoredKeyIssue::kNotCanonical;
          p.reason = "is read as " + quote_value(p.canonical) +
                     " by clients and receivers; a job enqueued with that key is another job";
        } else {
          p.issue = StoredKeyIssue::kCollides;
          p.same_as = RowCursor(same, 0).integer();
          p.reason = "is read as " + quote_value(p.canonical) + ", the key of job " +
                     std::to_string(*p.same_as) + ": a receiver takes both jobs for one request";
        }
      }
      out.push_back(std::move(p));
    }
    if (rows.size() < kPage) break;
  }
  return out;
}

}  // namespace keel::store
