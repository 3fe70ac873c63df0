// `keel-demo serve`: the payments API of examples/payments_api/ (POST /v1/charges through the
// idempotency flow on SQLite or PostgreSQL, GET /v1/charges[/{id}], /healthz, /metrics) on
// keel::store::beast::Server, behind this command's flags.
// --rate-limit answers 429 + Retry-After per principal; --max-concurrency sheds retries first
// (503 + Retry-After, keel/admission.hpp); the --chaos-* flags inject the failures that make
// clients retry (503s, delays, hangs, and "commit then drop the response"). --max-connections and
// the --*-timeout flags are the server's limits (keel::store::beast::ServerOptions).
// Stops cleanly on SIGTERM, SIGINT and SIGHUP: the listener closes, in-flight requests finish
// within --drain-timeout, and the process exits within it plus a quarter second even when a
// request is still blocked in the database (that request is abandoned: nothing of it commits).
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
#include <random>
#include <thread>
#include <utility>

#include "commands.hpp"
#include "keel/admission.hpp"
#include "keel/backoff.hpp"
#include "keel/duration.hpp"
#include "keel/faults/chaos.hpp"
#include "keel/metrics/metrics.hpp"
#include "keel/principal_rate_limiter.hpp"
#include "keel/retry_after.hpp"
#include "keel/store/beast/server.hpp"
#include "payments_api.hpp"
#include "rate_flag.hpp"

