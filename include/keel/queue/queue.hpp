// A durable job queue with retries and a dead-letter queue, on SQLite (the embedded default) or
// PostgreSQL (for fleets of workers), through the same database URLs as the idempotency store.
//
// A job carries its idempotency key from the moment it is enqueued (the caller's, or a random
// UUID generated once at enqueue and stored with the job), so every attempt, and every replay
// from the dead-letter queue, presents the same key to the receiver. A job moves through:
//
//   ready ──lease──> running ──success──────────────────────────> done
//     ^                 │ ──transient, attempts left──> retry_scheduled ──(due)──> leased again
//     │                 │ ──permanent, or attempts exhausted──> dead (the dead-letter queue)
//     ├──replay─────────┤ ──started, then lease expired (worker died) / released after grace
//     │                 │      ──> retry_scheduled or dead, as any failed attempt
//     └─────────────────┴── not started, then lease expired / released ──> ready, not charged
//
// Leases: lease() takes due jobs (PostgreSQL: UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP
// LOCKED), so concurrent workers never wait on or share a row; SQLite: one short write
// transaction) and stamps each with a lease expiry and a new fencing token. heartbeat() extends a
// lease. complete(), start(), heartbeat() and release() are fenced: a worker whose lease was
// taken over gets kStale (or false) and its late outcome is not recorded.
//
// An attempt is charged when it starts, not when its job is leased. A job leased in a batch
// waits with its worker until start() says its handler is about to run (a lease can start some
// of its jobs itself: the `start` argument); only then does its attempt count. A worker that
// dies stops heartbeating; once its lease expires, the next lease() call sweeps the job: a job
// whose attempt had started is charged that attempt, as a failure whose outcome is unknown
// (ambiguous: jobs carry keys, so repeating is safe), and keel::core's decide_retry decides what
// follows exactly as for a failure the handler reported: a backoff with jitter, or dead when the
// attempts or max_age are spent, with a reason that says the worker died while running it. A
// job leased but not started goes back to ready uncharged, as it was. release() (shutdown) does
// the same: a started job whose handler outlived the grace is charged like a crash; a job
// released before it started is not. No path makes a job ready again without one of these two
// rules, so a job that crashes its worker on every attempt reaches the dead-letter queue.
//
// Outcomes are keel::Outcome values, and what follows from each is decided by keel::core's
// decide_retry, under exactly the rules every in-memory retry loop uses: success → done;
// transient, throttled or ambiguous (jobs always carry a key, so repeating is safe) →
// retry_scheduled after the server's Retry-After (capped by retry_after_cap) or else a backoff
// draw, while attempts (and the outcome's retry_limit: a 500 is retried once) remain, else dead
// ("attempts exhausted"); permanent → dead at once.
//
// A refusal is not an attempt. When the handler reports kNotAttempted (its dependency's circuit
// breaker or retry budget refused before anything was sent), the job is deferred: back to
// retry_scheduled, due when the brake expects to admit a call (the outcome's server_delay), its
// attempt not counted, the deferral recorded in its history ("deferred") with the handler's
// reason. Jobs so wait out an outage of any length; only real attempts, or a max_age the user
// sets, make a job dead. stats() counts the deferred jobs per queue.
// Nothing is deleted silently: dead jobs stay until replayed or discarded, and done jobs are
// deleted only by prune_done() with an explicit retention. A dead-letter retention
// (QueueOptions::dead_letter_retention, none by default) lets prune_dead() delete dead jobs that
// have been dead for longer; before they go, dead_expiring() and QueueStats::dead_expiring count
// the ones due within the warning window (dead_letter_warning), so an alert can fire while they
// can still be replayed.
//
// Times are calendar milliseconds from the injected Clock's wall_now(), so several processes
// (and hosts with synchronised clocks) agree on lease expiry; tests inject keel::ManualClock and
// run lease expiry and backoff in virtual time.
//
// Where each part lives: a job as stored and leased, and the counts per queue, are in
// keel/queue/job.hpp; an enqueue's request and answer in enqueue.hpp; a worker's report and
// what the queue recorded in completion.hpp; the options in queue_options.hpp. JobQueue's
// methods are grouped below by who calls them, and each group
// is implemented in a file of its own. Producers enqueue (src/queue/queue_producer.cpp).
// Workers lease, heartbeat, release and complete_and_lease (src/queue/queue_lease.cpp, which
// also sweeps expired leases) and report outcomes with complete and complete_done
// (src/queue/queue_complete.cpp). Operators read a job with get (src/queue/queue.cpp)
// and administer the dead-letter queue by id or by queue with list_dead, replay and discard
// (src/queue/queue_dead_letters.cpp; by filter, with paced replays:
// keel/queue/dead_letters.hpp). Dashboards and housekeeping use stats, dead_depth,
// dead_expiring, queue_exists, idle, prune_done and prune_dead (src/queue/queue_stats.cpp).
// Construction, the schema and its migrations are src/queue/queue.cpp; what the files share
// is src/queue/detail/queue_sql.hpp. The long-running consumer built on the worker protocol
// is keel::store::Worker (keel/queue/queue_worker.hpp).
//
// Thread-safety: JobQueue is immutable after construction except for its random generator (which
// a mutex guards) and the time of its last expired-lease sweep (an atomic); it is safe for
// concurrent use. Each call uses the Connection it is given (one thread per connection). Every
// call that writes runs in its own transaction or single statement: requires no transaction open
// on the connection. The exceptions are enqueue_in and enqueue_many_in, which write in the
// caller's open transaction, so that a job commits with the caller's other writes or not at all
// (the transactional outbox).
//
// Example:
//   keel::store::JobQueue queue({.backoff = {.base = 1s, .cap = 1h}});
//   auto conn =
//   keel::store::open_database(keel::store::parse_database_url("sqlite:jobs.db").value());
//   keel::store::JobQueue::migrate(*conn);
//   auto job = queue.enqueue(*conn, {.queue = "email", .payload = R"({"to":"a@b"})"});
//   for (auto& leased : queue.lease(*conn, "email", "worker-1", 10)) {
//     auto outcome = send(leased.payload, leased.idempotency_key);        // keel::Outcome
//     (void)queue.complete(*conn, leased.id, leased.fence, {.outcome = outcome});
//   }
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/backoff.hpp"
#include "keel/core/classify.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/expected.hpp"
#include "keel/core/random.hpp"
#include "keel/core/retry.hpp"
#include "keel/db/database.hpp"
#include "keel/queue/completion.hpp"
#include "keel/queue/enqueue.hpp"
#include "keel/queue/job.hpp"
#include "keel/queue/queue_options.hpp"

