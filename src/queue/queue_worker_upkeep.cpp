// The Worker's upkeep on its heartbeat thread: each running job's lease renewed within its
// interval, and the prune of done jobs (WorkerOptions::done_retention) and dead letters past their
// retention. See queue_worker.cpp for the slots.
#include <map>
#include <optional>
#include <string>

#include "keel/core/backoff.hpp"
#include "keel/core/duration.hpp"
#include "keel/queue/queue_worker.hpp"

namespace keel::store {
namespace {

// How often a worker's heartbeat thread runs its housekeeping (pruning), on average.
constexpr Duration kPruneInterval = std::chrono::seconds(10);

}  // namespace

std::int64_t Worker::prune_batches(const std::function<std::int64_t(int)>& batch, TimePoint until,
                                   bool& more) {
  constexpr int kBatch = 1000;
  std::int64_t pruned = 0;
  while (!stopping_.load()) {
    const std::int64_t n = batch(kBatch);
    pruned += n;
    if (n < kBatch) return pruned;
    if (queue_.clock().now() >= until) break;
  }
  more = true;
  return pruned;
}

bool Worker::prune(Connection& conn) {
  // Batches of 1000 until the backlog is gone, for at most a quarter of the heartbeat interval a
  // pass: the running jobs' heartbeats wait for it. A queue that finishes 2,000 jobs a second
  // finishes 20,000 between two passes; one batch a pass (before) deleted 100 a second, and the
  // table grew without bound under any retention.
  const TimePoint until = queue_.clock().now() + options_.heartbeat_interval / 4;
  bool more = false;
  if (options_.done_retention) {
    (void)prune_batches(
        [&](int n) { return queue_.prune_done(conn, options_.queue, *options_.done_retention, n); },
        until, more);
  }
  const Duration retention = queue_.options().dead_letter_retention;
  if (retention >= kInfinite) return more;
  const std::int64_t pruned =
      prune_batches([&](int n) { return queue_.prune_dead(conn, options_.queue, n); }, until, more);
  if (pruned == 0) return more;
  log("pruned " + std::to_string(pruned) + " dead job(s) of queue '" + options_.queue +
      "' past the dead-letter retention (" + format_duration(retention) + ")");
  if (options_.on_dead_letters_pruned) options_.on_dead_letters_pruned(pruned);
  return more;
}

void Worker::heartbeat_loop() {
  std::optional<ConnectionPool::Lease> conn;
  TimePoint next_prune{};
  while (!finished_.load()) {
    {
      // Within the interval, never later (a lease must be renewed before it expires), spread
      // over its second half so that a fleet's heartbeats do not come in step.
      std::unique_lock lock(mu_);
      const Duration wait =
          uniform_duration(options_.heartbeat_interval / 2, options_.heartbeat_interval, rng_);
      // wait: core: the heartbeat, uniform within its interval
      cv_.wait_for(lock, wait, [&] { return finished_.load(); });
    }
    if (finished_.load()) break;
    std::map<std::int64_t, std::int64_t> leases;
    {
      std::lock_guard lock(mu_);
      leases = active_;
    }
    try {
      if (!conn || !(*conn)->usable()) {
        conn.reset();
        conn.emplace(pool_.acquire());
      }
      for (const auto& [id, fence] : leases) {
        if (queue_.heartbeat(**conn, id, fence)) continue;
        // Not running under this lease: either its own slot recorded it meanwhile (no longer
        // active, or active under a new lease), or another worker or the sweep took it.
        bool still_held = false;
        {
          std::lock_guard lock(mu_);
          const auto it = active_.find(id);
          still_held = it != active_.end() && it->second == fence;
        }
        if (still_held) log("job " + std::to_string(id) + ": lease lost (taken over or released)");
      }
      const TimePoint now = queue_.clock().now();
      if (!stopping_.load() && now >= next_prune) {
        // At most about every kPruneInterval, jittered (±50%) across a fleet; at the next
        // heartbeat while a pass leaves a backlog.
        {
          std::lock_guard lock(mu_);
          next_prune = now + jittered(kPruneInterval, rng_);
        }
        if (prune(**conn)) next_prune = now;
      }
    } catch (const std::exception& e) {
      log(std::string("heartbeat failed: ") + e.what());
      if (conn && (*conn)->broken()) conn.reset();
    }
  }
}

}  // namespace keel::store
