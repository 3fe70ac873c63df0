// A job-queue worker: N threads that lease jobs of one queue from a keel::store::JobQueue, run a
// handler on each, heartbeat the leases while handlers run, and record each outcome (fenced by
// the lease's token).
//
// A refusal pauses the worker: when a handler reports kNotAttempted with the brake's estimate of
// when it will admit a call (an open breaker's retry_in, in Outcome::server_delay), the job is
// deferred (JobQueue::complete) and this worker leases nothing more until then (the breaker's
// next probe); jobs already leased in the same batch are deferred with the same report without
// running. An outage so costs the breaker's probes, not jobs x attempts. A refusal without an
// estimate (an empty retry budget) defers only its own job.
//
// Housekeeping: the heartbeat thread also deletes the queue's done jobs past done_retention and,
// when the queue has a dead-letter retention (QueueOptions::dead_letter_retention), its dead jobs
// past it, reporting each deletion (on_dead_letters_pruned and a log line): never silently.
//
// Batches: a slot leases `batch` jobs in one statement and runs them one after another. With
// batch 1 the lease starts the job (a crash charges it). A batch starts none of its jobs: their
// successes wait in the slot's buffer and are recorded together by the statement that leases the
// next batch (JobQueue::complete_and_lease), or on their own (complete_done) once the oldest has
// waited `flush_window` when the next handler is about to run: a share of one statement per job.
// Failures are recorded on their own, at once. A worker that dies mid-batch is charged nothing
// for it: when the batch's leases expire, its jobs come back uncharged, each counted in
// LeasedJob::crashed_batches, and the successes still in the buffer run again (at most a flush
// window's worth: JobQueue::returned_after_crash counts the jobs so returned). A job counted so
// runs alone: after the rest of its batch, its start committed before its handler (with the
// buffer, JobQueue::complete_and_start), while no other handler of this worker runs; a crash then
// is charged to it and to no other, and a poison job ends dead as crashed after its attempts.
// docs/queue.md, "What a crash costs".
//
// Shutdown (stop(), e.g. on SIGTERM): no new job is leased; the buffered successes are recorded;
// jobs leased but not started are released at once, uncharged; running handlers get `grace` to
// finish and record their outcome. After that the handlers' cancel flag is raised, and those that
// return within a second record their (cancelled) attempt; the leases of the others are released,
// each charged as a failed attempt whose outcome is unknown ("released": the handler ran), with the
// retry or dead letter keel::core decides, and run() returns once the handlers have returned. A
// handler that outlives that cannot record its outcome: its lease's token is stale.
//
// Waiting for work: an idle worker is woken rather than polling. On PostgreSQL it holds one
// listening connection of its own (outside the pool) on channel keel_jobs, which the queue's
// triggers notify for every job that becomes ready, whoever wrote it; producers and replays in
// the same process wake it directly, on both backends. One idle slot at a time reads when the
// queue's earliest job is due (JobQueue::next_due) and sleeps until then, or until the jittered
// safety-net poll (idle_poll), while the others wait for a wakeup. Without a listener (SQLite,
// wakeups off, the listener down) it polls every poll_interval. docs/queue.md, "Wakeups".
//
// Thread-safety: run() is called once, from one thread; stop() may be called from any thread
// (not from a signal handler: block the signals and call it from a thread that waits for them).
//
// Example:
//   keel::store::ConnectionPool pool(url, {.max_connections = 6});
//   keel::store::JobQueue queue({.lease = 30s});
//   keel::store::Worker worker(pool, queue, {.queue = "email", .concurrency = 4},
//       [](const keel::store::LeasedJob& job, const std::atomic<bool>& cancel) {
//         return keel::store::AttemptReport{.outcome = send_email(job.payload)};
//       });
//   worker.run();   // until worker.stop()
//
// A handler whose effect is a write in the same database takes the job's transaction instead
// (TransactionalJobHandler), so its writes and the job's completion commit together:
//   keel::store::Worker worker(pool, queue, {.queue = "ledger"},
//       [](keel::store::Connection& tx, const keel::store::LeasedJob& job,
//          const std::atomic<bool>&) {
//         tx.query("INSERT INTO ledger (job, body) VALUES ($1, $2)", {job.id, job.payload});
//         return keel::store::AttemptReport::success();
//       });
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <string>
#include <thread>

