// keel::http::Client: an HTTP client on libcurl that applies every rule of keel::core to real
// requests. Per attempt it sets a connect timeout and a whole-attempt timeout separately, and
// the attempt never runs past the operation's deadline (RetryState's AttemptInfo::timeout). It
// classifies statuses, libcurl errors (with whether the request had been sent) and bodies with
// keel's taxonomy, honours Retry-After on 429/503 in both forms (capped by the policy), sends
// one Idempotency-Key per logical POST/PATCH unchanged on every attempt, and sends
// `Keel-Attempt: N` on every request so a receiver can see its caller is already retrying.
//
// Connections are reused across attempts and requests: the client keeps a pool of libcurl easy
// handles that share one connection cache and DNS cache (a CURLSH with a mutex per shared
// kind). A request that is not safe to repeat (a POST or PATCH without an idempotency key) is
// sent on a fresh connection: libcurl silently re-sends a request whose reused connection turns
// out to be dead, which must never happen to a write that keel will not retry.
//
// Each request's host ("host:port") has its own circuit breaker from a keel::BreakerRegistry,
// and every retry of the client draws on one keel::RetryBudget, so a failing dependency is not
// hit by every request's retries at once. Both are on by default, owned by the client unless
// the caller shares its own.
//
// Thread-safety: a Client is safe for concurrent use from many threads; send() blocks the
// calling thread (sleeping on the configured clock between attempts).
//
// Example:
//   keel::http::Client client({.retry = {.max_attempts = 4, .overall_timeout = 10s}});
//   keel::http::Result r = client.send({.method = "POST", .url = "http://127.0.0.1:8080/pay",
//                                       .body = R"({"amount": 5})"});
//   if (!r.ok()) std::cerr << keel::to_string(r.reason) << '\n';
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "keel/breaker.hpp"
#include "keel/budget.hpp"
#include "keel/classify.hpp"
#include "keel/clock.hpp"
#include "keel/http/message.hpp"
#include "keel/http/url.hpp"
#include "keel/random.hpp"
#include "keel/retry.hpp"

namespace keel::http {

/// A new idempotency key: a random (version 4) UUID in its 36-character text form, with 122
/// bits from OpenSSL's CSPRNG. Throws std::runtime_error if the CSPRNG cannot supply bytes.
[[nodiscard]] std::string make_idempotency_key();

/// The circuit-breaker key of a URL: its lower-case host and its port ("example.com:443"), or
/// nullopt when the URL is not valid (see parse_url).
[[nodiscard]] std::optional<std::string> breaker_key(const std::string& url);

/// Default ClientOptions::max_response_bytes.
inline constexpr std::size_t kDefaultMaxResponseBytes = std::size_t{256} * 1024 * 1024;

/// One logical operation (it may take several attempts).
struct Request {
  /// Method token, sent as given. Default "GET".
  std::string method = "GET";
  /// Absolute http:// or https:// URL (scheme in any case). Requires: non-empty. A URL that
  /// parse_url refuses fails the request before any attempt (see Client::send).
  std::string url;
  /// Extra header fields, sent on every attempt. An Idempotency-Key among them (any case) is the
  /// request's key, as if given in idempotency_key: sent once, and it makes the request safe to
  /// repeat. Keel-Attempt is the client's own and is dropped. Default none.
  Headers headers;
  /// Request body; sent when non-empty or when the method is POST, PUT or PATCH. Default empty.
  std::string body;
  /// Sent as Idempotency-Key on every attempt when non-empty (for example a key stored on a job
  /// record). Requires: empty or valid by check_idempotency_key, and the same as any
  /// Idempotency-Key in headers. Default empty: the client generates one for POST and PATCH
  /// when generate_idempotency_key is true.
  std::string idempotency_key;
  /// Whether to generate a key for a POST or PATCH that has none (in idempotency_key or
  /// headers). A caller's key is always sent. Default true.
  bool generate_idempotency_key = true;
  /// The caller's deadline, combined with the policy's overall_timeout (the earlier wins).
  /// Default infinite.
  Deadline deadline = Deadline::infinite();
  /// Attempts of this logical operation already made by a durable layer (a job queue's earlier
  /// attempts): the first attempt here is then a retry, asked of the retry budget before it is
  /// sent (CallOptions::prior_attempts), and Keel-Attempt counts on from them. Requires: >= 0.
  /// Default 0.
  int prior_attempts = 0;
  /// Where the response body goes instead of Response::body, for bodies too large to hold in
  /// memory (max_response_bytes does not apply). Called on the thread running the attempt (the
  /// client's executor for keel::asio). `restart` runs before each attempt and must drop what an
  /// earlier attempt wrote, so that only the final attempt's body remains; `write` receives the
  /// body's bytes in order. Either returning false ends the attempt as a permanent local failure
  /// (Result::error says so). The body classifier hook then sees an empty body. Default none
  /// (both empty): the body is collected in Response::body.
  struct BodySink {
    std::function<bool()> restart;
    std::function<bool(std::string_view)> write;
  } body_sink;
};

/// Checks a request before any attempt: its URL (parse_url), its header fields
/// (check_header_field) and its Idempotency-Key (check_idempotency_key), and finds the caller's
/// key: Request::idempotency_key or an Idempotency-Key header (any case). Returns empty and sets
/// `*key` to the caller's key (empty when none) when the request can be sent; otherwise why it
/// cannot (two different keys, for instance). Both clients run it first in send().
[[nodiscard]] std::string check_request(const Request& request, std::string* key);

/// What send() returns: errors are values.
struct Result {
  /// The last attempt's response; empty when no attempt got one (network failure, or no attempt
  /// ran).
  std::optional<Response> response;
  /// The last attempt's classification; kNotAttempted when no attempt ran (open circuit, with
  /// the breaker's retry_in; budget refused; deadline already passed): nothing was sent.
  /// kPermanent, with no attempt, for a request that check_request refuses (error says why).
  Outcome outcome;
  /// Why the operation stopped (kSuccess on success).
  StopReason reason = StopReason::kSuccess;
  int attempts = 0;
  Duration elapsed{};
  /// libcurl's message for the last attempt's transport failure, or why the request was refused
  /// or the response could not be taken (head over max_header_bytes, body over
  /// max_response_bytes, a body sink that failed); empty otherwise.
  std::string error;
  /// The Idempotency-Key sent (generated or the caller's); empty when none.
  std::string idempotency_key;

