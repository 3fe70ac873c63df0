// `keel jobs`: its flags (JobsArgs, filled by add_jobs in jobs.cpp) and its four commands,
// enqueue and stats in jobs.cpp, work in jobs_work.cpp and check-keys in jobs_keys.cpp. Each
// prints its own errors and returns the exit status.
#pragma once

#include <optional>
#include <string>

#include "flags.hpp"
#include "keel/core/duration.hpp"
#include "keel/db/database.hpp"
#include "keel/queue/queue.hpp"

namespace keel::cli::jobs_cli {

/// --timeout's default for --deliver and --deferred (one HTTP request); --exec has none.
inline constexpr const char* kDeliverTimeout = "30s";

struct JobsArgs {
  std::string db = std::string(store::kDefaultDatabaseUrl);
  // enqueue, work (required) and check-keys (optional)
  std::string queue;
  std::string payload;
  std::string payloads_from;
  std::string key;
  int max_attempts = 25;
  std::string delay = "0s";
  // work
  std::string deliver;
  std::string exec;
  bool deferred = false;  // each job is a request deferred by keel call --queue-on-failure
  int concurrency = 1;
  int batch = 1;
  std::string flush_window = "10ms";  // --batch: how long a success waits to be recorded
  std::string lease = "30s";
  std::string backoff_base = "1s";
  std::string backoff_cap = "1h";
  std::string grace = "10s";
  std::string poll;       // empty: 100ms, and the idle poll is --idle-poll's
  std::string idle_poll;  // empty: 5s, or --poll when that is given
  bool no_wakeups = false;
  std::string listen_db;           // a direct URL for LISTEN beside --db through a pooler
  std::string node_check = "10s";  // how often the listener checks its node takes writes
  // --share-fleet[=URL] (or --share-breakers[=URL]): breakers, rate limits and pauses shared
  // through PostgreSQL (empty URL: --db).
  bool share_breakers = false;
  std::string share_breakers_url;
  std::string rate_limit;             // RATE[/s] per dependency
  bool rate_limit_given = false;      // --rate-limit was given (an empty value is refused)
  bool adaptive_concurrency = false;  // each dependency's calls in flight under an adaptive limit
  // One attempt's limit. Empty (not given): kDeliverTimeout for --deliver and --deferred, none
  // for --exec, whose commands may legitimately run long.
  std::string timeout;
  std::string retain_done = "1h";  // or "forever"
  std::string max_age;
  std::string retry_budget = "0.1";
  std::string max_db_outage = "1m";
  bool exit_when_idle = false;
  std::string metrics_listen;
  // work and stats
  std::string dead_letter_retention;  // empty: dead jobs are kept
  std::string dead_letter_warning;    // empty: min(24h, retention / 2)
  // stats and check-keys
  bool json = false;
};

/// Prints "keel jobs: MESSAGE" and returns kExitUsage.
int usage(const std::string& message);

/// What the queue's duration flags take: whole milliseconds (the queue stores its times in
/// them), 0 only where it means something.
inline constexpr DurationRange kQueueDuration{.min = std::chrono::milliseconds(1),
                                              .why_min = kWholeMilliseconds};
inline constexpr DurationRange kQueueDurationOrZero{
    .zero = true, .min = std::chrono::milliseconds(1), .why_min = kWholeMilliseconds};

/// The shortest --lease: the worker renews a lease every third of it, each renewal a database
/// round trip, so a shorter one is lost while its job runs.
inline constexpr DurationRange kLeaseDuration{
    .min = std::chrono::milliseconds(100),
    .why_min =
        "a worker renews its leases every third of the lease, each renewal a database "
        "round trip; a shorter lease is lost while its job runs"};

/// Parses a duration flag within `range`; prints the error naming the flag and returns nullopt
/// otherwise.
std::optional<Duration> duration_flag(const char* flag, const std::string& text,
                                      const DurationRange& range);

/// The queue's dead-letter retention and warning window from --dead-letter-retention and
/// --dead-letter-warning (into `options`); prints the error naming the flag and returns false when
/// one is invalid, or when the warning is given without a retention.
bool dead_letter_flags(const JobsArgs& a, store::QueueOptions& options);

int run_enqueue(const JobsArgs& a);
int run_stats(const JobsArgs& a);
int run_work(const JobsArgs& a);

/// Exit status of check-keys when it lists jobs.
inline constexpr int kExitKeysFound = 3;
int run_check_keys(const JobsArgs& a);

}  // namespace keel::cli::jobs_cli
