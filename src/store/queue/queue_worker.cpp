// The job-queue worker: slot threads that lease and run jobs, one heartbeat thread, and the
// graceful shutdown described in include/keel/store/queue/queue_worker.hpp.
#include "keel/store/queue/queue_worker.hpp"

#include <unistd.h>

#include <cstdio>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "db/detail/listener.hpp"
#include "keel/duration.hpp"
#include "keel/expected.hpp"
#include "queue/detail/worker_tx.hpp"

namespace keel::store {
namespace {

std::string default_worker_id() {
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  return std::string(host[0] != '\0' ? host : "localhost") + ":" + std::to_string(getpid()) + ":" +
         new_job_key().substr(0, 8);
}

// The wait between failed leases while the database is out: full jitter under ceilings that
// start at the poll interval and double up to 5 s (the poll interval when that is longer).
BackoffOptions database_backoff(Duration poll) {
  const Duration base = poll > Duration::zero() ? poll : std::chrono::milliseconds(100);
  return {.base = base, .cap = std::max<Duration>(base, std::chrono::seconds(5))};
}

}  // namespace

Worker::Worker(ConnectionPool& pool, const JobQueue& queue, WorkerOptions options,
               JobHandler handler)
    : pool_(pool),
      queue_(queue),
      options_(std::move(options)),
      handler_(std::move(handler)),
      db_backoff_(database_backoff(options_.poll_interval)),
      rng_(options_.seed != 0
               ? options_.seed
               : (std::uint64_t{std::random_device{}()} << 32) ^ std::random_device{}()) {
  constexpr std::string_view kOptions = "keel::store::WorkerOptions";
  const auto reject = [&](std::string_view field, std::string_view problem, std::string got) {
    throw_invalid({.context = std::string(kOptions),
                   .field = std::string(field),
                   .problem = std::string(problem),
                   .got = std::move(got)});
  };
  if (auto checked = check_queue_name(options_.queue); !checked) {
    throw_invalid(checked.error().in("queue", kOptions));
  }
  if (options_.concurrency < 1) {
    reject("concurrency", "must be >= 1", std::to_string(options_.concurrency));
  }
  if (options_.batch < 1) reject("batch", "must be >= 1", std::to_string(options_.batch));
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
  if (options_.heartbeat_interval == Duration::zero()) {
    options_.heartbeat_interval =
        std::max(Duration(std::chrono::milliseconds(1)), queue_.options().lease / 3);
  }
  if (options_.worker_id.empty()) options_.worker_id = default_worker_id();
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

Duration Worker::database_failed(const std::string& what) {
  const std::int64_t now = queue_.clock().now().time_since_epoch().count();
  std::string line;
  bool give_up = false;
  int failures = 0;
  {
    std::lock_guard lock(mu_);
    failures = ++db_failures_;
    if (db_failing_since_ns_ == 0) db_failing_since_ns_ = now;
    const Duration out(now - db_failing_since_ns_);
    if (failures == 1) {
      line = "lease failed: " + what;
      db_logged_ns_ = now;
    } else if (Duration(now - db_logged_ns_) >= std::chrono::seconds(10)) {
      line = "lease still failing (" + std::to_string(failures) + " times in " +
             format_duration(out) + "): " + what;
      db_logged_ns_ = now;
    }
    if (options_.max_database_outage < kInfinite && out >= options_.max_database_outage &&
        !failed_.load()) {
      give_up = true;
      failure_ = "the database has failed for " + format_duration(out) + " (" +
                 std::to_string(failures) + " lease attempts): " + what;
      failed_.store(true);
    }
  }
  if (!line.empty()) log(line);
  if (give_up) {
    log("giving up: " + failure());
    stop();
  }
  // Back off with core's full jitter (ceilings: the poll interval doubling, at most 5 s), so a
  // fleet of workers that lost the database together does not come back in lockstep.
  std::lock_guard lock(mu_);
  db_delay_ = db_backoff_.delay(failures - 1, db_delay_, rng_);
  return db_delay_;
}

void Worker::database_ok() {
  std::string line;
  {
    std::lock_guard lock(mu_);
    if (db_failures_ == 0) return;
    if (db_failures_ > 1) {
      const std::int64_t now = queue_.clock().now().time_since_epoch().count();
      line = "database usable again after " +
             format_duration(Duration(now - db_failing_since_ns_)) + " (" +
             std::to_string(db_failures_) + " failed leases)";
    }
    db_failures_ = 0;
    db_failing_since_ns_ = 0;
    db_delay_ = Duration::zero();
  }
  if (!line.empty()) log(line);
}

void Worker::recorded(const WorkerEvent& event) {
  if (event.result.status != CompleteStatus::kStale) recorded_.fetch_add(1);
  // A brake that says when it will admit a call again (an open breaker's retry_in) pauses
  // leasing until then; one that cannot say (an empty retry budget) defers just this job.
  if (event.result.status == CompleteStatus::kDeferred && event.report.outcome.has_server_delay()) {
    pause(event.result.delay, event.report);
  }
  if (options_.on_event) options_.on_event(event);
}

void Worker::record_pending(Connection& conn, std::optional<WorkerEvent>& pending) {
  if (!pending) return;
  WorkerEvent event = std::move(*pending);
  pending.reset();  // if recording throws, its lease expires and the job runs again
  event.result = queue_.complete(conn, event.job.id, event.job.fence, event.report);
  recorded(event);
}

void Worker::process(Connection& conn, const LeasedJob& job, std::optional<WorkerEvent>& pending,
                     std::vector<LeasedJob>* next) {
  const TimePoint start = queue_.clock().now();
  std::optional<WorkerEvent> finished = std::move(pending);  // recorded by this job's start
  pending.reset();
  AttemptReport report;
  std::optional<CompleteStatus> settled;  // recorded in the handler's transaction already
  if (paused_for() > Duration::zero()) {
    record_pending(conn, finished);
    // Leased before a refusal paused the worker: defer it the same way, sending nothing.
    std::lock_guard lock(mu_);
    report = pause_report_;
  } else {
    bool current = true;
    if (!job.started) {
      // The previous job's success and this job's start in one statement (one transaction on
      // SQLite): a crash in between re-runs neither, and one after charges only this job.
      const DoneAndStarted step =
          finished ? queue_.complete_and_start(conn, {{finished->job.id, finished->job.fence}},
                                               job.id, job.fence)
                   : DoneAndStarted{.started = queue_.start(conn, job.id, job.fence)};
      if (finished) {
        finished->result.status =
            step.current == 1 ? CompleteStatus::kDone : CompleteStatus::kStale;
        recorded(*finished);
        finished.reset();
      }
      current = step.started;
    }
    record_pending(conn, finished);  // a started job: nothing to record it with
    if (!current) {
      // The lease was lost while the job waited in this batch: another worker has it.
      {
        std::lock_guard lock(mu_);
        active_.erase(job.id);
      }
      log("job " + std::to_string(job.id) + ": lease lost before it started; not run");
      if (options_.on_event) {
        WorkerEvent event;
        event.job = job;
        event.result.status = CompleteStatus::kStale;
        options_.on_event(event);
      }
      return;
    }
    try {
      if (tx_handler_) {
        // The handler's writes and the success in one transaction (queue_worker_tx.cpp).
        const detail::TransactionalAttempt attempt =
            detail::run_transactional_attempt(conn, queue_, job, tx_handler_, cancel_, [&] {
              std::lock_guard lock(mu_);
              active_.erase(job.id);
            });
        report = attempt.report;
        if (attempt.done || attempt.stale) {
          settled = attempt.done ? CompleteStatus::kDone : CompleteStatus::kStale;
        }
      } else {
        report = handler_(job, cancel_);
      }
    } catch (const std::exception& e) {
      report.outcome = Outcome::permanent();
      report.error = std::string("handler threw: ") + e.what();
    }
  }
  {
    std::lock_guard lock(mu_);
    active_.erase(job.id);
  }
  WorkerEvent event;
  event.job = job;
  event.report = report;
  event.took = queue_.clock().now() - start;
  const bool busy = report.outcome.kind == OutcomeKind::kSuccess && !stopping_.load() &&
                    paused_for() == Duration::zero();
  if (settled) {
    event.result.status = *settled;
  } else if (next == nullptr && busy) {
    // A success with more of the batch to run: recorded with the next job's start.
    pending = std::move(event);
    return;
  } else if (next != nullptr && busy) {
    // The busy path: the success and the next lease in one step (one statement on PostgreSQL).
    DoneAndLeased step = queue_.complete_and_lease(conn, {{job.id, job.fence}}, options_.queue,
                                                   options_.worker_id, options_.batch, 1);
    {
      std::lock_guard lock(mu_);
      for (const LeasedJob& j : step.leased) active_[j.id] = j.fence;
    }
    *next = std::move(step.leased);
    event.result.status = step.current == 1 ? CompleteStatus::kDone : CompleteStatus::kStale;
  } else {
    event.result = queue_.complete(conn, job.id, job.fence, report);
  }
  recorded(event);
}

void Worker::slot_loop() {
  std::optional<ConnectionPool::Lease> conn;
  std::vector<LeasedJob> next;         // leased by the last success of a batch (complete_and_lease)
  std::optional<WorkerEvent> pending;  // a success of the batch, recorded with the next start
  std::uint64_t seen = 0;              // the wakeups counted before the last lease
  bool woken = false;                  // the last idle wait ended with a wakeup
  while (!stopping_.load()) {
    if (const Duration paused = paused_for(); paused > Duration::zero()) {
      // A brake refused: lease nothing until it expects to admit a call again.
      std::unique_lock lock(mu_);
      cv_.wait_for(lock, std::min(paused, options_.poll_interval),
                   [&] { return stopping_.load(); });
      continue;
    }
    // Leased when the last job's success was recorded, on this connection; else lease now.
    std::vector<LeasedJob> jobs = std::move(next);
    next.clear();
    if (jobs.empty()) {
      try {
        if (!conn || (*conn)->broken()) {
          conn.reset();
          conn.emplace(pool_.acquire());
        }
        // Only the first job starts with the lease; each of the others starts (and is charged)
        // right before its handler runs, so a crash charges only the job that was running.
        seen = wake_epoch();
        jobs = queue_.lease(**conn, options_.queue, options_.worker_id, options_.batch, 1);
        if (!jobs.empty() && woken) woken_leases_.fetch_add(1);
        woken = false;
        if (jobs.empty() && options_.exit_when_idle && queue_.idle(**conn, options_.queue)) {
          stop();
          break;
        }
        database_ok();
      } catch (const std::exception& e) {
        if (conn && (*conn)->broken()) conn.reset();
        const Duration wait = database_failed(e.what());
        std::unique_lock lock(mu_);
        cv_.wait_for(lock, wait, [&] { return stopping_.load(); });
        continue;
      }
    }
    if (jobs.empty()) {
      woken = idle_wait(**conn, seen) == IdleEnd::kWoken;
      continue;
    }
    {
      std::lock_guard lock(mu_);
      for (const LeasedJob& job : jobs) active_[job.id] = job.fence;
    }
    for (std::size_t i = 0; i < jobs.size(); ++i) {
      const LeasedJob& job = jobs[i];
      try {
        if (stopping_.load()) {
          record_pending(**conn, pending);
          // Leased in this batch but not started: give it back at once.
          {
            std::lock_guard lock(mu_);
            active_.erase(job.id);
          }
          if (queue_.release(**conn, job.id, job.fence, "worker stopping; not started")) {
            released_.fetch_add(1);
          }
          continue;
        }
        process(**conn, job, pending, i + 1 == jobs.size() ? &next : nullptr);
      } catch (const std::exception& e) {
        pending.reset();  // not recorded: its lease expires and it runs again
        log("job " + std::to_string(job.id) + ": recording the outcome failed: " + e.what() +
            " (the lease expires and the job runs again)");
        std::lock_guard lock(mu_);
        active_.erase(job.id);
        if ((*conn)->broken()) {
          // The rest of the batch cannot be recorded on this connection: stop heartbeating
          // those leases so that they expire and another attempt picks the jobs up.
          for (std::size_t j = i + 1; j < jobs.size(); ++j) active_.erase(jobs[j].id);
          conn.reset();
          break;
        }
      }
    }
  }
  // Stopping with jobs leased by the last success and not started: give them back at once.
  for (const LeasedJob& job : next) {
    {
      std::lock_guard lock(mu_);
      active_.erase(job.id);
    }
    try {
      if (conn && !(*conn)->broken() &&
          queue_.release(**conn, job.id, job.fence, "worker stopping; not started")) {
        released_.fetch_add(1);
      }
    } catch (const std::exception& e) {
      log("job " + std::to_string(job.id) + ": release failed: " + e.what() +
          " (the lease expires and the job runs again)");
    }
  }
  {
    std::lock_guard lock(mu_);
    --slots_running_;
  }
  cv_.notify_all();
}

void Worker::prune(Connection& conn) {
  if (options_.done_retention) {
    (void)queue_.prune_done(conn, options_.queue, *options_.done_retention);
  }
  const Duration retention = queue_.options().dead_letter_retention;
  if (retention >= kInfinite) return;
  // A few batches per heartbeat: a large backlog drains over several without starving the
  // heartbeats of the running jobs' leases.
  constexpr int kBatch = 1000;
  constexpr int kBatchesPerHeartbeat = 10;
  std::int64_t pruned = 0;
  for (int i = 0; i < kBatchesPerHeartbeat && !stopping_.load(); ++i) {
    const std::int64_t n = queue_.prune_dead(conn, options_.queue, kBatch);
    pruned += n;
    if (n < kBatch) break;
  }
  if (pruned == 0) return;
  log("pruned " + std::to_string(pruned) + " dead job(s) of queue '" + options_.queue +
      "' past the dead-letter retention (" + format_duration(retention) + ")");
  if (options_.on_dead_letters_pruned) options_.on_dead_letters_pruned(pruned);
}

void Worker::heartbeat_loop() {
  std::optional<ConnectionPool::Lease> conn;
  TimePoint last_prune{};
  while (!finished_.load()) {
    {
      std::unique_lock lock(mu_);
      cv_.wait_for(lock, options_.heartbeat_interval, [&] { return finished_.load(); });
    }
    if (finished_.load()) break;
    std::map<std::int64_t, std::int64_t> leases;
    {
      std::lock_guard lock(mu_);
      leases = active_;
    }
    try {
      if (!conn || (*conn)->broken()) {
        conn.reset();
        conn.emplace(pool_.acquire());
      }
      for (const auto& [id, fence] : leases) {
        if (!queue_.heartbeat(**conn, id, fence)) {
          log("job " + std::to_string(id) + ": lease lost (taken over or released)");
        }
      }
      const TimePoint now = queue_.clock().now();
      if (!stopping_.load() && now - last_prune >= std::chrono::seconds(10)) {
        last_prune = now;
        prune(**conn);
      }
    } catch (const std::exception& e) {
      log(std::string("heartbeat failed: ") + e.what());
      if (conn && (*conn)->broken()) conn.reset();
    }
  }
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
  return recorded_.load();
}

}  // namespace keel::store
