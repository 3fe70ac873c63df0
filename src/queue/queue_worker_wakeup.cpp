// The Worker's wakeups (docs/queue.md, "Wakeups"): an idle slot waits for a notification from
// the database (PostgreSQL LISTEN on a connection of the worker's own), a producer of this
// process, the earliest due job, or the poll; one idle slot at a time reads the database while
// the others wait for a wakeup.
#include <algorithm>
#include <exception>
#include <string>

#include "db/detail/listener.hpp"
#include "keel/backoff.hpp"
#include "keel/duration.hpp"
#include "keel/store/db/dialect.hpp"
#include "keel/store/queue/queue_worker.hpp"
#include "queue/detail/queue_wakeup.hpp"

namespace keel::store {

std::uint64_t Worker::wake_epoch() {
  std::lock_guard lock(mu_);
  return wake_epoch_;
}

void Worker::wake() {
  {
    std::lock_guard lock(mu_);
    ++wake_epoch_;
  }
  cv_.notify_all();
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
          .woken_leases = woken_leases_.load()};
}

Worker::IdleEnd Worker::idle_wait(Connection& conn, std::uint64_t seen) {
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
  const auto woken = [&] { return stopping_.load() || wake_epoch_ != seen; };
  ++idle_slots_;
  while (idle_poller_ && !woken()) cv_.wait(lock, [&] { return woken() || !idle_poller_; });
  if (woken()) {
    --idle_slots_;
    return IdleEnd::kWoken;
  }
  idle_poller_ = true;
  IdleEnd end = IdleEnd::kPoll;
  for (;;) {
    Duration wait = options_.poll_interval;
    if (listening_.load()) {
      // Wakeups arrive: the poll is a safety net. Look when the earliest job is due.
      lock.unlock();
      std::optional<std::int64_t> due;
      bool failed = false;
      try {
        due = queue_.next_due(conn, options_.queue);
      } catch (const std::exception&) {
        failed = true;  // the lease that follows reports it and backs off
      }
      due_checks_.fetch_add(1);
      lock.lock();
      if (woken()) {
        end = IdleEnd::kWoken;
        break;
      }
      const std::int64_t now = queue_.now_ms();
      if (failed || (due && *due <= now)) {
        end = IdleEnd::kDue;
        break;
      }
      // Nothing ready, scheduled or running: the slot's next lease finds the queue idle.
      if (!due && options_.exit_when_idle) break;
      wait = uniform_duration(options_.idle_poll / 2, options_.idle_poll / 2 * 3, rng_);
      if (due) wait = std::min<Duration>(wait, std::chrono::milliseconds(*due - now));
    }
    if (!listening_.load()) wait = jittered(wait, rng_);  // a fleet's polls spread out
    if (cv_.wait_for(lock, wait, woken)) {
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
  Duration delay{};
  std::string payload;  // "SCHEMA.QUEUE": this worker's jobs
  while (!stopping_.load()) {
    std::unique_ptr<detail::Listener> listener;
    try {
      listener = detail::open_listener(options_.listen_url.value_or(pool_.url()));
      {
        std::lock_guard lock(mu_);
        if (stopping_.load()) break;
        listener_ = listener.get();
      }
      // The listener's own connection (the pool's may all be held by the slots and heartbeats).
      listener_statements_.fetch_add(1);
      payload = listener->scalar(detail::kJobsSchemaQuery) + "." + options_.queue;
      listener_statements_.fetch_add(1);
      listener->listen(detail::kJobsChannel);
      listening_.store(true);
      if (failures > 0) log("listening for the queue's notifications again");
      failures = 0;
      // A job committed before LISTEN took effect sent its notification to nobody.
      wake();
      while (!stopping_.load()) {
        Duration check{};
        {
          std::lock_guard lock(mu_);
          check = jittered(options_.node_check, rng_);
        }
        const std::vector<detail::Notification> got = listener->wait(check);
        for (const detail::Notification& n : got) {
          if (n.payload != payload) continue;  // another queue's job, or another schema's
          notifications_.fetch_add(1);
          wake();
        }
        if (!got.empty() || stopping_.load()) continue;
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
    if (stopping_.load()) break;
    // Reconnect after core's full jitter (the database-outage backoff's ceilings).
    std::unique_lock lock(mu_);
    delay = db_backoff_.delay(std::max(0, failures - 1), delay, rng_);
    cv_.wait_for(lock, delay, [&] { return stopping_.load(); });
  }
}

}  // namespace keel::store
