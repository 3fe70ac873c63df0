// keel::asio::HttpClient: a non-blocking HTTP client on libcurl's multi interface, driven by the
// same Asio event loop as the code that awaits it. A request in flight is a socket registered
// with the reactor and a request waiting to be retried is a steady_timer: thousands of
// operations share one thread.
//
// It behaves as the blocking keel::http::Client: per attempt a connect timeout and a
// whole-attempt timeout, set separately (the attempt never runs past the operation's deadline);
// statuses, libcurl errors (with whether the request had been sent) and bodies classified with
// keel's taxonomy; Retry-After honoured on 429/503 in both forms (capped by the policy); one
// Idempotency-Key (a random UUID from OpenSSL's CSPRNG) per logical POST or PATCH, unchanged on
// every attempt; `Keel-Attempt: N` on every request. The retry loop is keel::asio::retry's, so
// the engine's rules, the overall deadline and cancellation are the same as there: cancelling
// the awaiting operation removes the transfer from libcurl at once and reports kCancelled.
//
// Connections are reused across attempts and requests (one libcurl multi handle per client); a
// request that is not safe to repeat is sent on a fresh connection, so that libcurl never
// silently re-sends it on a reused connection that turned out to be dead.
//
// Thread-safety: not thread-safe. A client belongs to one executor (one thread, or a strand);
// call send() and destroy the client there. Any number of send() may be in flight at once.
//
// Example:
//   ::asio::io_context io;
//   keel::asio::HttpClient client(io.get_executor(), {.retry = {.max_attempts = 4}});
//   ::asio::co_spawn(io, [&]() -> ::asio::awaitable<void> {
//     keel::http::Result r = co_await client.send({.method = "POST",
//         .url = "http://127.0.0.1:8080/pay", .body = R"({"amount": 5})"});
//     if (!r.ok()) std::cerr << keel::to_string(r.reason) << '\n';
//   }, ::asio::detached);
//   io.run();
#pragma once

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
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
#include "keel/http/client.hpp"
#include "keel/retry.hpp"

namespace keel::asio {

/// The request, response and result types are keel::http's, so that code written against the
/// blocking client moves to this one by changing the call, and the two are tested by one suite.
using Headers = http::Headers;
using HttpRequest = http::Request;
using HttpResponse = http::Response;
using HttpResult = http::Result;
using HttpAttemptEvent = http::AttemptEvent;
using http::breaker_key;
using http::find_header;
using http::make_idempotency_key;

struct HttpClientOptions {
  /// Retry policy for every request. Defaults: 3 attempts, per-try timeout 10 s, overall
  /// deadline 30 s, full jitter base 100 ms cap 10 s, Retry-After cap 60 s.
  RetryOptions retry = {.max_attempts = 3,
                        .per_try_timeout = std::chrono::seconds(10),
                        .overall_timeout = std::chrono::seconds(30)};
  /// Time allowed to establish a connection, within an attempt's timeout. Requires: > 0.
  /// Default 2 s.
  Duration connect_timeout = std::chrono::seconds(2);
  /// How statuses and bodies are classified. Default: 500 retried at most once, no body hook.
  HttpClassifierOptions classifier = {};
  /// Called after every attempt, on the client's executor. Default none.
  std::function<void(const HttpAttemptEvent&)> on_attempt;
  /// Receives the line logged when an operation gives up (keel::format_give_up). Default: the
  /// line is written to stderr.
  std::function<void(std::string_view)> log;
  /// Whether requests go through a circuit breaker per "host:port" of their URL
  /// (keel::http::breaker_key): an open breaker stops an operation before an attempt
  /// (StopReason::kCircuitOpen) and every outcome is reported to the host's breaker. Default
  /// true, as keel::http::Client.
  bool circuit_breakers = true;
  /// The registry the per-host breakers come from; share one between clients (blocking or not)
  /// to share their view of each host. Non-owning; Requires: outlives the client. Default none:
  /// the client keeps a registry of its own built from own_breakers.
  BreakerRegistry* breakers = nullptr;
  /// Options of the client's own registry (when breakers is none). Default: keel's
  /// BreakerRegistryOptions.
  BreakerRegistryOptions own_breakers = {};
  /// Whether retries draw on a retry budget shared by every request of the client (refused:
  /// StopReason::kBudgetExhausted). Default true, as keel::http::Client.
  bool retry_budget = true;
  /// The budget to draw on. Non-owning; Requires: outlives the client. Default none: the client
  /// keeps its own TokenBucketBudget built from own_budget.
  RetryBudget* budget = nullptr;
  /// Options of the client's own budget (when budget is none). Default: 500 tokens, a retry
  /// costs 5 (10 after a timeout), a successful first attempt refunds 1.
  TokenBucketBudgetOptions own_budget = {};
  /// Largest response head accepted, in bytes, as keel::http::ClientOptions. Requires: >= 1.
  /// Default 64 KiB.
  std::size_t max_header_bytes = http::kDefaultMaxHeaderBytes;
  /// Largest response body collected in memory, in bytes, as keel::http::ClientOptions (not
  /// applied to a Request::body_sink). Requires: >= 1. Default 256 MiB.
  std::size_t max_response_bytes = http::kDefaultMaxResponseBytes;
  /// Connections open at once to one host; further transfers queue inside libcurl.
  /// Requires: >= 0. Default 0 (no limit).
  long max_host_connections = 0;
  /// Transfers handed to libcurl at once; the others wait, in order, inside the client, and the
  /// wait counts against the attempt's timeout. Set it for large fan-outs: libcurl's own queue
  /// (behind max_host_connections) re-examines every waiting transfer each time a connection
  /// frees, which is quadratic in the number waiting.
  /// Requires: >= 0. Default 0 (no limit).
  long max_transfers = 0;
  /// Sent as User-Agent unless the request sets one. Default "keel/0.1".
  std::string user_agent = "keel/0.1";
  /// Time source for deadlines. A keel::ManualClock makes the waits between attempts virtual
  /// (see keel/asio/retry.hpp). Default keel::steady_clock().
  Clock* clock = nullptr;
  /// Randomness for the backoff jitter. Default keel::thread_rng().
  Rng* rng = nullptr;
};

class HttpClient {
 public:
  /// Throws std::invalid_argument naming the field and value when a Requires line is broken
  /// (including the retry options), std::runtime_error when libcurl cannot be initialised.
  HttpClient(::asio::any_io_executor executor, HttpClientOptions options = {});
  /// Requires: no send() in flight.
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  /// Runs one logical operation with retries. Transport and HTTP failures are in the result,
  /// never thrown; throws std::invalid_argument for an empty URL or method. Cancel it by
  /// cancelling the awaiting operation (cancellation slot): the transfer in flight or the wait
  /// stops at once and the result says kCancelled. `context`: the keel::RetryContext of an
  /// enclosing asynchronous retry loop, if any (one retrying layer, see keel/asio/retry.hpp):
  /// inside a running loop this request makes a single attempt. Default none.
  [[nodiscard]] ::asio::awaitable<HttpResult> send(HttpRequest request,
                                                   RetryContext* context = nullptr);

  [[nodiscard]] const HttpClientOptions& options() const noexcept;
  /// Transfers in flight in libcurl right now (for tests and metrics).
  [[nodiscard]] std::size_t transfers_in_flight() const noexcept;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace keel::asio
