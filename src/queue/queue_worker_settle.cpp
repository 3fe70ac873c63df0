// The Worker's recovery of what a failed statement left unknown: outcomes settled on a new
// connection with each job's fencing token (settle, settle_one), and leases given back that no
// slot runs (give_back, give_back_unknown_leases). See queue_worker.cpp for the slots.
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "keel/core/text.hpp"
#include "keel/queue/queue_worker.hpp"

namespace keel::store {

CompleteResult Worker::settle_one(Connection& conn, Unrecorded& u) {
  WorkerEvent& event = u.event;
  const std::string job = "job " + std::to_string(event.job.id);
  const auto same_lease = [&](const std::optional<Job>& row) {
    return row && row->fence == event.job.fence;
  };
  // A queue that keeps no done job (QueueOptions::keep_done false) deletes a job with its
  // success: a job gone was done, by this lease's success or by a later one's (nothing else
  // deletes a job that is not dead or done).
  const bool deleted_as_done =
      !queue_.options().keep_done && event.report.outcome.kind == OutcomeKind::kSuccess;
  if (u.tx_in_doubt) {
    // The success was recorded in the handler's transaction: the row says whether it committed.
    // A job gone is read below, after complete() finds nothing to record.
    const std::optional<Job> row = queue_.get(conn, event.job.id);
    if (same_lease(row) && row->state == JobState::kDone) {
      log(job + ": its transaction committed before the connection was lost");
      return {.status = CompleteStatus::kDone};
    }
    if (same_lease(row) && row->state == JobState::kRunning) {
      // Rolled back with the lost connection: nothing of the attempt remains, so it is given
      // back, as a brake's refusal is, rather than charged.
      event.report = {.outcome = Outcome::not_attempted(),
                      .error =
                          "not charged: the job's transaction did not commit (the connection "
                          "was lost during COMMIT: " +
                          event.report.error + ")"};
    }
  }
  CompleteResult result;
  try {
    result = queue_.complete(conn, event.job.id, event.job.fence, event.report);
  } catch (const DatabaseError& e) {
    if (e.failure() != DatabaseFailure::kPermanent) throw;
    // The outcome cannot be stored as it is (its text, most likely): the outcome is kept and its
    // text replaced, never turned into a second run of the job.
    log(job + ": its outcome (" + describe(event.report.outcome) +
        ") could not be stored with its text (" + e.what() + "); recording it without");
    event.report.error = "(the outcome's text could not be stored: the database refused it)";
    result = queue_.complete(conn, event.job.id, event.job.fence, event.report);
  }
  if (result.status != CompleteStatus::kStale) return result;
  // Not running under this lease any more: recorded already (a commit in doubt that applied), or
  // taken over or released meanwhile.
  const std::optional<Job> row = queue_.get(conn, event.job.id);
  if (!row && deleted_as_done) {
    log(job +
        ": its success was recorded (the job deleted with it) before the connection was "
        "lost");
    return {.status = CompleteStatus::kDone};
  }
  if (same_lease(row) && row->state != JobState::kRunning) {
    log(job + ": its outcome was recorded before the connection was lost");
    switch (row->state) {
      case JobState::kDone:
        return {.status = CompleteStatus::kDone};
      case JobState::kDead:
        return {.status = CompleteStatus::kDead};
      default:
        return {.status = CompleteStatus::kRetryScheduled};
    }
  }
  log(job + ": lease lost while its outcome was settled (taken over or released); its outcome (" +
      describe(event.report.outcome) + ") was not recorded");
  return result;
}

void Worker::settle(std::optional<ConnectionPool::Lease>& conn, std::vector<Unrecorded>& unrecorded,
                    std::string error) {
  for (const Unrecorded& u : unrecorded) {
    log("job " + std::to_string(u.event.job.id) + ": recording its outcome (" +
        (u.event.report.outcome.kind == OutcomeKind::kSuccess ? std::string("success")
                                                              : describe(u.event.report.outcome)) +
        ") failed: " + error + "; settling it on a new connection");
  }
  bool reclaim = false;  // a lost answer may have leased jobs this worker does not know of
  for (bool first = true; !unrecorded.empty() || reclaim; first = false) {
    if (!first) {
      // Core's jittered backoff while the database is out, counted towards max_database_outage.
      const Duration wait = database_failed("settling an outcome", error);
      std::unique_lock lock(mu_);
      // wait: core: the database-outage BackoffSequence
      cv_.wait_for(lock, wait, [&] { return cancel_.load(); });
    }
    if (cancel_.load()) {
      // The grace after stop() is over: what is not settled is left to its lease.
      for (const Unrecorded& u : unrecorded) {
        log("job " + std::to_string(u.event.job.id) +
            ": outcome not settled before the worker stopped (" + error +
            "); its lease expires and the sweep decides");
        std::lock_guard lock(mu_);
        held_.erase(u.event.job.id);
      }
      unrecorded.clear();
      return;
    }
    try {
      if (!conn || !(*conn)->usable()) {
        conn.reset();
        conn.emplace(pool_.acquire());
      }
      while (!unrecorded.empty()) {
        Unrecorded& u = unrecorded.front();
        u.event.result = settle_one(**conn, u);
        if (u.leased) reclaim = true;
        recorded(u.event);
        unrecorded.erase(unrecorded.begin());
      }
      if (database_ok()) reclaim = true;
      if (reclaim) {
        give_back_unknown_leases(conn);
        reclaim = false;
      }
    } catch (const std::exception& e) {
      error = e.what();
      if (conn && (*conn)->broken()) conn.reset();
    }
  }
}

void Worker::give_back_unknown_leases(std::optional<ConnectionPool::Lease>& conn) {
  // No lease is in flight meanwhile: every job leased by a statement whose answer came back is
  // in active_ already, so what the database says this worker holds beyond that is unknown to it.
  std::unique_lock gate(lease_gate_);
  std::vector<LeasedJob> unknown;
  {
    const std::vector<LeasedJob> held =
        queue_.leases_of(**conn, options_.queue, options_.worker_id);
    std::lock_guard lock(mu_);
    for (const LeasedJob& job : held) {
      if (held_.count(job.id) == 0) unknown.push_back(job);
    }
  }
  gate.unlock();
  if (unknown.empty()) return;
  log("giving back " + std::to_string(unknown.size()) +
      " job(s) leased by a statement whose answer was lost");
  give_back(conn, unknown, /*maybe_started=*/true);
}

void Worker::give_back(std::optional<ConnectionPool::Lease>& conn,
                       const std::vector<LeasedJob>& jobs, bool maybe_started) {
  for (const LeasedJob& job : jobs) {
    {
      std::lock_guard lock(mu_);
      active_.erase(job.id);
      held_.erase(job.id);
    }
    try {
      if (!conn || !(*conn)->usable()) {
        conn.reset();
        conn.emplace(pool_.acquire());
      }
      // Leased and not started: ready again at once, in its place, not charged. One whose start
      // may have committed (its statement's outcome is unknown) gets that attempt back the way a
      // brake's refusal does.
      const bool given =
          maybe_started ? queue_.complete(**conn, job.id, job.fence,
                                          {.outcome = Outcome::not_attempted(Duration::zero()),
                                           .error = "not run: the database failed as it started"})
                                  .status != CompleteStatus::kStale
                        : queue_.release(**conn, job.id, job.fence, "worker stopping; not started");
      if (given) released_.fetch_add(1);
    } catch (const std::exception& e) {
      if (conn && (*conn)->broken()) conn.reset();
      log("job " + std::to_string(job.id) + ": release failed: " + e.what() +
          " (the lease expires and the job runs again)");
    }
  }
}

}  // namespace keel::store
