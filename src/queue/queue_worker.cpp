// The job-queue worker: slot threads that lease and run jobs, one heartbeat thread, and the
// graceful shutdown described in include/keel/queue/queue_worker.hpp.
#include "keel/queue/queue_worker.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <shared_mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "db/detail/listener.hpp"
#include "db/detail/options_refusal.hpp"
#include "db/detail/process.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "keel/core/random.hpp"
#include "keel/core/text.hpp"
#include "queue/detail/alone_gate.hpp"
#include "queue/detail/queue_wakeup.hpp"
#include "queue/detail/worker_decision.hpp"
#include "queue/detail/worker_tx.hpp"

namespace keel::store {
namespace {

// The cooldown after wakeups whose leases found nothing: full jitter under ceilings that start
// at 1 ms and double up to the poll interval (a worker that keeps losing looks as often as one
// that polls).
BackoffOptions wakeup_backoff(Duration poll) {
  const Duration base = std::chrono::milliseconds(1);
  return {.base = base, .cap = std::max<Duration>(base, poll)};
}

// The worker's seed: WorkerOptions::seed, or a random one.
std::uint64_t seed_of(std::uint64_t seed) { return seed != 0 ? seed : random_seed(); }

}  // namespace

Worker::Worker(ConnectionPool& pool, const JobQueue& queue, WorkerOptions options,
               JobHandler handler)
    : pool_(pool),
      queue_(queue),
      options_(std::move(options)),
      handler_(std::move(handler)),
      rng_(seed_of(options_.seed)),
      db_backoff_(detail::database_backoff(options_.poll_interval), rng_()),
      wake_backoff_(wakeup_backoff(options_.poll_interval), rng_()) {
  constexpr std::string_view kOptions = "keel::store::WorkerOptions";
  const detail::OptionsRefusal reject(kOptions);
  if (auto checked = check_queue_name(options_.queue); !checked) {
    throw_invalid(checked.error().in("queue", kOptions));
  }
  if (options_.concurrency < 1) {
    reject("concurrency", "must be >= 1", std::to_string(options_.concurrency));
  }
  if (options_.batch < 1) reject("batch", "must be >= 1", std::to_string(options_.batch));
  if (options_.flush_window < Duration::zero()) {
    reject("flush_window", "must be >= 0", format_duration(options_.flush_window));
  }
  if (options_.poll_interval <= Duration::zero()) {
    reject("poll_interval", "must be > 0", format_duration(options_.poll_interval));
  }
  if (options_.idle_poll <= Duration::zero()) {
    reject("idle_poll", "must be > 0", format_duration(options_.idle_poll));
  }
  if (options_.heartbeat_interval < Duration::zero()) {
    reject("heartbeat_interval", "must be >= 0", format_duration(options_.heartbeat_interval));
  }
  if (options_.grace < Duration::zero()) {
    reject("grace", "must be >= 0", format_duration(options_.grace));
  }
  if (options_.node_check <= Duration::zero()) {
    reject("node_check", "must be > 0", format_duration(options_.node_check));
  }
  if (options_.max_database_outage <= Duration::zero()) {
    reject("max_database_outage", "must be > 0", format_duration(options_.max_database_outage));
  }
  if (options_.done_retention && *options_.done_retention < Duration::zero()) {
    reject("done_retention", "must be >= 0", format_duration(*options_.done_retention));
  }
  if (!handler_) {
    throw_invalid(
        {.context = "keel::store::Worker", .field = "handler", .problem = "must not be empty"});
  }
  if (options_.heartbeat_interval != Duration::zero() &&
      options_.heartbeat_interval >= queue_.options().lease) {
    // A lease would expire before its heartbeat: every job would be taken over as it runs.
    reject(
        "heartbeat_interval",
        "must be shorter than the queue's lease (" + format_duration(queue_.options().lease) + ")",
        format_duration(options_.heartbeat_interval));
  }
  if (options_.poll_interval < std::chrono::milliseconds(1)) {
    reject("poll_interval", "must be >= 1ms", format_duration(options_.poll_interval));
  }
  if (!options_.worker_id.empty() &&
      (!is_storable_text(options_.worker_id) || options_.worker_id.size() > 255)) {
    // Stored as each lease's owner: text the database refuses would fail every lease.
    reject("worker_id", "must be UTF-8 text without NUL, at most 255 bytes",
           quote_value(options_.worker_id, 80));
  }
  if (options_.heartbeat_interval == Duration::zero()) {
    options_.heartbeat_interval =
        std::max(Duration(std::chrono::milliseconds(1)), queue_.options().lease / 3);
  }
  if (options_.worker_id.empty()) options_.worker_id = detail::process_name();
  if (options_.batch > 1) alone_ = std::make_unique<detail::AloneGate>();
  deadlocks_logged_.store(queue_.deadlocks());
}

Worker::Worker(ConnectionPool& pool, const JobQueue& queue, WorkerOptions options,
               TransactionalJobHandler handler)
    // handler_ is never called when tx_handler_ is set; it only passes the check above.
    : Worker(pool, queue, std::move(options),
             [](const LeasedJob&, const std::atomic<bool>&) { return AttemptReport{}; }) {
  if (!handler) {
    throw_invalid(
        {.context = "keel::store::Worker", .field = "handler", .problem = "must not be empty"});
  }
  tx_handler_ = std::move(handler);
}

Worker::~Worker() = default;

void Worker::log(const std::string& line) const {
  if (options_.log) {
    options_.log(line);
  } else {
    std::fprintf(stderr, "keel worker %s: %s\n", options_.worker_id.c_str(), line.c_str());
  }
}

void Worker::note_deadlocks() {
  const std::int64_t now = queue_.deadlocks();
  std::int64_t logged = deadlocks_logged_.load();
  while (now > logged) {
    if (deadlocks_logged_.compare_exchange_weak(logged, now)) {
      log("PostgreSQL broke " + std::to_string(now - logged) +
          " deadlock(s) in the queue's statements (40P01, each after deadlock_timeout); retried, "
          "nothing lost (" +
          std::to_string(now) + " so far)");
      return;
    }
  }
}

void Worker::stop() noexcept {
  {
    std::lock_guard lock(mu_);
    stopping_.store(true);
    if (listener_ != nullptr) listener_->interrupt();
  }
  cv_.notify_all();
}

Duration Worker::paused_for() const noexcept {
  const std::int64_t until = paused_until_ns_.load();
  const std::int64_t now = queue_.clock().now().time_since_epoch().count();
  return until > now ? Duration(until - now) : Duration::zero();
}

void Worker::pause(Duration delay, const AttemptReport& report) {
  const std::int64_t until = saturating_add(queue_.clock().now(), delay).time_since_epoch().count();
  std::lock_guard lock(mu_);
  std::int64_t cur = paused_until_ns_.load();
  if (until > cur) {
    paused_until_ns_.store(until);
    pause_report_ = report;
  }
}

std::string Worker::failure() const {
  std::lock_guard lock(const_cast<std::mutex&>(mu_));
  return failure_;
}

Duration Worker::database_failed(const std::string& activity, const std::string& what) {
  const std::int64_t now = queue_.clock().now().time_since_epoch().count();
  std::string line;
  bool give_up = false;
  int failures = 0;
  Duration wait{};
  {
    std::lock_guard lock(mu_);
    // Core's full jitter (ceilings: the poll interval doubling, at most 5 s), so a fleet of
    // workers that lost the database together does not come back in lockstep.
    wait = db_backoff_.next();
    failures = db_backoff_.failures();
    if (db_failing_since_ns_ == 0) db_failing_since_ns_ = now;
    const Duration out(now - db_failing_since_ns_);
    if (failures == 1) {
      line = activity + " failed: " + what;
      db_logged_ns_ = now;
    } else if (Duration(now - db_logged_ns_) >= std::chrono::seconds(10)) {
      line = activity + " still failing (" + std::to_string(failures) + " times in " +
             format_duration(out) + "): " + what;
      db_logged_ns_ = now;
    }
    if (options_.max_database_outage < kInfinite && out >= options_.max_database_outage &&
        !failed_.load()) {
      give_up = true;
      failure_ = "the database has failed for " + format_duration(out) + " (" +
                 std::to_string(failures) + " attempts): " + what;
      failed_.store(true);
    }
  }
  if (!line.empty()) log(line);
  if (give_up) {
    log("giving up: " + failure());
    stop();
  }
  return wait;
}

bool Worker::database_ok() {
  std::string line;
  {
    std::lock_guard lock(mu_);
    const int failures = db_backoff_.failures();
    if (failures == 0) return false;
    if (failures > 1) {
      const std::int64_t now = queue_.clock().now().time_since_epoch().count();
      line = "database usable again after " +
             format_duration(Duration(now - db_failing_since_ns_)) + " (" +
             std::to_string(failures) + " failed leases)";
    }
    db_backoff_.reset();
    db_failing_since_ns_ = 0;
  }
  if (!line.empty()) log(line);
  return true;
}

void Worker::recorded(const WorkerEvent& event) {
  {
    std::lock_guard lock(mu_);
    held_.erase(event.job.id);
    // A buffered success stayed active (heartbeated) until now.
    if (const auto it = active_.find(event.job.id);
        it != active_.end() && it->second == event.job.fence) {
      active_.erase(it);
    }
  }
  if (event.result.status != CompleteStatus::kStale) recorded_.fetch_add(1);
  // A brake that says when it will admit a call again (an open breaker's retry_in, a pause)
  // holds leasing until then; one that cannot say (an empty retry budget) defers just this job,
  // and so does a rate limit's line (Outcome::in_line: a new call waits for its own turn, and
  // this job comes back at its own).
  if (event.result.status == CompleteStatus::kDeferred && event.report.outcome.has_server_delay() &&
      !event.report.outcome.in_line) {
    pause(event.result.delay, event.report);
  }
  if (options_.on_event) options_.on_event(event);
}

// A slot's state between its jobs: its connection, and what the batch it runs has left for the
// next statement to carry.
struct Worker::Slot {
  std::optional<ConnectionPool::Lease> conn;
  std::vector<LeasedJob> next;         // leased by the last success of a batch (complete_and_lease)
  std::vector<WorkerEvent> buffer;     // outcomes of the batch not recorded yet, oldest first
  TimePoint buffer_since{};            // when the oldest of them finished
  std::vector<Unrecorded> unrecorded;  // outcomes known whose recording has not finished
  LeaseHint hint;           // what the last lease said about the queue when it came back short
  bool woken = false;       // the last idle wait ended with a wakeup
  bool after_work = false;  // the slot ran jobs since its last idle wait
  bool looked = false;      // ... or it ended because a job was due
  bool ran = false;         // the current job's handler ran (or its deferral was decided)
};

// What a job's handler gave: its report, and whether its transaction recorded it already.
struct Worker::HandlerRun {
  AttemptReport report;
  std::optional<CompleteStatus> settled;  // recorded in the handler's transaction already
  bool in_doubt = false;                  // the handler's transaction's COMMIT is in doubt
};

std::vector<std::pair<std::int64_t, std::int64_t>> Worker::buffer_to_unrecorded(Slot& slot) {
  std::vector<std::pair<std::int64_t, std::int64_t>> done;
  done.reserve(slot.buffer.size());
  for (WorkerEvent& e : slot.buffer) {
    done.emplace_back(e.job.id, e.job.fence);
    slot.unrecorded.push_back({.event = std::move(e)});
  }
  slot.buffer.clear();
  return done;
}

void Worker::buffer_recorded(Slot& slot, std::size_t from,
                             const std::vector<std::int64_t>& current) {
  // unrecorded[from, end) is what buffer_to_unrecorded moved, successes only: each recorded, or
  // found stale.
  std::vector<CompleteResult> results(slot.unrecorded.size() - from);
  for (std::size_t i = 0; i < results.size(); ++i) {
    const std::int64_t id = slot.unrecorded[from + i].event.job.id;
    results[i].status = std::find(current.begin(), current.end(), id) != current.end()
                            ? CompleteStatus::kDone
                            : CompleteStatus::kStale;
  }
  buffer_recorded(slot, from, std::move(results));
}

void Worker::buffer_recorded(Slot& slot, std::size_t from, std::vector<CompleteResult> results) {
  std::vector<Unrecorded> moved(
      std::make_move_iterator(slot.unrecorded.begin() + static_cast<std::ptrdiff_t>(from)),
      std::make_move_iterator(slot.unrecorded.end()));
  slot.unrecorded.resize(from);
  for (std::size_t i = 0; i < moved.size(); ++i) {
    WorkerEvent& e = moved[i].event;
    e.result = std::move(results[i]);
    recorded(e);
  }
}

bool Worker::buffer_all_successes(const Slot& slot) {
  return std::all_of(slot.buffer.begin(), slot.buffer.end(), [](const WorkerEvent& e) {
    return e.report.outcome.kind == OutcomeKind::kSuccess;
  });
}

void Worker::flush_buffer(Slot& slot) {
  if (slot.buffer.empty()) return;
  // Successes and failures in one transaction, in a few statements (JobQueue::complete_batch).
  std::vector<BatchOutcome> outcomes;
  outcomes.reserve(slot.buffer.size());
  for (const WorkerEvent& e : slot.buffer) outcomes.push_back({e.job.id, e.job.fence, e.report});
  const std::size_t from = slot.unrecorded.size();
  (void)buffer_to_unrecorded(slot);
  buffer_recorded(slot, from, queue_.complete_batch(**slot.conn, outcomes));
}

bool Worker::start_job(Slot& slot, const LeasedJob& job) {
  // The buffered successes and this job's start in one statement (one transaction on SQLite): a
  // crash in between re-runs none of them, and one after charges only this job. Failures in the
  // buffer are recorded first, with the successes (the start's statement records successes only).
  if (!buffer_all_successes(slot)) flush_buffer(slot);
  const std::size_t from = slot.unrecorded.size();
  const auto done = buffer_to_unrecorded(slot);
  const DoneAndStarted step = queue_.complete_and_start(**slot.conn, done, job.id, job.fence);
  buffer_recorded(slot, from, step.current_ids);
  return step.started;
}

void Worker::lost_before_start(const LeasedJob& job) {
  // The lease was lost while the job waited in this batch: another worker has it.
  {
    std::lock_guard lock(mu_);
    active_.erase(job.id);
    held_.erase(job.id);
  }
  log("job " + std::to_string(job.id) + ": lease lost before it started; not run");
  if (options_.on_event) {
    WorkerEvent event;
    event.job = job;
    event.result.status = CompleteStatus::kStale;
    options_.on_event(event);
  }
}

Worker::HandlerRun Worker::run_handler(Connection& conn, const LeasedJob& job) {
  HandlerRun run;
  try {
    if (tx_handler_) {
      // The handler's writes and the success in one transaction (queue_worker_tx.cpp).
      const detail::TransactionalAttempt attempt =
          detail::run_transactional_attempt(conn, queue_, job, tx_handler_, cancel_, [&] {
            std::lock_guard lock(mu_);
            active_.erase(job.id);
          });
      run.report = attempt.report;
      run.in_doubt = attempt.in_doubt;
      if (attempt.done || attempt.stale) {
        run.settled = attempt.done ? CompleteStatus::kDone : CompleteStatus::kStale;
      }
    } else {
      run.report = handler_(job, cancel_);
    }
  } catch (const std::exception& e) {
    run.report.outcome = Outcome::permanent();
    run.report.error = std::string("handler threw: ") + e.what();
  }
  return run;
}

void Worker::process(Slot& slot, const LeasedJob& job, bool last) {
  const TimePoint start = queue_.clock().now();
  slot.ran = false;
  const detail::StartDecision how = detail::decide_start(
      {.paused = paused_for() > Duration::zero(),
       .started = job.started,
       .suspect = job.crashed_batches > 0,
       .buffered = !slot.buffer.empty(),
       .buffer_due = !slot.buffer.empty() && start - slot.buffer_since >= options_.flush_window});
  if (how.flush) flush_buffer(slot);
  HandlerRun run;
  // A batched worker's handlers pass the gate shared; a suspect's start, handler and record
  // alone: its start is committed, and a crash before its outcome is recorded would charge it.
  std::optional<detail::AloneGate::Pass> pass;
  if (how.defer) {
    // Leased before a refusal paused the worker: defer it the same way, sending nothing.
    slot.ran = true;  // "ran" as far as recording goes: its report is the deferral
    std::lock_guard lock(mu_);
    run.report = pause_report_;
  } else {
    pass.emplace(alone_.get(), how.alone);
    const bool current = !how.start || start_job(slot, job);
    slot.ran = true;  // nothing to give back: run, or another worker's now
    if (!current) return lost_before_start(job);
    run = run_handler(**slot.conn, job);
  }
  WorkerEvent event;
  event.job = job;
  event.report = run.report;
  event.took = queue_.clock().now() - start;
  const detail::RecordingFacts facts{.recorded_by_handler = run.settled.has_value(),
                                     .in_doubt = run.in_doubt,
                                     .success = run.report.outcome.kind == OutcomeKind::kSuccess,
                                     .refused = !run.report.outcome.attempted(),
                                     .stopping = stopping_.load(),
                                     .paused = paused_for() > Duration::zero(),
                                     .last_of_batch = last,
                                     .ran_alone = how.alone};
  const detail::Recording recording = detail::decide_recording(facts);
  // Only a handler that ran shared may leave the gate before its outcome is recorded.
  if (!how.alone) pass.reset();
  if (recording != detail::Recording::kBuffered) {
    std::lock_guard lock(mu_);
    active_.erase(job.id);
  }
  switch (recording) {
    case detail::Recording::kRecorded:
      event.result.status = *run.settled;
      recorded(event);
      return;
    case detail::Recording::kBuffered:
      // Heartbeated (still active) until a later statement records it.
      if (slot.buffer.empty()) slot.buffer_since = queue_.clock().now();
      slot.buffer.push_back(std::move(event));
      return;
    case detail::Recording::kAlone:
      // Recorded now, after the buffer (outcomes in the order their handlers ran), in one
      // transaction with it (flush_buffer).
      slot.buffer.push_back(std::move(event));
      flush_buffer(slot);
      return;
    case detail::Recording::kSettle:
    case detail::Recording::kWithNextLease:
      break;
  }
  slot.unrecorded.push_back({.event = event,
                             .tx_in_doubt = run.in_doubt,
                             .leased = recording == detail::Recording::kWithNextLease});
  if (recording == detail::Recording::kSettle) {
    // Only the job's row can say whether the COMMIT applied: settled on a new connection.
    throw DatabaseError("the job's transaction's COMMIT is in doubt: " + run.report.error,
                        {.backend = (*slot.conn)->backend(), .during_commit = true});
  }
  if (recording == detail::Recording::kWithNextLease) {
    // The busy path: the success and the next lease in one step (one statement on PostgreSQL).
    event.result.status =
        complete_and_lease(slot, job) == 1 ? CompleteStatus::kDone : CompleteStatus::kStale;
  }
  slot.unrecorded.pop_back();
  recorded(event);
}

std::int64_t Worker::complete_and_lease(Slot& slot, const LeasedJob& job) {
  // The lease's statement records successes only: buffered failures go first, with the rest.
  if (!buffer_all_successes(slot)) flush_buffer(slot);
  leasing();
  std::shared_lock gate(lease_gate_);
  // The buffer's successes and this one (the last of `unrecorded`, already there).
  const std::size_t from = slot.unrecorded.size();
  auto done = buffer_to_unrecorded(slot);
  done.emplace_back(job.id, job.fence);
  DoneAndLeased step = queue_.complete_and_lease(
      **slot.conn, done, options_.queue, options_.worker_id, options_.batch, lease_starts());
  order_batch(step.leased);
  buffer_recorded(slot, from, step.current_ids);
  {
    std::lock_guard lock(mu_);
    for (const LeasedJob& j : step.leased) {
      active_[j.id] = j.fence;
      held_.insert(j.id);
    }
  }
  slot.hint = {.due_ms = step.next_due_ms,
               .due_known = step.next_due_known,
               .empty_after_success = step.leased.empty() && step.next_due_known};
  recruit(step.leased.size());
  slot.next = std::move(step.leased);
  return std::find(step.current_ids.begin(), step.current_ids.end(), job.id) !=
                 step.current_ids.end()
             ? 1
             : 0;
}

int Worker::lease_starts() const noexcept { return options_.batch > 1 ? 0 : JobQueue::kStartAll; }

void Worker::order_batch(std::vector<LeasedJob>& jobs) {
  // The suspects last, each run alone after the rest of the batch has run and been recorded
  // (with its start), so that a crash then re-runs nothing that finished.
  std::stable_partition(jobs.begin(), jobs.end(),
                        [](const LeasedJob& j) { return j.started || j.crashed_batches == 0; });
}

void Worker::slot_loop() {
  Slot slot;
  while (!stopping_.load()) {
    note_deadlocks();
    if (const Duration paused = paused_for(); paused > Duration::zero()) {
      // A brake refused: lease nothing until it expects to admit a call again.
      // Looked at again within the poll interval, jittered: a fleet's paused slots do not all
      // come back in the same instant.
      std::unique_lock lock(mu_);
      const Duration wait = jittered(std::min(paused, options_.poll_interval), rng_);
      // wait: core: a brake's pause, jittered
      cv_.wait_for(lock, wait, [&] { return stopping_.load(); });
      continue;
    }
    // Leased when the last job's success was recorded, on this connection; else lease now.
    std::vector<LeasedJob> jobs = std::move(slot.next);
    slot.next.clear();
    if (jobs.empty() && slot.hint.empty_after_success) {
      // The last success's statement leased nothing: the queue had no due job then, and a job
      // that came after it wakes the worker. Wait without asking again.
      slot.hint.empty_after_success = false;
      idle(slot, /*after_work=*/true);
      continue;
    }
    if (jobs.empty() && !lease(slot, jobs)) continue;
    if (jobs.empty()) {
      idle(slot, slot.after_work);
      slot.hint = {};
      slot.after_work = false;
      continue;
    }
    slot.after_work = true;
    run_batch(slot, jobs);
  }
  // Stopping with jobs leased by the last success and not started: give them back at once.
  give_back(slot.conn, slot.next, /*maybe_started=*/false);
  {
    std::lock_guard lock(mu_);
    --slots_running_;
  }
  cv_.notify_all();
}

void Worker::idle(Slot& slot, bool after_work) {
  const IdleEnd end = idle_wait(**slot.conn, slot.hint.due_ms, slot.hint.due_known, after_work);
  slot.woken = end == IdleEnd::kWoken;
  slot.looked = end != IdleEnd::kPoll;
}

bool Worker::lease(Slot& slot, std::vector<LeasedJob>& jobs) {
  try {
    // A session the server ended (or a node that stopped taking writes) is replaced first.
    if (!slot.conn || !(*slot.conn)->usable()) {
      slot.conn.reset();
      slot.conn.emplace(pool_.acquire());
    }
    // A job leased alone starts with its lease; a batch starts none (decide_start).
    leasing();
    {
      std::shared_lock gate(lease_gate_);
      DoneAndLeased step = queue_.complete_and_lease(
          **slot.conn, {}, options_.queue, options_.worker_id, options_.batch, lease_starts());
      jobs = std::move(step.leased);
      order_batch(jobs);
      slot.hint = {.due_ms = step.next_due_ms, .due_known = step.next_due_known};
      std::lock_guard lock(mu_);
      for (const LeasedJob& job : jobs) {
        active_[job.id] = job.fence;
        held_.insert(job.id);
      }
    }
    if (!jobs.empty() && slot.woken) woken_leases_.fetch_add(1);
    if (slot.looked) wakeup_lease(/*lost=*/jobs.empty());
    slot.woken = false;
    slot.looked = false;
    recruit(jobs.size());
    if (jobs.empty() && options_.exit_when_idle && queue_.idle(**slot.conn, options_.queue)) {
      stop();
      return false;
    }
    // The first lease after an outage: what the database says this worker holds beyond what
    // its slots run goes back (give_back_unknown_leases), not left to its lease's expiry.
    if (database_ok()) give_back_unknown_leases(slot.conn);
    return true;
  } catch (const std::exception& e) {
    if (slot.conn && (*slot.conn)->broken()) slot.conn.reset();
    const Duration wait = database_failed("lease", e.what());
    std::unique_lock lock(mu_);
    // wait: core: the database-outage BackoffSequence
    cv_.wait_for(lock, wait, [&] { return stopping_.load(); });
    return false;
  }
}

void Worker::run_batch(Slot& slot, const std::vector<LeasedJob>& jobs) {
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    const LeasedJob& job = jobs[i];
    slot.ran = false;
    try {
      if (stopping_.load()) {
        flush_buffer(slot);
        // Leased in this batch but not started: give it back at once.
        {
          std::lock_guard lock(mu_);
          active_.erase(job.id);
          held_.erase(job.id);
        }
        if (queue_.release(**slot.conn, job.id, job.fence, "worker stopping; not started")) {
          released_.fetch_add(1);
        }
        continue;
      }
      process(slot, job, i + 1 == jobs.size());
    } catch (const std::exception& e) {
      // An outcome is known but was not recorded (the connection was lost, its commit is in
      // doubt, a node turned read-only): it is settled on a new connection, with the job's
      // fencing token, never left to its lease and run again. A job of this batch that did not
      // run is given back uncharged.
      // The buffer's outcomes ran first: they go first.
      const auto known = static_cast<std::ptrdiff_t>(slot.unrecorded.size());
      (void)buffer_to_unrecorded(slot);
      std::rotate(slot.unrecorded.begin(), slot.unrecorded.begin() + known, slot.unrecorded.end());
      if (slot.conn && (*slot.conn)->broken()) slot.conn.reset();
      if (!slot.unrecorded.empty()) {
        settle(slot.conn, slot.unrecorded, e.what());
      } else {
        log("job " + std::to_string(job.id) + (slot.ran ? ": " : ": not run: ") + e.what());
      }
      if (!slot.ran) give_back(slot.conn, {job}, /*maybe_started=*/true);
      give_back(
          slot.conn,
          std::vector<LeasedJob>(jobs.begin() + static_cast<std::ptrdiff_t>(i) + 1, jobs.end()),
          /*maybe_started=*/false);
      return;
    }
  }
  // Every way a batch ends records its buffer (decide_recording: its last outcome, a refusal); what
  // is left would otherwise wait for its lease's expiry and run again.
  if (slot.buffer.empty()) return;
  try {
    flush_buffer(slot);
  } catch (const std::exception& e) {
    if (slot.conn && (*slot.conn)->broken()) slot.conn.reset();
    settle(slot.conn, slot.unrecorded, e.what());
  }
}

