// `keel-demo serve`: the payments API of examples/payments_api/ (POST /v1/charges through the
// idempotency flow on SQLite or PostgreSQL, GET /v1/charges[/{id}], /healthz, /metrics) on
// keel::store::beast::Server, behind this command's flags.
// --rate-limit answers 429 + Retry-After per principal; --max-concurrency sheds retries first
// (503 + Retry-After, keel/core/admission.hpp); the --chaos-* flags inject the failures that make
// clients retry (503s, delays, hangs, and "commit then drop the response"). --max-connections and
// the --*-timeout flags are the server's limits (keel::store::beast::ServerOptions).
// Stops cleanly on SIGTERM, SIGINT and SIGHUP: the listener closes, in-flight requests finish
// within --drain-timeout, and the process exits within it plus a quarter second even when a
// request is still blocked in the database (that request is abandoned: nothing of it commits).
#include "serve.hpp"

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <boost/asio/error.hpp>
#include <boost/beast/http/field.hpp>
#include <boost/system/system_error.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <thread>
#include <utility>

#include "commands.hpp"
#include "keel/core/admission.hpp"
#include "keel/core/backoff.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/principal_rate_limiter.hpp"
#include "keel/core/random.hpp"
#include "keel/core/retry_after.hpp"
#include "keel/faults/chaos.hpp"
#include "keel/metrics/metrics.hpp"
#include "keel/serve/beast/server.hpp"
#include "payments_api.hpp"
#include "stop_signals.hpp"

namespace keel::cli::serve_cli {
namespace {

namespace beast = store::beast;
namespace http = boost::beast::http;

// keel_chaos_injected_total{fault}: what the --chaos-* flags injected so far.
std::string chaos_metrics(const faults::Chaos& chaos) {
  metrics::Scrape scrape;
  for (const faults::ChaosFault fault : {faults::ChaosFault::k503, faults::ChaosFault::kDelay,
                                         faults::ChaosFault::kHang, faults::ChaosFault::kDrop}) {
    scrape.counter("keel_chaos_injected_total", "Faults injected by --chaos flags.",
                   {{"fault", std::string(faults::to_string(fault))}},
                   static_cast<double>(chaos.injected(fault)));
  }
  return scrape.text();
}

// --scope-secret-file's key, without its trailing line ends (empty without the flag); nullopt
// after a usage error.
std::optional<std::string> read_scope_secret(const ServeOptions& o) {
  std::string scope_secret;
  if (o.scope_secret_file.empty()) return scope_secret;
  const auto refuse = [&](std::string problem) {
    usage_error(Error{.field = "--scope-secret-file",
                      .problem = std::move(problem),
                      .got = quote_value(o.scope_secret_file)}
                    .message());
    return std::nullopt;
  };
  std::ifstream in(o.scope_secret_file, std::ios::binary);
  if (!in) return refuse("cannot be read");
  scope_secret.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  while (!scope_secret.empty() && (scope_secret.back() == '\n' || scope_secret.back() == '\r')) {
    scope_secret.pop_back();
  }
  if (scope_secret.size() < 16) return refuse("must name a file of at least 16 bytes");
  return scope_secret;
}

// --adaptive-admission: the threshold-free limit, at most --max-concurrency, starting at keel's
// initial limit (20) or that bound when lower.
std::optional<ConcurrencyLimitOptions> adaptive_admission(const ServeOptions& o) {
  if (!o.adaptive_admission) return std::nullopt;
  ConcurrencyLimitOptions limit;
  limit.max_limit = std::min<std::int64_t>(o.max_concurrency, std::int64_t{1} << 20);
  limit.initial_limit = std::min(limit.initial_limit, limit.max_limit);
  return limit;
}

// What stands between a request and the API: the rate limiter, the injected faults, admission.
struct Guards {
  explicit Guards(const ServeOptions& o)
      : chaos({.fraction_503 = o.chaos_503,
               .retry_after_503 = o.chaos_503_retry_after,
               .delay_fraction = o.chaos_delay_fraction,
               .delay = o.chaos_delay,
               .hang_fraction = o.chaos_hang_fraction,
               .hang = o.chaos_hang,
               .drop_after_commit = o.chaos_drop,
               .seed = o.chaos_seed}) {
    // Principals are stored and rate-limited by their keyed hash, never as the credential.
    if (o.rate_limit) {
      limiter.emplace(o.rate_limit->per_s, static_cast<std::size_t>(o.rate_limit_principals));
    }
    // --max-concurrency: one limiter over every /v1 route, retries shed first. The injected
    // delays and hangs run inside the admitted region, as a slow handler or database would.
    if (o.max_concurrency > 0) {
      admission.emplace(AdmissionOptions{
          .max_concurrency = o.max_concurrency,
          .queue_bound = o.admission_queue >= 0 ? o.admission_queue
                                                : std::max<std::int64_t>(1, o.max_concurrency / 4),
          .latency_threshold = o.adaptive_latency.value_or(Duration::zero()),
          .adaptive = adaptive_admission(o)});
    }
  }