namespace keel::store {

namespace detail {
struct SettleRow;    // a running job as settle() reads it (src/queue/detail/queue_sql.hpp)
struct SettleWrite;  // what settle() writes of it
}  // namespace detail

class JobQueue {
 public:
  // Construction and schema (src/queue/queue.cpp).

  /// Throws std::invalid_argument naming the field and value when a Requires line is broken.
  explicit JobQueue(QueueOptions options = {});

  /// Creates or upgrades the tables (component "queue" in keel_schema). Throws DatabaseError.
  static void migrate(Connection& connection);
  /// The queue's schema component ("queue"), for a program that migrates every component (its
  /// `migrate` applies it).
  [[nodiscard]] static SchemaComponent schema() noexcept;

  // Producer: adding jobs (src/queue/queue_producer.cpp).

  /// Adds a job, or returns the existing job with the same key on the same queue (a unique index
  /// on (queue, key) decides, never a read-then-insert). Invalid requests are refused with
  /// EnqueueResult::error and write nothing. Throws DatabaseError.
  [[nodiscard]] EnqueueResult enqueue(Connection& connection, const EnqueueRequest& request) const;

  /// Several enqueues in one transaction (batching for throughput): all requests are checked
  /// first, and when one is invalid nothing is written and every result carries that error.
  /// Requires: no transaction open on `connection` (else every result's error says so, naming
  /// enqueue_in, and nothing is written). Throws DatabaseError.
  [[nodiscard]] std::vector<EnqueueResult> enqueue_many(
      Connection& connection, const std::vector<EnqueueRequest>& requests) const;

