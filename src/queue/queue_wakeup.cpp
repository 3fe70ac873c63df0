// The process-wide registry of the job queue's in-process wakeups (detail/queue_wakeup.hpp).
#include "queue/detail/queue_wakeup.hpp"

#include <algorithm>

namespace keel::store::detail {

LocalWakeups& LocalWakeups::instance() {
  static LocalWakeups registry;
  return registry;
}

std::uint64_t LocalWakeups::subscribe(std::string database, std::string queue, Wake wake) {
  std::lock_guard lock(mu_);
  const std::uint64_t id = next_id_++;
  entries_.push_back({.id = id,
                      .database = std::move(database),
                      .queue = std::move(queue),
                      .wake = std::move(wake)});
  subscribers_.fetch_add(1);
  return id;
}

void LocalWakeups::unsubscribe(std::uint64_t id) noexcept {
  std::lock_guard lock(mu_);
  const auto it =
      std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.id == id; });
  if (it == entries_.end()) return;
  entries_.erase(it);
  subscribers_.fetch_sub(1);
}

void LocalWakeups::notify(std::string_view database, std::string_view queue) const {
  if (empty() || database.empty()) return;
  std::lock_guard lock(mu_);
  for (const Entry& e : entries_) {
    if (e.database == database && (queue.empty() || e.queue == queue)) e.wake();
  }
}

void wake_local_workers(const Connection& conn, const std::vector<EnqueueRequest>& requests) {
  LocalWakeups& registry = LocalWakeups::instance();
  if (registry.empty()) return;  // no worker in this process: not even the identity is needed
  const std::string database = conn.database_identity();
  std::vector<std::string_view> done;
  for (const EnqueueRequest& r : requests) {
    if (std::find(done.begin(), done.end(), r.queue) != done.end()) continue;
    done.push_back(r.queue);
    registry.notify(database, r.queue);
  }
}

void wake_local_workers(const Connection& conn, std::string_view queue) {
  LocalWakeups& registry = LocalWakeups::instance();
  if (registry.empty()) return;
  registry.notify(conn.database_identity(), queue);
}

}  // namespace keel::store::detail
