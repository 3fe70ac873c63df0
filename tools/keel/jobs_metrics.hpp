// What `keel jobs work` reports about itself: the Prometheus metrics served on --metrics-listen
// (the queue's counts per state from the database, plus this worker's attempts, dead letters,
// deferrals, stale completions, deadlocks PostgreSQL broke and, under a dead-letter retention, the
// dead jobs about to be pruned and those pruned) and one stderr line per breaker opening and
// closing. Thread-safety: both classes are safe for concurrent use (a mutex around their counters).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/breaker.hpp"
#include "keel/core/budget.hpp"
#include "keel/core/events.hpp"
#include "keel/core/rate_limit.hpp"
#include "keel/fleet/shared_breakers.hpp"
#include "keel/metrics/metrics.hpp"
#include "keel/queue/queue.hpp"
#include "keel/queue/queue_worker.hpp"

namespace keel::cli::jobs_cli {

class Metrics {
 public:
  /// `dead_letter_retention`: whether the worker prunes the queue's dead jobs (then the
  /// expiring gauge is exported for its queue).
  explicit Metrics(std::string queue, bool dead_letter_retention = false);

  void record(const store::WorkerEvent& e);

  /// Every move to the dead-letter queue, including a lease that expired on its last attempt,
  /// counted by the reason's kind (the label reason="permanent", "attempts_exhausted" or
  /// "max_age").
  void dead_lettered(store::DeadReason reason);

  /// Dead jobs deleted by the worker because they outlived the dead-letter retention.
  void dead_letters_pruned(std::int64_t n);

  /// The Prometheus text exposition of `stats` (the worker's queue included even when empty)
  /// and of this worker's counters; `deadlocks` is the worker's JobQueue::deadlocks(),
  /// `returned_after_crash` its JobQueue::returned_after_crash().
  [[nodiscard]] std::string render(const std::vector<store::QueueStats>& stats,
                                   std::int64_t deadlocks = 0,
                                   std::int64_t returned_after_crash = 0) const;

  /// Adds the webhook client's retries, give-ups and breakers to the metrics
  /// (keel::metrics::RetryMetrics), with the breakers' and the budget's state read at each
  /// scrape. Returns the stream to set as the client's RetryOptions::events. Requires: called
  /// once; `breakers` and `budget` (may be null) outlive the scrapes and this object outlives
  /// `breakers`.
  [[nodiscard]] EventStream& watch(BreakerRegistry& breakers, const RetryBudget* budget);

  /// Adds the dependencies' rate limits and pauses (and, with `fleet`, its chunk leases and
  /// their failures) to the metrics, read at each scrape. At most kMaxRateLabels dependencies
  /// are named; the rest are summed under dependency="other". Requires: both (fleet may be
  /// null) outlive the scrapes.
  void watch_rates(const RateLimitRegistry* rates, const store::SharedBreakers* fleet);
  static constexpr std::size_t kMaxRateLabels = 50;

 private:
  std::string queue_;
  bool dead_letter_retention_ = false;
  mutable std::mutex mu_;
  std::map<std::string, std::int64_t> attempts_;       // guarded by mu_
  std::map<std::string, std::int64_t> dead_lettered_;  // guarded by mu_
  std::int64_t stale_ = 0;                             // guarded by mu_
  std::int64_t deferrals_ = 0;                         // guarded by mu_
  std::int64_t pruned_ = 0;                            // guarded by mu_
  EventStream events_;
  prometheus::Registry registry_;
  std::shared_ptr<metrics::RetryMetrics> retry_metrics_;
  const BreakerRegistry* breakers_ = nullptr;
  const RetryBudget* budget_ = nullptr;
  const RateLimitRegistry* rates_ = nullptr;
  const store::SharedBreakers* fleet_ = nullptr;
  void render_rates(metrics::Scrape& scrape) const;
};

/// Logs one line when a dependency's breaker opens and one when it closes again, with the
/// failure rate that tripped it, how long it stayed open and how many probes it took.
class BreakerLog {
 public:
  explicit BreakerLog(BreakerRegistry& registry) : registry_(registry) {}

  void on_change(std::string_view key, BreakerState from, BreakerState to);

 private:
  struct Outage {
    TimePoint opened{};
    std::int64_t probes_before = 0;  // the breaker's probe count when it opened
  };
  BreakerRegistry& registry_;
  std::mutex mu_;
  std::map<std::string, Outage> outages_;  // guarded by mu_
};

}  // namespace keel::cli::jobs_cli
