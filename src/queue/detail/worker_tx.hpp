// One attempt of a transactional job handler (keel/queue/queue_worker.hpp): the handler's
// writes and the job's success in one transaction. Private to keel::store_queue; stateless, safe
// from any thread, each call on the Connection it is given.
#pragma once

#include <atomic>
#include <functional>

#include "keel/queue/queue.hpp"
#include "keel/queue/queue_worker.hpp"

namespace keel::store::detail {

struct TransactionalAttempt {
  /// The handler's report, or the transaction's failure as an outcome (kFailed: the database
  /// error's classification; commit in doubt: ambiguous).
  AttemptReport report;
  /// The success committed with the handler's writes: nothing left to record.
  bool done = false;
  /// The lease was lost before the commit: the handler's writes were rolled back, and nothing
  /// is recorded (another worker owns the job).
  bool stale = false;
  /// The COMMIT's outcome is unknown (the connection was lost during it): the worker settles it
  /// on a new connection, where the job's row says whether the success committed.
  bool in_doubt = false;
};

// Runs `handler` in a transaction on `conn` (with_transaction_retry: a lost race runs the handler
// again) and, on success, records the job done in it (JobQueue::complete_in) after calling
// `before_complete` (the worker stops heartbeating the lease). A failure's report is returned
// with done and stale false, its writes rolled back, for the caller to record with complete().
// A transaction that failed because the database could not serve it (DatabaseFailure
// kUnavailable or kWrongNode: a lost connection, a failover, a node turned read-only) is reported
// not attempted: its writes were rolled back and the job is not charged for the infrastructure.
// Exceptions other than DatabaseError thrown by the handler propagate, rolled back.
TransactionalAttempt run_transactional_attempt(Connection& conn, const JobQueue& queue,
                                               const LeasedJob& job,
                                               const TransactionalJobHandler& handler,
                                               const std::atomic<bool>& cancel,
                                               const std::function<void()>& before_complete);

}  // namespace keel::store::detail
