// `keel jobs work`: checks the flags, builds the queue, the handler (keel::store::WebhookHandler
// for --deliver, keel::store::CommandHandler for --exec, keel::store::DeferredRequestHandler for
// --deferred) and the keel::store::Worker, serves --metrics-listen and turns SIGTERM and SIGINT
// into Worker::stop(). --timeout is a per-request limit for the HTTP handlers (default 30 s) and
// a per-run limit for --exec only when given.
#include <httplib.h>
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>

#include "jobs_cli.hpp"
#include "jobs_metrics.hpp"
#include "keel/budget.hpp"
#include "keel/duration.hpp"
#include "keel/http/client.hpp"
#include "keel/http/url.hpp"
#include "keel/rate_limit.hpp"
#include "keel/store/db/dialect.hpp"
#include "keel/store/fleet/shared_breakers.hpp"
#include "keel/store/handlers/command_handler.hpp"
#include "keel/store/handlers/deferred_request.hpp"
#include "keel/store/handlers/webhook_handler.hpp"
#include "keel/store/queue/queue_worker.hpp"
#include "keel/store/server/idempotency_middleware.hpp"
#include "queue_cli.hpp"
#include "rate_flag.hpp"

namespace keel::cli::jobs_cli {

using queue_cli::failure;

int run_work(const JobsArgs& a) {
  const auto url = queue_cli::parse_db_flag("jobs", a.db);
  if (!url) return kExitUsage;
  if (auto queue = store::check_queue_name(a.queue); !queue) {
    return usage(queue.error().in("--queue").message());
  }
  if (const int handlers = !a.deliver.empty() + !a.exec.empty() + a.deferred; handlers != 1) {
    return usage(handlers == 0
                     ? "work needs a handler: give --deliver URL or --exec CMD (or --deferred)"
                     : "--deliver, --exec and --deferred are mutually exclusive");
  }
  if (!a.deliver.empty()) {
    // The client's own check: a URL it cannot send is refused here, not dead-lettered per job.
    if (auto parsed = http::parse_url(a.deliver); !parsed) {
      return usage(parsed.error().in("--deliver").message());
    }
  }
  std::optional<store::DatabaseUrl> listen_url;
  if (!a.listen_db.empty()) {
    auto parsed = store::parse_database_url(a.listen_db);
    if (!parsed) return usage(parsed.error().in("--listen-db").message());
    if (!store::dialect_of(parsed->backend).listen_notify() || parsed->transaction_pooler) {
      return usage(Error{.field = "--listen-db",
                         .problem = "must be a direct PostgreSQL URL (LISTEN needs a session of "
                                    "its own, not a transaction pooler's)",
                         .got = quote_value(parsed->redacted)}
                       .message());
    }
    listen_url = std::move(*parsed);
  }
  const auto node_check = duration_flag("--node-check", a.node_check, kQueueDuration);
  if (!node_check) return kExitUsage;
  std::optional<store::DatabaseUrl> share_url;
  if (a.share_breakers) {
    if (!a.exec.empty()) {
      return usage(
          "--share-fleet: needs --deliver or --deferred (an --exec job calls no "
          "dependency keel knows of)");
    }
    if (a.share_breakers_url.empty()) {
      share_url = *url;
    } else {
      auto parsed = store::parse_database_url(a.share_breakers_url);
      if (!parsed) return usage(parsed.error().in("--share-fleet").message());
      share_url = std::move(*parsed);
    }
  }
  std::optional<double> rate;
  if (!a.rate_limit.empty()) {
    if (!a.exec.empty()) {
      return usage(
          "--rate-limit: needs --deliver or --deferred (an --exec job calls no "
          "dependency keel knows of)");
    }
    auto parsed = parse_rate("--rate-limit", a.rate_limit);
    if (!parsed) return usage(parsed.error().message());
    rate = *parsed;
  }
  if (a.concurrency < 1 || a.concurrency > 256) {
    return usage("--concurrency: must be 1..256, got " + std::to_string(a.concurrency));
  }
  if (a.batch < 1 || a.batch > 1000) {
    return usage("--batch: must be 1..1000, got " + std::to_string(a.batch));
  }
  const auto lease = duration_flag("--lease", a.lease, kLeaseDuration);
  if (!lease) return kExitUsage;
  const auto base = duration_flag("--backoff-base", a.backoff_base, kQueueDuration);
  if (!base) return kExitUsage;
  const auto cap = duration_flag("--backoff-cap", a.backoff_cap, kQueueDuration);
  if (!cap) return kExitUsage;
  if (*cap < *base) {
    return usage("--backoff-cap: must be at least --backoff-base (" + a.backoff_base + "), got '" +
                 a.backoff_cap + "'");
  }
  const auto grace = duration_flag("--grace", a.grace, kQueueDurationOrZero);
  if (!grace) return kExitUsage;
  // --poll, when given, holds whatever wakes the worker: it is also the idle poll on PostgreSQL.
  const auto poll = duration_flag("--poll", a.poll.empty() ? "100ms" : a.poll, kQueueDuration);
  if (!poll) return kExitUsage;
  const auto idle_poll = duration_flag("--idle-poll",
                                       !a.idle_poll.empty() ? a.idle_poll
                                       : !a.poll.empty()    ? a.poll
                                                            : "5s",
                                       kQueueDuration);
  if (!idle_poll) return kExitUsage;
  // --timeout bounds one HTTP request of --deliver and --deferred (30 s unless given) and, only
  // when given, one run of an --exec command: a command that has always run long is not cut
  // short by a default it never had.
  const bool timeout_given = !a.timeout.empty();
  const auto timeout = duration_flag("--timeout", timeout_given ? a.timeout : kDeliverTimeout,
                                     a.exec.empty() ? kCurlTimeout : kQueueDuration);
  if (!timeout) return kExitUsage;
  // The queue's retries draw on a ratio budget (retries <= RATIO x first attempts in 10 s, plus
  // 10 a second): it refills with time, so a deferred job is never stuck behind it.
  std::optional<double> budget_ratio;
  if (a.retry_budget != "off") {
    const auto r = parse_fraction("--retry-budget", a.retry_budget, 0.0, 1000.0);
    if (!r) {
      return usage(Error{.field = "--retry-budget",
                         .problem = "must be a ratio from 0 to 1000 (a decimal number) or 'off'",
                         .got = quote_value(a.retry_budget)}
                       .message());
    }
    budget_ratio = *r;
  }
  const auto max_db_outage = duration_flag("--max-db-outage", a.max_db_outage, kQueueDuration);
  if (!max_db_outage) return kExitUsage;
  Duration max_age = kInfinite;
  if (!a.max_age.empty()) {
    const auto d = duration_flag("--max-age", a.max_age, kQueueDuration);
    if (!d) return kExitUsage;
    max_age = *d;
  }
  std::optional<Duration> retain;
  if (!a.retain_done.empty()) {
    retain = duration_flag("--retain-done", a.retain_done, kQueueDurationOrZero);
    if (!retain) return kExitUsage;
  }
  store::QueueOptions queue_options;
  if (!dead_letter_flags(a, queue_options)) return kExitUsage;
  std::string metrics_host;
  int metrics_port = -1;
  if (!a.metrics_listen.empty()) {
    const std::size_t colon = a.metrics_listen.rfind(':');
    if (colon == std::string::npos) {
      return usage("--metrics-listen: expected HOST:PORT, got '" + a.metrics_listen + "'");
    }
    metrics_host = a.metrics_listen.substr(0, colon);
    if (metrics_host.empty()) metrics_host = "127.0.0.1";
    const auto port = parse_count("--metrics-listen", a.metrics_listen.substr(colon + 1), 0, 65535);
    if (!port) {
      return usage(Error{.field = "--metrics-listen",
                         .problem = "must be HOST:PORT with a PORT from 0 to 65535",
                         .got = quote_value(a.metrics_listen)}
                       .message());
    }
    metrics_port = static_cast<int>(*port);
  }
  if (!store::database_exists(*url)) {
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
  Metrics metrics(a.queue, queue_options.dead_letter_retention < kInfinite);
  queue_options.backoff = {.base = *base, .cap = *cap};
  queue_options.lease = *lease;
  queue_options.max_age = max_age;
  queue_options.on_dead_letter = [&](std::int64_t, const store::DeadLetterReason& dead) {
    metrics.dead_lettered(dead.reason);
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
  // Each dependency's rate, and the pauses a 429 or 503 with Retry-After asks for: with
  // --rate-limit, or with the fleet's sharing (pauses only, without --rate-limit). Declared
  // before the sharing, which detaches from it when destroyed.
  std::unique_ptr<RateLimitRegistry> rates;
  if ((rate || share_url) && (!a.deliver.empty() || a.deferred)) {
    rates = std::make_unique<RateLimitRegistry>(RateLimitOptions{.rate_per_s = rate.value_or(0)});
  }
  std::unique_ptr<store::SharedBreakers> shared_breakers;
  if (!a.deliver.empty() || a.deferred) {
    breakers.add_listener([&](std::string_view key, BreakerState from, BreakerState to) {
      breaker_log.on_change(key, from, to);
    });
    if (share_url) {
      try {
        shared_breakers = std::make_unique<store::SharedBreakers>(
            breakers, *share_url,
            store::SharedBreakersOptions{.listen_url = listen_url, .rate_limits = rates.get()});
      } catch (const std::invalid_argument& e) {
        return usage(std::string("--share-fleet: ") + e.what());
      }
      // Start with the fleet's state; an unreachable database was said by SharedBreakers.
      if (shared_breakers->wait_until_sharing(std::chrono::seconds(5))) {
        std::fprintf(stderr, "keel jobs: breakers%s shared through %s as %s\n",
                     rate ? ", rate limits and pauses" : " and pauses", share_url->redacted.c_str(),
                     shared_breakers->process().c_str());
      }
    }
    http::ClientOptions options = store::webhook_client_options(*timeout);
    options.brakes.breakers = &breakers;
    // A slot within the fleet's schedule is waited for; a longer hold (a pause) defers the job.
    options.brakes.rate_limits = rates.get();
    options.brakes.max_limit_wait = std::chrono::seconds(2);
    options.brakes.retry_budget = budget != nullptr;
    options.brakes.budget = budget.get();
    options.retry.events = &metrics.watch(breakers, budget.get());  // retries, breakers, budget
    options.retry.operation = "webhook";
    client = std::make_unique<http::Client>(options);
  }
  store::JobHandler handler;
  if (a.deferred) {
    handler = store::DeferredRequestHandler(*client);
  } else if (client) {
    handler = store::WebhookHandler(*client, a.deliver);
  } else {
    handler = store::CommandHandler(a.exec, {.timeout = timeout_given ? *timeout : kInfinite});
  }
  store::WorkerOptions options;
  options.queue = a.queue;
  options.concurrency = a.concurrency;
  options.batch = a.batch;
  options.poll_interval = *poll;
  options.idle_poll = *idle_poll;
  options.wakeups = !a.no_wakeups;
  options.listen_url = listen_url;
  options.node_check = *node_check;
  options.grace = *grace;
  options.exit_when_idle = a.exit_when_idle;
  options.done_retention = retain;
  options.max_database_outage = *max_db_outage;
  options.on_event = [&](const store::WorkerEvent& e) { metrics.record(e); };
  options.on_dead_letters_pruned = [&](std::int64_t n) { metrics.dead_letters_pruned(n); };
  store::Worker worker(pool, queue, options, handler);

  std::unique_ptr<httplib::Server> server;
  std::thread server_thread;
  if (metrics_port >= 0) {
    server = std::make_unique<httplib::Server>();
    store::apply_server_limits(*server, {});  // an exclusive port (no SO_REUSEPORT), limits
    server->Get("/metrics", [&](const httplib::Request&, httplib::Response& res) {
      try {
        auto conn = pool.acquire();
        res.set_content(metrics.render(queue.stats(*conn), queue.deadlocks()),
                        "text/plain; version=0.0.4");
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

}  // namespace keel::cli::jobs_cli
