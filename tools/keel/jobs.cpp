// `keel jobs --db URL enqueue|work|stats`: the durable job queue from the shell
// (keel::store::JobQueue and keel::store::Worker). A worker delivers each job as a webhook
// (--deliver URL, through keel::http::Client with a single HTTP attempt per job attempt: the
// queue is the retrying layer) or runs a command (--exec CMD), and can export Prometheus metrics.
#include <fcntl.h>
#include <httplib.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "keel/duration.hpp"
#include "keel/http/client.hpp"
#include "keel/store/idempotency_middleware.hpp"
#include "keel/store/queue_worker.hpp"
#include "queue_cli.hpp"

extern char** environ;

namespace keel::cli {
namespace {

using queue_cli::failure;
using queue_cli::kExitFailure;

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
work --exec CMD runs CMD with /bin/sh -c, the payload on stdin and KEEL_IDEMPOTENCY_KEY,
KEEL_ATTEMPT, KEEL_JOB_ID and KEEL_QUEUE in the environment: exit 0 is done, 75 (EX_TEMPFAIL)
transient, anything else permanent.
SIGTERM or SIGINT: stop leasing, let running jobs finish within --grace, release the rest.

Exit status: 0 success, 1 database or runtime failure, 2 invalid arguments.)";

int usage(const std::string& message) { return queue_cli::usage_error("jobs", message); }

std::optional<Duration> duration_flag(const char* flag, const std::string& text, bool positive) {
  auto d = parse_duration_flag(flag, text, positive);
  if (!d) {
    usage(d.error().message());
    return std::nullopt;
  }
  return *d;
}

struct JobsArgs {
  std::string db = std::string(store::kDefaultDatabaseUrl);
  // enqueue
  std::string queue;
  std::string payload;
  std::string payloads_from;
  std::string key;
  int max_attempts = 25;
  std::string delay = "0s";
  // work
  std::string deliver;
  std::string exec;
  int concurrency = 1;
  int batch = 1;
  std::string lease = "30s";
  std::string backoff_base = "1s";
  std::string backoff_cap = "1h";
  std::string grace = "10s";
  std::string poll = "100ms";
  std::string timeout = "30s";
  std::string retain_done;
  std::string max_age;
  std::string retry_budget = "0.1";
  std::string max_db_outage = "1m";
  bool exit_when_idle = false;
  std::string metrics_listen;
  // stats
  bool json = false;
};

// ---------------------------------------------------------------------------------------------
// enqueue

int run_enqueue(const JobsArgs& a) {
  const auto url = queue_cli::parse_db_flag("jobs", a.db);
  if (!url) return kExitUsage;
  if (std::string why = store::check_queue_name(a.queue); !why.empty()) {
    return usage("--queue: " + why);
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
  const auto delay = duration_flag("--delay", a.delay, false);
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
  if (!queue_cli::database_exists(*url)) {
    return usage("--db: database '" + url->redacted + "' does not exist");
  }
  bool has_schema = false;
  auto conn = queue_cli::open_queue_db_read_only(*url, &has_schema);
  store::JobQueue queue;
  std::vector<store::QueueStats> stats;
  if (has_schema) stats = queue.stats(*conn);
  std::int64_t depth = 0;
  for (const auto& s : stats) depth += s.dead;
  if (a.json) {
    nlohmann::json out;
    out["queues"] = nlohmann::json::array();
    for (const auto& s : stats) {
      out["queues"].push_back({{"queue", s.queue},
                               {"ready", s.ready},
                               {"running", s.running},
                               {"retry_scheduled", s.retry_scheduled},
                               {"done", s.done},
                               {"dead", s.dead},
                               {"deferred", s.deferred},
                               {"oldest_ready_age_seconds",
                                std::chrono::duration<double>(s.oldest_ready_age).count()}});
    }
    out["dead_letter_depth"] = depth;
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  std::printf("%-24s %8s %8s %16s %10s %8s %9s %18s\n", "QUEUE", "READY", "RUNNING",
              "RETRY_SCHEDULED", "DONE", "DEAD", "DEFERRED", "OLDEST_READY_AGE");
  for (const auto& s : stats) {
    std::printf("%-24s %8lld %8lld %16lld %10lld %8lld %9lld %18s\n", s.queue.c_str(),
                static_cast<long long>(s.ready), static_cast<long long>(s.running),
                static_cast<long long>(s.retry_scheduled), static_cast<long long>(s.done),
                static_cast<long long>(s.dead), static_cast<long long>(s.deferred),
                format_duration(s.oldest_ready_age).c_str());
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
  return 0;
}

// ---------------------------------------------------------------------------------------------
// work: handlers

store::AttemptReport deliver(http::Client& client, const std::string& url,
                             const std::string& dependency, const store::LeasedJob& job) {
  http::Request request;
  request.method = "POST";
  request.url = url;
  request.body = job.payload;
  request.idempotency_key = job.idempotency_key;
  // The queue's earlier attempts: this one is a retry for the budget, and Keel-Attempt says so.
  request.prior_attempts = job.attempt - 1;
  request.headers = {{"Content-Type", "application/json"},
                     {"Keel-Job-Attempt", std::to_string(job.attempt)}};
  const http::Result r = client.send(request);
  store::AttemptReport report;
  report.outcome = r.outcome;
  if (r.ok()) return report;
  if (!r.outcome.attempted()) {
    // Nothing was sent: the queue defers the job without charging an attempt.
    if (r.reason == StopReason::kCircuitOpen) {
      report.error = "circuit open for " + dependency;
      if (r.outcome.has_server_delay()) {
        report.error += ", next probe in " + format_duration(r.outcome.server_delay);
      }
    } else {
      report.error = std::string(to_string(r.reason)) + " for " + dependency;
    }
    return report;
  }
  std::string error = describe(r.outcome);
  if (!r.error.empty()) error += ": " + r.error;
  if (r.response && !r.response->body.empty()) {
    error += ": " + r.response->body.substr(0, 200);
  }
  report.error = error;
  return report;
}

store::AttemptReport exec_command(const std::string& command, const store::LeasedJob& job,
                                  const std::atomic<bool>& cancel) {
  store::AttemptReport report;
  int in_pipe[2];
  int err_pipe[2];
  if (pipe2(in_pipe, O_CLOEXEC) != 0) {
    report.outcome = Outcome::transient();
    report.error = std::string("pipe: ") + std::strerror(errno);
    return report;
  }
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    ::close(in_pipe[0]);
    ::close(in_pipe[1]);
    report.outcome = Outcome::transient();
    report.error = std::string("pipe: ") + std::strerror(errno);
    return report;
  }
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view v(*e);
    if (v.starts_with("KEEL_IDEMPOTENCY_KEY=") || v.starts_with("KEEL_ATTEMPT=") ||
        v.starts_with("KEEL_JOB_ID=") || v.starts_with("KEEL_QUEUE=")) {
      continue;
    }
    env_strings.emplace_back(v);
  }
  env_strings.push_back("KEEL_IDEMPOTENCY_KEY=" + job.idempotency_key);
  env_strings.push_back("KEEL_ATTEMPT=" + std::to_string(job.attempt));
  env_strings.push_back("KEEL_JOB_ID=" + std::to_string(job.id));
  env_strings.push_back("KEEL_QUEUE=" + job.queue);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string sh = "/bin/sh";
  std::string dash_c = "-c";
  std::string cmd = command;
  char* argv[] = {sh.data(), dash_c.data(), cmd.data(), nullptr};

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in_pipe[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, err_pipe[1], STDERR_FILENO);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);  // the worker blocks SIGTERM; the child must not
  sigset_t defaults;
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGPIPE);  // ignored in the worker; a default in the command's pipelines
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, sh.c_str(), &actions, &attr, argv, envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  ::close(in_pipe[0]);
  ::close(err_pipe[1]);
  if (rc != 0) {
    ::close(in_pipe[1]);
    ::close(err_pipe[0]);
    report.outcome = Outcome::transient();
    report.error = std::string("cannot start /bin/sh: ") + std::strerror(rc);
    return report;
  }
  // Feed stdin and collect stderr without blocking on either, watching for cancellation.
  fcntl(in_pipe[1], F_SETFL, fcntl(in_pipe[1], F_GETFL) | O_NONBLOCK);
  std::size_t written = 0;
  int in_fd = in_pipe[1];
  int err_fd = err_pipe[0];
  std::string err_tail;
  bool killed = false;
  while (err_fd >= 0) {
    if (cancel.load() && !killed) {
      ::kill(pid, SIGKILL);
      killed = true;
    }
    if (in_fd >= 0 && written >= job.payload.size()) {
      ::close(in_fd);
      in_fd = -1;
    }
    pollfd fds[2];
    nfds_t n = 0;
    fds[n++] = {err_fd, POLLIN, 0};
    if (in_fd >= 0) fds[n++] = {in_fd, POLLOUT, 0};
    if (::poll(fds, n, 100) < 0 && errno != EINTR) break;
    if (n == 2 && (fds[1].revents & (POLLOUT | POLLERR | POLLHUP)) != 0) {
      const ssize_t w = ::write(in_fd, job.payload.data() + written, job.payload.size() - written);
      if (w > 0) {
        written += static_cast<std::size_t>(w);
      } else if (w < 0 && errno != EAGAIN && errno != EINTR) {
        ::close(in_fd);  // the command does not read its input (EPIPE): fine
        in_fd = -1;
      }
    }
    if ((fds[0].revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
      char buf[4096];
      const ssize_t r = ::read(err_fd, buf, sizeof buf);
      if (r > 0) {
        err_tail.append(buf, static_cast<std::size_t>(r));
        if (err_tail.size() > 4000) err_tail.erase(0, err_tail.size() - 2000);
      } else if (r == 0 || (errno != EAGAIN && errno != EINTR)) {
        ::close(err_fd);
        err_fd = -1;
      }
    }
  }
  if (in_fd >= 0) ::close(in_fd);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  while (!err_tail.empty() && (err_tail.back() == '\n' || err_tail.back() == '\r')) {
    err_tail.pop_back();
  }
  if (err_tail.size() > 500) err_tail = err_tail.substr(err_tail.size() - 500);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return store::AttemptReport::success();
  std::string what;
  if (WIFEXITED(status)) {
    const int code = WEXITSTATUS(status);
    report.outcome = code == 75 ? Outcome::transient() : Outcome::permanent();
    report.outcome.code = code;
    what = "exit status " + std::to_string(code) + (code == 75 ? " (EX_TEMPFAIL)" : "");
  } else {
    // Killed by a signal (OOM killer, a crash, our cancellation): a timing accident.
    report.outcome = Outcome::transient();
    what = "killed by signal " + std::to_string(WTERMSIG(status));
  }
  report.error = what + (err_tail.empty() ? "" : ": " + err_tail);
  return report;
}

// ---------------------------------------------------------------------------------------------
// work: metrics

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

class Metrics {
 public:
  explicit Metrics(std::string queue) : queue_(std::move(queue)) {
    for (const char* o : {"success", "transient", "throttled", "ambiguous", "permanent"}) {
      attempts_[o] = 0;
    }
    for (const char* r : {"permanent", "attempts_exhausted", "max_age"}) dead_lettered_[r] = 0;
  }