  /// Enqueues inside the caller's own transaction (the transactional outbox): the same checks
  /// and statements as enqueue(), without BEGIN or COMMIT, so the job exists if and only if the
  /// caller's transaction commits, together with the caller's other writes; a rollback leaves
  /// no job and no key behind. A key already enqueued returns the existing job (created false),
  /// as enqueue() does; a concurrent enqueue of the same key waits on the (queue, key) index
  /// until the other transaction ends. Invalid requests are refused with EnqueueResult::error
  /// and write nothing. Requires: a transaction open on `tx` (the caller's; else the error says
  /// so and nothing is written); on SQLite, one begun with Connection::begin (BEGIN IMMEDIATE),
  /// so that the write lock is taken before the caller's first read. Throws DatabaseError; a
  /// lost race (40001, 40P01, SQLITE_BUSY) must be retried by running the caller's whole
  /// transaction again, as with_transaction_retry does.
  ///
  /// Example:
  ///   auto r = keel::store::with_transaction_retry(*conn, [&](keel::store::Connection& tx) {
  ///     tx.query("INSERT INTO orders (id, total) VALUES ($1, $2)", {order_id, total});
  ///     auto job = queue.enqueue_in(tx, {.queue = "receipts", .payload = receipt,
  ///                                      .key = "receipt-" + order_id});
  ///     return job.ok();                 // false rolls back the order with the job
  ///   });
  [[nodiscard]] EnqueueResult enqueue_in(Connection& tx, const EnqueueRequest& request) const;

  /// Several enqueue_in() in the caller's transaction, with enqueue_many()'s checks and
  /// statements. Requires and throws as enqueue_in().
  [[nodiscard]] std::vector<EnqueueResult> enqueue_many_in(
      Connection& tx, const std::vector<EnqueueRequest>& requests) const;

  // Worker protocol, leases: taking, extending and giving back jobs; expired leases are swept
  // inside lease() (src/queue/queue_lease.cpp).

  /// For lease()'s and complete_and_lease()'s `start`: every leased job starts at once.
  static constexpr int kStartAll = 1 << 30;

  /// Leases up to `limit` due jobs of `queue` for options().lease, oldest due first, each with a
  /// new fencing token, in one statement on PostgreSQL (one write transaction on SQLite). On
  /// PostgreSQL a lease that took `limit` jobs lets the next leases of this JobQueue scan from
  /// the earliest due time it took, for up to a second: a job that another process makes due
  /// before that time (its release or sweep, or a producer whose clock is behind) may wait up
  /// to a second behind later ones while the queue stays busy (docs/queue.md, "Lease floor"). The
  /// `start` jobs with the lowest ids start their attempt with the lease (LeasedJob::started;
  /// the default: all of them); the others wait for start(). The jobs come started first, then
  /// by id: the order to run them in. A lease looks for expired leases at most once a second per
  /// queue (from where its JobQueue's last look found none; from the start at least once a
  /// minute); when one is waiting and the due jobs do not fill `limit` (and at least every
  /// quarter lease), expired leases are swept as described above and the jobs they make ready are
  /// leased too. Requires: limit >= 1, start >= 0. Throws
  /// DatabaseError.
  [[nodiscard]] std::vector<LeasedJob> lease(Connection& connection, std::string_view queue,
                                             std::string_view worker, int limit = 1,
                                             int start = kStartAll) const;

  /// Records the success of each leased job in `done` (id, fence) and leases up to `limit` due
  /// jobs of `queue` for `worker`: a busy worker's step in one statement on PostgreSQL (one
  /// transaction on SQLite) instead of a completion and a lease. The same records as complete()
  /// with a success report for each current job, then the same leases as lease(). `done` may be
  /// empty (then it is lease()). Requires: limit >= 1, start >= 0. Throws DatabaseError.
  [[nodiscard]] DoneAndLeased complete_and_lease(
      Connection& connection, const std::vector<std::pair<std::int64_t, std::int64_t>>& done,
      std::string_view queue, std::string_view worker, int limit = 1, int start = kStartAll) const;

  /// Starts the attempt of a leased job whose lease did not start it (LeasedJob::started false):
  /// from now on the attempt counts, and a crash charges it. Call it right before the handler
  /// runs. Leaves the lease as it is (heartbeat() extends it), so that on PostgreSQL the row is
  /// updated in place. Idempotent for a started job. Returns false when the token is
  /// stale (the lease was lost): do not run the handler. Throws DatabaseError.
  [[nodiscard]] bool start(Connection& connection, std::int64_t job_id, std::int64_t fence) const;