namespace keel::cli {
namespace {

struct ServeOptions {
  std::string listen = "127.0.0.1:8080";
  std::string db = std::string(store::kDefaultDatabaseUrl);
  std::string ttl = "24h";
  std::string lock_timeout = "30s";
  std::string rate_limit;
  int rate_limit_principals = 10000;
  std::string scope_secret_file;
  std::string sweep_interval = "1m";
  int threads = 16;
  std::int64_t max_concurrency = 0;
  std::int64_t admission_queue = -1;
  std::string adaptive_latency;
  std::string max_body_bytes = "1048576";
  std::string max_json_depth = "64";
  std::string retry_after_spread = "3";
  std::string max_connections = "1024";
  std::string first_byte_timeout = "2s";
  std::string header_timeout = "10s";
  std::string body_timeout = "30s";
  std::string idle_timeout = "5s";
  std::string write_timeout = "10s";
  std::string drain_timeout = "10s";
  std::string health_timeout = "1s";
  bool reuse_port = false;
  bool no_idempotency = false;
  double chaos_503 = 0;
  std::string chaos_503_retry_after;
  double chaos_delay_fraction = 0;
  std::string chaos_delay = "1s";
  double chaos_hang_fraction = 0;
  std::string chaos_hang = "1m";
  double chaos_drop = 0;
  std::uint64_t chaos_seed = 1;
  // Whether these flags, which have defaults, were given (each needs another flag).
  bool given_rate_limit_principals = false;
  bool given_chaos_delay = false;
  bool given_chaos_hang = false;
};

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

int usage_error(const Error& error) {
  std::fprintf(stderr, "keel-demo serve: %s\n", error.message().c_str());
  return kExitUsage;
}

int usage_error(std::string_view flag, std::string problem, std::string_view value) {
  return usage_error(
      Error{.field = std::string(flag), .problem = std::move(problem), .got = quote_value(value)});
}

/// A timeout flag in whole milliseconds: at least 1 ms (0 too with `allow_zero`), at most a day.
Expected<std::chrono::milliseconds> parse_timeout_flag(std::string_view flag, std::string_view text,
                                                       bool allow_zero) {
  const auto d = parse_duration_flag(flag, text, !allow_zero);
  if (!d) return d.error();
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(*d);
  if (*d > std::chrono::hours(24) || (ms.count() == 0 && d->count() != 0)) {
    return Error{.field = std::string(flag),
                 .problem = allow_zero ? "must be 0 or from 1ms to 24h" : "must be from 1ms to 24h",
                 .got = quote_value(text)};
  }
  return ms;
}

int run_serve(const ServeOptions& o) {
  // ---- validate flags
  const auto ttl = parse_duration_flag("--idempotency-ttl", o.ttl, true);
  if (!ttl) return usage_error(ttl.error());
  const auto lock_timeout = parse_duration_flag("--lock-timeout", o.lock_timeout, true);
  if (!lock_timeout) return usage_error(lock_timeout.error());
  const auto sweep = parse_duration_flag("--sweep-interval", o.sweep_interval, true);
  if (!sweep) return usage_error(sweep.error());
  std::optional<Duration> adaptive_latency;
  if (!o.adaptive_latency.empty()) {
    const auto latency = parse_duration_flag("--adaptive-latency", o.adaptive_latency, true);
    if (!latency) return usage_error(latency.error());
    if (o.max_concurrency <= 0) {
      return usage_error("--adaptive-latency", "needs --max-concurrency (the upper limit)",
                         o.adaptive_latency);
    }
    adaptive_latency = *latency;
  }
  const auto delay = parse_duration_flag("--chaos-delay", o.chaos_delay, false);
  if (!delay) return usage_error(delay.error());
  const auto hang = parse_duration_flag("--chaos-hang", o.chaos_hang, false);
  if (!hang) return usage_error(hang.error());
  std::optional<Duration> chaos_retry_after;
  if (!o.chaos_503_retry_after.empty()) {
    const auto retry_after =
        parse_duration_flag("--chaos-503-retry-after", o.chaos_503_retry_after, false);
    if (!retry_after) return usage_error(retry_after.error());
    chaos_retry_after = *retry_after;
  }
  std::optional<double> rate;
  if (!o.rate_limit.empty()) {
    // A rate names its unit here (100/s, 6000/m): a bare number is refused.
    if (o.rate_limit.find('/') == std::string::npos) {
      return usage_error("--rate-limit", "must be a positive rate like 100/s", o.rate_limit);
    }
    const auto r = cli::parse_rate("--rate-limit", o.rate_limit);
    if (!r) return usage_error(r.error());
    rate = *r;
  }
  // Flags that only mean something with another.
  if (o.admission_queue >= 0 && o.max_concurrency <= 0) {
    return usage_error("--admission-queue", "needs --max-concurrency (the queue is beyond it)",
                       std::to_string(o.admission_queue));
  }
  if (o.given_rate_limit_principals && o.rate_limit.empty()) {
    return usage_error("--rate-limit-principals", "needs --rate-limit (the buckets it bounds)",
                       std::to_string(o.rate_limit_principals));
  }
  if (!o.chaos_503_retry_after.empty() && !(o.chaos_503 > 0)) {
    return usage_error("--chaos-503-retry-after", "needs --chaos-503 (the answers it is sent with)",
                       o.chaos_503_retry_after);
  }
  if (o.given_chaos_delay && !(o.chaos_delay_fraction > 0)) {
    return usage_error("--chaos-delay", "needs --chaos-delay-fraction (the requests it delays)",
                       o.chaos_delay);
  }
  if (o.given_chaos_hang && !(o.chaos_hang_fraction > 0)) {
    return usage_error("--chaos-hang", "needs --chaos-hang-fraction (the requests that hang)",
                       o.chaos_hang);
  }
  const std::size_t colon = o.listen.rfind(':');
  int port = -1;
  std::string host;
  if (colon != std::string::npos && colon > 0) {
    host = o.listen.substr(0, colon);
    if (const auto p = cli::parse_count("--listen", o.listen.substr(colon + 1), 0, 65535)) {
      port = static_cast<int>(*p);
    }
  }
  if (port < 0) {
    return usage_error("--listen", "must be HOST:PORT (e.g. 127.0.0.1:8080)", o.listen);
  }
  const auto url = store::parse_database_url(o.db);
  if (!url) return usage_error(url.error().in("--db"));
  const auto max_body = parse_count("--max-body-bytes", o.max_body_bytes, 1, 1ULL << 32);
  if (!max_body) return usage_error(max_body.error());
  const auto max_depth = parse_count("--max-json-depth", o.max_json_depth, 1, 10000);
  if (!max_depth) return usage_error(max_depth.error());
  const store::JsonLimits json_limits{.max_depth = static_cast<std::size_t>(*max_depth)};
  const auto spread = parse_count("--retry-after-spread", o.retry_after_spread, 1, 3600);
  if (!spread) return usage_error(spread.error());
  const auto max_connections = parse_count("--max-connections", o.max_connections, 1, 1 << 20);
  if (!max_connections) return usage_error(max_connections.error());
  std::chrono::milliseconds timeouts[7];
  {
    const std::pair<std::string_view, const std::string*> flags[7] = {
        {"--first-byte-timeout", &o.first_byte_timeout},
        {"--header-timeout", &o.header_timeout},
        {"--body-timeout", &o.body_timeout},
        {"--idle-timeout", &o.idle_timeout},
        {"--write-timeout", &o.write_timeout},
        {"--health-timeout", &o.health_timeout},
        {"--drain-timeout", &o.drain_timeout}};
    for (int i = 0; i < 7; ++i) {
      const auto t = parse_timeout_flag(flags[i].first, *flags[i].second, i == 6);
      if (!t) return usage_error(t.error());
      timeouts[i] = *t;
    }
  }
  const auto [first_byte_timeout, header_timeout, body_timeout, idle_timeout, write_timeout,
              health_timeout, drain_timeout] = timeouts;
  std::string scope_secret;
  if (!o.scope_secret_file.empty()) {
    std::ifstream in(o.scope_secret_file, std::ios::binary);
    if (!in) return usage_error("--scope-secret-file", "cannot be read", o.scope_secret_file);
    scope_secret.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    while (!scope_secret.empty() && (scope_secret.back() == '\n' || scope_secret.back() == '\r')) {
      scope_secret.pop_back();
    }
    if (scope_secret.size() < 16) {
      return usage_error("--scope-secret-file", "must name a file of at least 16 bytes",
                         o.scope_secret_file);
    }
  }

  // ---- signals: handled here with sigwait; every thread has them blocked, so they are blocked
  // before the first thread starts (the health check's, the server's).
  signal(SIGPIPE, SIG_IGN);
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGHUP);  // no configuration to reload: a hang-up stops as SIGTERM does
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // ---- database
  store::ConnectionPool pool(*url, {.max_connections = o.threads + 2});
  scope_secret = payments::prepare_database(*pool.acquire(), std::move(scope_secret));
  const store::IdempotencyStore idempotency({.ttl = *ttl, .lock_timeout = *lock_timeout});

