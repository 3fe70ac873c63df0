// `keel call [options] URL`: one HTTP request from the shell, like curl, with retries done right
// (keel::http::Client: jittered backoff, Retry-After, deadline, idempotency key, Keel-Attempt).
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "call_cli.hpp"
#include "call_fallback.hpp"
#include "call_spool.hpp"
#include "keel/core/backoff.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/events.hpp"
#include "keel/core/policy_check.hpp"
#include "keel/core/rate_limit.hpp"
#include "keel/http/client.hpp"
#include "rate_flag.hpp"

namespace keel::cli::call_cli {
namespace {

// Exit statuses of `keel call` (documented in --help and README.md).
constexpr int kExitOk = 0;
constexpr int kExitLocalError = 1;
constexpr int kExitPermanent = 3;
constexpr int kExitAttemptsExhausted = 4;
constexpr int kExitDeadline = 5;
constexpr int kExitNotSafe = 6;
constexpr int kExitBrake = 7;
constexpr int kExitQueued = 8;
constexpr int kExitKeyQueuedDifferently = 9;

int exit_status(StopReason reason) {
  switch (reason) {
    case StopReason::kSuccess:
      return kExitOk;
    case StopReason::kPermanent:
      return kExitPermanent;
    case StopReason::kAttemptsExhausted:
      return kExitAttemptsExhausted;
    case StopReason::kDeadline:
      return kExitDeadline;
    case StopReason::kNotSafeToRetry:
      return kExitNotSafe;
    case StopReason::kBudgetExhausted:
    case StopReason::kCircuitOpen:
    case StopReason::kLimited:
      return kExitBrake;
    case StopReason::kCancelled:
      return kExitLocalError;
    case StopReason::kQueued:
      return kExitQueued;
  }
  return kExitLocalError;
}

// The log, and with -v a line per attempt in the events' words.
void observe(const CallArgs& a, http::ClientOptions& options) {
  options.observability.log = [](std::string_view line) {
    std::fprintf(stderr, "%.*s\n", static_cast<int>(line.size()), line.data());
  };
  if (!a.verbose) return;
  options.observability.on_attempt = [](const http::AttemptEvent& e) {
    std::string line = "keel call: attempt " + std::to_string(e.attempt) + ": " +
                       std::string(e.method) + " " + std::string(e.url) + " -> " +
                       describe(e.outcome);
    if (!e.error.empty()) line += " [" + std::string(e.error) + "]";
    line += " in " + format_duration(e.took) + "; " +
            format_decision(e.will_retry, e.delay, e.reason);  // the events' words
    std::fprintf(stderr, "%s\n", line.c_str());
  };
}

// What --rate-limit, --share-fleet and --queue-on-failure add to the client: kept alive for the
// call.
struct CallBrakes {
  std::unique_ptr<RateLimitRegistry> rates;
#if KEEL_CLI_JOBS
  std::unique_ptr<SharedBreakersForCall> shared;
  std::unique_ptr<QueueOnFailure> queue;
#endif
};

// Sets up `brakes` and `options` for them; 0 or the exit status after a usage error.
int add_brakes(const CallArgs& a, http::ClientOptions& options, CallBrakes& brakes) {
  // The host's rate (--rate-limit) and the pauses a 429 or 503 with Retry-After asks for.
  if (a.rate_limit || !a.share_breakers.empty()) {
    brakes.rates = std::make_unique<RateLimitRegistry>(
        command_rate_options(a.rate_limit.value_or(0), "keel call"));
    options.brakes.rate_limits = brakes.rates.get();
  }
  options.brakes.adaptive_concurrency = a.adaptive_concurrency;
  // A slot, a pause or a place under the limit is waited for within the call's deadline, not a
  // shorter bound of its own.
  if (brakes.rates || a.adaptive_concurrency) {
    options.brakes.max_limit_wait = options.retry.overall_timeout;
  }
#if KEEL_CLI_JOBS
  if (!a.share_breakers.empty()) {
    auto opened =
        SharedBreakersForCall::open(a.share_breakers, std::chrono::seconds(2), brakes.rates.get());
    if (!opened) return usage_error(opened.error().message());
    brakes.shared = std::move(*opened);
    options.brakes.breakers = &brakes.shared->registry();
  }
  if (!a.queue_on_failure.empty()) {
    auto opened = QueueOnFailure::open(a.queue_on_failure, a.defer_queue, a.secret_headers);
    if (!opened) return usage_error(opened.error().message());
    brakes.queue = std::move(*opened);
    options.fallbacks.deferred_writes = &brakes.queue->writes();
  }
#else
  if (!a.queue_on_failure.empty() || !a.share_breakers.empty()) {
    return usage_error(
        std::string(a.queue_on_failure.empty() ? "--share-fleet" : "--queue-on-failure") +
        ": this keel was built without keel::store");
  }
#endif
  return 0;
}

// What the call ended with, on stdout and stderr, and its exit status.
int report(const CallArgs& a, const http::Result& result, Spool& spool, const CallBrakes& brakes) {
  if (result.outcome.duplicate) {
    std::fprintf(stderr,
                 "keel call: HTTP %d after an ambiguous failure: an earlier attempt took effect "
                 "(--duplicate-is-success)\n",
                 result.outcome.code);
  }
  if (result.reason == StopReason::kQueued) {
#if KEEL_CLI_JOBS
    std::fprintf(stderr,
                 "keel call: %s as job %s (Idempotency-Key %s); keel jobs --db %s "
                 "work --queue %s --deferred delivers it\n",
                 result.deferral == http::DeferralStatus::kAlreadyQueued ? "already queued"
                                                                         : "queued for later",
                 result.job_id.c_str(), result.idempotency_key.c_str(),
                 brakes.queue->database().c_str(), brakes.queue->queue().c_str());
#else
    (void)brakes;
#endif
    std::printf("%s\n", result.job_id.c_str());
    return exit_status(result.reason);
  }
  if (result.stale) std::fprintf(stderr, "%s\n", stale_note(result).c_str());
  if (result.response) {
    const std::string head = a.include ? response_head(result) : std::string();
    if (!a.output.empty()) {
      if (!spool.publish(a.output, head)) {
        std::fprintf(stderr, "keel call: --output: cannot write '%s': %s\n", a.output.c_str(),
                     spool.error().c_str());
        return kExitLocalError;
      }
    } else {
      std::fflush(stdout);
      if (!spool.copy_to(STDOUT_FILENO, head)) {
        std::fprintf(stderr, "keel call: cannot write to stdout: %s\n", spool.error().c_str());
        return kExitLocalError;
      }
    }
  } else if (!result.error.empty()) {
    std::fprintf(stderr, "keel call: %s\n", result.error.c_str());
  }
  if (result.response && !a.queue_on_failure.empty() && !result.error.empty()) {
    std::fprintf(stderr, "keel call: %s\n", result.error.c_str());  // the enqueue failed
  }
  if (result.deferral == http::DeferralStatus::kKeyConflict) return kExitKeyQueuedDifferently;
  if (result.attempts == 0 && result.reason == StopReason::kPermanent) {
    return kExitUsage;  // refused by the client before sending (check_request)
  }
  return exit_status(result.reason);
}

}  // namespace

int usage_error(const std::string& message) {
  std::fprintf(stderr, "keel call: %s\n", message.c_str());
  return kExitUsage;
}

int run_call(const CallArgs& a) {
  // Validate everything before sending anything.
  if (auto url = http::parse_url(a.url); !url) return usage_error(url.error().message());
  if (!check_policy_flags("call", a.policy)) return kExitUsage;
  const RetryOptions& retry = a.policy.retry;
  const auto hedge = hedge_options(a.hedge);
  if (!hedge) return kExitUsage;
  const std::optional<DuplicateFlag>& duplicate = a.duplicate_is_success;
  http::Request request;
  if (const int status = build_request(a, request); status != 0) return status;

  // The body is spooled to a file as it arrives (never held in memory): next to --output's file,
  // or in TMPDIR for stdout.
  Spool spool;
  if (auto opened = spool.open(a.output.empty() ? std::string() : Spool::directory_of(a.output));
      !opened) {
    std::fprintf(stderr, "keel call: %s: %s\n",
                 a.output.empty() ? "stdout" : ("--output '" + a.output + "'").c_str(),
                 opened.error().message().c_str());
    return kExitLocalError;
  }
  request.body_sink.restart = [&spool] { return spool.restart(); };
  request.body_sink.write = [&spool](std::string_view data) { return spool.write(data); };

  http::ClientOptions options;
  options.retry = retry;
  options.transport.connect_timeout = a.connect_timeout;
  options.hedge = *hedge;
  if (duplicate) {
    // The body goes to the spool, not to memory: the predicate reads the attempt's body there.
    options.classify.duplicate_success =
        DuplicateSuccessOptions{.statuses = {duplicate->status},
                                .body = [&spool, text = duplicate->text](std::string_view) {
                                  return text.empty() || spool.contains(text);
                                }};
  }
  observe(a, options);
  CallBrakes brakes;
  if (const int status = add_brakes(a, options, brakes); status != 0) return status;
  http::Client client(std::move(options));
  if (const std::string unfit = format_unfit(check_policy(RetryPolicy(retry)));
      a.verbose && !unfit.empty()) {
    std::fprintf(stderr, "keel call: warning: %s\n", unfit.c_str());
  }
  if (a.verbose && !request.idempotency_key.empty()) {
    std::fprintf(stderr, "keel call: Idempotency-Key: %s\n", request.idempotency_key.c_str());
  }
  return report(a, client.send(request), spool, brakes);
}

}  // namespace keel::cli::call_cli