  /// Records the success of each leased job in `done` (id, fence) and starts the leased job
  /// (job_id, fence) as start() does: a worker's step between two jobs of a batch, in one
  /// statement on PostgreSQL (one transaction on SQLite) instead of a completion and a start.
  /// The finished jobs are recorded whether or not the start is current. `done` may be empty
  /// (then it is start()). Throws DatabaseError.
  [[nodiscard]] DoneAndStarted complete_and_start(
      Connection& connection, const std::vector<std::pair<std::int64_t, std::int64_t>>& done,
      std::int64_t job_id, std::int64_t fence) const;

  /// Extends the lease to now + options().lease. Returns false when the token is stale (the
  /// lease was taken over, or the job released): the worker no longer owns the job. Throws
  /// DatabaseError.
  [[nodiscard]] bool heartbeat(Connection& connection, std::int64_t job_id,
                               std::int64_t fence) const;

  /// Gives a leased job back (shutdown). A job whose attempt had not started is ready again at
  /// once and not charged. A started job (its handler ran, e.g. past a shutdown's grace) is
  /// charged that attempt as a failure with an unknown outcome, recorded as "released" with
  /// `why`, and decide_retry schedules its retry or makes it dead, as for a crash. Returns false
  /// when the token was stale. Throws DatabaseError.
  bool release(Connection& connection, std::int64_t job_id, std::int64_t fence,
               std::string_view why) const;

  /// The jobs of `queue` that `worker` holds a lease on now (running under its name), with their
  /// fencing tokens; `started` says whether the attempt was started. For a worker that lost the
  /// answer of a statement that leased jobs (a COMMIT in doubt) and must give back what it was
  /// not told it holds. Throws DatabaseError.
  [[nodiscard]] std::vector<LeasedJob> leases_of(Connection& connection, std::string_view queue,
                                                 std::string_view worker) const;

  /// When a lease of `queue` could next find a job, in calendar ms: the earliest run time of its
  /// ready and retry-scheduled jobs (due already, delayed, or waiting for a retry) and of its
  /// running jobs' leases (a lease that expires makes its job leasable again); nullopt when the
  /// queue has none. One read over the queue's indexes; what an idle Worker sleeps until. Throws
  /// DatabaseError.
  [[nodiscard]] std::optional<std::int64_t> next_due(Connection& connection,
                                                     std::string_view queue) const;

  // Worker protocol, outcomes: recording an attempt, and with it the retry decision
  // (src/queue/queue_complete.cpp).

  /// Records an attempt's outcome, fenced by the lease's token. Throws DatabaseError.
  [[nodiscard]] CompleteResult complete(Connection& connection, std::int64_t job_id,
                                        std::int64_t fence, const AttemptReport& report) const;

  /// Records the success of a leased job inside the caller's open transaction, fenced by the
  /// lease's token in that same transaction: the job is done if and only if the caller's
  /// transaction commits, together with whatever else it wrote (a handler's effect). Returns
  /// false when the token is stale (the lease was lost or taken over): roll the transaction back,
  /// since another worker owns the job. On PostgreSQL the job's row stays locked from this call
  /// to the commit, so no sweep or other worker can take the lease over in between: call it last.
  /// Requires: a transaction open on `tx` (else std::invalid_argument). Throws DatabaseError.
  /// (src/queue/queue_complete_tx.cpp.)
  [[nodiscard]] bool complete_in(Connection& tx, std::int64_t job_id, std::int64_t fence) const;

  /// Records successes for several leased jobs in one transaction (batching for throughput);
  /// returns how many were current (the stale ones are skipped). Throws DatabaseError.
  [[nodiscard]] int complete_done(
      Connection& connection,
      const std::vector<std::pair<std::int64_t, std::int64_t>>& id_and_fence) const;
  /// complete_done(), returning the ids that were current, in ascending order.
  [[nodiscard]] std::vector<std::int64_t> complete_done_ids(
      Connection& connection,
      const std::vector<std::pair<std::int64_t, std::int64_t>>& id_and_fence) const;

