// `keel jobs`'s flags: enqueue, work, stats and check-keys registered with CLI11 into a JobsArgs
// (jobs_cli.hpp), and the --help footer.
#include <memory>
#include <string>

#include "jobs_cli.hpp"
#include "keel/core/idempotency_key.hpp"
#include "queue_cli.hpp"

namespace keel::cli {

namespace {

constexpr const char* kJobsFooter =
    R"(The database is a URL: sqlite:PATH (default sqlite:keel.db) or postgresql://...
Durations are a number and a unit: 10ms, 1.5s, 2m, 1h.

work --deliver URL POSTs each job's payload with the job's idempotency key as Idempotency-Key:
2xx is done; 408, 425, 429, 5xx and network failures are transient (retried by the queue with
full-jitter backoff, or after the server's Retry-After); a 500 is retried once; other statuses
are permanent (dead at once). Each job attempt is exactly one HTTP request. When the host's
circuit breaker is open (or the retry budget is empty) nothing is sent: the job is deferred
until the next probe without spending an attempt, and the worker pauses leasing until then, so
jobs wait out an outage of any length (give --max-age to bound it).
work --deferred sends each job's own HTTP request, queued by keel call --queue-on-failure
(method, URL, header fields and body), with the job's idempotency key as Idempotency-Key: the
key of the original call, so the receiver applies it once; its outcomes count as --deliver's.
work --exec CMD runs CMD with /bin/sh -c in a process group of its own, the payload on stdin
and KEEL_IDEMPOTENCY_KEY, KEEL_ATTEMPT, KEEL_JOB_ID and KEEL_QUEUE in the environment. Exit 0 is
done; 75 (EX_TEMPFAIL) is transient (retried with backoff); any other exit status is permanent
(dead at once); death by a signal (the OOM killer, a crash, a kill) is transient; a run longer
than --timeout, when given, is killed and transient ("timed out after D"). No process of the
group outlives its job's attempt: whatever the shell leaves running is killed (SIGTERM, then
SIGKILL after 250 ms).
SIGTERM or SIGINT: stop leasing, let running jobs finish within --grace, release the rest; an
--exec command still running then has its process group killed the same way.
Dead jobs stay until replayed or discarded, unless work has --dead-letter-retention D: then it
deletes those dead for longer than D, after counting the ones due within --dead-letter-warning
W in keel_queue_dead_letter_expiring_jobs (stats with the same flags: EXPIRING). W must be
shorter than D; by default it is 24h, or D/2 when D is shorter than 48h.

check-keys lists the jobs whose idempotency key the key rule (1 to 255 bytes of visible ASCII
without '"', ',' or '%', bare or quoted as "KEY", read bare) refuses, or reads as another form
('"abc"' is 'abc', one request to a receiver when a job with 'abc' is on the same queue); it
changes nothing and exits 3 when it lists any.

Exit status: 0 success, 1 database or runtime failure, 2 invalid arguments, 3 check-keys found
jobs.)";

}  // namespace

