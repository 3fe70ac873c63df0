// The Worker's transactional handlers (keel/queue/queue_worker.hpp): the handler's writes and
// the job's success commit together, with the lease's fencing token checked in that transaction.
#include "keel/db/transaction.hpp"
#include "queue/detail/worker_tx.hpp"

namespace keel::store::detail {

TransactionalAttempt run_transactional_attempt(Connection& conn, const JobQueue& queue,
                                               const LeasedJob& job,
                                               const TransactionalJobHandler& handler,
                                               const std::atomic<bool>& cancel,
                                               const std::function<void()>& before_complete) {
  TransactionalAttempt out;
  const TransactionResult r = with_transaction_retry(conn, [&](Connection& tx) {
    out = {};  // a retried transaction starts again from nothing
    out.report = handler(tx, job, cancel);
    // A failure rolls its writes back; the caller records it outside the transaction.
    if (out.report.outcome.kind != OutcomeKind::kSuccess) return false;
    before_complete();
    if (!queue.complete_in(tx, job.id, job.fence)) {
      out.stale = true;
      return false;
    }
    return true;
  });
  switch (r.status) {
    case TransactionStatus::kCommitted:
      out.done = true;
      break;
    case TransactionStatus::kRolledBack:
      break;
    case TransactionStatus::kFailed:
      out = {};
      if (r.failure == DatabaseFailure::kUnavailable || r.failure == DatabaseFailure::kWrongNode) {
        // Nothing of the attempt remains (the server rolled it back): the job waits for the
        // database, as for a brake, without losing an attempt.
        out.report.outcome = Outcome::not_attempted();
        out.report.error =
            "not charged: the job's transaction failed because the database could "
            "not serve it (" +
            std::string(to_string(*r.failure)) + "): " + r.error;
      } else {
        out.report.outcome = r.outcome;
        out.report.error = "job transaction failed: " + r.error;
      }
      break;
    case TransactionStatus::kCommitInDoubt:
      // Applied or not: the worker settles it with the job's row on a new connection.
      out = {};
      out.in_doubt = true;
      out.report.outcome = Outcome::ambiguous();
      out.report.error = "job transaction commit in doubt: " + r.error;
      break;
  }
  return out;
}

}  // namespace keel::store::detail
