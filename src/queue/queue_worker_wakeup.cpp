// The Worker's wakeups (docs/queue.md, "Wakeups"): an idle slot waits for a notification from
// the database (PostgreSQL LISTEN on a connection of the worker's own), a producer of this
// process, the earliest due job, or the poll; one idle slot at a time reads the database while
// the others wait for a wakeup.
#include <algorithm>
#include <exception>
#include <string>

#include "db/detail/listener.hpp"
#include "keel/core/backoff.hpp"
#include "keel/core/duration.hpp"
#include "keel/db/dialect.hpp"
#include "keel/queue/queue_worker.hpp"
#include "queue/detail/queue_wakeup.hpp"

namespace keel::store {

void Worker::wake() {
  {
    std::lock_guard lock(mu_);
    // One slot per wakeup: as many pending as there are idle slots to take them (one when none
    // is idle: the next slot to go idle leases once more, as the job may have come after its
    // lease read the queue).
    pending_wakes_ = std::min(pending_wakes_ + 1, std::max(1, idle_slots_));
  }
  cv_.notify_all();
}

void Worker::leasing() {
  std::lock_guard lock(mu_);
  pending_wakes_ = 0;  // the lease about to run sees every job committed before it
}

void Worker::notified() {
  {
    std::lock_guard lock(mu_);
    if (queue_.clock().now().time_since_epoch().count() < cooldown_until_ns_) {
      // Other workers took the jobs of the last wakeups: this one looks when the cooldown ends.
      missed_while_cooling_ = true;
      deferred_notifications_.fetch_add(1);
      return;
    }
  }
  wake();
}

void Worker::wakeup_lease(bool lost) {
  std::lock_guard lock(mu_);
  if (!lost) {
    wake_backoff_.reset();
    cooldown_until_ns_ = 0;
    return;
  }
  lost_wakeups_total_.fetch_add(1);
  // Core's full jitter: a fleet of workers that all lost the same race does not come back
  // together, and a worker that keeps losing (the others keep up) looks less often, at most
  // every poll_interval, as a worker without wakeups would.
  const Duration cooldown = wake_backoff_.next();
  cooldown_until_ns_ = saturating_add(queue_.clock().now(), cooldown).time_since_epoch().count();
}

WorkerWakeups Worker::wakeup_counts() const {
  int idle = 0;
  {
    std::lock_guard lock(const_cast<std::mutex&>(mu_));
    idle = idle_slots_;
  }
  return {.listening = listening_.load(),
          .idle = idle,
          .listener_statements = listener_statements_.load(),
          .notifications = notifications_.load(),
          .local = local_wakeups_.load(),
          .due_checks = due_checks_.load(),
          .woken_leases = woken_leases_.load(),
          .lost_wakeups = lost_wakeups_total_.load(),
          .deferred_notifications = deferred_notifications_.load()};
}

Worker::IdleEnd Worker::idle_wait(Connection& conn, std::optional<std::int64_t> due_ms,
                                  bool due_known, bool after_work) {
  if (!subscribed_.exchange(true)) {
    // Producers of this process find the worker by its database as a connection names it. The
    // registry calls wake() under its own mutex, so this is done without holding mu_.
    const std::uint64_t id = detail::LocalWakeups::instance().subscribe(
        conn.database_identity(), options_.queue, [this] {
          local_wakeups_.fetch_add(1);
          wake();
        });
    {
      std::lock_guard lock(mu_);
      local_subscription_ = id;
    }
    return IdleEnd::kPoll;  // a job enqueued since the lease found no subscriber: look again
  }
  std::unique_lock lock(mu_);
  const auto woken = [&] { return stopping_.load() || pending_wakes_ > 0; };
  ++idle_slots_;
  while (idle_poller_ && !woken()) cv_.wait(lock, [&] { return woken() || !idle_poller_; });
  if (woken()) {
    if (pending_wakes_ > 0) --pending_wakes_;  // this slot takes the wakeup
    --idle_slots_;
    return IdleEnd::kWoken;
  }
  idle_poller_ = true;
  IdleEnd end = IdleEnd::kPoll;
  // The lease's own read of the earliest due time stands for the first read when it says that
  // nothing is due yet (a job due now may be one another worker is leasing: read again).
  bool use_lease_due = due_known && (!due_ms || *due_ms > queue_.now_ms());
  for (;;) {
    Duration wait = options_.poll_interval;
    if (listening_.load()) {
      // Wakeups arrive: the poll is a safety net. Look when the earliest job is due.
      std::optional<std::int64_t> due;
      bool failed = false;
      if (use_lease_due) {
        due = due_ms;
        use_lease_due = false;
      } else {
        lock.unlock();
        try {
          due = queue_.next_due(conn, options_.queue);
        } catch (const std::exception&) {
          failed = true;  // the lease that follows reports it and backs off
        }
        lock.lock();
      }
      due_checks_.fetch_add(1);
      if (woken()) {
        if (pending_wakes_ > 0) --pending_wakes_;
        end = IdleEnd::kWoken;
        break;
      }
      const std::int64_t now = queue_.now_ms();
      if (failed || (due && *due <= now)) {
        // A job is due. When the last looks found nothing (other workers are leasing the due
        // jobs), look again only after the cooldown, rather than in a loop of reads and leases.
        const std::int64_t clock_now = queue_.clock().now().time_since_epoch().count();
        if (!failed && cooldown_until_ns_ > clock_now &&
            // wait: core: the cooldown after lost wakeups, a BackoffSequence
            !cv_.wait_for(lock, Duration(cooldown_until_ns_ - clock_now), woken)) {
          end = IdleEnd::kDue;
          break;
        }
        if (woken()) {
          if (pending_wakes_ > 0) --pending_wakes_;
          end = IdleEnd::kWoken;
          break;
        }
        end = IdleEnd::kDue;
        break;
      }
      // Nothing ready, scheduled or running: the slot's next lease finds the queue idle.
      if (!due && options_.exit_when_idle) break;
      wait = jittered(options_.idle_poll, rng_);
      if (after_work) {
        // Just out of work: a job whose producer saw this worker's last job waiting did not
        // notify (schema version 7), and if it committed after this worker's last lease read the
        // queue, only a look finds it. Look once more after a poll interval (jittered).
        wait = jittered(options_.poll_interval, rng_);
        after_work = false;
      }
      if (due) wait = std::min<Duration>(wait, std::chrono::milliseconds(*due - now));
    }
    if (!listening_.load()) wait = jittered(wait, rng_);  // a fleet's polls spread out
    // wait: core: the idle poll, jittered (or the earliest due job)
    if (cv_.wait_for(lock, wait, woken)) {
      if (pending_wakes_ > 0) --pending_wakes_;
      end = IdleEnd::kWoken;
      break;
    }
    if (!listening_.load()) break;  // polling: lease now
  }
  idle_poller_ = false;
  --idle_slots_;
  lock.unlock();
  cv_.notify_all();  // another idle slot takes the role
  return end;
}

void Worker::start_wakeups() {
  if (!options_.wakeups || !pool_.dialect().listen_notify()) return;
  if (!options_.listen_url && pool_.url().transaction_pooler) {
    log("not listening for the queue's notifications: the database URL goes through a "
        "transaction pooler (keel_pooler=transaction), where LISTEN does not work; polling every " +
        format_duration(options_.poll_interval) +
        " (jittered) instead; give a direct URL for LISTEN (keel jobs work --listen-db) for "
        "wakeups");
    return;
  }
  listener_thread_ = std::thread([this] { listen_loop(); });
}

void Worker::stop_wakeups() {
  {
    std::lock_guard lock(mu_);
    if (listener_ != nullptr) listener_->interrupt();
  }
  if (listener_thread_.joinable()) listener_thread_.join();
  std::uint64_t id = 0;
  {
    std::lock_guard lock(mu_);
    id = std::exchange(local_subscription_, 0);
  }
  if (id != 0) detail::LocalWakeups::instance().unsubscribe(id);
}

void Worker::listen_loop() {
  int failures = 0;
  std::string payload;  // "SCHEMA.QUEUE": this worker's jobs
  // Core's reconnect loop, under the database-outage backoff's ceilings: a listener that
  // listened starts the backoff over, each failure in a row waits core's next full jitter.
  BackoffSequence reconnect(detail::database_backoff(options_.poll_interval), [&] {
    std::lock_guard lock(mu_);
    return rng_();
  }());
  const auto session = [&]() -> SessionEnd {
    std::unique_ptr<detail::Listener> listener;
    bool listened = false;
    try {
      listener = detail::open_listener(options_.listen_url.value_or(pool_.url()));
      {
        std::lock_guard lock(mu_);
        if (stopping_.load()) return SessionEnd::kStop;
        listener_ = listener.get();
      }
      // The listener's own connection (the pool's may all be held by the slots and heartbeats).
      listener_statements_.fetch_add(1);
      payload = listener->scalar(detail::kJobsSchemaQuery) + "." + options_.queue;
      listener_statements_.fetch_add(1);
      listener->listen(detail::kJobsChannel);
      listening_.store(true);
      listened = true;
      if (failures > 0) log("listening for the queue's notifications again");
      failures = 0;
      // A job committed before LISTEN took effect sent its notification to nobody.
      wake();
      while (!stopping_.load()) {
        Duration check{};
        bool cooling = false;
        {
          std::lock_guard lock(mu_);
          check = jittered(options_.node_check, rng_);
          const std::int64_t now = queue_.clock().now().time_since_epoch().count();
          if (missed_while_cooling_ && now >= cooldown_until_ns_) {
            // The cooldown is over and notifications came during it: one wakeup for them all.
            missed_while_cooling_ = false;
            cooling = true;
          } else if (missed_while_cooling_) {
            check = std::min(check, Duration(cooldown_until_ns_ - now));
          }
        }
        if (cooling) wake();
        const std::vector<detail::Notification> got = listener->wait(check);
        bool mine = false;
        for (const detail::Notification& n : got) {
          if (n.payload != payload) continue;  // another queue's job, or another schema's
          notifications_.fetch_add(1);
          mine = true;
        }
        if (mine) notified();  // several at once are one wakeup
        bool waiting_out_cooldown = false;
        {
          std::lock_guard lock(mu_);
          waiting_out_cooldown = missed_while_cooling_;
        }
        if (!got.empty() || stopping_.load() || waiting_out_cooldown) continue;
        // Quiet: is the node still the one that takes writes? A standby, or a primary turned
        // read-only, takes LISTEN but will never see a job committed; the new primary will.
        listener_statements_.fetch_add(1);
        if (!listener->takes_writes()) {
          throw DatabaseError(
              "the listener's node no longer takes writes (a standby, or a "
              "primary turned read-only)",
              {.backend = pool_.backend(), .sqlstate = "25006"});
        }
      }
    } catch (const std::exception& e) {
      if (failures++ == 0) {
        log(std::string("listening for the queue's notifications failed: ") + e.what() +
            " (polling every " + format_duration(options_.poll_interval) + " until it works)");
      }
    }
    {
      std::lock_guard lock(mu_);
      listener_ = nullptr;
    }
    if (listening_.exchange(false)) wake();  // idle slots go back to the short poll
    listener.reset();
    if (stopping_.load()) return SessionEnd::kStop;
    return listened ? SessionEnd::kLost : SessionEnd::kFailed;
  };
  keep_reconnecting(reconnect, session, [&](Duration delay) {
    std::unique_lock lock(mu_);
    // wait: core: keep_reconnecting's delay
    return !cv_.wait_for(lock, delay, [&] { return stopping_.load(); });
  });
}

}  // namespace keel::store