  /// Records each outcome as complete() would, all in one transaction and in a few statements
  /// whatever their number and mix: the successes in one (as complete_done), the failures' rows
  /// read in one, written in one, and their history in one. results[i] is outcomes[i]'s
  /// (kStale for a lease no longer current); dead letters go to on_dead_letter after the commit.
  /// A Worker records a batch's outcomes this way. Throws DatabaseError (nothing recorded).
  [[nodiscard]] std::vector<CompleteResult> complete_batch(
      Connection& connection, const std::vector<BatchOutcome>& outcomes) const;

  // Inspection: one job with its history (src/queue/queue.cpp).

  /// The job with its full attempt history, or nullopt. Throws DatabaseError.
  [[nodiscard]] std::optional<Job> get(Connection& connection, std::int64_t job_id) const;

  // Dead-letter administration by id or by queue (src/queue/queue_dead_letters.cpp).
  // Selecting by reason or age, and paced replays: keel/queue/dead_letters.hpp.

  /// Dead jobs (no history), oldest first; all queues when `queue` is empty. Throws DatabaseError.
  [[nodiscard]] std::vector<Job> list_dead(Connection& connection, std::string_view queue = {},
                                           int limit = 1000) const;

  /// Moves dead jobs back to ready with attempts reset and the SAME key; the history is kept.
  /// Returns the ids replayed (ids that are not dead are skipped). Throws DatabaseError.
  std::vector<std::int64_t> replay(Connection& connection,
                                   const std::vector<std::int64_t>& ids) const;
  /// Replays every dead job (of `queue`, or of all queues when empty); returns how many.
  std::int64_t replay_all(Connection& connection, std::string_view queue = {}) const;

  /// Deletes dead jobs (an operator's explicit decision) with their history. Returns the ids
  /// deleted (ids that are not dead are skipped). Throws DatabaseError.
  std::vector<std::int64_t> discard(Connection& connection,
                                    const std::vector<std::int64_t>& ids) const;
  /// Discards every dead job (of `queue`, or of all queues when empty); returns how many.
  std::int64_t discard_all(Connection& connection, std::string_view queue = {}) const;

  // Statistics and housekeeping (src/queue/queue_stats.cpp).

  /// Dead jobs (of `queue`, or all when empty). Throws DatabaseError.
  [[nodiscard]] std::int64_t dead_depth(Connection& connection, std::string_view queue = {}) const;

  /// Counts per known queue (every queue ever enqueued to), sorted by name. Throws DatabaseError.
  [[nodiscard]] std::vector<QueueStats> stats(Connection& connection) const;

  /// Whether any job was ever enqueued on `queue` (queues are created by their first enqueue).
  [[nodiscard]] bool queue_exists(Connection& connection, std::string_view queue) const;

  /// Nothing ready, running or scheduled for retry on `queue` (delayed jobs count as ready).
  [[nodiscard]] bool idle(Connection& connection, std::string_view queue) const;

  /// Deletes at most `batch` done jobs of `queue` that finished more than `retention` ago, with
  /// their history; returns how many. The only way a done job is ever deleted (a queue that
  /// keeps none, QueueOptions::keep_done false, deletes each job with its success instead).
  /// Requires: retention >= 0, batch >= 1. Throws DatabaseError.
  std::int64_t prune_done(Connection& connection, std::string_view queue, Duration retention,
                          int batch = 1000) const;

  /// Deletes at most `batch` dead jobs (of `queue`, or of all queues when empty) that died more
  /// than options().dead_letter_retention ago, oldest first, with their history; returns how
  /// many. Deletes nothing, and returns 0, when no retention is set. A replayed job is not dead
  /// and is never pruned; if it dies again, its retention starts again. Requires: batch >= 1.
  /// Throws DatabaseError.
  std::int64_t prune_dead(Connection& connection, std::string_view queue = {},
                          int batch = 1000) const;

  /// Dead jobs (of `queue`, or of all queues when empty) that prune_dead() deletes within
  /// `within` from now, those already past the retention included; 0 when no retention is set.
  /// Requires: within >= 0. Throws DatabaseError.
  [[nodiscard]] std::int64_t dead_expiring(Connection& connection, std::string_view queue,
                                           Duration within) const;

  // Configuration.

