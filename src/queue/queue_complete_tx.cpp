// JobQueue::complete_in: a job's success recorded inside the caller's transaction, so that a
// handler's writes and the job's completion commit together (the Worker's transactional
// handlers, keel/queue/queue_worker.hpp). Apart from queue_complete.cpp because it opens no
// transaction and applies no retry decision: a success has none to make.
#include "keel/core/expected.hpp"
#include "keel/queue/queue.hpp"
#include "queue/detail/queue_sql.hpp"

namespace keel::store {

bool JobQueue::complete_in(Connection& tx, std::int64_t job_id, std::int64_t fence) const {
  if (!tx.in_transaction()) {
    throw_invalid({.context = "keel::store::JobQueue::complete_in",
                   .field = "connection",
                   .problem = "has no transaction open; complete_in records the success in the "
                              "caller's transaction (or use complete)"});
  }
  // The fence and the state are checked by the UPDATE itself, in the caller's transaction: a
  // lease taken over since (a new fence) or released (not running) updates nothing.
  return detail::mark_done(tx, job_id, fence, now_ms(), options_.keep_done);
}

}  // namespace keel::store