  void record(const store::WorkerEvent& e) {
    std::lock_guard lock(mu_);
    if (e.report.outcome.attempted()) {
      ++attempts_[std::string(to_string(e.report.outcome.kind))];
    } else {
      ++deferrals_;  // nothing was sent: not an attempt
    }
    if (e.result.status == store::CompleteStatus::kStale) ++stale_;
  }

  /// Every move to the dead-letter queue, including a lease that expired on its last attempt.
  void dead_lettered(std::string_view reason) {
    std::lock_guard lock(mu_);
    ++dead_lettered_[reason.starts_with("permanent") ? "permanent"
                     : reason.starts_with("max age") ? "max_age"
                                                     : "attempts_exhausted"];
  }

  std::string render(const std::vector<store::QueueStats>& stats) const {
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
    std::lock_guard lock(mu_);
    const std::string q = escape_label(queue_);
    out << "# HELP keel_queue_attempts_total Job attempts run by this worker, by outcome.\n"
           "# TYPE keel_queue_attempts_total counter\n";
    for (const auto& [outcome, n] : attempts_) {
      out << "keel_queue_attempts_total{queue=\"" << q << "\",outcome=\"" << outcome << "\"} " << n
          << '\n';
    }
    out << "# HELP keel_queue_dead_lettered_total Jobs this worker moved to the dead-letter "
           "queue, by reason.\n# TYPE keel_queue_dead_lettered_total counter\n";
    for (const auto& [reason, n] : dead_lettered_) {
      out << "keel_queue_dead_lettered_total{queue=\"" << q << "\",reason=\"" << reason << "\"} "
          << n << '\n';
    }
    out << "# HELP keel_queue_deferrals_total Jobs this worker deferred without sending (a brake "
           "refused).\n# TYPE keel_queue_deferrals_total counter\n"
        << "keel_queue_deferrals_total{queue=\"" << q << "\"} " << deferrals_ << '\n';
    out << "# HELP keel_queue_stale_completions_total Outcomes refused because the lease had "
           "been lost.\n# TYPE keel_queue_stale_completions_total counter\n"
        << "keel_queue_stale_completions_total{queue=\"" << q << "\"} " << stale_ << '\n';
    return out.str();
  }

