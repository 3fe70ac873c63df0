// `keel jobs work`'s flags read into WorkSettings: the targets (database, queue, handler,
// sharing), the brakes, the timing and the limits, each refused with a message naming it.
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>

#include "jobs_cli.hpp"
#include "jobs_work.hpp"
#include "keel/core/budget.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/rate_limit.hpp"
#include "keel/db/dialect.hpp"
#include "keel/fleet/shared_breakers.hpp"
#include "keel/handlers/deferred_request.hpp"
#include "keel/http/client.hpp"
#include "keel/http/url.hpp"
#include "queue_cli.hpp"
#include "rate_flag.hpp"

namespace keel::cli::jobs_cli {
namespace {

// The database, the queue, the handler and where the worker's dependencies are shared: false
// after printing a usage error.
bool parse_work_targets(const JobsArgs& a, WorkSettings& s) {
  const auto url = queue_cli::parse_db_flag("jobs", a.db);
  if (!url) return false;
  s.url = *url;
  if (auto queue = store::check_queue_name(a.queue); !queue) {
    return usage(queue.error().in("--queue").message()), false;
  }
  if (const int handlers = !a.deliver.empty() + !a.exec.empty() + a.deferred; handlers != 1) {
    return usage(handlers == 0
                     ? "work needs a handler: give --deliver URL or --exec CMD (or --deferred)"
                     : "--deliver, --exec and --deferred are mutually exclusive"),
           false;
  }
  if (!a.deliver.empty()) {
    // The client's own check: a URL it cannot send is refused here, not dead-lettered per job.
    if (auto parsed = http::parse_url(a.deliver); !parsed) {
      return usage(parsed.error().in("--deliver").message()), false;
    }
  }
  if (!a.listen_db.empty()) {
    auto parsed = store::parse_database_url(a.listen_db);
    if (!parsed) return usage(parsed.error().in("--listen-db").message()), false;
    if (!store::dialect_of(parsed->backend).listen_notify() || parsed->transaction_pooler) {
      return usage(Error{.field = "--listen-db",
                         .problem = "must be a direct PostgreSQL URL (LISTEN needs a session of "
                                    "its own, not a transaction pooler's)",
                         .got = quote_value(parsed->redacted)}
                       .message()),
             false;
    }
    s.listen_url = std::move(*parsed);
  }
  const auto node_check = duration_flag("--node-check", a.node_check, kQueueDuration);
  if (!node_check) return false;
  s.node_check = *node_check;
  return true;
}

// --share-fleet and --rate-limit, which only a handler that calls a dependency takes.
bool parse_work_brakes(const JobsArgs& a, WorkSettings& s) {
  if (a.share_breakers) {
    if (!a.exec.empty()) {
      return usage(
                 "--share-fleet: needs --deliver or --deferred (an --exec job calls no "
                 "dependency keel knows of)"),
             false;
    }
    if (a.share_breakers_url.empty()) {
      s.share_url = s.url;
    } else {
      auto parsed = store::parse_database_url(a.share_breakers_url);
      if (!parsed) return usage(parsed.error().in("--share-fleet").message()), false;
      s.share_url = std::move(*parsed);
    }
  }
  if (a.rate_limit_given) {
    if (!a.exec.empty()) {
      return usage(
                 "--rate-limit: needs --deliver or --deferred (an --exec job calls no "
                 "dependency keel knows of)"),
             false;
    }
    auto parsed = parse_rate("--rate-limit", a.rate_limit);
    if (!parsed) return usage(parsed.error().message()), false;
    s.rate = *parsed;
  }
  if (a.adaptive_concurrency && !a.exec.empty()) {
    return usage(
               "--adaptive-concurrency: needs --deliver or --deferred (an --exec job calls no "
               "dependency keel knows of)"),
           false;
  }
  s.adaptive_concurrency = a.adaptive_concurrency;
  return true;
}

// The worker's sizes, leases, backoff and waits: false after printing a usage error.
bool parse_work_timing(const JobsArgs& a, WorkSettings& s) {
  if (a.concurrency < 1 || a.concurrency > 256) {
    return usage("--concurrency: must be 1..256, got " + std::to_string(a.concurrency)), false;
  }
  if (a.batch < 1 || a.batch > 1000) {
    return usage("--batch: must be 1..1000, got " + std::to_string(a.batch)), false;
  }
  const auto lease = duration_flag("--lease", a.lease, kLeaseDuration);
  if (!lease) return false;
  const auto base = duration_flag("--backoff-base", a.backoff_base, kQueueDuration);
  if (!base) return false;
  const auto cap = duration_flag("--backoff-cap", a.backoff_cap, kQueueDuration);
  if (!cap) return false;
  if (*cap < *base) {
    return usage("--backoff-cap: must be at least --backoff-base (" + a.backoff_base + "), got '" +
                 a.backoff_cap + "'"),
           false;
  }
  const auto grace = duration_flag("--grace", a.grace, kQueueDurationOrZero);
  if (!grace) return false;
  const auto flush_window = duration_flag("--flush-window", a.flush_window, kQueueDurationOrZero);
  if (!flush_window) return false;
  // --poll, when given, holds whatever wakes the worker: it is also the idle poll on PostgreSQL.
  const auto poll = duration_flag("--poll", a.poll.empty() ? "100ms" : a.poll, kQueueDuration);
  if (!poll) return false;
  const auto idle_poll = duration_flag("--idle-poll",
                                       !a.idle_poll.empty() ? a.idle_poll
                                       : !a.poll.empty()    ? a.poll
                                                            : "5s",
                                       kQueueDuration);
  if (!idle_poll) return false;
  // --timeout bounds one HTTP request of --deliver and --deferred (30 s unless given) and, only
  // when given, one run of an --exec command: a command that has always run long is not cut
  // short by a default it never had.
  s.timeout_given = !a.timeout.empty();
  const auto timeout = duration_flag("--timeout", s.timeout_given ? a.timeout : kDeliverTimeout,
                                     a.exec.empty() ? kCurlTimeout : kQueueDuration);
  if (!timeout) return false;
  s.lease = *lease;
  s.backoff_base = *base;
  s.backoff_cap = *cap;
  s.grace = *grace;
  s.flush_window = *flush_window;
  s.poll = *poll;
  s.idle_poll = *idle_poll;
  s.timeout = *timeout;
  return true;
}

// The retry budget, the outage and age limits, retention and the metrics port: false after
// printing a usage error.
bool parse_work_limits(const JobsArgs& a, WorkSettings& s) {
  // The queue's retries draw on a ratio budget (retries <= RATIO x first attempts in 10 s, plus
  // 10 a second): it refills with time, so a deferred job is never stuck behind it.
  if (a.retry_budget != "off") {
    const auto r = parse_fraction("--retry-budget", a.retry_budget, 0.0, 1000.0);
    if (!r) {
      return usage(Error{.field = "--retry-budget",
                         .problem = "must be a ratio from 0 to 1000 (a decimal number) or 'off'",
                         .got = quote_value(a.retry_budget)}
                       .message()),
             false;
    }
    s.budget_ratio = *r;
  }
  const auto max_db_outage = duration_flag("--max-db-outage", a.max_db_outage, kQueueDuration);
  if (!max_db_outage) return false;
  s.max_db_outage = *max_db_outage;
  if (!a.max_age.empty()) {
    const auto d = duration_flag("--max-age", a.max_age, kQueueDuration);
    if (!d) return false;
    s.max_age = *d;
  }
  if (a.retain_done != "forever") {
    if (a.retain_done.empty() || !std::isdigit(static_cast<unsigned char>(a.retain_done[0]))) {
      return usage(
                 "--retain-done: a duration (ns, us, ms, s, m or h, like 1h or 168h) or "
                 "'forever', got '" +
                 a.retain_done + "'"),
             false;
    }
    s.retain = duration_flag("--retain-done", a.retain_done, kQueueDurationOrZero);
    if (!s.retain) return false;
  }
  if (!dead_letter_flags(a, s.queue_options)) return false;
  if (a.metrics_listen.empty()) return true;
  const std::size_t colon = a.metrics_listen.rfind(':');
  if (colon == std::string::npos) {
    return usage("--metrics-listen: expected HOST:PORT, got '" + a.metrics_listen + "'"), false;
  }
  s.metrics_host = a.metrics_listen.substr(0, colon);
  if (s.metrics_host.empty()) s.metrics_host = "127.0.0.1";
  const auto port = parse_count("--metrics-listen", a.metrics_listen.substr(colon + 1), 0, 65535);
  if (!port) {
    return usage(Error{.field = "--metrics-listen",
                       .problem = "must be HOST:PORT with a PORT from 0 to 65535",
                       .got = quote_value(a.metrics_listen)}
                     .message()),
           false;
  }
  s.metrics_port = static_cast<int>(*port);
  return true;
}

}  // namespace

bool parse_work_flags(const JobsArgs& a, WorkSettings& s) {
  return parse_work_targets(a, s) && parse_work_brakes(a, s) && parse_work_timing(a, s) &&
         parse_work_limits(a, s);
}

}  // namespace keel::cli::jobs_cli