#include "keel/core/backoff.hpp"
#include "keel/core/random.hpp"
#include "keel/db/database.hpp"
#include "keel/queue/queue.hpp"

namespace keel::store {

/// Runs one attempt of a job. `cancel` is raised when the worker gives up waiting for it (after
/// the grace period): stop as soon as possible. Must be safe to call from several threads.
using JobHandler =
    std::function<AttemptReport(const LeasedJob& job, const std::atomic<bool>& cancel)>;

/// Runs one attempt of a job inside a transaction on the worker's connection, `tx`: what the
/// handler writes through `tx` commits together with the job's success (JobQueue::complete_in,
/// fenced by the lease's token in the same transaction), or not at all. A success whose lease
/// was lost meanwhile is rolled back, writes included, and recorded as stale; a failure rolls its
/// writes back and is recorded as any attempt's. A lost race (40001, 40P01, SQLite busy) runs the
/// handler again in a new transaction, so it must write only through `tx` and call nothing it
/// cannot repeat. On SQLite the transaction holds the database's write lock while the handler
/// runs (heartbeats and other workers wait): keep such handlers short. Must be safe to call from
/// several threads.
using TransactionalJobHandler = std::function<AttemptReport(Connection& tx, const LeasedJob& job,
                                                            const std::atomic<bool>& cancel)>;

/// Reported after each attempt (and for each lease lost or released).
struct WorkerEvent {
  LeasedJob job;
  AttemptReport report;
  /// What complete() recorded (kStale when the lease had been lost or released).
  CompleteResult result;
  Duration took{};
};

struct WorkerOptions {
  /// The queue to work. Requires: a valid queue name.
  std::string queue;
  /// Recorded as lease owner. Default empty: "HOST:PID:RANDOM".
  std::string worker_id;
  /// Jobs run at once (threads). Requires: >= 1. Default 1.
  int concurrency = 1;
  /// Jobs leased per lease() call by each thread (batching; 1 = one at a time). Requires: >= 1.
  /// Default 1.
  int batch = 1;
  /// With batch > 1: how long a success may wait in its slot's buffer, as the next handler is
  /// about to run, before it is recorded on its own; otherwise it rides on the batch's next
  /// statement. A crash re-runs the successes still in the buffer: those that finished within
  /// this window before the handler then running began (or, for the batch's last job, within
  /// its lease statement). 0 records each success before the next handler runs. Requires: >= 0.
  /// Default 10 ms.
  Duration flush_window = std::chrono::milliseconds(10);
  /// Wait between looks at an empty queue while nothing from other processes can wake the
  /// worker: on SQLite, and on PostgreSQL while its listener is down or with `wakeups` off.
  /// Requires: > 0. Default 100 ms.
  Duration poll_interval = std::chrono::milliseconds(100);
  /// Time between heartbeats. Requires: >= 0, and shorter than the queue's lease; 0 means a
  /// third of the queue's lease. Default 0.
  Duration heartbeat_interval{};
  /// After stop(): how long running handlers may take before their leases are released.
  /// Requires: >= 0. Default 10 s.
  Duration grace = std::chrono::seconds(10);
  /// Return from run() once nothing is ready, running or scheduled for retry on the queue.
  /// Default false.
  bool exit_when_idle = false;
  /// Delete done jobs of the queue older than this (prune_done): about every 10 s (jittered), in
  /// batches of 1000 until none is left or a quarter of the heartbeat interval has passed (then
  /// again at the next heartbeat); nullopt keeps them forever (`keel jobs work` keeps them for
  /// 1h unless told otherwise). Default nullopt.
  std::optional<Duration> done_retention;
  /// Called from the heartbeat thread with how many dead jobs of the queue it just deleted
  /// because they had outlived the queue's QueueOptions::dead_letter_retention (checked every
  /// heartbeat, about every 10 s (jittered), in batches; each deletion is also logged). Default
  /// none.
  std::function<void(std::int64_t pruned)> on_dead_letters_pruned;
  /// Called after every attempt, from the thread that ran it. Default none.
  std::function<void(const WorkerEvent&)> on_event;
  /// Called with a line when the database fails (the worker keeps going). Default: stderr.
  std::function<void(std::string_view)> log;
  /// When leasing has failed without a break for this long (a full disk, a read-only or lost
  /// database), run() stops and failed() says why. While it fails, the worker backs off with
  /// keel::core's full jitter (ceilings from the poll interval doubling up to 5 s, so workers
  /// that lost the database together come back spread out) and logs the first failure and then
  /// one line per 10 s.
  /// Requires: > 0. Default none (kInfinite): keep trying.
  Duration max_database_outage = kInfinite;
  /// Seed for the jitter of the database-outage backoff and of the idle poll; 0 seeds from
  /// std::random_device. Default 0.
  std::uint64_t seed = 0;
  /// PostgreSQL: hold one listening connection (outside the pool) on the queue's notifications
  /// (channel keel_jobs, which the queue's trigger notifies for every job that becomes ready),
  /// so that idle slots lease as soon as a job is enqueued or replayed by any process, and poll
  /// only every `idle_poll`. Ignored on SQLite, which has no notifications. Default true.
  bool wakeups = true;
  /// While the listener listens: the safety-net poll. An idle worker looks at the queue (one
  /// read, JobQueue::next_due) when it goes idle and then after waits drawn uniformly from
  /// [idle_poll / 2, idle_poll x 3/2) (keel::uniform_duration, so a fleet's looks do not line
  /// up), each cut short at the earliest job's due time (a retry, a delayed job, an expiring
  /// lease). Requires: > 0. Default 5 s.
  Duration idle_poll = std::chrono::seconds(5);
  /// PostgreSQL: where the listener connects, when the pool's URL cannot carry LISTEN: a direct
  /// URL of the same database beside a pool URL through a transaction pooler (keel_pooler=
  /// transaction; PgBouncer accepts LISTEN there but delivers the notifications to whichever
  /// client next holds that server connection). Without it, a worker whose pool URL says
  /// keel_pooler=transaction does not listen: it polls every poll_interval (jittered) and says
  /// why once, at start. Default none: the pool's URL.
  std::optional<DatabaseUrl> listen_url;
  /// How often the listener checks that its node still takes writes (a primary demoted or a
  /// standby, where no notification will ever come): waits drawn uniformly from
  /// [node_check / 2, node_check x 3/2). A listener on such a node reconnects through the URL's
  /// host list, and the idle worker looks at the queue. Requires: > 0. Default 10 s.
  Duration node_check = std::chrono::seconds(10);
};

/// How a Worker's idle slots were woken (Worker::wakeup_counts()).
struct WorkerWakeups {
  /// Whether the PostgreSQL listener is listening now.
  bool listening = false;
  /// Slots waiting for work now (a lease found nothing).
  int idle = 0;
  /// Statements the listener ran on its own connection: per connection opened, a read of the
  /// schema keel_jobs is in and the LISTEN.
  std::int64_t listener_statements = 0;
  /// Notifications for the worker's queue received from the database.
  std::int64_t notifications = 0;
  /// Wakeups from producers (enqueue, replay) in this process.
  std::int64_t local = 0;
  /// JobQueue::next_due reads of an idle worker (the safety net, and when it goes idle).
  std::int64_t due_checks = 0;
  /// Leases that found jobs right after a wakeup ended an idle wait.
  std::int64_t woken_leases = 0;
  /// Leases that found nothing right after a wakeup (another worker took the job); each one
  /// lengthens the cooldown in which notifications wait (docs/queue.md, "Wakeups").
  std::int64_t lost_wakeups = 0;
  /// Notifications that arrived during a cooldown (delivered, as one wakeup, when it ends).
  std::int64_t deferred_notifications = 0;
};

namespace detail {
class Listener;
class AloneGate;
}  // namespace detail

class Worker {
 public:
  /// Throws std::invalid_argument naming the field and value when a Requires line is broken.
  /// Requires: pool, queue and handler outlive the worker; the pool allows at least
  /// concurrency + 1 connections.
  Worker(ConnectionPool& pool, const JobQueue& queue, WorkerOptions options, JobHandler handler);
  /// The same worker with a transactional handler (TransactionalJobHandler above): each job's
  /// writes and its completion commit in one transaction. The busy path that records a success
  /// and leases the next jobs in one statement is not used: the success commits with the writes.
  Worker(ConnectionPool& pool, const JobQueue& queue, WorkerOptions options,
         TransactionalJobHandler handler);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  /// Works until stop() (then shuts down as described above) or, with exit_when_idle, until the
  /// queue is idle. Returns the number of attempts whose outcome was recorded.
  std::int64_t run();