  faults::Chaos chaos;
  std::optional<PrincipalRateLimiter> limiter;
  std::optional<AdmissionLimiter> admission;
};

// Limits, framing checks and deadlines per request are the server's (keel/serve/beast/
// server.hpp). The order of the checks every /v1 request meets next, decided here, on the event
// loop: a deadline that passed before the request arrived (400, before it can spend a
// rate-limit token or an admission slot: it is not retryable, a 429 would be); then the rate
// limit and the injected 503; then admission (the API's limiter).
std::optional<beast::Response> refuse(const beast::Request& req, const ServeOptions& o,
                                      Guards& guards, payments::Metrics& metrics,
                                      const std::string& scope_secret) {
  auto& limiter = guards.limiter;
  auto& chaos = guards.chaos;
  const TimePoint now = steady_clock().now();
  if (beast::request_deadline(req, now).expired(now)) {
    ++metrics.outcomes[static_cast<int>(store::IdempotencyOutcome::kDeadlineExceeded)];
    return beast::to_response(store::deadline_exceeded_response("before it arrived"),
                              req.version());
  }
  if (limiter) {
    const std::string scope = payments::scope_of(req, scope_secret);
    const Duration wait =
        limiter->admit(scope == store::kAnonymousScope ? std::string_view() : scope);
    metrics.rate_limit_principals = limiter->size();
    if (wait > Duration::zero()) {
      ++metrics.rate_limited;
      beast::Response res = beast::problem_response(
          429, "Too many requests", "the rate limit for this principal is " + o.rate_limit->text,
          req.version());
      res.set(http::field::retry_after, format_retry_after(wait));
      return res;
    }
  }
  if (chaos.inject_503()) {
    beast::Response res = beast::problem_response(503, "Service unavailable",
                                                  "injected by --chaos-503", req.version());
    if (chaos.retry_after_503()) {
      res.set(http::field::retry_after, format_retry_after(*chaos.retry_after_503()));
    }
    return res;
  }
  return std::nullopt;
}

payments::PaymentsApi make_api(const ServeOptions& o, store::ConnectionPool& pool,
                               const store::IdempotencyStore& idempotency,
                               const std::string& scope_secret, payments::Metrics& metrics,
                               Guards& guards) {
  return payments::PaymentsApi(
      {.pool = &pool,
       .idempotency = &idempotency,
       .scope_secret = scope_secret,
       .json_limits = {.max_depth = o.max_json_depth},
       .retry_after_spread = o.retry_after_spread,
       .no_idempotency = o.no_idempotency,
       .health_timeout = o.health_timeout,
       .metrics = &metrics,
       .refuse =
           [&o, &guards, &metrics, &scope_secret](const beast::Request& req) {
             return refuse(req, o, guards, metrics, scope_secret);
           },
       .limiter = guards.admission ? &*guards.admission : nullptr,
       .before = [&guards](const beast::Request&) { guards.chaos.slow_down(); },
       .after_commit =
           [&guards](const beast::Request&, beast::Response& res) {
             if (guards.chaos.drop_after_commit()) res = beast::no_answer();
           },
       .extra_metrics =
           [&guards] {
             std::string text = chaos_metrics(guards.chaos);
             if (guards.admission) text += payments::render_admission(guards.admission->stats());
             return text;
           },
       .log_prefix = "keel-demo serve"});
}

beast::ServerOptions server_options(const ServeOptions& o) {
  return {.address = o.listen.host,
          .port = o.listen.port,
          .event_loop_threads = 2,
          .worker_threads = o.threads,
          .first_byte_timeout = o.first_byte_timeout,
          .header_timeout = o.header_timeout,
          .body_timeout = o.body_timeout,
          .idle_timeout = o.idle_timeout,
          .write_timeout = o.write_timeout,
          .max_connections = o.max_connections,
          .max_body_bytes = o.max_body_bytes,
          .reuse_port = o.reuse_port,
          .drain_timeout = o.drain_timeout,
          .log = [](std::string_view message) {
            std::fprintf(stderr, "keel-demo serve: %.*s\n", static_cast<int>(message.size()),
                         message.data());
          }};
}

// Purges expired idempotency records on a thread of its own until stop() (bounded by
// beast::kStopGrace).
class Sweeper {
 public:
  Sweeper(const ServeOptions& o, store::ConnectionPool& pool,
          const store::IdempotencyStore& idempotency)
      : thread_([this, &o, &pool, &idempotency] { run(o.sweep_interval, pool, idempotency); }) {}