  // ---- server
  namespace beast = store::beast;
  namespace http = boost::beast::http;
  payments::Metrics metrics;
  std::atomic<bool> stopping{false};
  faults::Chaos chaos({.fraction_503 = o.chaos_503,
                       .retry_after_503 = chaos_retry_after,
                       .delay_fraction = o.chaos_delay_fraction,
                       .delay = *delay,
                       .hang_fraction = o.chaos_hang_fraction,
                       .hang = *hang,
                       .drop_after_commit = o.chaos_drop,
                       .seed = o.chaos_seed});
  // Principals are stored and rate-limited by their keyed hash, never as the credential.
  std::optional<PrincipalRateLimiter> limiter;
  if (rate) limiter.emplace(*rate, static_cast<std::size_t>(o.rate_limit_principals));

  // --max-concurrency: one limiter over every /v1 route, retries shed first. The injected delays
  // and hangs run inside the admitted region, as a slow handler or database would.
  std::optional<AdmissionLimiter> admission_limiter;
  if (o.max_concurrency > 0) {
    admission_limiter.emplace(AdmissionOptions{
        .max_concurrency = o.max_concurrency,
        .queue_bound = o.admission_queue >= 0 ? o.admission_queue
                                              : std::max<std::int64_t>(1, o.max_concurrency / 4),
        .latency_threshold = adaptive_latency.value_or(Duration::zero())});
  }

  // Limits, framing checks and deadlines per request are the server's (keel/store/beast/
  // server.hpp). The order of the checks every /v1 request meets next, decided here, on the event
  // loop: a deadline that passed before the request arrived (400, before it can spend a
  // rate-limit token or an admission slot: it is not retryable, a 429 would be); then the rate
  // limit and the injected 503; then admission (the API's limiter).
  const auto refuse = [&](const beast::Request& req) -> std::optional<beast::Response> {
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
            429, "Too many requests", "the rate limit for this principal is " + o.rate_limit,
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
  };

  payments::PaymentsApi api({.pool = &pool,
                             .idempotency = &idempotency,
                             .scope_secret = scope_secret,
                             .json_limits = json_limits,
                             .retry_after_spread = static_cast<int>(*spread),
                             .no_idempotency = o.no_idempotency,
                             .health_timeout = health_timeout,
                             .metrics = &metrics,
                             .refuse = refuse,
                             .limiter = admission_limiter ? &*admission_limiter : nullptr,
                             .before = [&](const beast::Request&) { chaos.slow_down(); },
                             .after_commit =
                                 [&](const beast::Request&, beast::Response& res) {
                                   if (chaos.drop_after_commit()) res = beast::no_answer();
                                 },
                             .extra_metrics =
                                 [&] {
                                   std::string text = chaos_metrics(chaos);
                                   if (admission_limiter) {
                                     text += payments::render_admission(admission_limiter->stats());
                                   }
                                   return text;
                                 },
                             .log_prefix = "keel-demo serve"});
  beast::Server server({.address = host,
                        .port = static_cast<std::uint16_t>(port),
                        .event_loop_threads = 2,
                        .worker_threads = o.threads,
                        .first_byte_timeout = first_byte_timeout,
                        .header_timeout = header_timeout,
                        .body_timeout = body_timeout,
                        .idle_timeout = idle_timeout,
                        .write_timeout = write_timeout,
                        .max_connections = static_cast<std::size_t>(*max_connections),
                        .max_body_bytes = static_cast<std::size_t>(*max_body),
                        .reuse_port = o.reuse_port,
                        .drain_timeout = drain_timeout,
                        .log = [](std::string_view message) {
                          std::fprintf(stderr, "keel-demo serve: %.*s\n",
                                       static_cast<int>(message.size()), message.data());
                        }});
  api.install(server);