  /// Asks run() to shut down. Safe from any thread; idempotent.
  void stop() noexcept;

  /// Whether leasing is paused by a deferral, and for how much longer.
  [[nodiscard]] Duration paused_for() const noexcept;

  /// Whether run() stopped because the database stayed unusable for max_database_outage, and
  /// the last error then.
  [[nodiscard]] bool failed() const noexcept { return failed_.load(); }
  [[nodiscard]] std::string failure() const;

  /// Leases released at shutdown because their handlers outlived the grace period.
  [[nodiscard]] std::int64_t released() const noexcept { return released_.load(); }
  [[nodiscard]] const std::string& worker_id() const noexcept { return options_.worker_id; }

  /// What woke the idle slots so far. Safe from any thread.
  [[nodiscard]] WorkerWakeups wakeup_counts() const;

 private:
  void slot_loop();
  void heartbeat_loop();
  void log(const std::string& line) const;
  // Housekeeping on the heartbeat thread: prune_done and prune_dead, as configured. True when
  // it stopped with a backlog left (the next heartbeat prunes again).
  bool prune(Connection& conn);
  // Runs `batch` (deleting at most its argument's count) until one comes back short, or the
  // queue's clock reaches `until` (then sets `more`); returns how many it deleted.
  std::int64_t prune_batches(const std::function<std::int64_t(int)>& batch, TimePoint until,
                             bool& more);
  // An outcome whose recording was under way is in a slot's `unrecorded` until it is recorded
  // (so that a failure leaves it there to be settled).
  struct Unrecorded {
    WorkerEvent event;
    /// The handler's transaction (the success with the writes) was lost during COMMIT.
    bool tx_in_doubt = false;
    /// Its recording also leased jobs (complete_and_lease): when its answer was lost, the worker
    /// may hold leases it was not told of.
    bool leased = false;
  };
  // What a lease that came back short said about the queue: its earliest due time, read by the
  // same statement, and whether it was the batch's last success that leased nothing (the slot
  // then waits without leasing again).
  struct LeaseHint {
    std::optional<std::int64_t> due_ms;
    bool due_known = false;
    bool empty_after_success = false;
  };
  struct Slot;        // one slot thread's state (queue_worker.cpp)
  struct HandlerRun;  // what a job's handler gave
  // Leases a batch into `jobs`; false when the slot should look again (the lease failed and the
  // slot waited, or the worker stops because the queue is idle).
  bool lease(Slot& slot, std::vector<LeasedJob>& jobs);
  // Waits for a job (idle_wait) and notes how the wait ended.
  void idle(Slot& slot, bool after_work);
  // Runs a leased batch in order; a failure to record settles what is known and gives back
  // what did not run.
  void run_batch(Slot& slot, const std::vector<LeasedJob>& jobs);
  // Runs one job (or, while paused, defers it with `pause_report_`) and records its outcome as
  // detail::decide_start and detail::decide_recording say (queue/detail/worker_decision.hpp):
  // the buffered outcomes of the batch (`slot.buffer`) ride on this job's committed start when
  // it has one and they are successes, or are flushed first when due; a success of the batch's
  // `last` job is recorded with the buffer by complete_and_lease, which puts the jobs it leased
  // in `slot.next`; any other outcome of a batch going on joins the buffer.
  void process(Slot& slot, const LeasedJob& job, bool last);
  // Records this job's start, with the buffer; false when its lease was lost meanwhile.
  bool start_job(Slot& slot, const LeasedJob& job);
  void lost_before_start(const LeasedJob& job);
  [[nodiscard]] HandlerRun run_handler(Connection& conn, const LeasedJob& job);
  // Records the batch's last success and leases the next batch into `slot.next`; returns how
  // many rows the success updated (1: still this worker's).
  std::int64_t complete_and_lease(Slot& slot, const LeasedJob& job);
  // The `start` of this worker's leases: a job leased alone starts with it; a batch's do not.
  [[nodiscard]] int lease_starts() const noexcept;
  // The order to run a leased batch in: the suspects (LeasedJob::crashed_batches) last.
  static void order_batch(std::vector<LeasedJob>& jobs);
  // After a lease of `leased` jobs: when it was full, wakes one idle slot.
  void recruit(std::size_t leased);
  // The bookkeeping after an outcome was recorded: the count, a brake's pause, on_event.
  void recorded(const WorkerEvent& event);
  // Moves the buffer into `slot.unrecorded` (its recording is under way) and returns the pairs
  // (id, fence) to record (a buffer of successes only, for a start's or a lease's statement).
  std::vector<std::pair<std::int64_t, std::int64_t>> buffer_to_unrecorded(Slot& slot);
  // The recording of what buffer_to_unrecorded moved (unrecorded[from, end)) ended: `current`
  // were recorded, the rest found stale.
  void buffer_recorded(Slot& slot, std::size_t from, const std::vector<std::int64_t>& current);
  // ... each with its result (results[i] is unrecorded[from + i]'s).
  void buffer_recorded(Slot& slot, std::size_t from, std::vector<CompleteResult> results);
  // Whether every outcome in the slot's buffer is a success (which a start's or a lease's
  // statement can record).
  static bool buffer_all_successes(const Slot& slot);
  // Records the buffer, successes and failures, if there is any, in one transaction
  // (JobQueue::complete_batch), and clears it.
  void flush_buffer(Slot& slot);
  // Records outcomes whose recording failed (`error`) on a new connection, with each job's
  // fencing token: recorded now, found recorded already (a commit in doubt that applied), or
  // found taken over. Waits for the database with core's backoff, counted towards
  // max_database_outage, until the grace after stop() is over.
  void settle(std::optional<ConnectionPool::Lease>& conn, std::vector<Unrecorded>& unrecorded,
              std::string error);
  [[nodiscard]] CompleteResult settle_one(Connection& conn, Unrecorded& u);
  // Gives leased jobs that did not run back (not charged): released, or, when `maybe_started`
  // (the statement that started it failed with its outcome unknown), deferred with its attempt
  // given back.
  void give_back(std::optional<ConnectionPool::Lease>& conn, const std::vector<LeasedJob>& jobs,
                 bool maybe_started);
  // Gives back the jobs the database says this worker holds that none of its slots runs.
  void give_back_unknown_leases(std::optional<ConnectionPool::Lease>& conn);
  void pause(Duration delay, const AttemptReport& report);
  // A lease (or `activity`) failed: logs (rate-limited), gives up past max_database_outage;
  // returns the wait.
  Duration database_failed(const std::string& activity, const std::string& what);
  // A statement succeeded: ends an outage (logged). True when one ended, and the caller then
  // gives back what the database says this worker holds beyond what it runs: a lost answer may
  // have leased jobs, and a failover to a standby that lagged brings back leases this worker
  // already settled on the old primary.
  [[nodiscard]] bool database_ok();
  // Logs one line when PostgreSQL broke deadlocks in the queue's statements since the last call
  // (JobQueue::deadlocks() went up; keel retried each).
  void note_deadlocks();