namespace {

using Args = std::shared_ptr<jobs_cli::JobsArgs>;
using Command = std::shared_ptr<std::string>;

// --dead-letter-retention and --dead-letter-warning, for work and stats.
void add_dead_letter_options(CLI::App* sub, const Args& args, const char* retention_help) {
  sub->add_option("--dead-letter-retention", args->dead_letter_retention, retention_help);
  sub->add_option("--dead-letter-warning", args->dead_letter_warning,
                  "With --dead-letter-retention: count the dead jobs pruned within this; "
                  "shorter than the retention (default 24h, at most half the retention)");
}

void add_enqueue(CLI::App* jobs, const Args& args, const Command& cmd) {
  CLI::App* enqueue = jobs->add_subcommand("enqueue", "Add a job; prints its id");
  enqueue->add_option("--queue", args->queue, "Queue name")->required();
  enqueue->add_option("--payload", args->payload, "The job's payload (JSON)");
  enqueue->add_option("--payloads-from", args->payloads_from,
                      "Enqueue one job per line of FILE (- for stdin), each line a JSON payload, "
                      "in one transaction; prints one id per line");
  enqueue
      ->add_option("--key", args->key, "Idempotency key (default: a new UUID, stored with the job)")
      ->check([](const std::string& key) {
        const IdempotencyKeyCheck checked = check_idempotency_key(key);
        return checked.ok() ? std::string() : checked.error.message();  // CLI11: empty is valid
      });
  enqueue->add_option("--max-attempts", args->max_attempts, "Attempts before the job is dead")
      ->capture_default_str();
  enqueue->add_option("--delay", args->delay, "Not before now + this")->capture_default_str();
  enqueue->callback([cmd] { *cmd = "enqueue"; });
}

// work's handler and sizes.
CLI::App* add_work_handler(CLI::App* jobs, const Args& args) {
  CLI::App* work = jobs->add_subcommand("work", "Run jobs of a queue");
  work->add_option("--queue", args->queue, "Queue name")->required();
  work->add_option("--deliver", args->deliver,
                   "POST each payload to URL with the job's Idempotency-Key");
  work->add_option("--exec", args->exec, "Run CMD per job (payload on stdin)");
  work->add_flag("--deferred", args->deferred,
                 "Send each job's HTTP request, deferred by keel call --queue-on-failure, with "
                 "its Idempotency-Key");
  work->add_option("--concurrency", args->concurrency, "Jobs run at once")->capture_default_str();
  work->add_option("--batch", args->batch, "Jobs leased per database round trip")
      ->capture_default_str();
  work->add_option("--flush-window", args->flush_window,
                   "With --batch: a success waits this long at most to be recorded with others "
                   "(a crash re-runs at most this window's worth)")
      ->capture_default_str();
  work->add_option("--lease", args->lease, "Lease duration (extended by heartbeats)")
      ->capture_default_str();
  work->add_option("--backoff-base", args->backoff_base, "Full-jitter backoff base")
      ->capture_default_str();
  work->add_option("--backoff-cap", args->backoff_cap, "Full-jitter backoff cap")
      ->capture_default_str();
  work->add_option("--grace", args->grace, "On SIGTERM, time for running jobs to finish")
      ->capture_default_str();
  return work;
}

// work's waits: polls, wakeups, the listener.
void add_work_waits(CLI::App* work, const Args& args) {
  work->add_option("--poll", args->poll,
                   "Wait between polls of an empty queue when nothing else wakes the worker "
                   "(SQLite; PostgreSQL without its listener). Given, also PostgreSQL's idle "
                   "poll: the queue is looked at that often whatever wakes it (default: 100ms)");
  work->add_option("--idle-poll", args->idle_poll,
                   "PostgreSQL: while enqueues and replays wake the worker (LISTEN/NOTIFY), the "
                   "safety-net poll of an empty queue, jittered by +-50% and cut short when a "
                   "retry or delayed job is due (default: 5s, or --poll when given)");
  work->add_flag("--no-wakeups", args->no_wakeups,
                 "PostgreSQL: do not LISTEN for the queue's notifications; poll every --poll "
                 "instead");
  work->add_option("--listen-db", args->listen_db,
                   "PostgreSQL: a direct URL of the same database for LISTEN (the wake-ups, and "
                   "--share-fleet), when --db goes through a transaction pooler "
                   "(keel_pooler=transaction); without it such a worker polls");
  work->add_option("--node-check", args->node_check,
                   "PostgreSQL: how often (jittered) the listener checks that its node still "
                   "takes writes, and follows a failover when not")
      ->capture_default_str();
}

// work's limits, retention and metrics.
void add_work_limits(CLI::App* work, const Args& args) {
  work->add_option("--timeout", args->timeout,
                   "Limit of one attempt: one HTTP request of --deliver or --deferred (default "
                   "30s); one run of an --exec command, killed with its process group (default: "
                   "none)");
  work->add_option("--retain-done", args->retain_done,
                   "Delete done jobs older than this, or keep them: 'forever'; 0s deletes each "
                   "job with its success")
      ->capture_default_str();
  work->add_option("--retry-budget", args->retry_budget,
                   "--deliver: retries per first attempt allowed in 10 s (plus 10 a second), or "
                   "'off'; a retry the budget refuses is deferred, not spent")
      ->capture_default_str();
  work->add_option("--max-db-outage", args->max_db_outage,
                   "Exit 1 when leasing has failed without a break for this long (a full disk, "
                   "a read-only database)")
      ->capture_default_str();
  work->add_option("--max-age", args->max_age,
                   "Dead-letter a job older than this instead of retrying or deferring it "
                   "(default: only attempts count)");
}

// work's dead letters, exit, metrics and fleet flags, and its callback.
void add_work_fleet(CLI::App* work, const Args& args, const Command& cmd) {
  add_dead_letter_options(
      work, args,
      "Delete dead jobs of the queue that have been dead for longer than this, "
      "counting them in keel_queue_dead_letters_pruned_total (default: keep them "
      "until replayed or discarded)");
  work->add_flag("--exit-when-idle", args->exit_when_idle,
                 "Exit 0 once nothing is ready, running or scheduled for retry");
  work->add_option("--metrics-listen", args->metrics_listen,
                   "Serve Prometheus metrics on HOST:PORT (/metrics; port 0 picks one)");
  CLI::Option* share =
      work->add_option("--share-fleet,--share-breakers", args->share_breakers_url,
                       "--deliver, --deferred: share circuit breakers, rate limits and 429 "
                       "pauses with every process on this PostgreSQL database (default: --db), "
                       "so that the fleet opens together, sends one probe per break and keeps "
                       "one rate (docs/fleet.md; --share-breakers is the old name)")
          ->expected(0, 1);
  auto* rate =
      work->add_option(
              "--rate-limit", args->rate_limit,
              "--deliver, --deferred: at most RATE calls per second to each dependency "
              "(RATE/s, RATE/m, RATE/h), the whole fleet's with --share-fleet; a 429 or 503 "
              "with Retry-After pauses it, and a job held by either is deferred without "
              "losing an attempt (docs/rate-limits.md)")
          ->type_name("RATE[/s]");
  work->add_flag("--adaptive-concurrency", args->adaptive_concurrency,
                 "--deliver, --deferred: bound each dependency's calls in flight by an adaptive "
                 "limit found from their latency and its 429/503 answers; a job over it is "
                 "deferred without losing an attempt (docs/concurrency.md)");
  work->callback([cmd, args, share, rate] {
    *cmd = "work";
    args->share_breakers = share->count() > 0;
    args->rate_limit_given = rate->count() > 0;
  });
}

void add_stats_and_check_keys(CLI::App* jobs, const Args& args, const Command& cmd) {
  CLI::App* stats = jobs->add_subcommand("stats", "Counts per queue and state, dead-letter depth");
  stats->add_flag("--json", args->json, "JSON output");
  add_dead_letter_options(stats, args,
                          "The workers' dead-letter retention: also show how many dead jobs it "
                          "prunes within --dead-letter-warning (EXPIRING)");
  stats->callback([cmd] { *cmd = "stats"; });

  CLI::App* check_keys = jobs->add_subcommand(
      "check-keys", "List jobs whose key clients and receivers refuse or read as another key");
  check_keys->add_option("--queue", args->queue, "Only this queue (default: all)");
  check_keys->add_flag("--json", args->json, "JSON output");
  check_keys->callback([cmd] { *cmd = "check-keys"; });
}

}  // namespace