  [[nodiscard]] const QueueOptions& options() const noexcept { return options_; }
  /// Deadlocks PostgreSQL reported so far to this queue's worker statements (lease, complete,
  /// start, heartbeat, release, sweep; 40P01, each one cost a deadlock_timeout and was retried).
  /// They take rows in one order (ascending id, docs/queue.md), so this stays 0; a Worker logs
  /// each rise; export it as a counter (keel_queue_deadlocks_total). Thread-safe.
  [[nodiscard]] std::int64_t deadlocks() const noexcept { return deadlocks_.load(); }
  /// Jobs this queue's sweeps gave back uncharged from an expired lease that had not started
  /// them (a batch whose worker died or lost its database): each runs again, and each may have
  /// run before its outcome was recorded, at most a Worker's flush window's worth of the batch
  /// (docs/queue.md, "What a crash costs"). Export it as a counter
  /// (keel_queue_returned_after_crash_total). Thread-safe.
  [[nodiscard]] std::int64_t returned_after_crash() const noexcept {
    return returned_after_crash_.load();
  }
  [[nodiscard]] Clock& clock() const noexcept { return *clock_; }
  /// Calendar milliseconds now, from the clock.
  [[nodiscard]] std::int64_t now_ms() const noexcept;

 private:
  // Producer internals (src/queue/queue_producer.cpp).

  // Checks every request and fills `keys` with their canonical (or new) keys; false, with every
  // result's error set, when one is invalid.
  bool check_requests(const std::vector<EnqueueRequest>& requests, std::vector<std::string>& keys,
                      std::vector<EnqueueResult>& out) const;
  [[nodiscard]] int max_attempts_of(const EnqueueRequest& request) const noexcept;
  // Writes checked requests in the transaction open on `tx` (its own or the caller's).
  void write_jobs(Connection& tx, const std::vector<EnqueueRequest>& requests,
                  const std::vector<std::string>& keys, std::int64_t now,
                  std::vector<EnqueueResult>& out) const;

  // Worker protocol internals (src/queue/queue_lease.cpp).

  // Sweeps expired leases of `queue`: unstarted jobs back to ready uncharged, started ones
  // charged through settle(); returns how many jobs it moved.
  std::int64_t reap_expired(Connection& connection, std::string_view queue) const;
  // Records a finished (or lost) attempt of a running job read with detail::kSettleColumns (row
  // i of `row`) inside the caller's transaction: keel::core's decide_retry chooses retry,
  // deferral or dead, and the history row is named `history` (the outcome's kind when empty).
  // The caller reports a kDead result to on_dead_letter after its commit.
  [[nodiscard]] CompleteResult settle(Connection& tx, const Rows& row, std::size_t i,
                                      const AttemptReport& report, std::string_view history,
                                      std::int64_t now) const;
  // Records the successes in `done` (ascending ids) at `now` in the caller's transaction or
  // statement: the ids that were current, ascending.
  [[nodiscard]] std::vector<std::int64_t> record_done(
      Connection& connection, const std::vector<std::pair<std::int64_t, std::int64_t>>& done,
      std::int64_t now) const;
  // settle()'s decision for one job (core's decide_retry on its row and report): the result,
  // and the row's writes appended to `writes` for detail::apply_settles, which writes any number
  // of them in two statements.
  [[nodiscard]] CompleteResult decide_settle(const detail::SettleRow& job,
                                             const AttemptReport& report, std::string_view history,
                                             std::int64_t now,
                                             std::vector<detail::SettleWrite>& writes) const;
  // Records the successes in `done` and leases up to `limit` due jobs: one statement on
  // PostgreSQL, which also says whether an expired lease is waiting to be reaped
  // (*expired_waiting); SQLite asks that with a second query.
  [[nodiscard]] DoneAndLeased finish_and_lease_due(
      Connection& connection, const std::vector<std::pair<std::int64_t, std::int64_t>>& done,
      std::string_view queue, std::string_view worker, int limit, int start,
      bool* expired_waiting) const;
  // Leases up to `limit` due jobs (finish_and_lease_due with nothing done).
  [[nodiscard]] std::vector<LeasedJob> lease_due(Connection& connection, std::string_view queue,
                                                 std::string_view worker, int limit,
                                                 int start) const;