void Worker::recruit(std::size_t leased) {
  if (static_cast<int>(leased) < options_.batch) return;
  bool idle = false;
  {
    std::lock_guard lock(mu_);
    idle = idle_slots_ > 0;
  }
  // A full lease: more jobs are likely waiting. One idle slot of this worker joins in (and,
  // if its lease is full too, the next).
  if (idle) wake();
}

std::int64_t Worker::run() {
  {
    std::lock_guard lock(mu_);
    slots_running_ = options_.concurrency;
  }
  std::vector<std::thread> slots;
  slots.reserve(static_cast<std::size_t>(options_.concurrency));
  for (int i = 0; i < options_.concurrency; ++i) slots.emplace_back([this] { slot_loop(); });
  std::thread heartbeats([this] { heartbeat_loop(); });
  start_wakeups();

  {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return stopping_.load() || slots_running_ == 0; });
    // Stopping: running handlers have the grace period to finish.
    // wait: bound: the running jobs, at most the grace
    cv_.wait_for(lock, options_.grace, [&] { return slots_running_ == 0; });
  }
  // The grace is over: handlers are told to stop (an --exec command's process group is killed)
  // before their leases are given back, so no job is ready for another worker while its first
  // run is still going. A handler that returns within the second after that records its outcome
  // (cancelled, an attempt); the leases of the others are released, each charged as the attempt
  // it was.
  cancel_.store(true);
  {
    std::unique_lock lock(mu_);
    // wait: bound: the slots left, a second at a time until they end
    cv_.wait_for(lock, std::chrono::seconds(1), [&] { return slots_running_ == 0; });
  }
  std::map<std::int64_t, std::int64_t> remaining;
  {
    std::lock_guard lock(mu_);
    remaining = active_;
  }
  if (!remaining.empty()) {
    try {
      auto conn = pool_.acquire();
      for (const auto& [id, fence] : remaining) {
        if (queue_.release(*conn, id, fence, "worker stopped; grace period over")) {
          released_.fetch_add(1);
        }
      }
    } catch (const std::exception& e) {
      log(std::string("releasing leases failed: ") + e.what() +
          " (they expire and the jobs run again)");
    }
  }
  for (std::thread& t : slots) t.join();
  stop_wakeups();
  {
    std::lock_guard lock(mu_);
    finished_.store(true);
  }
  cv_.notify_all();
  heartbeats.join();
  note_deadlocks();
  return recorded_.load();
}

}  // namespace keel::store