Runner add_jobs(CLI::App& app) {
  using namespace jobs_cli;
  auto args = std::make_shared<JobsArgs>();
  auto cmd = std::make_shared<std::string>();
  CLI::App* jobs =
      app.add_subcommand("jobs", "The durable job queue: enqueue, work, stats, check-keys");
  jobs->footer(kJobsFooter);
  jobs->fallthrough();
  jobs->require_subcommand(1);
  jobs->add_option("--db", args->db, "Database URL (sqlite:PATH or postgresql://...)")
      ->capture_default_str();

  add_enqueue(jobs, args, cmd);
  CLI::App* work = add_work_handler(jobs, args);
  add_work_waits(work, args);
  add_work_limits(work, args);
  add_work_fleet(work, args, cmd);
  add_stats_and_check_keys(jobs, args, cmd);

  return [args, cmd]() -> int {
    try {
      if (*cmd == "enqueue") return run_enqueue(*args);
      if (*cmd == "work") return run_work(*args);
      if (*cmd == "stats") return run_stats(*args);
      if (*cmd == "check-keys") return run_check_keys(*args);
    } catch (const store::DatabaseError& e) {
      return queue_cli::failure("jobs", std::string("database error: ") + e.what());
    }
    return kExitUsage;
  };
}

}  // namespace keel::cli
