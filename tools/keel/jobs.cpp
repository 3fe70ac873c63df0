// `keel jobs --db URL enqueue|work|stats|check-keys`: the durable job queue from the shell
// (keel::store::JobQueue and keel::store::Worker). A worker delivers each job as a webhook
// (--deliver URL: keel::store::WebhookHandler, a single HTTP attempt per job attempt: the queue
// is the retrying layer) or runs a command (--exec CMD: keel::store::CommandHandler), and can
// export Prometheus metrics. This file holds enqueue and stats; the flags are in
// jobs_flags.cpp, work in jobs_work.cpp, check-keys in jobs_keys.cpp.
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "jobs_cli.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/idempotency_key.hpp"
#include "queue_cli.hpp"

namespace keel::cli {
namespace jobs_cli {

using queue_cli::failure;

int usage(const std::string& message) { return queue_cli::usage_error("jobs", message); }

std::optional<Duration> duration_flag(const char* flag, const std::string& text,
                                      const DurationRange& range) {
  auto d = parse_duration_flag(flag, text, range);
  if (!d) {
    usage(d.error().message());
    return std::nullopt;
  }
  return *d;
}

bool dead_letter_flags(const JobsArgs& a, store::QueueOptions& options) {
  if (a.dead_letter_retention.empty()) {
    if (!a.dead_letter_warning.empty()) {
      usage(
          "--dead-letter-warning: needs --dead-letter-retention (dead jobs are kept forever "
          "without one)");
      return false;
    }
    return true;
  }
  const auto retention =
      duration_flag("--dead-letter-retention", a.dead_letter_retention, kQueueDuration);
  if (!retention) return false;
  options.dead_letter_retention = *retention;
  if (!a.dead_letter_warning.empty()) {
    const auto warning =
        duration_flag("--dead-letter-warning", a.dead_letter_warning, kQueueDurationOrZero);
    if (!warning) return false;
    if (*warning >= *retention) {
      usage(Error{.field = "--dead-letter-warning",
                  .problem = "must be shorter than --dead-letter-retention (" +
                             a.dead_letter_retention +
                             "): dead jobs would be pruned before it could warn",
                  .got = quote_value(a.dead_letter_warning)}
                .message());
      return false;
    }
    options.dead_letter_warning = *warning;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// enqueue

int run_enqueue(const JobsArgs& a) {
  const auto url = queue_cli::parse_db_flag("jobs", a.db);
  if (!url) return kExitUsage;
  if (auto queue = store::check_queue_name(a.queue); !queue) {
    return usage(queue.error().in("--queue").message());
  }
  if (a.payload.empty() == a.payloads_from.empty()) {
    return usage("enqueue needs exactly one of --payload JSON and --payloads-from FILE");
  }
  if (!a.payloads_from.empty() && !a.key.empty()) {
    return usage("--key: cannot be used with --payloads-from (each job gets its own UUID key)");
  }
  // Every payload is read and checked before anything is written.
  std::vector<std::string> payloads;
  if (!a.payloads_from.empty()) {
    std::ifstream file;
    if (a.payloads_from != "-") {
      file.open(a.payloads_from);
      if (!file) return usage("--payloads-from: cannot read '" + a.payloads_from + "'");
    }
    std::istream& in = a.payloads_from == "-" ? std::cin : file;
    std::string line;
    for (int number = 1; std::getline(in, line); ++number) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      if (nlohmann::json::parse(line, nullptr, false).is_discarded()) {
        return usage("--payloads-from: line " + std::to_string(number) +
                     " is not valid JSON: " + line.substr(0, 80));
      }
      payloads.push_back(std::move(line));
    }
    if (payloads.empty()) return usage("--payloads-from: no payloads in '" + a.payloads_from + "'");
  } else {
    if (nlohmann::json::parse(a.payload, nullptr, false).is_discarded()) {
      return usage("--payload: not valid JSON: " + a.payload.substr(0, 80));
    }
    payloads.push_back(a.payload);
  }
  if (a.max_attempts < 1) {
    return usage("--max-attempts: must be at least 1, got " + std::to_string(a.max_attempts));
  }
  const auto delay = duration_flag("--delay", a.delay, kQueueDurationOrZero);
  if (!delay) return kExitUsage;
  auto conn = queue_cli::open_queue_db(*url, /*create=*/true, nullptr);
  store::JobQueue queue({.max_attempts = a.max_attempts});
  std::vector<store::EnqueueRequest> requests;
  requests.reserve(payloads.size());
  for (const std::string& payload : payloads) {
    requests.push_back({.queue = a.queue, .payload = payload, .key = a.key, .delay = *delay});
  }
  // One transaction: all the jobs are added, or none.
  const std::vector<store::EnqueueResult> results = queue.enqueue_many(*conn, requests);
  for (const store::EnqueueResult& r : results) {
    if (!r.ok()) return usage(r.error);
  }
  for (const store::EnqueueResult& r : results) {
    std::printf("%lld\n", static_cast<long long>(r.id));
    if (!r.created) {
      std::fprintf(stderr,
                   "keel jobs: a job with key '%s' already exists on queue '%s' (job %lld); "
                   "nothing was added\n",
                   r.idempotency_key.c_str(), a.queue.c_str(), static_cast<long long>(r.id));
    }
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// stats

int run_stats(const JobsArgs& a) {
  const auto url = queue_cli::parse_db_flag("jobs", a.db);
  if (!url) return kExitUsage;
  store::QueueOptions options;
  if (!dead_letter_flags(a, options)) return kExitUsage;
  const bool retention = !a.dead_letter_retention.empty();
  if (!store::database_exists(*url)) {
    return usage("--db: database '" + url->redacted + "' does not exist");
  }
  bool has_schema = false;
  auto conn = queue_cli::open_queue_db_read_only(*url, &has_schema);
  store::JobQueue queue(options);
  std::vector<store::QueueStats> stats;
  if (has_schema) stats = queue.stats(*conn);
  std::int64_t depth = 0;
  std::int64_t expiring = 0;
  for (const auto& s : stats) {
    depth += s.dead;
    expiring += s.dead_expiring;
  }
  if (a.json) {
    nlohmann::json out;
    out["queues"] = nlohmann::json::array();
    for (const auto& s : stats) {
      nlohmann::json q = {
          {"queue", s.queue},
          {"ready", s.ready},
          {"running", s.running},
          {"retry_scheduled", s.retry_scheduled},
          {"done", s.done},
          {"dead", s.dead},
          {"deferred", s.deferred},
          {"oldest_ready_age_seconds", std::chrono::duration<double>(s.oldest_ready_age).count()}};
      if (retention) q["dead_expiring"] = s.dead_expiring;
      out["queues"].push_back(std::move(q));
    }
    out["dead_letter_depth"] = depth;
    if (retention) out["dead_letter_expiring"] = expiring;
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  std::printf("%-24s %8s %8s %16s %10s %8s %9s %18s%s\n", "QUEUE", "READY", "RUNNING",
              "RETRY_SCHEDULED", "DONE", "DEAD", "DEFERRED", "OLDEST_READY_AGE",
              retention ? "  EXPIRING" : "");
  for (const auto& s : stats) {
    std::printf("%-24s %8lld %8lld %16lld %10lld %8lld %9lld %18s", s.queue.c_str(),
                static_cast<long long>(s.ready), static_cast<long long>(s.running),
                static_cast<long long>(s.retry_scheduled), static_cast<long long>(s.done),
                static_cast<long long>(s.dead), static_cast<long long>(s.deferred),
                format_duration(s.oldest_ready_age).c_str());
    if (retention) std::printf(" %9lld", static_cast<long long>(s.dead_expiring));
    std::printf("\n");
  }
  std::int64_t deferred = 0;
  for (const auto& s : stats) deferred += s.deferred;
  if (deferred > 0) {
    std::printf(
        "deferred: %lld jobs wait for an open circuit or an empty retry budget (not "
        "counted as attempts)\n",
        static_cast<long long>(deferred));
  }
  std::printf("dead-letter depth: %lld\n", static_cast<long long>(depth));
  if (retention) {
    std::printf(
        "expiring: %lld dead jobs are pruned within %s (retention %s); replay them first with "
        "keel dlq replay\n",
        static_cast<long long>(expiring),
        format_duration(*queue.options().dead_letter_warning).c_str(),
        format_duration(options.dead_letter_retention).c_str());
  }
  return 0;
}

}  // namespace jobs_cli

}  // namespace keel::cli