  ConnectionPool& pool_;
  const JobQueue& queue_;
  WorkerOptions options_;
  JobHandler handler_;
  TransactionalJobHandler tx_handler_;  // set instead of handler_ by the second constructor

  std::atomic<bool> stopping_{false};
  std::atomic<bool> cancel_{false};
  std::atomic<bool> finished_{false};  // slots and run() are done; the heartbeat thread exits
  std::atomic<std::int64_t> recorded_{0};
  std::atomic<std::int64_t> released_{0};
  /// Leasing paused until this time of queue_.clock() (ns since its epoch); 0: not paused.
  std::atomic<std::int64_t> paused_until_ns_{0};
  std::atomic<bool> failed_{false};
  std::atomic<std::int64_t> deadlocks_logged_{0};  // queue_.deadlocks() when last logged
  /// The current database outage: when it began and when it was last logged (queue_.clock()
  /// ns; 0 when the database works); its failures in a row are db_backoff_'s. Guarded by mu_.
  std::int64_t db_failing_since_ns_ = 0;
  std::int64_t db_logged_ns_ = 0;
  std::string failure_;  // guarded by mu_

  std::mutex mu_;
  std::condition_variable cv_;
  /// Leases held by running handlers: job id -> fence. Guarded by mu_.
  std::map<std::int64_t, std::int64_t> active_;
  /// Every lease this worker knows it holds, from the lease until its outcome is recorded (or
  /// found recorded, or the job given back): active_ plus the jobs whose outcomes are being
  /// recorded or settled. Guarded by mu_.
  std::set<std::int64_t> held_;
  /// Held shared from a statement that leases jobs until they are in held_; held exclusively
  /// to find leases the worker holds without knowing (a lease whose answer was lost).
  std::shared_mutex lease_gate_;
  /// Slot threads still running. Guarded by mu_.
  int slots_running_ = 0;
  /// The report of the deferral that paused leasing, applied to jobs leased before it.
  /// Guarded by mu_.
  AttemptReport pause_report_;
  Rng rng_;                     // the idle waits' jitter; guarded by mu_
  BackoffSequence db_backoff_;  // the database-outage waits; guarded by mu_

