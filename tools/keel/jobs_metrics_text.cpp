// `keel jobs work`'s /metrics as hand-written exposition text: the build without prometheus-cpp
// (jobs_metrics.cpp serialises the same metrics through prometheus-cpp when it is found).
#include <chrono>
#include <sstream>
#include <utility>

#include "jobs_metrics.hpp"

namespace keel::cli::jobs_cli {
namespace {

std::string escape_label(std::string_view v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

}  // namespace

std::string Metrics::render(const std::vector<store::QueueStats>& stats) const {
  std::ostringstream out;
  out << "# HELP keel_queue_jobs Jobs by queue and state.\n# TYPE keel_queue_jobs gauge\n";
  bool have_own = false;
  for (const auto& s : stats) have_own = have_own || s.queue == queue_;
  std::vector<store::QueueStats> all = stats;
  if (!have_own) {
    store::QueueStats empty;
    empty.queue = queue_;
    all.push_back(empty);
  }
  for (const auto& s : all) {
    const std::string q = escape_label(s.queue);
    const std::pair<const char*, std::int64_t> states[] = {{"ready", s.ready},
                                                           {"running", s.running},
                                                           {"retry_scheduled", s.retry_scheduled},
                                                           {"done", s.done},
                                                           {"dead", s.dead}};
    for (const auto& [state, n] : states) {
      out << "keel_queue_jobs{queue=\"" << q << "\",state=\"" << state << "\"} " << n << '\n';
    }
  }
  out << "# HELP keel_queue_dead_letter_depth Jobs in the dead-letter queue (0 when empty).\n"
         "# TYPE keel_queue_dead_letter_depth gauge\n";
  for (const auto& s : all) {
    out << "keel_queue_dead_letter_depth{queue=\"" << escape_label(s.queue) << "\"} " << s.dead
        << '\n';
  }
  out << "# HELP keel_queue_deferred_jobs Jobs waiting because a breaker or budget refused them "
         "(not because an attempt failed).\n# TYPE keel_queue_deferred_jobs gauge\n";
  for (const auto& s : all) {
    out << "keel_queue_deferred_jobs{queue=\"" << escape_label(s.queue) << "\"} " << s.deferred
        << '\n';
  }
  out << "# HELP keel_queue_oldest_ready_age_seconds Age of the oldest job waiting for a "
         "worker.\n# TYPE keel_queue_oldest_ready_age_seconds gauge\n";
  for (const auto& s : all) {
    out << "keel_queue_oldest_ready_age_seconds{queue=\"" << escape_label(s.queue) << "\"} "
        << std::chrono::duration<double>(s.oldest_ready_age).count() << '\n';
  }
  const std::string q = escape_label(queue_);
  if (dead_letter_retention_) {
    // Only the worker's own queue: the one whose dead jobs it prunes.
    std::int64_t expiring = 0;
    for (const auto& s : all) {
      if (s.queue == queue_) expiring = s.dead_expiring;
    }
    out << "# HELP keel_queue_dead_letter_expiring_jobs Dead jobs this worker prunes within the "
           "warning window (past the dead-letter retention by then); replay them first.\n"
           "# TYPE keel_queue_dead_letter_expiring_jobs gauge\n"
        << "keel_queue_dead_letter_expiring_jobs{queue=\"" << q << "\"} " << expiring << '\n';
  }
  std::lock_guard lock(mu_);
  out << "# HELP keel_queue_attempts_total Job attempts run by this worker, by outcome.\n"
         "# TYPE keel_queue_attempts_total counter\n";
  for (const auto& [outcome, n] : attempts_) {
    out << "keel_queue_attempts_total{queue=\"" << q << "\",outcome=\"" << outcome << "\"} " << n
        << '\n';
  }
  out << "# HELP keel_queue_dead_lettered_total Jobs this worker moved to the dead-letter "
         "queue, by reason.\n# TYPE keel_queue_dead_lettered_total counter\n";
  for (const auto& [reason, n] : dead_lettered_) {
    out << "keel_queue_dead_lettered_total{queue=\"" << q << "\",reason=\"" << reason << "\"} " << n
        << '\n';
  }
  out << "# HELP keel_queue_deferrals_total Jobs this worker deferred without sending (a brake "
         "refused).\n# TYPE keel_queue_deferrals_total counter\n"
      << "keel_queue_deferrals_total{queue=\"" << q << "\"} " << deferrals_ << '\n';
  out << "# HELP keel_queue_stale_completions_total Outcomes refused because the lease had "
         "been lost.\n# TYPE keel_queue_stale_completions_total counter\n"
      << "keel_queue_stale_completions_total{queue=\"" << q << "\"} " << stale_ << '\n';
  out << "# HELP keel_queue_dead_letters_pruned_total Dead jobs this worker deleted because they "
         "outlived the dead-letter retention.\n# TYPE keel_queue_dead_letters_pruned_total "
         "counter\n"
      << "keel_queue_dead_letters_pruned_total{queue=\"" << q << "\"} " << pruned_ << '\n';
  return out.str();
}

}  // namespace keel::cli::jobs_cli