  [[nodiscard]] bool ok() const noexcept { return reason == StopReason::kSuccess; }
};

/// Passed to ClientOptions::on_attempt after every attempt.
struct AttemptEvent {
  std::string_view method;
  std::string_view url;
  int attempt = 1;          // 1 for the first
  Outcome outcome;          // its classification
  std::string_view error;   // libcurl's message for a transport failure, else empty
  Duration took{};          // how long the attempt ran
  bool will_retry = false;  // another attempt follows
  Duration delay{};         // the wait before it (when will_retry)
  StopReason reason = StopReason::kSuccess;  // why the operation stops (when !will_retry)
};

struct ClientOptions {
  /// Retry policy for every request. Defaults: 3 attempts, per-try timeout 10 s, overall
  /// deadline 30 s, full jitter base 100 ms cap 10 s, Retry-After cap 60 s. Its on_retry and
  /// on_give_up hooks are called as the engine documents.
  RetryOptions retry = {.max_attempts = 3,
                        .per_try_timeout = std::chrono::seconds(10),
                        .overall_timeout = std::chrono::seconds(30)};
  /// Time allowed to establish a connection, within an attempt's timeout. Requires: > 0.
  /// Default 2 s.
  Duration connect_timeout = std::chrono::seconds(2);
  /// How statuses and bodies are classified (500 retry limit, body hook). Default: 500 retried
  /// at most once, no body hook.
  HttpClassifierOptions classifier = {};
  /// Called after every attempt. Must be safe to call from any thread using the client.
  /// Default none.
  std::function<void(const AttemptEvent&)> on_attempt;
  /// Receives the one line logged when an operation gives up (keel::format_give_up). Must be
  /// safe to call from any thread. Default: the line is written to stderr.
  std::function<void(std::string_view)> log;
  /// Largest response head (status line and header fields) accepted, in bytes; a larger one
  /// ends the attempt as a permanent failure (a local error: the response is not taken).
  /// Requires: >= 1. Default 64 KiB.
  std::size_t max_header_bytes = kDefaultMaxHeaderBytes;
  /// Largest response body collected in memory (Response::body), in bytes; a larger one ends the
  /// attempt as a permanent failure. Not applied to a Request::body_sink. Requires: >= 1.
  /// Default 256 MiB.
  std::size_t max_response_bytes = kDefaultMaxResponseBytes;
  /// Idle easy handles kept for reuse. Requires: >= 1. Default 16.
  int max_idle_handles = 16;
  /// Sent as User-Agent unless the request sets one. Default "keel/0.1".
  std::string user_agent = "keel/0.1";
  /// Time source for deadlines and the sleep between attempts. Default keel::steady_clock().
  Clock* clock = nullptr;
  /// Whether requests go through a circuit breaker per "host:port" of their URL: an open breaker
  /// stops an operation before an attempt (StopReason::kCircuitOpen) and every outcome is
  /// reported to the host's breaker. Default true.
  bool circuit_breakers = true;
  /// The registry the per-host breakers come from; share one between clients to share their
  /// view of each host. Non-owning; Requires: outlives the client. Default none: the client
  /// keeps a registry of its own built from own_breakers.
  BreakerRegistry* breakers = nullptr;
  /// Options of the client's own registry (when breakers is none). Default: keel's
  /// BreakerRegistryOptions (time window 30 s, at least 20 calls, trip at 50% failures, open 5 s).
  BreakerRegistryOptions own_breakers = {};
  /// Whether retries draw on a retry budget shared by every request of the client (refused:
  /// StopReason::kBudgetExhausted). Default true.
  bool retry_budget = true;
  /// The budget to draw on; share one between clients that call the same dependencies.
  /// Non-owning; Requires: outlives the client. Default none: the client keeps its own
  /// TokenBucketBudget built from own_budget.
  RetryBudget* budget = nullptr;
  /// Options of the client's own budget (when budget is none). Default: 500 tokens, a retry
  /// costs 5 (10 after a timeout), a successful first attempt refunds 1 (the AWS SDKs' quota).
  TokenBucketBudgetOptions own_budget = {};
};

class Client {
 public:
  /// Throws std::invalid_argument naming the field and value when a Requires line is broken
  /// (including the retry options), std::runtime_error when libcurl cannot be initialised.
  explicit Client(ClientOptions options = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  /// Runs one logical operation with retries. Never throws for transport or HTTP failures (they
  /// are in the Result); throws std::invalid_argument for a request with an empty URL or method.
  [[nodiscard]] Result send(const Request& request);

  [[nodiscard]] const ClientOptions& options() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace keel::http
