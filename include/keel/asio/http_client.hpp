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

#include "keel/core/breaker.hpp"
#include "keel/core/budget.hpp"
#include "keel/core/classify.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/retry.hpp"
#include "keel/http/options.hpp"
#include "keel/http/request.hpp"

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

/// The options are keel::http::ClientOptions (keel/http/options.hpp), shared with the blocking
/// client: the same retry policy, limits, breakers and budget. limits.max_host_connections,
/// limits.max_transfers and rng are this client's own; limits.max_idle_handles is not used (this
/// client keeps up to 64 idle easy handles). observability.on_attempt and observability.log are
/// called on the client's executor.
using HttpClientOptions = http::ClientOptions;

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
