// `keel call`'s flags: registered with CLI11 and read into a CallArgs (call_cli.hpp), each value
// checked as it is parsed, and the --help footer.
#include <memory>
#include <string>
#include <string_view>

#include "call_cli.hpp"
#include "commands.hpp"
#include "flag_options.hpp"
#include "rate_flag.hpp"

namespace keel::cli {
namespace {

using call_cli::CallArgs;
using call_cli::DuplicateFlag;

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

Expected<DuplicateFlag> parse_duplicate_flag(std::string_view value) {
  const std::size_t colon = value.find(':');
  const std::string status(value.substr(0, colon));
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
  if (colon != std::string::npos) out.text = std::string(value.substr(colon + 1));
  return out;
}

// The URL and what the request carries, and where its answer goes.
void add_request_flags(CLI::App* sub, CallArgs& a) {
  sub->add_option("URL", a.url, "http:// or https:// URL")->required();
  sub->add_option("-X,--request", a.method, "Method (default GET, or POST with --data)");
  sub->add_option("-d,--data", a.data, "Request body, or @FILE to read it from a file");
  sub->add_option("-H,--header", a.headers, "Extra header 'Name: value' (repeatable)");
  sub->add_flag("-i,--include", a.include, "Print the status line and headers before the body");
  sub->add_flag("-v,--verbose", a.verbose, "One line per attempt on stderr");
  sub->add_option("-o,--output", a.output, "Write the response to FILE instead of stdout");
}

// --idempotency-key and what a call falls back on: a duplicate's answer, the job queue, the
// fleet's breakers and rate limits.
void add_fallback_flags(CLI::App* sub, CallArgs& a) {
  sub->add_option("--idempotency-key", a.idempotency_key,
                  "KEY, auto (a UUID for POST and PATCH) or off")
      ->capture_default_str();
  add_checked(sub, "keel call", "--duplicate-is-success", a.duplicate_is_success,
              FlagParser<DuplicateFlag>(parse_duplicate_flag),
              "After an ambiguous failure, this answer means an earlier attempt took effect")
      ->type_name("STATUS[:TEXT]");
  sub->add_option("--queue-on-failure", a.queue_on_failure,
                  "When the host is down, queue a request with an Idempotency-Key for later "
                  "in DB's job queue (exit 8, the job id on stdout)")
      ->type_name("DB");
  sub->add_option("--share-fleet,--share-breakers", a.share_breakers,
                  "Share the host's circuit breaker, rate limit and 429 pauses with every "
                  "process on this PostgreSQL database: refused at once while the fleet's "
                  "breaker is open, held while the fleet is paused (docs/fleet.md; "
                  "--share-breakers is the old name)")
      ->type_name("DB");
  add_checked(
      sub, "keel call", "--rate-limit", a.rate_limit,
      FlagParser<double>([](std::string_view text) { return parse_rate("--rate-limit", text); }),
      "At most RATE calls per second to the host (RATE/s, RATE/m, RATE/h), the "
      "whole fleet's with --share-fleet; the call waits for its slot or a pause "
      "within --deadline, else exits as refused by a brake (docs/rate-limits.md)")
      ->type_name("RATE[/s]");
  sub->add_flag("--adaptive-concurrency", a.adaptive_concurrency,
                "Bound the host's calls in flight by an adaptive limit found from their latency "
                "and its 429/503 answers; an attempt over it waits within --deadline, else "
                "exits as refused by a brake (docs/concurrency.md)");
  sub->add_option("--defer-queue", a.defer_queue, "The queue --queue-on-failure writes to")
      ->capture_default_str();
  sub->add_option("--secret-header", a.secret_headers,
                  "A header field that carries a credential (besides Authorization, "
                  "Proxy-Authorization and Cookie): redacted where keel shows a queued request "
                  "(repeatable)")
      ->type_name("NAME");
}

void add_call_flags(CLI::App* sub, CallArgs& a) {
  add_request_flags(sub, a);
  add_policy_flags(sub, "call", a.policy);
  add_duration(sub, "keel call", "--connect-timeout", a.connect_timeout, kCurlTimeout,
               "Time allowed to connect, per attempt")
      ->default_val("2s");
  add_fallback_flags(sub, a);
  add_hedge_flags(sub, a.hedge);
}

}  // namespace

Runner add_call(CLI::App& app) {
  return add_command<CallArgs>(app, "call",
                               "Send one HTTP request, like curl, with retries done right",
                               kCallFooter, add_call_flags, call_cli::run_call);
}

}  // namespace keel::cli
