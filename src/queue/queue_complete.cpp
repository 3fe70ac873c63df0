// JobQueue's worker protocol, the outcome side: complete (an attempt's outcome, with the retry
// decision left to keel::core's decide_retry: done, retry scheduled, deferred or dead) and
// complete_done and complete_done_ids (successes in a batch).
#include <algorithm>
#include <mutex>

#include "keel/core/duration.hpp"
#include "keel/db/dialect.hpp"
#include "keel/queue/queue.hpp"
#include "queue/detail/queue_sql.hpp"

namespace keel::store {

using detail::clip;
using detail::in_transaction;
using detail::insert_attempt;
using detail::to_ms;

namespace {

std::string_view outcome_name(OutcomeKind kind) { return to_string(kind); }

// Why a job is dead, from core's verdict: its kind and the reason stored beside it.
struct DeadVerdict {
  DeadReason kind = DeadReason::kAttemptsExhausted;
  std::string reason;
};

DeadVerdict dead_verdict(StopReason stop, std::int64_t attempts, std::int64_t max_attempts,
                         const Outcome& outcome, const std::string& error, std::string_view history,
                         Duration max_age) {
  switch (stop) {
    case StopReason::kPermanent:
      return {DeadReason::kPermanent, "permanent: " + error};
    case StopReason::kDeadline:
      return {DeadReason::kMaxAge, "max age " + format_duration(max_age) + " reached: " + error};
    default:
      // The expired-lease sweep reports the run whose worker died (history "lease_expired").
      return {history == "lease_expired" ? DeadReason::kCrashed : DeadReason::kAttemptsExhausted,
              "attempts exhausted (" + std::to_string(attempts) + " of " +
                  std::to_string(max_attempts) +
                  (outcome.retry_limit != Outcome::kNoRetryLimit
                       ? ", at most " + std::to_string(outcome.retry_limit) +
                             " retries after this outcome"
                       : std::string()) +
                  "): " + error};
  }
}

}  // namespace

AttemptReport AttemptReport::not_sent(const Outcome& outcome, StopReason reason,
                                      std::string_view dependency) {
  AttemptReport report{.outcome = outcome, .error = {}};
  if (reason == StopReason::kCircuitOpen) {
    report.error = "circuit open for " + std::string(dependency);
    if (outcome.has_server_delay()) {
      report.error += ", next probe in " + format_duration(outcome.server_delay);
    }
  } else if (reason == StopReason::kLimited) {
    // Its rate limit, or the pause a 429 or 503 with Retry-After asked for: not a failure.
    report.error = "held by the rate limit of " + std::string(dependency);
    if (outcome.has_server_delay()) {
      report.error += (outcome.in_line ? ", its turn in line in " : ", next slot in ") +
                      format_duration(outcome.server_delay);
    }
  } else {
    report.error = std::string(to_string(reason)) + " for " + std::string(dependency);
  }
  return report;
}

CompleteResult JobQueue::complete(Connection& connection, std::int64_t job_id, std::int64_t fence,
                                  const AttemptReport& report) const {
  CompleteResult out;
  if (report.outcome.kind == OutcomeKind::kSuccess) {
    // One UPDATE: the done row is the success's history. Atomic on its own, retried as a
    // transaction is (40P01, a busy database).
    bool current = false;
    detail::in_statement(deadlocks_, connection, [&](Connection& c) {
      current = detail::mark_done(c, job_id, fence, now_ms());
      return true;
    });
    out.status = current ? CompleteStatus::kDone : CompleteStatus::kStale;
    return out;
  }
  in_transaction(deadlocks_, connection, [&](Connection& tx) {
    out = CompleteResult{};
    const Rows row = tx.query(std::string("SELECT ") + std::string(detail::kSettleColumns) +
                                  " FROM keel_jobs WHERE " + detail::held_by("$1", "$2") +
                                  std::string(connection.dialect().lock_rows()),
                              {job_id, fence});
    if (row.empty()) {
      out.status = CompleteStatus::kStale;
      return false;
    }
    out = settle(tx, row, 0, report, {}, now_ms());
    return true;
  });
  if (out.status == CompleteStatus::kDead && options_.on_dead_letter) {
    options_.on_dead_letter(job_id, DeadLetterReason{out.dead_kind, out.dead_reason});
  }
  return out;
}

CompleteResult JobQueue::settle(Connection& tx, const Rows& row, std::size_t i,
                                const AttemptReport& report, std::string_view history,
                                std::int64_t now) const {
  CompleteResult out;
  const detail::SettleRow job = detail::read_settle_row(row, i);
  const std::int64_t job_id = job.id;
  const bool started = job.started_ms.has_value();
  const OutcomeKind kind = report.outcome.kind;
  const bool attempted = report.outcome.attempted();
  // The attempt this report is about: the started one, or (a report on a job whose attempt was
  // not started) the one it starts now. The stored count changes by `charge`: a report on an
  // unstarted job charges it now; a deferral gives back a started attempt.
  const std::int64_t attempts = job.attempts + (started ? 0 : 1);
  const int charge = attempted ? (started ? 0 : 1) : (started ? -1 : 0);
  const std::int64_t max_attempts = job.max_attempts;
  const std::int64_t began = started ? *job.started_ms : job.leased_ms.value_or(now);
  const std::string& owner = job.lease_owner;
  const std::int64_t round = job.replays;
  std::string error = report.error;
  if (error.empty() && kind != OutcomeKind::kSuccess) error = describe(report.outcome);
  const std::string_view name =
      !history.empty() ? history : (attempted ? outcome_name(kind) : std::string_view("deferred"));

  // Every retry rule is keel::core's: the queue stores the progress and applies the verdict.
  RetryLimits limits;
  limits.max_attempts = static_cast<int>(std::max<std::int64_t>(1, max_attempts));
  limits.safe_to_repeat = true;  // a job carries its idempotency key on every attempt
  if (options_.max_age < kInfinite) {
    const Duration age = std::chrono::milliseconds(now - job.created_ms);
    limits.time_left = options_.max_age - age;
  }
  RetryProgress progress;
  progress.attempts = static_cast<int>(std::max<std::int64_t>(1, attempts));
  progress.limited_retries = static_cast<int>(job.limited_retries);
  progress.previous_delay = std::chrono::milliseconds(job.prev_delay_ms);
  RetryVerdict verdict;
  {
    std::lock_guard lock(rng_mu_);
    verdict = decide_retry(policy_, limits, progress, report.outcome, rng_);
  }

  if (verdict.retry) {
    // Deferred when nothing was sent: no attempt is charged and the job waits for its brake.
    const bool deferred = !verdict.counts_attempt;
    out.status = deferred ? CompleteStatus::kDeferred : CompleteStatus::kRetryScheduled;
    out.delay = verdict.delay;
    out.retry_at_ms = now + to_ms(verdict.delay);
    if (deferred) {
      tx.query(
          "UPDATE keel_jobs SET state = 'retry_scheduled', attempts = attempts + $5,"
          " lease_owner = NULL, lease_expires_ms = NULL, run_at_ms = $3, deferred_reason = $4,"
          " deferrals = deferrals + 1, updated_ms = $2 WHERE id = $1",
          {job_id, now, out.retry_at_ms, clip(error), charge});
    } else {
      tx.query(
          "UPDATE keel_jobs SET state = 'retry_scheduled', attempts = attempts + $7,"
          " lease_owner = NULL, lease_expires_ms = NULL, run_at_ms = $3, last_error = $4,"
          " deferred_reason = NULL, limited_retries = $5, prev_delay_ms = $6, updated_ms = $2"
          " WHERE id = $1",
          {job_id, now, out.retry_at_ms, clip(error), verdict.progress.limited_retries,
           to_ms(verdict.progress.previous_delay), charge});
    }
    insert_attempt(tx, job_id, round, attempts, began, now, name, error, to_ms(verdict.delay),
                   owner);
    return out;
  }
  out.status = CompleteStatus::kDead;
  const DeadVerdict dead = dead_verdict(verdict.reason, attempts, max_attempts, report.outcome,
                                        error, history, options_.max_age);
  out.dead_kind = dead.kind;
  out.dead_reason = clip(dead.reason);
  tx.query(
      "UPDATE keel_jobs SET state = 'dead', attempts = attempts + $5, lease_owner = NULL,"
      " lease_expires_ms = NULL, run_at_ms = $2, last_error = $3, dead_reason = $4,"
      " dead_kind = $6, updated_ms = $2, finished_ms = $2 WHERE id = $1",
      {job_id, now, clip(error), out.dead_reason, charge, std::string(to_string(out.dead_kind))});
  insert_attempt(tx, job_id, round, attempts, began, now, name, error, std::nullopt, owner);
  return out;
}

int JobQueue::complete_done(
    Connection& connection,
    const std::vector<std::pair<std::int64_t, std::int64_t>>& id_and_fence) const {
  return static_cast<int>(complete_done_ids(connection, id_and_fence).size());
}

std::vector<std::int64_t> JobQueue::complete_done_ids(
    Connection& connection,
    const std::vector<std::pair<std::int64_t, std::int64_t>>& id_and_fence) const {
  std::vector<std::int64_t> current;
  if (id_and_fence.empty()) return current;
  // In ascending id order, as every statement of the queue that writes several jobs.
  std::vector<std::pair<std::int64_t, std::int64_t>> done = id_and_fence;
  std::sort(done.begin(), done.end());
  if (connection.dialect().data_modifying_ctes()) {
    // One statement for the whole set, atomic on its own.
    // kMarkDone's now is $2; $1 is a 0 the statement only compares.
    std::vector<Value> params = {std::int64_t{0}, now_ms()};
    const std::string sql = "WITH " + detail::done_ctes(done, params) +
                            " SELECT id FROM done WHERE $1::bigint = 0 ORDER BY id";
    detail::in_statement(deadlocks_, connection, [&](Connection& c) {
      const Rows r = c.query(sql, params);
      current.clear();
      for (std::size_t i = 0; i < r.size(); ++i) current.push_back(RowCursor(r, i).integer());
      return true;
    });
    return current;
  }
  in_transaction(deadlocks_, connection, [&](Connection& tx) {
    current.clear();
    const std::int64_t now = now_ms();
    for (const auto& [id, fence] : done) {
      if (detail::mark_done(tx, id, fence, now)) current.push_back(id);
    }
    return true;
  });
  return current;
}

}  // namespace keel::store
