// How the job queue's idle workers are woken (docs/queue.md, "Wakeups"): the PostgreSQL channel
// that the queue's trigger notifies on every new or newly ready job, and the process-wide
// registry through which a producer wakes the workers of its own process at once, on SQLite as
// on PostgreSQL. Private to keel::store_queue.
//
// Thread-safety: LocalWakeups is safe for concurrent use. A subscriber's wake function is called
// with the registry's mutex held, so once unsubscribe() has returned it is not running and will
// not be called again; it must not call into the registry.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/backoff.hpp"
#include "keel/core/clock.hpp"
#include "keel/db/database.hpp"
#include "keel/queue/queue.hpp"

namespace keel::store::detail {

// The Worker's wait between failed leases while the database is out, and between its
// listener's reconnects: full jitter under ceilings that start at the poll interval and double
// up to 5 s (the poll interval when that is longer).
[[nodiscard]] inline BackoffOptions database_backoff(Duration poll) {
  const Duration base = poll > Duration::zero() ? poll : std::chrono::milliseconds(100);
  return {.base = base, .cap = std::max<Duration>(base, std::chrono::seconds(5))};
}

/// The channel of the queue's notifications. A channel is per database: the payload is
/// "SCHEMA.QUEUE", the schema of the keel_jobs table the job is in and its queue.
inline constexpr std::string_view kJobsChannel = "keel_jobs";

/// The schema of the keel_jobs table a connection reads (PostgreSQL), for the payload of the
/// notifications meant for it: one text cell.
inline constexpr std::string_view kJobsSchemaQuery =
    "SELECT nspname FROM pg_namespace WHERE oid ="
    " (SELECT relnamespace FROM pg_class WHERE oid = 'keel_jobs'::regclass)";

class LocalWakeups {
 public:
  using Wake = std::function<void()>;

  /// The registry of this process.
  static LocalWakeups& instance();

  /// Calls `wake` on every notify() of (database, queue) until unsubscribe(id). Returns the id.
  std::uint64_t subscribe(std::string database, std::string queue, Wake wake);
  void unsubscribe(std::uint64_t id) noexcept;

  /// Wakes the subscribers of `queue` on `database` (every queue of it when `queue` is empty).
  /// An empty `database` matches nothing. One atomic load when nobody subscribed.
  void notify(std::string_view database, std::string_view queue) const;

  [[nodiscard]] bool empty() const noexcept { return subscribers_.load() == 0; }

 private:
  struct Entry {
    std::uint64_t id;
    std::string database;
    std::string queue;
    Wake wake;
  };
  mutable std::mutex mu_;
  std::vector<Entry> entries_;  // guarded by mu_
  std::uint64_t next_id_ = 1;   // guarded by mu_
  std::atomic<int> subscribers_{0};
};

/// After jobs were written through `conn` (committed, or in the caller's open transaction, when
/// a wakeup only makes a worker look early): wakes this process's workers of each request's
/// queue on that database.
void wake_local_workers(const Connection& conn, const std::vector<EnqueueRequest>& requests);

/// After a replay through `conn`: wakes this process's workers of `queue` on that database, or
/// of every queue when it is empty.
void wake_local_workers(const Connection& conn, std::string_view queue);

}  // namespace keel::store::detail
