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
using detail::held_by;
using detail::in_transaction;
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
      current = detail::mark_done(c, job_id, fence, now_ms(), options_.keep_done);
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
  std::vector<detail::SettleWrite> writes;
  const CompleteResult out =
      decide_settle(detail::read_settle_row(row, i), report, history, now, writes);
  detail::apply_settles(tx, writes, now);
  return out;
}

CompleteResult JobQueue::decide_settle(const detail::SettleRow& job, const AttemptReport& report,
                                       std::string_view history, std::int64_t now,
                                       std::vector<detail::SettleWrite>& writes) const {
  CompleteResult out;
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

  detail::SettleWrite w{.id = job_id, .charge = charge};
  w.history = {.job_id = job_id,
               .round = job.replays,
               .attempt = attempts,
               .started_ms = began,
               .finished_ms = now,
               .outcome = std::string(name),
               .error = error,
               .worker = job.lease_owner};
  if (verdict.retry) {
    out.status =
        verdict.counts_attempt ? CompleteStatus::kRetryScheduled : CompleteStatus::kDeferred;
    out.delay = verdict.delay;
    out.retry_at_ms = now + to_ms(verdict.delay);
    w.state = "retry_scheduled";
    w.run_at_ms = out.retry_at_ms;
    w.history.delay_ms = to_ms(verdict.delay);
    if (!verdict.counts_attempt) {
      // Nothing was sent: no attempt is charged and the job waits for its brake.
      w.deferred_reason = clip(error);
      w.deferral = 1;
    } else {
      w.last_error = clip(error);
      w.limited_retries = verdict.progress.limited_retries;
      w.prev_delay_ms = to_ms(verdict.progress.previous_delay);
    }
    writes.push_back(std::move(w));
    return out;
  }
  out.status = CompleteStatus::kDead;
  const DeadVerdict dead = dead_verdict(verdict.reason, attempts, max_attempts, report.outcome,
                                        error, history, options_.max_age);
  out.dead_kind = dead.kind;
  out.dead_reason = clip(dead.reason);
  w.state = "dead";
  w.run_at_ms = now;
  w.last_error = clip(error);
  w.dead_reason = out.dead_reason;
  w.dead_kind = std::string(to_string(out.dead_kind));
  w.finished_ms = now;
  writes.push_back(std::move(w));
  return out;
}

std::vector<CompleteResult> JobQueue::complete_batch(
    Connection& connection, const std::vector<BatchOutcome>& outcomes) const {
  std::vector<CompleteResult> out(outcomes.size());
  if (outcomes.empty()) return out;
  std::vector<std::pair<std::int64_t, std::int64_t>> done;
  std::vector<std::size_t> failed;  // indexes into outcomes
  for (std::size_t i = 0; i < outcomes.size(); ++i) {
    if (outcomes[i].report.outcome.kind == OutcomeKind::kSuccess) {
      done.emplace_back(outcomes[i].job_id, outcomes[i].fence);
    } else {
      failed.push_back(i);
    }
  }
  // In ascending id order, as every statement of the queue that writes several jobs.
  std::sort(done.begin(), done.end());
  std::sort(failed.begin(), failed.end(),
            [&](std::size_t a, std::size_t b) { return outcomes[a].job_id < outcomes[b].job_id; });
  in_transaction(deadlocks_, connection, [&](Connection& tx) {
    for (CompleteResult& r : out) r = CompleteResult{.status = CompleteStatus::kStale};
    const std::int64_t now = now_ms();
    const std::vector<std::int64_t> current = record_done(tx, done, now);
    for (std::size_t i = 0; i < outcomes.size(); ++i) {
      if (std::binary_search(current.begin(), current.end(), outcomes[i].job_id) &&
          outcomes[i].report.outcome.kind == OutcomeKind::kSuccess) {
        out[i].status = CompleteStatus::kDone;
      }
    }
    if (failed.empty()) return true;
    // The failed jobs still held under their leases, read and locked in one statement.
    std::vector<Value> params;
    const auto param = [&](std::int64_t v) {
      params.emplace_back(v);
      return "$" + std::to_string(params.size());
    };
    std::string held;
    for (std::size_t k = 0; k < failed.size(); ++k) {
      const BatchOutcome& o = outcomes[failed[k]];
      held += (k ? " OR (" : "(") + held_by(param(o.job_id), param(o.fence)) + ")";
    }
    const Rows rows = tx.query(std::string("SELECT ") + std::string(detail::kSettleColumns) +
                                   " FROM keel_jobs WHERE " + held + " ORDER BY id" +
                                   std::string(tx.dialect().lock_rows()),
                               params);
    std::vector<detail::SettleWrite> writes;
    writes.reserve(rows.size());
    std::size_t k = 0;
    for (std::size_t r = 0; r < rows.size(); ++r) {
      const detail::SettleRow job = detail::read_settle_row(rows, r);
      while (k < failed.size() && outcomes[failed[k]].job_id < job.id) ++k;
      if (k == failed.size()) break;
      out[failed[k]] = decide_settle(job, outcomes[failed[k]].report, {}, now, writes);
    }
    detail::apply_settles(tx, writes, now);
    return true;
  });
  if (options_.on_dead_letter) {
    for (std::size_t i = 0; i < outcomes.size(); ++i) {
      if (out[i].status == CompleteStatus::kDead) {
        options_.on_dead_letter(outcomes[i].job_id,
                                DeadLetterReason{out[i].dead_kind, out[i].dead_reason});
      }
    }
  }
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
  const auto record = [&](Connection& c) {
    current = record_done(c, done, now_ms());
    return true;
  };
  // One statement for the whole set where WITH may hold an UPDATE, atomic on its own.
  if (connection.dialect().data_modifying_ctes()) {
    detail::in_statement(deadlocks_, connection, record);
  } else {
    in_transaction(deadlocks_, connection, record);
  }
  return current;
}

std::vector<std::int64_t> JobQueue::record_done(
    Connection& connection, const std::vector<std::pair<std::int64_t, std::int64_t>>& done,
    std::int64_t now) const {
  std::vector<std::int64_t> current;
  if (done.empty()) return current;
  if (connection.dialect().data_modifying_ctes()) {
    // kMarkDone's now is $2 (a delete reads none); $1 is a 0 the statement only compares.
    std::vector<Value> params = {std::int64_t{0}};
    if (options_.keep_done) params.emplace_back(now);
    const std::string sql = "WITH " + detail::done_ctes(done, params, options_.keep_done) +
                            " SELECT id FROM done WHERE $1::bigint = 0 ORDER BY id";
    const Rows r = connection.query(sql, params);
    for (std::size_t i = 0; i < r.size(); ++i) current.push_back(RowCursor(r, i).integer());
    return current;
  }
  for (const auto& [id, fence] : done) {
    if (detail::mark_done(connection, id, fence, now, options_.keep_done)) current.push_back(id);
  }
  return current;
}

}  // namespace keel::store