 private:
  std::string queue_;
  mutable std::mutex mu_;
  std::map<std::string, std::int64_t> attempts_;       // guarded by mu_
  std::map<std::string, std::int64_t> dead_lettered_;  // guarded by mu_
  std::int64_t stale_ = 0;                             // guarded by mu_
  std::int64_t deferrals_ = 0;                         // guarded by mu_
};

/// Logs one line when a dependency's breaker opens and one when it closes again, with the
/// failure rate that tripped it, how long it stayed open and how many probes it took.
class BreakerLog {
 public:
  explicit BreakerLog(BreakerRegistry& registry) : registry_(registry) {}

  void on_change(std::string_view key, BreakerState from, BreakerState to) {
    const TimePoint now = steady_clock().now();
    std::lock_guard lock(mu_);
    Outage& o = outages_[std::string(key)];
    if (to == BreakerState::kOpen && from == BreakerState::kClosed) {
      o = Outage{now, 0};
      std::int64_t calls = 0;
      std::int64_t failures = 0;
      if (auto b = registry_.find(key)) {
        const BreakerSnapshot snap = b->snapshot();
        calls = snap.calls;
        failures = snap.failures;
      }
      std::fprintf(
          stderr,
          "keel jobs: circuit open for %.*s: %lld of %lld calls failed (%.0f%%); jobs "
          "wait for it without spending attempts\n",
          static_cast<int>(key.size()), key.data(), static_cast<long long>(failures),
          static_cast<long long>(calls),
          calls > 0 ? 100.0 * static_cast<double>(failures) / static_cast<double>(calls) : 0.0);
    } else if (to == BreakerState::kHalfOpen) {
      ++o.probes;
    } else if (to == BreakerState::kClosed) {
      std::fprintf(stderr, "keel jobs: circuit closed for %.*s after %s open (%d probes)\n",
                   static_cast<int>(key.size()), key.data(),
                   format_duration(now - o.opened).c_str(), o.probes);
      outages_.erase(std::string(key));
    }
  }

