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

#include "call_fallback.hpp"
#include "call_hedge.hpp"
#include "call_spool.hpp"
#include "commands.hpp"
#include "keel/backoff.hpp"
#include "keel/duration.hpp"
#include "keel/events.hpp"
#include "keel/http/client.hpp"
#include "keel/policy_check.hpp"
#include "keel/rate_limit.hpp"
#include "policy_flags.hpp"
#include "rate_flag.hpp"

namespace keel::cli {
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

constexpr const char* kCallFooter =
    R"(Durations are a number and a unit: 250ms, 1.5s, 2m, 1h (also ns, us).

Exit status:
  0  the final response was 2xx or 3xx, or the --duplicate-is-success answer to a retry
     after an ambiguous failure (an earlier attempt took effect)
  1  a local error (the output file could not be written, or cancelled)
  2  invalid arguments (the message names the flag)
  3  the final response was a failure that must not be retried (for example 400, 404,
     or a 500 already retried once; the body is still printed), a permanent network
     error such as an unknown host, or a response keel will not take (a head over 64 KiB)
  4  gave up after the last attempt on a retryable failure (5xx, 429, reset, timeout)
  5  gave up because the next attempt, or the server's Retry-After, would pass the deadline
  6  not retried because the request was not safe to repeat (an ambiguous failure of a POST
     or PATCH without an idempotency key)
  7  not retried because a brake refused: the retry budget was empty or the host's circuit
     breaker was open
  8  --queue-on-failure: the request failed as in 4, 5 or 7 and was queued for later; the
     job id is printed on stdout (`keel jobs work --deferred` delivers it), or the same
     request was already queued under its Idempotency-Key ("already queued as job N")
  9  --queue-on-failure: the request failed as in 4, 5 or 7 and was NOT queued because its
     Idempotency-Key is already queued with a different request (method, URL, header fields
     or body); the existing job id is printed on stderr. Use a new key for a new request

Every request carries Keel-Attempt: N. POST and PATCH carry one Idempotency-Key (a random
UUID, the same on every attempt) unless --idempotency-key off. A key given with
-H 'Idempotency-Key: K' or --idempotency-key K is the one sent, once, on every attempt (even
with off); the two must agree. A key is at most 255 bytes of visible ASCII.

--duplicate-is-success STATUS[:TEXT] (for example 409:'already exists') reads that answer,
on a retry after an ambiguous failure (a timeout or reset after sending, a 500), as the
success of the earlier attempt: the receiver acted on it and only its answer was lost. The
duplicate answer is printed, with a note on stderr. On a first attempt, or after any other
failure, the same answer keeps its meaning (a 409 is then a real conflict).

--queue-on-failure DB (a database URL as keel jobs --db takes it, or a SQLite path) hands
a request that carries an Idempotency-Key (a POST or PATCH with --idempotency-key auto, or a
caller's key) to the job queue --defer-queue of DB when the host is down: its breaker is open,
or the retries gave up on a retryable failure (exit 4, 5 or 7). The call then exits 8 and
prints the job id; `keel jobs --db DB work --queue deferred-http --deferred` sends it later
with the same Idempotency-Key, so the receiver applies it once. A request without a key is
never queued. When the enqueue fails, the call exits as it would have, saying why.
The queued request keeps its header fields, credentials included (Authorization,
Proxy-Authorization, Cookie and each --secret-header NAME), in the queue's database, so that
the delivery carries them: protect that database like the credentials. keel dlq shows them
as [redacted], and they are not compared when the same key is queued again.

--hedge DELAY sends another attempt of a request that is safe to repeat (GET, HEAD, PUT,
DELETE, OPTIONS, or a POST or PATCH with its Idempotency-Key; the same key on every attempt)
when the one in flight has not answered after DELAY, up to --max-hedges at once (default 1);
the first good answer wins and the others are cancelled. Each hedge is charged to the retry
budget like a retry: when the budget is empty no hedge is sent and the call waits.

The body is written to -o FILE as it arrives (through a temporary file renamed at the end, so
only the final attempt's body is kept); for stdout it is spooled to a file in TMPDIR first.)";

struct CallArgs {
  std::string url;
  std::string method;
  std::string data;
  bool data_given = false;
  std::vector<std::string> headers;
  bool include = false;
  bool verbose = false;
  std::string output;
  PolicyFlags policy;
  std::string connect_timeout = "2s";
  std::string idempotency_key = "auto";
  std::string duplicate_is_success;  // STATUS[:TEXT]; empty: off
  std::string queue_on_failure;      // DB; empty: off
  std::string share_breakers;        // DB; empty: the call's own breakers
  std::string rate_limit;            // RATE[/s]; empty: none
  std::string defer_queue = "deferred-http";
  std::string hedge;       // DELAY; empty: no hedging
  std::string max_hedges;  // N; empty: 1
  // --secret-header NAME, repeatable: credentials besides Authorization, Cookie.
  std::vector<std::string> secret_headers;
};

int usage_error(const std::string& message) {
  std::fprintf(stderr, "keel call: %s\n", message.c_str());
  return kExitUsage;
}

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

// Reads --data @FILE; the Error names the flag, the file and why (a directory, unreadable, ...).
Expected<std::string> read_body_file(const std::string& path) {
  const auto fail = [&path](std::string why) {
    return Error{.field = "--data", .problem = "cannot be read: " + why, .got = quote_value(path)};
  };
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec) return fail(ec.message());
  if (std::filesystem::is_directory(status)) return fail("it is a directory");
  std::ifstream in(path, std::ios::binary);
  if (!in) return fail(std::strerror(errno));
  std::ostringstream content;
  content << in.rdbuf();
  if (in.bad()) return fail("read error");
  return content.str();
}

// --duplicate-is-success STATUS[:TEXT]: the status, and the text the body must contain (empty:
// any body).
struct DuplicateFlag {
  int status = 0;
  std::string text;
};

Expected<DuplicateFlag> parse_duplicate_flag(const std::string& value) {
  const std::size_t colon = value.find(':');
  const std::string status = value.substr(0, colon);
  const auto bad = [&value] {
    return Error{.field = "--duplicate-is-success",
                 .problem = "must be STATUS[:TEXT] with a STATUS from 400 to 599",
                 .got = quote_value(value)};
  };
  if (status.size() != 3) return bad();
  auto code = parse_count("--duplicate-is-success", status, 400, 599);
  if (!code) return bad();
  DuplicateFlag out;
  out.status = static_cast<int>(*code);
  if (colon != std::string::npos) out.text = value.substr(colon + 1);
  return out;
}

// The method: --request, or POST with a body and GET without; 0 or the exit status after
// printing a usage error.
int set_method(const CallArgs& a, http::Request& request) {
  request.method = !a.method.empty() ? a.method : (a.data_given ? "POST" : "GET");
  bool token = !request.method.empty() && request.method.size() <= 64;
  for (char c : request.method) {
    if (c <= ' ' || c >= 127 || c == ':' || c == '/') token = false;
  }
  if (!token) {
    return usage_error(Error{.field = "--request",
                             .problem = "must be a method token of 1 to 64 bytes",
                             .got = quote_value(a.method)}
                           .message());
  }
  return 0;
}

// The -H fields, and the Idempotency-Key one of them gives (canonical, in `header_key`): the
// caller's own key is always the one sent, exactly once. 0 or the exit status after a usage
// error.
int set_headers(const CallArgs& a, http::Request& request, std::string& header_key) {
  for (const std::string& h : a.headers) {
    auto field = http::parse_header_field(h);
    if (!field) return usage_error("--header: " + field.error().message());
    if (http::same_header_name(field->first, "Idempotency-Key")) {
      auto key = http::check_idempotency_key(field->second);  // canonical: "k" is k
      if (!key) {
        return usage_error("--header: " + key.error().message());
      }
      if (!header_key.empty() && header_key != *key) {
        return usage_error("--header: two different Idempotency-Key headers ('" + header_key +
                           "' and '" + field->second + "')");
      }
      header_key = std::move(*key);
      continue;  // sent once, as the request's key
    }
    request.headers.push_back(std::move(*field));
  }
  return 0;
}

// --idempotency-key (KEY, auto or off) with the -H key; 0 or the exit status after a usage error.
int set_key(const CallArgs& a, http::Request& request, const std::string& header_key) {
  if (a.idempotency_key == "off" || a.idempotency_key == "auto") {
    request.generate_idempotency_key = a.idempotency_key == "auto";
    request.idempotency_key = header_key;  // a key given with -H is sent even with off
  } else {
    auto key = http::check_idempotency_key(a.idempotency_key);
    if (!key) {
      Error e = key.error().in("--idempotency-key");
      e.problem += " (give a KEY, auto or off)";
      return usage_error(e.message());
    }
    if (!header_key.empty() && header_key != *key) {
      return usage_error("--idempotency-key: '" + a.idempotency_key +
                         "' conflicts with --header 'Idempotency-Key: " + header_key + "'");
    }
    request.idempotency_key = std::move(*key);
  }
  // With auto, make the key here (as the client would) so that -v can show it up front.
  if (request.idempotency_key.empty() && request.generate_idempotency_key &&
      (request.method == "POST" || request.method == "PATCH")) {
    request.idempotency_key = http::make_idempotency_key();
  }
  return 0;
}

// The request the flags describe; 0 or the exit status after a usage error.
int build_request(const CallArgs& a, http::Request& request) {
  request.url = a.url;
  if (const int status = set_method(a, request); status != 0) return status;
  std::string header_key;
  if (const int status = set_headers(a, request, header_key); status != 0) return status;
  if (a.data_given) {
    if (a.data.starts_with("@")) {
      const std::string path = a.data.substr(1);
      auto body = read_body_file(path);
      if (!body) return usage_error(body.error().message());
      request.body = std::move(*body);
    } else {
      request.body = a.data;
    }
  }
  return set_key(a, request, header_key);
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
  if (!a.rate_limit.empty() || !a.share_breakers.empty()) {
    double rate = 0;
    if (!a.rate_limit.empty()) {
      auto parsed = parse_rate("--rate-limit", a.rate_limit);
      if (!parsed) return usage_error(parsed.error().message());
      rate = *parsed;
    }
    brakes.rates = std::make_unique<RateLimitRegistry>(RateLimitOptions{.rate_per_s = rate});
    options.brakes.rate_limits = brakes.rates.get();
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

int run_call(const CallArgs& a) {
  // Validate everything before sending anything.
  if (auto url = http::parse_url(a.url); !url) return usage_error(url.error().message());
  const auto retry = parse_policy_flags("call", a.policy);
  if (!retry) return kExitUsage;
  const auto connect = duration_flag("call", "--connect-timeout", a.connect_timeout, kCurlTimeout);
  if (!connect) return kExitUsage;
  const auto hedge = parse_hedge_flags(a.hedge, a.max_hedges);
  if (!hedge) return kExitUsage;
  std::optional<DuplicateFlag> duplicate;
  if (!a.duplicate_is_success.empty()) {
    auto parsed = parse_duplicate_flag(a.duplicate_is_success);
    if (!parsed) return usage_error(parsed.error().message());
    duplicate = std::move(*parsed);
  }
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
  options.retry = *retry;
  options.transport.connect_timeout = *connect;
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
  if (const std::string unfit = format_unfit(check_policy(RetryPolicy(*retry)));
      a.verbose && !unfit.empty()) {
    std::fprintf(stderr, "keel call: warning: %s\n", unfit.c_str());
  }
  if (a.verbose && !request.idempotency_key.empty()) {
    std::fprintf(stderr, "keel call: Idempotency-Key: %s\n", request.idempotency_key.c_str());
  }
  return report(a, client.send(request), spool, brakes);
}

}  // namespace

Runner add_call(CLI::App& app) {
  auto a = std::make_shared<CallArgs>();
  CLI::App* sub =
      app.add_subcommand("call", "Send one HTTP request, like curl, with retries done right");
  sub->footer(kCallFooter);
  sub->add_option("URL", a->url, "http:// or https:// URL")->required();
  sub->add_option("-X,--request", a->method, "Method (default GET, or POST with --data)");
  sub->add_option("-d,--data", a->data, "Request body, or @FILE to read it from a file")
      ->each([a](const std::string&) { a->data_given = true; });
  sub->add_option("-H,--header", a->headers, "Extra header 'Name: value' (repeatable)");
  sub->add_flag("-i,--include", a->include, "Print the status line and headers before the body");
  sub->add_flag("-v,--verbose", a->verbose, "One line per attempt on stderr");
  sub->add_option("-o,--output", a->output, "Write the response to FILE instead of stdout");
  add_policy_flags(sub, a->policy);
  sub->add_option("--connect-timeout", a->connect_timeout, "Time allowed to connect, per attempt")
      ->capture_default_str();
  sub->add_option("--idempotency-key", a->idempotency_key,
                  "KEY, auto (a UUID for POST and PATCH) or off")
      ->capture_default_str();
  sub->add_option("--duplicate-is-success", a->duplicate_is_success,
                  "After an ambiguous failure, this answer means an earlier attempt took effect")
      ->type_name("STATUS[:TEXT]");
  sub->add_option("--queue-on-failure", a->queue_on_failure,
                  "When the host is down, queue a request with an Idempotency-Key for later "
                  "in DB's job queue (exit 8, the job id on stdout)")
      ->type_name("DB");
  sub->add_option("--share-fleet,--share-breakers", a->share_breakers,
                  "Share the host's circuit breaker, rate limit and 429 pauses with every "
                  "process on this PostgreSQL database: refused at once while the fleet's "
                  "breaker is open, held while the fleet is paused (docs/fleet.md; "
                  "--share-breakers is the old name)")
      ->type_name("DB");
  sub->add_option("--rate-limit", a->rate_limit,
                  "At most RATE calls per second to the host (RATE/s, RATE/m, RATE/h), the "
                  "whole fleet's with --share-fleet; the call waits for its slot or a pause "
                  "within --deadline, else exits as refused by a brake (docs/rate-limits.md)")
      ->type_name("RATE[/s]");
  sub->add_option("--defer-queue", a->defer_queue, "The queue --queue-on-failure writes to")
      ->capture_default_str();
  sub->add_option("--secret-header", a->secret_headers,
                  "A header field that carries a credential (besides Authorization, "
                  "Proxy-Authorization and Cookie): redacted where keel shows a queued request "
                  "(repeatable)")
      ->type_name("NAME");
  sub->add_option("--hedge", a->hedge,
                  "Send another attempt when none has answered after DELAY (safe requests only)")
      ->type_name("DELAY");
  sub->add_option("--max-hedges", a->max_hedges, "Hedges in flight at once, with --hedge (1-10)")
      ->type_name("N");
  return [a] { return run_call(*a); };
}

}  // namespace keel::cli
