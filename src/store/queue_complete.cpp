// JobQueue's worker protocol, the outcome side: complete (an attempt's outcome, with the retry
// decision left to keel::core's decide_retry: done, retry scheduled, deferred or dead) and
// complete_done (successes in a batch).
#include <algorithm>
#include <mutex>

#include "detail/queue_sql.hpp"
#include "keel/duration.hpp"
#include "keel/store/queue.hpp"

namespace keel::store {

using detail::clip;
using detail::in_transaction;
using detail::insert_attempt;
using detail::optional_text;
using detail::to_ms;

namespace {

std::string_view outcome_name(OutcomeKind kind) { return to_string(kind); }

}  // namespace

CompleteResult JobQueue::complete(Connection& connection, std::int64_t job_id, std::int64_t fence,
                                  const AttemptReport& report) const {
  const bool pg = connection.backend() == Backend::kPostgres;
  CompleteResult out;
  if (report.outcome.kind == OutcomeKind::kSuccess) {
    // One UPDATE: the done row is the success's history. On PostgreSQL the statement alone, atomic
    // on its own; on SQLite in the transaction wrapper, which retries SQLITE_BUSY.
    bool current = false;
    if (pg) {
      current = detail::mark_done(connection, job_id, fence, now_ms());
    } else {
      in_transaction(connection, [&](Connection& tx) {
        current = detail::mark_done(tx, job_id, fence, now_ms());
        return true;
      });
    }
    out.status = current ? CompleteStatus::kDone : CompleteStatus::kStale;
    return out;
  }
  in_transaction(connection, [&](Connection& tx) {
    out = CompleteResult{};
    const std::int64_t now = now_ms();
    const Rows row =
        tx.query(std::string("SELECT attempts, max_attempts, leased_ms, lease_owner, replays,"
                             " limited_retries, prev_delay_ms, created_ms FROM keel_jobs"
                             " WHERE id = $1 AND fence = $2 AND state = 'running'") +
                     (pg ? " FOR UPDATE" : ""),
                 {job_id, fence});
    if (row.empty()) {
      out.status = CompleteStatus::kStale;
      return false;
    }
    const std::int64_t attempts = row.integer(0, 0);
    const std::int64_t max_attempts = row.integer(0, 1);
    const std::int64_t started = row.cell(0, 2) ? row.integer(0, 2) : now;
    const std::string owner = optional_text(row, 0, 3);
    const std::int64_t round = row.integer(0, 4);
    const OutcomeKind kind = report.outcome.kind;
    std::string error = report.error;
    if (error.empty() && kind != OutcomeKind::kSuccess) error = describe(report.outcome);

    // Every retry rule is keel::core's: the queue stores the progress and applies the verdict.
    RetryLimits limits;
    limits.max_attempts = static_cast<int>(std::max<std::int64_t>(1, max_attempts));
    limits.safe_to_repeat = true;  // a job carries its idempotency key on every attempt
    if (options_.max_age < kInfinite) {
      const Duration age = std::chrono::milliseconds(now - row.integer(0, 7));
      limits.time_left = options_.max_age - age;
    }
    RetryProgress progress;
    progress.attempts = static_cast<int>(std::max<std::int64_t>(1, attempts));
    progress.limited_retries = static_cast<int>(row.integer(0, 5));
    progress.previous_delay = std::chrono::milliseconds(row.integer(0, 6));
    RetryVerdict verdict;
    {
      std::lock_guard lock(rng_mu_);
      verdict = decide_retry(policy_, limits, progress, report.outcome, rng_);
    }

    if (verdict.retry && !verdict.counts_attempt) {
      // Nothing was sent: the lease's attempt is given back and the job waits for its brake.
      out.status = CompleteStatus::kDeferred;
      out.delay = verdict.delay;
      out.retry_at_ms = now + to_ms(verdict.delay);
      tx.query(
          "UPDATE keel_jobs SET state = 'retry_scheduled', attempts = attempts - 1,"
          " lease_owner = NULL, lease_expires_ms = NULL, run_at_ms = $3, deferred_reason = $4,"
          " deferrals = deferrals + 1, updated_ms = $2 WHERE id = $1",
          {job_id, now, out.retry_at_ms, clip(error)});
      insert_attempt(tx, job_id, round, attempts, started, now, "deferred", error,
                     to_ms(verdict.delay), owner);
      return true;
    }
    if (verdict.retry) {
      out.status = CompleteStatus::kRetryScheduled;
      out.delay = verdict.delay;
      out.retry_at_ms = now + to_ms(verdict.delay);
      tx.query(
          "UPDATE keel_jobs SET state = 'retry_scheduled', lease_owner = NULL,"
          " lease_expires_ms = NULL, run_at_ms = $3, last_error = $4, deferred_reason = NULL,"
          " limited_retries = $5, prev_delay_ms = $6, updated_ms = $2 WHERE id = $1",
          {job_id, now, out.retry_at_ms, clip(error), verdict.progress.limited_retries,
           to_ms(verdict.progress.previous_delay)});
      insert_attempt(tx, job_id, round, attempts, started, now, outcome_name(kind), error,
                     to_ms(verdict.delay), owner);
      return true;
    }
    out.status = CompleteStatus::kDead;
    switch (verdict.reason) {
      case StopReason::kPermanent:
        out.dead_reason = "permanent: " + error;
        break;
      case StopReason::kDeadline:
        out.dead_reason = "max age " + format_duration(options_.max_age) + " reached: " + error;
        break;
      default:
        out.dead_reason = "attempts exhausted (" + std::to_string(attempts) + " of " +
                          std::to_string(max_attempts) +
                          (report.outcome.retry_limit != Outcome::kNoRetryLimit
                               ? ", at most " + std::to_string(report.outcome.retry_limit) +
                                     " retries after this outcome"
                               : std::string()) +
                          "): " + error;
        break;
    }
    out.dead_reason = clip(out.dead_reason);
    // A deferral's attempt was not counted: record the history row under its own name.
    const bool attempted = report.outcome.attempted();
    tx.query(std::string("UPDATE keel_jobs SET state = 'dead', lease_owner = NULL,") +
                 (attempted ? "" : " attempts = attempts - 1,") +
                 " lease_expires_ms = NULL, run_at_ms = $2, last_error = $3, dead_reason = $4,"
                 " updated_ms = $2, finished_ms = $2 WHERE id = $1",
             {job_id, now, clip(error), out.dead_reason});
    insert_attempt(tx, job_id, round, attempts, started, now,
                   attempted ? outcome_name(kind) : std::string_view("deferred"), error,
                   std::nullopt, owner);
    return true;
  });
  if (out.status == CompleteStatus::kDead && options_.on_dead_letter) {
    options_.on_dead_letter(job_id, out.dead_reason);
  }
  return out;
}

int JobQueue::complete_done(
    Connection& connection,
    const std::vector<std::pair<std::int64_t, std::int64_t>>& id_and_fence) const {
  int current = 0;
  in_transaction(connection, [&](Connection& tx) {
    current = 0;
    const std::int64_t now = now_ms();
    for (const auto& [id, fence] : id_and_fence) {
      if (detail::mark_done(tx, id, fence, now)) ++current;
    }
    return true;
  });
  return current;
}

}  // namespace keel::store