 private:
  struct Outage {
    TimePoint opened{};
    int probes = 0;
  };
  BreakerRegistry& registry_;
  std::mutex mu_;
  std::map<std::string, Outage> outages_;  // guarded by mu_
};

// ---------------------------------------------------------------------------------------------
// work

int run_work(const JobsArgs& a) {
  const auto url = queue_cli::parse_db_flag("jobs", a.db);
  if (!url) return kExitUsage;
  if (std::string why = store::check_queue_name(a.queue); !why.empty()) {
    return usage("--queue: " + why);
  }
  if (a.deliver.empty() == a.exec.empty()) {
    return usage(a.deliver.empty() ? "work needs a handler: give --deliver URL or --exec CMD"
                                   : "--deliver and --exec are mutually exclusive");
  }
  if (!a.deliver.empty() && !a.deliver.starts_with("http://") &&
      !a.deliver.starts_with("https://")) {
    return usage("--deliver: URL '" + a.deliver + "' must start with http:// or https://");
  }
  if (a.concurrency < 1 || a.concurrency > 256) {
    return usage("--concurrency: must be 1..256, got " + std::to_string(a.concurrency));
  }
  if (a.batch < 1 || a.batch > 1000) {
    return usage("--batch: must be 1..1000, got " + std::to_string(a.batch));
  }
  const auto lease = duration_flag("--lease", a.lease, true);
  if (!lease) return kExitUsage;
  const auto base = duration_flag("--backoff-base", a.backoff_base, true);
  if (!base) return kExitUsage;
  const auto cap = duration_flag("--backoff-cap", a.backoff_cap, true);
  if (!cap) return kExitUsage;
  if (*cap < *base) {
    return usage("--backoff-cap: must be at least --backoff-base (" + a.backoff_base + "), got '" +
                 a.backoff_cap + "'");
  }
  const auto grace = duration_flag("--grace", a.grace, false);
  if (!grace) return kExitUsage;
  const auto poll = duration_flag("--poll", a.poll, true);
  if (!poll) return kExitUsage;
  const auto timeout = duration_flag("--timeout", a.timeout, true);
  if (!timeout) return kExitUsage;
  // The queue's retries draw on a ratio budget (retries <= RATIO x first attempts in 10 s, plus
  // 10 a second): it refills with time, so a deferred job is never stuck behind it.
  std::optional<double> budget_ratio;
  if (a.retry_budget != "off") {
    char* end = nullptr;
    const double r = std::strtod(a.retry_budget.c_str(), &end);
    if (a.retry_budget.empty() || end != a.retry_budget.c_str() + a.retry_budget.size() ||
        !(r >= 0.0 && r <= 1000.0)) {
      return usage("--retry-budget: expected a ratio in [0, 1000] or 'off', got '" +
                   a.retry_budget + "'");
    }
    budget_ratio = r;
  }
  const auto max_db_outage = duration_flag("--max-db-outage", a.max_db_outage, true);
  if (!max_db_outage) return kExitUsage;
  Duration max_age = kInfinite;
  if (!a.max_age.empty()) {
    const auto d = duration_flag("--max-age", a.max_age, true);
    if (!d) return kExitUsage;
    max_age = *d;
  }
  std::optional<Duration> retain;
  if (!a.retain_done.empty()) {
    retain = duration_flag("--retain-done", a.retain_done, false);
    if (!retain) return kExitUsage;
  }
  std::string metrics_host;
  int metrics_port = -1;
  if (!a.metrics_listen.empty()) {
    const std::size_t colon = a.metrics_listen.rfind(':');
    if (colon == std::string::npos) {
      return usage("--metrics-listen: expected HOST:PORT, got '" + a.metrics_listen + "'");
    }
    metrics_host = a.metrics_listen.substr(0, colon);
    if (metrics_host.empty()) metrics_host = "127.0.0.1";
    try {
      std::size_t used = 0;
      metrics_port = std::stoi(a.metrics_listen.substr(colon + 1), &used);
      if (used != a.metrics_listen.size() - colon - 1) throw std::invalid_argument("trailing");
    } catch (const std::exception&) {
      metrics_port = -1;
    }
    if (metrics_port < 0 || metrics_port > 65535) {
      return usage("--metrics-listen: invalid port in '" + a.metrics_listen + "'");
    }
  }
  if (url->backend == store::Backend::kSqlite && !queue_cli::database_exists(*url)) {
    return usage("--db: database '" + url->redacted + "' does not exist (enqueue creates it)");
  }

  store::ConnectionPool pool(*url, {.max_connections = a.concurrency + 3});
  {
    bool has_schema = false;
    auto conn = queue_cli::open_queue_db(*url, false, &has_schema);
    store::JobQueue q;
    if (!has_schema || !q.queue_exists(*conn, a.queue)) {
      return usage("--queue: unknown queue '" + a.queue + "' in " + url->redacted +
                   " (a queue is created by its first enqueue)");
    }
  }
  Metrics metrics(a.queue);
  store::QueueOptions queue_options;
  queue_options.backoff = {.base = *base, .cap = *cap};
  queue_options.lease = *lease;
  queue_options.max_age = max_age;
  queue_options.on_dead_letter = [&](std::int64_t, std::string_view reason) {
    metrics.dead_lettered(reason);
  };
  store::JobQueue queue(queue_options);

  // Signals are taken by one thread with sigwait; every other thread (started below) inherits
  // the blocked mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  std::unique_ptr<http::Client> client;
  std::unique_ptr<RatioBudget> budget;
  if (budget_ratio)
    budget = std::make_unique<RatioBudget>(RatioBudgetOptions{.ratio = *budget_ratio});
  BreakerRegistry breakers;
  BreakerLog breaker_log(breakers);
  std::string dependency;
  if (!a.deliver.empty()) {
    breakers.add_listener([&](std::string_view key, BreakerState from, BreakerState to) {
      breaker_log.on_change(key, from, to);
    });
    dependency = http::breaker_key(a.deliver).value_or(a.deliver);
    http::ClientOptions options;
    options.retry = {.max_attempts = 1, .per_try_timeout = *timeout, .overall_timeout = *timeout};
    options.log = [](std::string_view) {};  // the queue records every attempt
    options.breakers = &breakers;
    options.retry_budget = budget != nullptr;
    options.budget = budget.get();
    client = std::make_unique<http::Client>(options);
  }
  store::JobHandler handler;
  if (client) {
    handler = [&](const store::LeasedJob& job, const std::atomic<bool>&) {
      return deliver(*client, a.deliver, dependency, job);
    };
  } else {
    handler = [&](const store::LeasedJob& job, const std::atomic<bool>& cancel) {
      return exec_command(a.exec, job, cancel);
    };
  }
  store::WorkerOptions options;
  options.queue = a.queue;
  options.concurrency = a.concurrency;
  options.batch = a.batch;
  options.poll_interval = *poll;
  options.grace = *grace;
  options.exit_when_idle = a.exit_when_idle;
  options.done_retention = retain;
  options.max_database_outage = *max_db_outage;
  options.on_event = [&](const store::WorkerEvent& e) { metrics.record(e); };
  store::Worker worker(pool, queue, options, handler);

  std::unique_ptr<httplib::Server> server;
  std::thread server_thread;
  if (metrics_port >= 0) {
    server = std::make_unique<httplib::Server>();
    store::apply_server_limits(*server, {});  // an exclusive port (no SO_REUSEPORT), limits
    server->Get("/metrics", [&](const httplib::Request&, httplib::Response& res) {
      try {
        auto conn = pool.acquire();
        res.set_content(metrics.render(queue.stats(*conn)), "text/plain; version=0.0.4");
      } catch (const std::exception& e) {
        res.status = 500;
        res.set_content(std::string("database error: ") + e.what() + "\n", "text/plain");
      }
    });
    const int port = metrics_port == 0
                         ? server->bind_to_any_port(metrics_host)
                         : (server->bind_to_port(metrics_host, metrics_port) ? metrics_port : -1);
    if (port < 0) {
      return failure("jobs", "--metrics-listen: cannot listen on " + a.metrics_listen);
    }
    std::fprintf(stderr, "keel jobs: metrics on http://%s:%d/metrics\n", metrics_host.c_str(),
                 port);
    server_thread = std::thread([&] { server->listen_after_bind(); });
  }

  std::atomic<bool> done{false};
  std::thread signal_thread([&] {
    const timespec tick{0, 100'000'000};
    while (!done.load()) {
      const int sig = sigtimedwait(&signals, nullptr, &tick);
      if (sig == SIGTERM || sig == SIGINT) {
        std::fprintf(stderr, "keel jobs: %s: stopping (grace %s)\n",
                     sig == SIGTERM ? "SIGTERM" : "SIGINT", a.grace.c_str());
        worker.stop();
      }
    }
  });
  std::fprintf(stderr, "keel jobs: worker %s on queue '%s' (%s)\n", worker.worker_id().c_str(),
               a.queue.c_str(), url->redacted.c_str());
  const std::int64_t recorded = worker.run();
  done.store(true);
  signal_thread.join();
  if (server) {
    server->stop();
    server_thread.join();
  }
  std::fprintf(stderr, "keel jobs: worker stopped: %lld attempts recorded, %lld leases released\n",
               static_cast<long long>(recorded), static_cast<long long>(worker.released()));
  if (worker.failed()) return failure("jobs", worker.failure());
  return 0;
}

}  // namespace