  // Asks the sweep to end; whether it did within beast::kStopGrace (then it is joined).
  bool stop() {
    bool out = false;
    {
      std::unique_lock lock(mu_);
      stopping_ = true;
      cv_.notify_all();
      out = cv_.wait_for(lock, beast::kStopGrace, [&] { return swept_out_; });
    }
    if (out) thread_.join();
    return out;
  }

 private:
  void run(Duration sweep, store::ConnectionPool& pool,
           const store::IdempotencyStore& idempotency) {
    // Every --sweep-interval, jittered (the processes of a fleet sweep at spread times), and
    // after a failure core's backoff up to that interval.
    PeriodicSchedule schedule(
        sweep, {.base = std::min<Duration>(std::chrono::seconds(1), sweep), .cap = sweep},
        random_seed());
    Duration wait = schedule.after_success();
    std::unique_lock lock(mu_);
    while (!cv_.wait_for(lock, wait, [&] { return stopping_; })) {
      lock.unlock();
      try {
        auto conn = pool.acquire();
        while (idempotency.purge_expired(*conn) >= idempotency.options().purge_batch) {
        }
        wait = schedule.after_success();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "keel-demo serve: idempotency sweep failed: %s\n", e.what());
        wait = schedule.after_failure();
      }
      lock.lock();
    }
    swept_out_ = true;
    cv_.notify_all();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;   // guarded by mu_
  bool swept_out_ = false;  // guarded by mu_: run has returned
  std::thread thread_;
};

// Waits for SIGTERM, SIGINT or SIGHUP and stops the server, the faults and the sweep; returns the
// exit status (or exits at once when a request is still blocked in the database).
int wait_and_stop(sigset_t& signals, beast::Server& server, faults::Chaos& chaos,
                  Sweeper& sweeper) {
  int sig = 0;
  sigwait(&signals, &sig);
  std::fprintf(stderr, "keel-demo serve: %s received, finishing in-flight requests\n",
               stop_signal_name(sig));
  chaos.stop();   // hangs end now: their requests are answered before the drain ends
  server.stop();  // within --drain-timeout + keel::store::beast::kStopGrace
  const bool sweeper_out = sweeper.stop();
  if (const std::size_t blocked = server.stranded_workers(); blocked > 0 || !sweeper_out) {
    // Threads still blocked in the database: exiting closes their connections, so the database
    // rolls their transactions back (and the flows would commit nothing anyway: abandoned).
    std::fprintf(stderr,
                 "keel-demo serve: %zu request(s)%s still blocked in the database after the drain: "
                 "abandoned, nothing of them commits; exiting without them\n",
                 blocked, sweeper_out ? "" : " and the idempotency sweep");
    std::printf("keel-demo serve: stopped\n");
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(0);
  }
  std::printf("keel-demo serve: stopped\n");
  return 0;
}

}  // namespace

int usage_error(const std::string& message) {
  std::fprintf(stderr, "keel-demo serve: %s\n", message.c_str());
  return kExitUsage;
}

int run_serve(const ServeOptions& o) {
  auto scope_secret = read_scope_secret(o);
  if (!scope_secret) return kExitUsage;
  sigset_t signals = block_stop_signals();

  store::ConnectionPool pool(o.db, {.max_connections = o.threads + 2});
  *scope_secret = payments::prepare_database(*pool.acquire(), std::move(*scope_secret));
  const store::IdempotencyStore idempotency({.ttl = o.ttl, .lock_timeout = o.lock_timeout});
  payments::Metrics metrics;
  Guards guards(o);
  payments::PaymentsApi api = make_api(o, pool, idempotency, *scope_secret, metrics, guards);
  beast::Server server(server_options(o));
  api.install(server);
  try {
    server.start();
  } catch (const boost::system::system_error& e) {
    const bool in_use = e.code() == boost::asio::error::address_in_use;
    std::fprintf(stderr, "keel-demo serve: --listen: cannot listen on %s: %s%s\n",
                 o.listen.text.c_str(), e.code().message().c_str(),
                 in_use ? " (another process listens there; --reuse-port shares it)" : "");
    return 1;
  }
  std::printf("keel-demo serve: listening on http://%s:%d (db %s, idempotency %s)\n",
              o.listen.host.c_str(), static_cast<int>(server.port()), o.db.redacted.c_str(),
              o.no_idempotency ? "off" : "on");
  std::fflush(stdout);
  Sweeper sweeper(o, pool, idempotency);
  return wait_and_stop(signals, server, guards.chaos, sweeper);
}

}  // namespace keel::cli::serve_cli