  try {
    server.start();
  } catch (const boost::system::system_error& e) {
    const bool in_use = e.code() == boost::asio::error::address_in_use;
    std::fprintf(stderr, "keel-demo serve: --listen: cannot listen on %s: %s%s\n", o.listen.c_str(),
                 e.code().message().c_str(),
                 in_use ? " (another process listens there; --reuse-port shares it)" : "");
    return 1;
  }
  std::printf("keel-demo serve: listening on http://%s:%d (db %s, idempotency %s)\n", host.c_str(),
              static_cast<int>(server.port()), url->redacted.c_str(),
              o.no_idempotency ? "off" : "on");
  std::fflush(stdout);

  std::mutex sweep_mu;
  std::condition_variable sweep_cv;
  bool swept_out = false;  // guarded by sweep_mu: the sweeper has returned
  std::thread sweeper([&] {
    // Every --sweep-interval, jittered (the processes of a fleet sweep at spread times), and
    // after a failure core's backoff up to that interval.
    PeriodicSchedule schedule(
        *sweep, {.base = std::min<Duration>(std::chrono::seconds(1), *sweep), .cap = *sweep},
        (std::uint64_t{std::random_device{}()} << 32) ^ std::random_device{}());
    Duration wait = schedule.after_success();
    std::unique_lock lock(sweep_mu);
    while (!sweep_cv.wait_for(lock, wait, [&] { return stopping.load(); })) {
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
    swept_out = true;
    sweep_cv.notify_all();
  });

  int sig = 0;
  sigwait(&signals, &sig);
  std::fprintf(stderr, "keel-demo serve: %s received, finishing in-flight requests\n",
               sig == SIGINT   ? "SIGINT"
               : sig == SIGHUP ? "SIGHUP"
                               : "SIGTERM");
  chaos.stop();   // hangs end now: their requests are answered before the drain ends
  server.stop();  // within --drain-timeout + keel::store::beast::kStopGrace
  bool sweeper_out = false;
  {
    std::unique_lock lock(sweep_mu);
    stopping = true;
    sweep_cv.notify_all();
    sweeper_out = sweep_cv.wait_for(lock, beast::kStopGrace, [&] { return swept_out; });
  }
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
  sweeper.join();
  std::printf("keel-demo serve: stopped\n");
  return 0;
}

}  // namespace

Runner add_serve(CLI::App& app) {
  auto o = std::make_shared<ServeOptions>();
  CLI::App* sub = app.add_subcommand(
      "serve", "Run a small payments API with idempotency keys (POST /v1/charges)");
  sub->add_option("--listen", o->listen, "HOST:PORT to listen on (port 0: any free port)")
      ->capture_default_str();
  sub->add_option("--db", o->db, "Database URL: sqlite:PATH or postgres://...")
      ->capture_default_str();
  sub->add_option("--idempotency-ttl", o->ttl, "How long idempotency records are kept")
      ->capture_default_str();
  sub->add_option("--lock-timeout", o->lock_timeout,
                  "How long a claim holds a key before another request may take it over")
      ->capture_default_str();
  sub->add_option("--rate-limit", o->rate_limit, "Per-principal limit, e.g. 100/s (429 beyond)");
  CLI::Option* rate_limit_principals =
      sub->add_option("--rate-limit-principals", o->rate_limit_principals,
                      "Most principals with a rate-limit bucket of their own (least recently used "
                      "evicted; others share one bucket)")
          ->check(CLI::Range(1, 10000000))
          ->capture_default_str();
  sub->add_option("--scope-secret-file", o->scope_secret_file,
                  "File holding the key (>= 16 bytes) of the HMAC that hashes principals before "
                  "they are stored (default: a key kept in the database)");
  sub->add_option("--sweep-interval", o->sweep_interval, "How often expired records are purged")
      ->capture_default_str();
  sub->add_option("--threads", o->threads,
                  "Worker threads (the database work; the event loop reads and writes apart)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  sub->add_option("--max-concurrency", o->max_concurrency,
                  "Requests in flight on /v1 beyond which retries (Keel-Attempt, "
                  "x-envoy-attempt-count or grpc-previous-rpc-attempts > first) are answered 503 "
                  "+ Retry-After (default 0: no limit)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30));
  sub->add_option("--admission-queue", o->admission_queue,
                  "First attempts admitted beyond --max-concurrency before they are shed too "
                  "(default max-concurrency / 4, at least 1)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30));
  sub->add_option("--adaptive-latency", o->adaptive_latency,
                  "Make --max-concurrency the upper bound of an adaptive limit (AIMD): a request "
                  "slower than this cuts it by 10%, a fast one while busy adds 1");
  sub->add_option("--max-body-bytes", o->max_body_bytes,
                  "Largest request body in bytes (413 beyond, before it is read)")
      ->capture_default_str();
  sub->add_option("--max-json-depth", o->max_json_depth,
                  "Deepest nesting of JSON arrays and objects in a request body (400 beyond)")
      ->capture_default_str();
  sub->add_option("--retry-after-spread", o->retry_after_spread,
                  "Retry-After of the answers every client meets at once (database "
                  "unavailable, commit in doubt): whole seconds uniform over 1..N")
      ->type_name("N")
      ->capture_default_str();
  sub->add_option("--max-connections", o->max_connections,
                  "Connections open at once; at the limit a new one takes the slot of the oldest "
                  "connection not having a request handled (lowered when the limit of open files "
                  "cannot hold it)")
      ->type_name("N")
      ->capture_default_str();
  sub->add_option("--first-byte-timeout", o->first_byte_timeout,
                  "How long a new connection may wait before sending its first byte")
      ->capture_default_str();
  sub->add_option("--header-timeout", o->header_timeout,
                  "Deadline of a request's head, from its first byte (from the accept for a "
                  "connection's first request)")
      ->capture_default_str();
  sub->add_option("--body-timeout", o->body_timeout,
                  "Deadline of a request's body, from the end of its head")
      ->capture_default_str();
  sub->add_option("--idle-timeout", o->idle_timeout,
                  "How long a keep-alive connection may wait for its next request")
      ->capture_default_str();
  sub->add_option("--write-timeout", o->write_timeout, "Deadline of writing one answer")
      ->capture_default_str();
  sub->add_option("--drain-timeout", o->drain_timeout,
                  "How long a stop (SIGTERM, SIGINT, SIGHUP) waits for in-flight requests; those "
                  "left then are abandoned (nothing of them commits)")
      ->capture_default_str();
  sub->add_option("--health-timeout", o->health_timeout,
                  "How long GET /healthz waits for the database (on a connection of its own) "
                  "before it answers 503")
      ->capture_default_str();
  sub->add_flag("--reuse-port", o->reuse_port,
                "Share the listening port with other processes (SO_REUSEPORT); without it a port "
                "in use is an error");
  sub->add_flag("--no-idempotency", o->no_idempotency,
                "Serve POST /v1/charges without the idempotency layer (for comparison)");
  sub->add_option("--chaos-503", o->chaos_503, "Fraction of /v1 requests answered 503")
      ->check(CLI::Range(0.0, 1.0));
  sub->add_option("--chaos-503-retry-after", o->chaos_503_retry_after,
                  "Retry-After sent with injected 503s (default none)");
  sub->add_option("--chaos-delay-fraction", o->chaos_delay_fraction,
                  "Fraction of /v1 requests delayed by --chaos-delay")
      ->check(CLI::Range(0.0, 1.0));
  CLI::Option* chaos_delay =
      sub->add_option("--chaos-delay", o->chaos_delay, "Injected delay")->capture_default_str();
  sub->add_option("--chaos-hang-fraction", o->chaos_hang_fraction,
                  "Fraction of /v1 requests that hang for --chaos-hang (or until shutdown)")
      ->check(CLI::Range(0.0, 1.0));
  CLI::Option* chaos_hang = sub->add_option("--chaos-hang", o->chaos_hang, "How long a hang lasts")
                                ->capture_default_str();
  sub->add_option("--chaos-drop-after-commit", o->chaos_drop,
                  "Fraction of committed charges whose response is dropped (connection closed)")
      ->check(CLI::Range(0.0, 1.0));
  sub->add_option("--chaos-seed", o->chaos_seed, "Seed for the fault injection");
  return [o, rate_limit_principals, chaos_delay, chaos_hang] {
    o->given_rate_limit_principals = rate_limit_principals->count() > 0;
    o->given_chaos_delay = chaos_delay->count() > 0;
    o->given_chaos_hang = chaos_hang->count() > 0;
    return run_serve(*o);
  };
}

}  // namespace keel::cli
