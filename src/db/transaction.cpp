// with_transaction_retry: BEGIN ... COMMIT driven by keel::RetryState (full jitter, capped
// attempts), re-running the whole transaction on a serialization failure, deadlock or busy
// database, and refusing to re-run a commit in doubt.
#include "keel/db/transaction.hpp"

#include "db/detail/commit.hpp"
#include "db/detail/connections.hpp"

namespace keel::store {

std::string_view to_string(TransactionStatus status) noexcept {
  switch (status) {
    case TransactionStatus::kCommitted:
      return "committed";
    case TransactionStatus::kRolledBack:
      return "rolled back";
    case TransactionStatus::kFailed:
      return "failed";
    case TransactionStatus::kCommitInDoubt:
      return "commit in doubt";
  }
  return "unknown";
}

const RetryPolicy& default_transaction_retry_policy() {
  static const RetryPolicy policy(
      {.max_attempts = 5,
       .backoff = {.base = std::chrono::milliseconds(5), .cap = std::chrono::milliseconds(250)}});
  return policy;
}

namespace {

// The one retry loop for the store's atomic units: a BEGIN ... COMMIT transaction, or (wrap
// false) a single statement in autocommit, which is a transaction of its own and is re-run
// whole in the same way. keel::core's RetryState decides every retry and its jittered delay.
// `ends` (wrap only) may say the first transaction is open already and how to commit.
TransactionResult run_with_retry(Connection& connection, const std::function<bool(Connection&)>& fn,
                                 const RetryPolicy& policy, Isolation isolation,
                                 const CallOptions& call, bool wrap,
                                 const detail::TransactionEnds& ends = {}) {
  // Checked before anything is sent: a caller's open transaction is left exactly as it was.
  if (wrap && !ends.begun) detail::refuse_nested_transaction(connection, "with_transaction_retry");
  if (!wrap) detail::refuse_nested_transaction(connection, "a single-statement transaction");
  TransactionResult result;
  CallOptions options = call;
  options.safe_to_repeat = false;  // an ambiguous outcome (commit in doubt) is never re-run
  RetryState state(policy, options);
  for (AttemptStart start = state.start_attempt(); start.proceed; start = state.start_attempt()) {
    result.attempts = start.attempt.number;
    // The attempt's statements end by the operation's deadline (their lock waits, statements
    // and answers: Connection::deadline), and within the policy's per-try timeout when it has one.
    const ScopedDeadline scoped(connection, Deadline::after(steady_clock(), start.attempt.timeout));
    try {
      if (wrap && !(ends.begun && result.attempts == 1)) connection.begin(isolation);
      if (!fn(connection)) {
        if (wrap) connection.rollback();
        result.status = TransactionStatus::kRolledBack;
        result.outcome = Outcome::success();
        return result;
      }
      if (wrap && ends.commit) {
        if (!ends.commit(connection)) {
          connection.rollback();
          result.status = TransactionStatus::kRolledBack;
          result.outcome = Outcome::success();
          return result;
        }
      } else if (wrap) {
        connection.commit();
      }
      result.status = TransactionStatus::kCommitted;
      result.outcome = Outcome::success();
      result.error.clear();
      result.sqlstate.clear();
      result.failure.reset();
      return result;
    } catch (const DatabaseError& e) {
      connection.rollback();
      result.outcome = e.outcome();
      result.error = e.what();
      result.sqlstate = e.details().sqlstate;
      result.failure = e.failure();
      // An autocommit statement's connection lost mid-statement may have committed: in doubt.
      const bool lost_mid_statement = !wrap && e.details().connection_lost;
      if ((e.details().during_commit && result.outcome.kind == OutcomeKind::kAmbiguous) ||
          lost_mid_statement) {
        result.status = TransactionStatus::kCommitInDoubt;
        return result;
      }
      result.status = TransactionStatus::kFailed;
      if (e.details().connection_lost || connection.broken()) return result;  // needs a new one
      const Decision decision = state.next(result.outcome);
      if (!decision.retry) return result;
      // wait: core: the transaction retry's decision
      state.clock().sleep_for(decision.delay);
    } catch (...) {
      connection.rollback();
      throw;
    }
  }
  if (result.attempts == 0) {
    if (ends.begun) connection.rollback();  // the caller's transaction never ran
    // The engine refused the first transaction (the call's deadline or ceiling had passed, or
    // its breaker was open): nothing ran, and nothing was committed.
    result.status = TransactionStatus::kFailed;
    result.outcome = state.last_outcome();
    result.error = "not started: " + std::string(to_string(state.stop_reason()));
  }
  return result;  // the deadline stopped a retry; status holds the last failure
}

}  // namespace

TransactionResult with_transaction_retry(Connection& connection,
                                         const std::function<bool(Connection&)>& fn,
                                         const RetryPolicy& policy, Isolation isolation,
                                         const CallOptions& call) {
  return run_with_retry(connection, fn, policy, isolation, call, true);
}

namespace detail {

TransactionResult with_transaction_retry(Connection& connection,
                                         const std::function<bool(Connection&)>& fn,
                                         const TransactionEnds& ends, const RetryPolicy& policy,
                                         Isolation isolation, const CallOptions& call) {
  return run_with_retry(connection, fn, policy, isolation, call, true, ends);
}

TransactionResult with_statement_retry(Connection& connection,
                                       const std::function<bool(Connection&)>& fn) {
  return run_with_retry(connection, fn, default_transaction_retry_policy(),
                        Isolation::kReadCommitted, {}, false);
}

}  // namespace detail

}  // namespace keel::store