Runner add_jobs(CLI::App& app) {
  auto args = std::make_shared<JobsArgs>();
  auto cmd = std::make_shared<std::string>();
  CLI::App* jobs = app.add_subcommand("jobs", "The durable job queue: enqueue, work, stats");
  jobs->footer(kJobsFooter);
  jobs->fallthrough();
  jobs->require_subcommand(1);
  jobs->add_option("--db", args->db, "Database URL (sqlite:PATH or postgresql://...)")
      ->capture_default_str();

  CLI::App* enqueue = jobs->add_subcommand("enqueue", "Add a job; prints its id");
  enqueue->add_option("--queue", args->queue, "Queue name")->required();
  enqueue->add_option("--payload", args->payload, "The job's payload (JSON)");
  enqueue->add_option("--payloads-from", args->payloads_from,
                      "Enqueue one job per line of FILE (- for stdin), each line a JSON payload, "
                      "in one transaction; prints one id per line");
  enqueue
      ->add_option("--key", args->key, "Idempotency key (default: a new UUID, stored with the job)")
      ->check([](const std::string& key) {
        const auto checked = http::check_idempotency_key(key);
        return checked ? std::string() : checked.error().message();  // CLI11: empty is valid
      });
  enqueue->add_option("--max-attempts", args->max_attempts, "Attempts before the job is dead")
      ->capture_default_str();
  enqueue->add_option("--delay", args->delay, "Not before now + this")->capture_default_str();
  enqueue->callback([cmd] { *cmd = "enqueue"; });

  CLI::App* work = jobs->add_subcommand("work", "Run jobs of a queue");
  work->add_option("--queue", args->queue, "Queue name")->required();
  work->add_option("--deliver", args->deliver,
                   "POST each payload to URL with the job's Idempotency-Key");
  work->add_option("--exec", args->exec, "Run CMD per job (payload on stdin)");
  work->add_option("--concurrency", args->concurrency, "Jobs run at once")->capture_default_str();
  work->add_option("--batch", args->batch, "Jobs leased per database round trip")
      ->capture_default_str();
  work->add_option("--lease", args->lease, "Lease duration (extended by heartbeats)")
      ->capture_default_str();
  work->add_option("--backoff-base", args->backoff_base, "Full-jitter backoff base")
      ->capture_default_str();
  work->add_option("--backoff-cap", args->backoff_cap, "Full-jitter backoff cap")
      ->capture_default_str();
  work->add_option("--grace", args->grace, "On SIGTERM, time for running jobs to finish")
      ->capture_default_str();
  work->add_option("--poll", args->poll, "Wait between polls of an empty queue")
      ->capture_default_str();
  work->add_option("--timeout", args->timeout, "--deliver: timeout of one HTTP request")
      ->capture_default_str();
  work->add_option("--retain-done", args->retain_done,
                   "Delete done jobs older than this (default: keep them)");
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
  work->add_flag("--exit-when-idle", args->exit_when_idle,
                 "Exit 0 once nothing is ready, running or scheduled for retry");
  work->add_option("--metrics-listen", args->metrics_listen,
                   "Serve Prometheus metrics on HOST:PORT (/metrics; port 0 picks one)");
  work->callback([cmd] { *cmd = "work"; });

  CLI::App* stats = jobs->add_subcommand("stats", "Counts per queue and state, dead-letter depth");
  stats->add_flag("--json", args->json, "JSON output");
  stats->callback([cmd] { *cmd = "stats"; });

  return [args, cmd]() -> int {
    try {
      if (*cmd == "enqueue") return run_enqueue(*args);
      if (*cmd == "work") return run_work(*args);
      if (*cmd == "stats") return run_stats(*args);
    } catch (const store::DatabaseError& e) {
      return failure("jobs", std::string("database error: ") + e.what());
    }
    return kExitUsage;
  };
}

}  // namespace keel::cli
