// `keel jobs work`'s Prometheus metrics (through prometheus-cpp, keel::metrics) and breaker log
// lines (see jobs_metrics.hpp).
#include "jobs_metrics.hpp"

#include <chrono>
#include <cstdio>
#include <sstream>
#include <utility>

#include "keel/core/duration.hpp"
#include "keel/metrics/metrics.hpp"

namespace keel::cli::jobs_cli {
Metrics::Metrics(std::string queue, bool dead_letter_retention)
    : queue_(std::move(queue)), dead_letter_retention_(dead_letter_retention) {
  for (const char* o : {"success", "transient", "throttled", "ambiguous", "permanent"}) {
    attempts_[o] = 0;
  }
  for (const auto r : {store::DeadReason::kPermanent, store::DeadReason::kAttemptsExhausted,
                       store::DeadReason::kMaxAge, store::DeadReason::kCrashed}) {
    dead_lettered_[std::string(to_string(r))] = 0;
  }
}

void Metrics::record(const store::WorkerEvent& e) {
  std::lock_guard lock(mu_);
  if (e.report.outcome.attempted()) {
    ++attempts_[std::string(to_string(e.report.outcome.kind))];
  } else {
    ++deferrals_;  // nothing was sent: not an attempt
  }
  if (e.result.status == store::CompleteStatus::kStale) ++stale_;
}

void Metrics::dead_lettered(store::DeadReason reason) {
  std::lock_guard lock(mu_);
  ++dead_lettered_[std::string(to_string(reason))];
}

void Metrics::dead_letters_pruned(std::int64_t n) {
  std::lock_guard lock(mu_);
  pruned_ += n;
}

std::string Metrics::render(const std::vector<store::QueueStats>& stats, std::int64_t deadlocks,
                            std::int64_t returned_after_crash) const {
  bool have_own = false;
  for (const auto& s : stats) have_own = have_own || s.queue == queue_;
  std::vector<store::QueueStats> all = stats;
  if (!have_own) {
    store::QueueStats empty;
    empty.queue = queue_;
    all.push_back(empty);
  }
  metrics::Scrape scrape;
  for (const auto& s : all) {
    const std::pair<const char*, std::int64_t> states[] = {{"ready", s.ready},
                                                           {"running", s.running},
                                                           {"retry_scheduled", s.retry_scheduled},
                                                           {"done", s.done},
                                                           {"dead", s.dead}};
    for (const auto& [state, n] : states) {
      scrape.gauge("keel_queue_jobs", "Jobs by queue and state.",
                   {{"queue", s.queue}, {"state", state}}, static_cast<double>(n));
    }
  }
  for (const auto& s : all) {
    scrape.gauge("keel_queue_dead_letter_depth", "Jobs in the dead-letter queue (0 when empty).",
                 {{"queue", s.queue}}, static_cast<double>(s.dead));
  }
  for (const auto& s : all) {
    scrape.gauge("keel_queue_deferred_jobs",
                 "Jobs waiting because a brake refused them (a breaker, the budget, a rate limit "
                 "or a pause; not because an attempt failed).",
                 {{"queue", s.queue}}, static_cast<double>(s.deferred));
  }
  for (const auto& s : all) {
    scrape.gauge("keel_queue_oldest_ready_age_seconds",
                 "Age of the oldest job waiting for a worker.", {{"queue", s.queue}},
                 std::chrono::duration<double>(s.oldest_ready_age).count());
  }
  if (dead_letter_retention_) {
    // Only the worker's own queue: the one whose dead jobs it prunes.
    std::int64_t expiring = 0;
    for (const auto& s : all) {
      if (s.queue == queue_) expiring = s.dead_expiring;
    }
    scrape.gauge("keel_queue_dead_letter_expiring_jobs",
                 "Dead jobs this worker prunes within the warning window (past the dead-letter "
                 "retention by then); replay them first.",
                 {{"queue", queue_}}, static_cast<double>(expiring));
  }
  std::lock_guard lock(mu_);
  for (const auto& [outcome, n] : attempts_) {
    scrape.counter("keel_queue_attempts_total", "Job attempts run by this worker, by outcome.",
                   {{"queue", queue_}, {"outcome", outcome}}, static_cast<double>(n));
  }
  for (const auto& [reason, n] : dead_lettered_) {
    scrape.counter("keel_queue_dead_lettered_total",
                   "Jobs this worker moved to the dead-letter queue, by reason.",
                   {{"queue", queue_}, {"reason", reason}}, static_cast<double>(n));
  }
  scrape.counter(
      "keel_queue_deferrals_total",
      "Jobs this worker deferred without sending (a breaker, the budget, a rate limit or "
      "a pause refused).",
      {{"queue", queue_}}, static_cast<double>(deferrals_));
  scrape.counter("keel_queue_stale_completions_total",
                 "Outcomes refused because the lease had been lost.", {{"queue", queue_}},
                 static_cast<double>(stale_));
  scrape.counter("keel_queue_deadlocks_total",
                 "Deadlocks PostgreSQL broke in this worker's queue statements (each retried after "
                 "deadlock_timeout; nothing lost).",
                 {{"queue", queue_}}, static_cast<double>(deadlocks));
  scrape.counter("keel_queue_returned_after_crash_total",
                 "Jobs this worker's sweeps gave back uncharged from a batch whose worker died "
                 "before recording them: each runs again, alone; those that had finished (at most "
                 "a flush window's worth per crash) run twice.",
                 {{"queue", queue_}}, static_cast<double>(returned_after_crash));
  scrape.counter("keel_queue_dead_letters_pruned_total",
                 "Dead jobs this worker deleted because they outlived the dead-letter retention.",
                 {{"queue", queue_}}, static_cast<double>(pruned_));
  render_rates(scrape);
  std::string text = scrape.text();
  if (retry_metrics_ != nullptr) {
    retry_metrics_->observe(health_snapshot(*breakers_, {{"webhook", budget_}}));
    text += metrics::serialize({&registry_});
  }
  return text;
}

void Metrics::watch_rates(const RateLimitRegistry* rates, const store::SharedBreakers* fleet) {
  std::lock_guard lock(mu_);
  rates_ = rates;
  fleet_ = fleet;
}

// Requires: mu_ held.
void Metrics::render_rates(metrics::Scrape& scrape) const {
  if (rates_ == nullptr) return;
  struct Sums {
    double went = 0, waited = 0, refused = 0, own_pauses = 0, fleet_pauses = 0, cut = 0,
           on_share = 0, failures = 0, busy = 0, lost = 0, late = 0;
  };
  std::map<std::string, Sums> by;
  for (const auto& [key, limit] : rates_->all()) {
    const RateLimitStats st = limit->stats();
    Sums& s = by.size() < kMaxRateLabels || by.contains(key) ? by[key] : by["other"];
    s.went += static_cast<double>(st.went);
    s.waited += static_cast<double>(st.waited);
    s.refused += static_cast<double>(st.refused);
    s.own_pauses += static_cast<double>(st.pauses - st.pauses_from_fleet);
    s.fleet_pauses += static_cast<double>(st.pauses_from_fleet);
    s.cut += static_cast<double>(st.pauses_cut);
    s.on_share += static_cast<double>(st.on_share);
    s.failures += static_cast<double>(st.fleet_failures);
    s.busy += static_cast<double>(st.fleet_busy);
    s.lost += static_cast<double>(st.slots_lost);
    s.late += static_cast<double>(st.slots_late);
  }
  for (const auto& [key, s] : by) {
    const prometheus::Labels d = {{"dependency", key}};
    scrape.counter("keel_rate_limit_slots_total",
                   "Calls a dependency's rate limit let go, at once or after a wait.",
                   {{"dependency", key}, {"wait", "none"}}, s.went - s.waited);
    scrape.counter("keel_rate_limit_slots_total",
                   "Calls a dependency's rate limit let go, at once or after a wait.",
                   {{"dependency", key}, {"wait", "waited"}}, s.waited);
    scrape.counter("keel_rate_limit_refusals_total",
                   "Calls told to come back later (a pause, or a slot further than they wait).", d,
                   s.refused);
    scrape.counter("keel_rate_limit_pauses_total",
                   "Pauses of a dependency, by cause: its own Retry-After here, or the fleet's.",
                   {{"dependency", key}, {"cause", "retry_after"}}, s.own_pauses);
    scrape.counter("keel_rate_limit_pauses_total",
                   "Pauses of a dependency, by cause: its own Retry-After here, or the fleet's.",
                   {{"dependency", key}, {"cause", "fleet"}}, s.fleet_pauses);
    scrape.counter("keel_rate_limit_pauses_cut_total",
                   "Retry-After advice longer than the longest pause, cut to it.", d, s.cut);
    scrape.counter("keel_rate_limit_fallback_slots_total",
                   "Calls that went on this process's share of a shared rate (the fleet did not "
                   "answer a lease, or failed it).",
                   d, s.on_share);
    scrape.counter("keel_rate_limit_fleet_failures_total",
                   "Leases of the fleet's schedule that failed with the database reachable.", d,
                   s.failures);
    scrape.counter("keel_rate_limit_fleet_busy_total",
                   "Busy answers of the fleet's schedule (a lock or statement timeout) and calls "
                   "whose lease had no answer in time: told to come back, not on the share.",
                   d, s.busy);
    scrape.counter("keel_rate_limit_slots_lost_total",
                   "Leased slots of the fleet's schedule that passed unused here.", d, s.lost);
    scrape.counter("keel_rate_limit_slots_late_total",
                   "Slots given up because their call could not leave within the allowance after "
                   "them (a thread woken late); the call asked for another.",
                   d, s.late);
  }
  if (fleet_ != nullptr) {
    const store::SharedBreakersStats f = fleet_->stats();
    const std::pair<const char*, std::uint64_t> leases[] = {
        {"chunk", f.chunks_leased}, {"full", f.leases_full}, {"failed", f.lease_failures}};
    for (const auto& [result, n] : leases) {
      scrape.counter("keel_fleet_rate_leases_total",
                     "Leases of the fleet's rate schedules by this process, by result.",
                     {{"result", result}}, static_cast<double>(n));
    }
    scrape.gauge("keel_fleet_rates_disagreeing",
                 "Dependencies another process of the fleet limits at a lower rate (kept).",
                 prometheus::Labels{}, static_cast<double>(f.rates_disagreeing));
  }
}

EventStream& Metrics::watch(BreakerRegistry& breakers, const RetryBudget* budget) {
  retry_metrics_ = std::make_shared<metrics::RetryMetrics>(registry_);
  (void)events_.subscribe(retry_metrics_, kOutcomeEvents);
  publish_breaker_transitions(breakers, events_);
  breakers_ = &breakers;
  budget_ = budget;
  return events_;
}

void BreakerLog::on_change(std::string_view key, BreakerState from, BreakerState to) {
  const bool opened = to == BreakerState::kOpen && from == BreakerState::kClosed;
  if (!opened && to != BreakerState::kClosed) return;
  const TimePoint now = steady_clock().now();
  const auto breaker = registry_.find(key);
  const BreakerSnapshot snap = breaker ? breaker->snapshot() : BreakerSnapshot{};
  std::lock_guard lock(mu_);
  if (opened) {
    outages_[std::string(key)] = Outage{now, snap.probes};
    std::fprintf(stderr,
                 "keel jobs: circuit open for %.*s: %lld of %lld calls failed (%.0f%%); jobs "
                 "wait for it without spending attempts\n",
                 static_cast<int>(key.size()), key.data(), static_cast<long long>(snap.failures),
                 static_cast<long long>(snap.calls), 100.0 * snap.failure_rate());
  } else {
    // The probes this process sent during the outage: half-open moments that the fleet's trial
    // gate held open (another process probed) sent none and are not counted.
    const auto it = outages_.find(std::string(key));
    const Outage o = it != outages_.end() ? it->second : Outage{now, snap.probes};
    std::fprintf(stderr, "keel jobs: circuit closed for %.*s after %s open (%lld probes)\n",
                 static_cast<int>(key.size()), key.data(), format_duration(now - o.opened).c_str(),
                 static_cast<long long>(snap.probes - o.probes_before));
    if (it != outages_.end()) outages_.erase(it);
  }
}

}  // namespace keel::cli::jobs_cli
