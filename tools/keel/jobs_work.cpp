// `keel jobs work`: checks the flags, builds the queue, the handler (keel::store::WebhookHandler
// for --deliver, keel::store::CommandHandler for --exec, keel::store::DeferredRequestHandler for
// --deferred) and the keel::store::Worker, serves --metrics-listen and turns a stop signal
// (SIGTERM, SIGINT, SIGHUP) into Worker::stop(). --timeout is a per-request limit for the HTTP
// handlers (default 30 s) and a per-run limit for --exec only when given.
#include "jobs_work.hpp"

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
#include "keel/core/budget.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/rate_limit.hpp"
#include "keel/db/dialect.hpp"
#include "keel/fleet/shared_breakers.hpp"
#include "keel/handlers/command_handler.hpp"
#include "keel/handlers/deferred_request.hpp"
#include "keel/handlers/webhook_handler.hpp"
#include "keel/http/client.hpp"
#include "keel/http/url.hpp"
#include "keel/queue/queue_worker.hpp"
#include "keel/serve/httplib/idempotency_middleware.hpp"
#include "queue_cli.hpp"
#include "rate_flag.hpp"
#include "stop_signals.hpp"

namespace keel::cli::jobs_cli {

using queue_cli::failure;

namespace {

// What a --deliver or --deferred worker calls its dependency with: the breakers (shared with
// the fleet with --share-fleet), each dependency's rate and pauses, the retry budget.
struct Delivery {
  std::unique_ptr<RatioBudget> budget;
  BreakerRegistry breakers;
  std::unique_ptr<BreakerLog> breaker_log;
  // Declared before the sharing, which detaches from it when destroyed.
  std::unique_ptr<RateLimitRegistry> rates;
  std::unique_ptr<store::SharedBreakers> shared;
  std::unique_ptr<http::Client> client;
};

// Sets up `d` for a worker that delivers; false after printing a usage error.
bool start_delivery(const WorkSettings& s, Metrics& metrics, Delivery& d) {
  if (s.budget_ratio) {
    d.budget = std::make_unique<RatioBudget>(RatioBudgetOptions{.ratio = *s.budget_ratio});
  }
  d.breaker_log = std::make_unique<BreakerLog>(d.breakers);
  // Each dependency's rate, and the pauses a 429 or 503 with Retry-After asks for: with
  // --rate-limit, or with the fleet's sharing (pauses only, without --rate-limit).
  if (s.rate || s.share_url) {
    d.rates =
        std::make_unique<RateLimitRegistry>(command_rate_options(s.rate.value_or(0), "keel jobs"));
  }
  d.breakers.add_listener([&d](std::string_view key, BreakerState from, BreakerState to) {
    d.breaker_log->on_change(key, from, to);
  });
  if (s.share_url) {
    try {
      d.shared = std::make_unique<store::SharedBreakers>(
          d.breakers, *s.share_url,
          store::SharedBreakersOptions{.listen_url = s.listen_url, .rate_limits = d.rates.get()});
    } catch (const std::invalid_argument& e) {
      return usage(std::string("--share-fleet: ") + e.what()), false;
    }
    // Start with the fleet's state; an unreachable database was said by SharedBreakers.
    if (d.shared->wait_until_sharing(std::chrono::seconds(5))) {
      std::fprintf(stderr, "keel jobs: breakers%s shared through %s as %s\n",
                   s.rate ? ", rate limits and pauses" : " and pauses",
                   s.share_url->redacted.c_str(), d.shared->process().c_str());
    }
  }
  metrics.watch_rates(d.rates.get(), d.shared.get());
  http::ClientOptions options = store::webhook_client_options(s.timeout);
  options.brakes.breakers = &d.breakers;
  // A slot within the fleet's schedule is waited for; a longer hold (a pause) defers the job.
  options.brakes.rate_limits = d.rates.get();
  options.brakes.max_limit_wait = std::chrono::seconds(2);
  options.brakes.adaptive_concurrency = s.adaptive_concurrency;
  options.brakes.retry_budget = d.budget != nullptr;
  options.brakes.budget = d.budget.get();
  options.retry.events = &metrics.watch(d.breakers, d.budget.get());  // retries, breakers, budget
  options.retry.operation = "webhook";
  d.client = std::make_unique<http::Client>(options);
  return true;
}

store::WorkerOptions worker_options(const JobsArgs& a, const WorkSettings& s, Metrics& metrics) {
  store::WorkerOptions options;
  options.queue = a.queue;
  options.concurrency = a.concurrency;
  options.batch = a.batch;
  options.poll_interval = s.poll;
  options.idle_poll = s.idle_poll;
  options.wakeups = !a.no_wakeups;
  options.listen_url = s.listen_url;
  options.node_check = s.node_check;
  options.grace = s.grace;
  options.flush_window = s.flush_window;
  options.exit_when_idle = a.exit_when_idle;
  options.done_retention = s.retain;
  options.max_database_outage = s.max_db_outage;
  options.on_event = [&metrics](const store::WorkerEvent& e) { metrics.record(e); };
  options.on_dead_letters_pruned = [&metrics](std::int64_t n) { metrics.dead_letters_pruned(n); };
  return options;
}

// The /metrics endpoint (--metrics-listen) on a thread of its own; -1 when it cannot listen.
int start_metrics(const WorkSettings& s, store::ConnectionPool& pool, const store::JobQueue& queue,
                  Metrics& metrics, std::unique_ptr<httplib::Server>& server, std::thread& thread) {
  server = std::make_unique<httplib::Server>();
  store::apply_server_limits(*server, {});  // an exclusive port (no SO_REUSEPORT), limits
  server->Get("/metrics", [&](const httplib::Request&, httplib::Response& res) {
    try {
      auto conn = pool.acquire();
      res.set_content(
          metrics.render(queue.stats(*conn), queue.deadlocks(), queue.returned_after_crash()),
          "text/plain; version=0.0.4");
    } catch (const std::exception& e) {
      res.status = 500;
      res.set_content(std::string("database error: ") + e.what() + "\n", "text/plain");
    }
  });
  const int port = s.metrics_port == 0 ? server->bind_to_any_port(s.metrics_host)
                   : server->bind_to_port(s.metrics_host, s.metrics_port) ? s.metrics_port
                                                                          : -1;
  if (port < 0) return -1;
  std::fprintf(stderr, "keel jobs: metrics on http://%s:%d/metrics\n", s.metrics_host.c_str(),
               port);
  thread = std::thread([&server] { server->listen_after_bind(); });
  return port;
}

// Runs `worker` until it stops or a stop signal (stop_signals.hpp) stops it (after the grace);
// the attempts it recorded.
std::int64_t run_until_signalled(store::Worker& worker, const sigset_t& signals,
                                 const std::string& grace) {
  std::atomic<bool> done{false};
  std::thread signal_thread([&] {
    const timespec tick{0, 100'000'000};
    while (!done.load()) {
      const int sig = sigtimedwait(&signals, nullptr, &tick);
      if (sig > 0) {
        std::fprintf(stderr, "keel jobs: %s: stopping (grace %s)\n", stop_signal_name(sig),
                     grace.c_str());
        worker.stop();
      }
    }
  });
  const std::int64_t recorded = worker.run();
  done.store(true);
  signal_thread.join();
  return recorded;
}

}  // namespace

int run_work(const JobsArgs& a) {
  WorkSettings s;
  if (!parse_work_flags(a, s)) return kExitUsage;
  if (!store::database_exists(s.url)) {
    return usage("--db: database '" + s.url.redacted + "' does not exist (enqueue creates it)");
  }
  store::ConnectionPool pool(s.url, {.max_connections = a.concurrency + 3});
  {
    bool has_schema = false;
    auto conn = queue_cli::open_queue_db(s.url, false, &has_schema);
    store::JobQueue q;
    if (!has_schema || !q.queue_exists(*conn, a.queue)) {
      return usage("--queue: unknown queue '" + a.queue + "' in " + s.url.redacted +
                   " (a queue is created by its first enqueue)");
    }
  }
  Metrics metrics(a.queue, s.queue_options.dead_letter_retention < kInfinite);
  s.queue_options.backoff = {.base = s.backoff_base, .cap = s.backoff_cap};
  s.queue_options.lease = s.lease;
  s.queue_options.max_age = s.max_age;
  // --retain-done 0s: a success deletes its job in the statement that records it, rather than
  // a prune pass deleting it within 10 s.
  s.queue_options.keep_done = !(s.retain && *s.retain == Duration::zero());
  s.queue_options.on_dead_letter = [&](std::int64_t, const store::DeadLetterReason& dead) {
    metrics.dead_lettered(dead.reason);
  };
  store::JobQueue queue(s.queue_options);

  // Signals are taken by one thread with sigwait; every other thread (started below) inherits
  // the blocked mask.
  const sigset_t signals = block_stop_signals();

  Delivery delivery;
  store::JobHandler handler;
  if (!a.deliver.empty() || a.deferred) {
    if (!start_delivery(s, metrics, delivery)) return kExitUsage;
    handler = a.deferred ? store::JobHandler(store::DeferredRequestHandler(*delivery.client))
                         : store::JobHandler(store::WebhookHandler(*delivery.client, a.deliver));
  } else {
    handler = store::CommandHandler(a.exec, {.timeout = s.timeout_given ? s.timeout : kInfinite});
  }
  store::Worker worker(pool, queue, worker_options(a, s, metrics), handler);

  std::unique_ptr<httplib::Server> server;
  std::thread server_thread;
  if (s.metrics_port >= 0 && start_metrics(s, pool, queue, metrics, server, server_thread) < 0) {
    return failure("jobs", "--metrics-listen: cannot listen on " + a.metrics_listen);
  }
  std::fprintf(stderr, "keel jobs: worker %s on queue '%s' (%s)\n", worker.worker_id().c_str(),
               a.queue.c_str(), s.url.redacted.c_str());
  const std::int64_t recorded = run_until_signalled(worker, signals, a.grace);
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
