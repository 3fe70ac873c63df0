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
// Its request and result types are in keel/http/request.hpp, its options (shared with
// keel::asio::HttpClient) in keel/http/options.hpp, and the libcurl attempt it runs in
// keel/http/detail/attempt.hpp.
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

#include <memory>

#include "keel/http/options.hpp"
#include "keel/http/request.hpp"

namespace keel::http {

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