  // Where a lease on PostgreSQL starts its scan of a queue's due jobs (queue_lease.cpp): the
  // earliest run_at_ms the last full lease took (a short one's now, less a commit's lag), while
  // the full scan that started it is younger than kLeaseFloorFor.
  struct LeaseFloor {
    std::string queue;
    std::int64_t run_at_ms = 0;
    std::int64_t full_scan_ms = 0;
  };
  // The floor for `queue` at `now`, or nullopt: scan from the queue's first due job.
  [[nodiscard]] std::optional<LeaseFloor> lease_floor(std::string_view queue,
                                                      std::int64_t now) const;
  // A next due time read from `floor` (none: from the queue's start): `found`, or the floor's
  // end when sooner.
  [[nodiscard]] static std::optional<std::int64_t> due_within_floor(
      std::optional<std::int64_t> found, const std::optional<LeaseFloor>& floor);
  // After a lease of `queue` at `now` that was a full scan or not: a lease that took `limit`
  // jobs, the earliest of them due at `earliest`, leaves a floor there; a shorter one took every
  // due job it saw and leaves one at `now` less a commit's lag.
  // `generation` is floor_generation() read before the lease's floor: a lease that began before
  // the last forget_lease_floors leaves no floor.
  void note_lease(std::string_view queue, std::int64_t now, bool full_scan, bool filled,
                  std::optional<std::int64_t> earliest, std::uint64_t generation) const;
  [[nodiscard]] std::uint64_t floor_generation() const;
  // Clears every floor and starts a new generation of them: a job was made due again, its
  // transaction committed, at a time a floor may be past.
  void forget_lease_floors() const;

  // Whether a lease looks for expired leases of a queue, and from where (queue_lease.cpp): at
  // most once per kExpiryCheckEveryMs per queue, each check from where the last one found none.
  struct ExpiryCheck {
    std::string queue;
    std::int64_t last_ms = 0;              // the last check
    std::optional<std::int64_t> clear_to;  // no running job has run_at_ms <= this
    std::int64_t chain_ms = 0;             // the full check clear_to counts from
  };
  struct ExpiryPlan {
    bool check = false;                 // look for an expired lease with this lease
    std::optional<std::int64_t> above;  // only among run_at_ms > this (none: all)
  };
  [[nodiscard]] ExpiryPlan expiry_plan(std::string_view queue, std::int64_t now) const;
  // After a check planned by `plan` at `now` that found an expired lease or none.
  void note_expiry_check(std::string_view queue, std::int64_t now, const ExpiryPlan& plan,
                         bool found) const;

  // What one lease asks for, and the expiry check it makes.
  struct LeaseAsk {
    std::string_view queue;
    std::string_view worker;
    int limit = 0;
    int start = 0;  // how many of the leased jobs it starts (the lowest ids); >= limit: all
    std::int64_t now = 0;
    std::int64_t expires = 0;
    ExpiryPlan expiry;
  };
  // finish_and_lease_due's two algorithms (queue_lease.cpp): one statement where WITH may hold
  // the writes, a transaction of reads and updates elsewhere.
  [[nodiscard]] DoneAndLeased lease_in_one_statement(
      Connection& connection, const std::vector<std::pair<std::int64_t, std::int64_t>>& done,
      const LeaseAsk& ask, bool* expired_waiting) const;
  [[nodiscard]] DoneAndLeased lease_in_transaction(
      Connection& connection, const std::vector<std::pair<std::int64_t, std::int64_t>>& done,
      const LeaseAsk& ask, bool* expired_waiting) const;

  QueueOptions options_;
  RetryPolicy policy_;  // the retry rules decide_retry applies (max attempts, backoff, caps)
  Clock* clock_;
  mutable std::mutex rng_mu_;
  mutable Rng rng_;  // guarded by rng_mu_
  mutable std::atomic<std::int64_t> last_reap_ms_{0};
  mutable std::atomic<std::int64_t> deadlocks_{0};
  mutable std::atomic<std::int64_t> returned_after_crash_{0};
  mutable std::mutex floor_mu_;
  mutable std::vector<LeaseFloor> floors_;      // guarded by floor_mu_
  mutable std::uint64_t floor_generation_ = 0;  // guarded by floor_mu_
  mutable std::vector<ExpiryCheck> expiry_;     // guarded by floor_mu_
};

}  // namespace keel::store