  // Wakeups (src/queue/queue_worker_wakeup.cpp).
  enum class IdleEnd : unsigned char { kWoken, kDue, kPoll };
  // After a lease found nothing: waits for a wakeup, the earliest due job or the poll. One idle
  // slot at a time reads the database (the "poller"); the others wait for a wakeup or its role.
  // `due_ms`: when the lease that found nothing already read the queue's earliest due time
  // (complete_and_lease), the poller's first read is skipped. `after_work`: the slot ran jobs
  // before this wait; the poller looks again after a poll interval rather than idle_poll.
  IdleEnd idle_wait(Connection& conn, std::optional<std::int64_t> due_ms, bool due_known,
                    bool after_work);
  // One wakeup: one idle slot leases (a slot that leases next, when none is idle).
  void wake();
  // A notification for the worker's queue: a wakeup, unless the worker is cooling down after
  // wakeups whose leases found nothing (then remembered and delivered when the cooldown ends).
  void notified();
  // The lease that followed a wakeup found nothing (`lost`: another worker took the job) or
  // found work. Lost wakeups in a row lengthen the cooldown (keel::core's full jitter, ceilings
  // doubling from 1 ms up to poll_interval); work ends it.
  void wakeup_lease(bool lost);
  // Called before a slot leases: the wakeups so far are answered by that lease.
  void leasing();
  void start_wakeups();  // run(): the listener thread
  void stop_wakeups();   // run(), once the slots are done
  void listen_loop();
  int pending_wakes_ = 0;                 // wakeups no slot took yet; guarded by mu_
  std::int64_t cooldown_until_ns_ = 0;    // queue_.clock() ns; guarded by mu_
  bool missed_while_cooling_ = false;     // guarded by mu_
  BackoffSequence wake_backoff_;          // the cooldowns after lost wakeups; guarded by mu_
  bool idle_poller_ = false;              // guarded by mu_
  int idle_slots_ = 0;                    // guarded by mu_
  detail::Listener* listener_ = nullptr;  // guarded by mu_; interrupted by stop()
  std::uint64_t local_subscription_ = 0;  // guarded by mu_; 0: none
  std::atomic<bool> subscribed_{false};   // a slot subscribed to the in-process wakeups
  std::atomic<bool> listening_{false};
  std::atomic<std::int64_t> listener_statements_{0};
  std::atomic<std::int64_t> notifications_{0};
  std::atomic<std::int64_t> local_wakeups_{0};
  std::atomic<std::int64_t> due_checks_{0};
  std::atomic<std::int64_t> woken_leases_{0};
  std::atomic<std::int64_t> lost_wakeups_total_{0};
  std::atomic<std::int64_t> deferred_notifications_{0};
  std::thread listener_thread_;
  /// Suspect jobs run with no other handler of the worker running (batch > 1).
  std::unique_ptr<detail::AloneGate> alone_;
};

}  // namespace keel::store
