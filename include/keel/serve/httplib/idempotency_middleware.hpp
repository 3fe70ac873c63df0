// HTTP middleware for cpp-httplib that applies the idempotency-key flow
// (keel/idempotency/idempotency.hpp) around a POST or PATCH handler: it validates the
// Idempotency-Key, claims it, runs the handler inside a transaction it can write to, stores the
// response in that same transaction, and answers repeats with the replay, 409 + Retry-After or 422.
// Errors are application/problem+json (RFC 9457). It is an adapter: the flow itself is
// IdempotentRequestFlow (keel/idempotency/idempotency_flow.hpp, no cpp-httplib), which
// servers on other frameworks drive directly.
//
// The adapter counts the Idempotency-Key header fields (cpp-httplib hands a handler only the
// first), so that two of them are refused with 400 by the flow rather than one used silently.
//
// What this adapter does not protect against (cpp-httplib 0.11.4, measured on a payments API
// with 16 worker threads); put a proxy that buffers
// whole requests in front, or run the flow on keel::store::beast::Server
// (keel/serve/beast/server.hpp), if these matter:
//   - A read timeout per recv(), not per request: slow clients hold threads. 48 connections
//     trickling their headers a byte at a time held every worker, and a fresh GET /healthz took
//     99 s; 20 sending one header line a second hold 16 workers indefinitely. A bigger pool
//     only raises the number of connections needed.
//   - No HTTP/1.1 pipelining: each request is read through a fresh 4 KiB buffer, so requests
//     written in the same packet after the first are dropped (3 pipelined POSTs, 1 answer) and
//     the connection closes at the keep-alive timeout.
//   - A form-body limit of its own: cpp-httplib answers a form-urlencoded body over 8,192 bytes
//     with 413 whatever set_payload_max_length() (max_body_bytes) says
//     (CPPHTTPLIB_FORM_URL_ENCODED_PAYLOAD_MAX_LENGTH, compiled into Debian's libcpp-httplib),
//     unless the route is registered through read_whole_body().
//
// Thread-safety: the returned handler is safe to call from cpp-httplib's worker threads at once;
// each call takes its own connection from the pool. The options' store, pool and hooks must
// outlive it and be safe for concurrent use.
//
// Example:
//   keel::store::IdempotencyMiddleware idem({.store = &store, .pool = &pool});
//   server.Post("/v1/charges", keel::store::read_whole_body(idem.wrap(
//                                  [](const httplib::Request& req, keel::store::Connection& tx) {
//                                    tx.query("INSERT INTO charges ...", {...});
//                                    return keel::store::StoredResponse{
//                                        201, {{"Content-Type", "application/json"}}, body};
//                                  })));
#pragma once

#include <httplib.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "keel/core/retry.hpp"
#include "keel/db/transaction.hpp"
#include "keel/idempotency/idempotency.hpp"
#include "keel/idempotency/idempotency_flow.hpp"
#include "keel/json/json_check.hpp"

namespace keel::store {

/// The handler: reads the request, writes through `tx` (a transaction is open), returns the
/// response. A 2xx/3xx response is stored and committed with the writes; anything else rolls
/// the writes back and is answered without being stored. It may run more than once (the
/// transaction is retried on serialization failures), so it must do nothing outside `tx`.
using TransactionalHandler =
    std::function<StoredResponse(const httplib::Request& request, Connection& tx)>;

/// Writes an RFC 9457 problem: Content-Type application/problem+json, {"type", "title",
/// "status", "detail"}.
void write_problem(httplib::Response& response, int status, std::string_view title,
                   std::string_view detail);

/// The FlowOptions of the IdempotentRequestFlow underneath (store, pool, scope_secret,
/// transaction_policy, isolation, on_outcome, json_limits, max_key_bytes, retry_after_spread,
/// random, log), plus the two
/// cpp-httplib hooks principal and after_commit.
struct MiddlewareOptions {
  /// The record store. Required (non-null).
  const IdempotencyStore* store = nullptr;
  /// Where connections come from. Required (non-null).
  ConnectionPool* pool = nullptr;
  /// The principal a key is scoped to: who the request authenticates as, "" for nobody. Plug in
  /// your own authentication here (return the verified user or tenant id, never a value the
  /// client chose unverified). The middleware never stores it: the stored scope is
  /// principal_scope(principal, scope_secret). Default bearer_principal.
  std::function<std::string(const httplib::Request&)> principal;
  /// Key of the HMAC-SHA-256 that turns a principal into its stored scope. Requires: empty or at
  /// least 16 bytes. Default (empty): 32 random bytes drawn when the middleware is built, so the
  /// scopes, and so the replays, last only as long as the process; set the same secret on every
  /// process that shares the database and across restarts.
  std::string scope_secret;
  /// Retries of the handler's transaction. Default default_transaction_retry_policy().
  const RetryPolicy* transaction_policy = nullptr;
  /// Isolation of the handler's transaction. Default read committed.
  Isolation isolation = Isolation::kReadCommitted;
  /// Called once per request with its outcome. Default none.
  std::function<void(IdempotencyOutcome)> on_outcome;
  /// Called after the handler's transaction committed, before the response is sent. Default
  /// none. (Fault injection drops the connection here: keel::faults::Chaos::after_commit.)
  std::function<void(const httplib::Request&, httplib::Response&)> after_commit;
  /// Limits on JSON bodies: a body whose first non-blank byte is '{' or '[', or whose
  /// Content-Type is application/json or +json, must pass check_json()
  /// (keel/json/json_check.hpp) or is answered 400 problem+json naming the limit or the
  /// duplicated member, before anything is parsed, claimed or stored. A body not valid JSON is left
  /// to the handler. Default depth 64.
  JsonLimits json_limits;
  /// Longest Idempotency-Key, in bytes: lowers keel's limit of 255 (keel/core/idempotency_key.hpp),
  /// never raises it. Requires: >= 1. Default kMaxKeyLength (255).
  std::size_t max_key_bytes = kMaxKeyLength;
  /// N of the Retry-After of answers every waiting client meets at once (503 database
  /// unavailable, 500 commit in doubt, 409 claim lost): whole seconds uniform over 1..N; a 409
  /// in progress answers the lock's expiry plus 0..N-1 s. Requires: 1 to 3600. Default 3.
  int retry_after_spread = 3;
  /// The random bits of that spread, called from cpp-httplib's worker threads. Default (empty):
  /// the calling thread's keel::thread_rng().
  std::function<std::uint64_t()> random;
  /// Where the text of handler exceptions and database errors goes: clients receive a generic
  /// detail only. Default: one line on stderr.
  std::function<void(std::string_view message)> log;
};

/// The default principal, the credential as sent (principal_from_authorization() of the
/// Authorization header): "Authorization: Bearer <token>" gives <token> (a token without
/// whitespace); any other Authorization value (Basic, an empty or malformed Bearer) gives
/// "Authorization: <value>", which contains a space and so equals no token; no Authorization
/// header gives "" (unauthenticated). No credential is verified here.
[[nodiscard]] std::string bearer_principal(const httplib::Request& request);

class IdempotencyMiddleware {
 public:
  /// Throws std::invalid_argument when store or pool is null, or a limit breaks its Requires line.
  explicit IdempotencyMiddleware(MiddlewareOptions options);

  /// Wraps a handler; the result is what cpp-httplib's Post()/Patch() take.
  [[nodiscard]] httplib::Server::Handler wrap(TransactionalHandler handler) const;

  /// The stored scope of `request`'s principal (for the application's own per-principal rows,
  /// so that they hold no credential either).
  [[nodiscard]] std::string scope(const httplib::Request& request) const;

  /// The flow underneath (its options hold the scope secret in use).
  [[nodiscard]] const IdempotentRequestFlow& flow() const noexcept { return flow_; }

 private:
  void handle(const TransactionalHandler& handler, const httplib::Request& request,
              httplib::Response& response) const;

  MiddlewareOptions options_;
  IdempotentRequestFlow flow_;
};

/// The flow's request for `request`: its method, path, Idempotency-Key and how many header fields
/// carried one (two are refused by the flow), Content-Type and body, `principal`, and the deadline
/// of its Keel-Deadline-Ms counted from now. The result views `request`'s strings: use it while
/// `request` lives.
[[nodiscard]] FlowRequest flow_request(const httplib::Request& request, std::string_view principal);

/// The deadline `request` carries: its Keel-Deadline-Ms counted from `arrival`
/// (request_deadline() of the value). Infinite when the header is absent, sent twice or invalid.
[[nodiscard]] Deadline request_deadline(const httplib::Request& request, TimePoint arrival);

/// For a pre-routing handler, ahead of anything a request spends (a rate-limit token, an
/// admission slot): when `request`'s deadline has already passed on arrival (Keel-Deadline-Ms:
/// 0), writes the flow's answer (deadline_exceeded_response(): 400 problem+json "Deadline
/// exceeded"), closes the connection once it is written (the body is not read) and returns
/// Handled; otherwise Unhandled. A request refused here never reaches the flow or its on_outcome:
/// count it where this is called.
[[nodiscard]] httplib::Server::HandlerResponse refuse_expired_deadline(
    const httplib::Request& request, httplib::Response& response);

/// Writes `answer` (status, headers, body; Content-Type through set_content) into `response`.
void write_flow_response(const FlowResponse& answer, httplib::Response& response);

/// keel's recommended settings for an httplib::Server that faces untrusted clients, with the
/// middleware or without. apply_server_limits() sets cpp-httplib's own limits and installs a
/// pre-routing handler that refuses, before any body byte is read, what cpp-httplib 0.11 would
/// otherwise mis-frame or read without bound; every refusal is application/problem+json and
/// closes the connection (the unread bytes must not be parsed as a next request).
/// Refused before the body is read:
///   - two Content-Length headers, or one that is not 1*DIGIT: 400;
///   - Content-Length together with Transfer-Encoding, any coding but "chunked", several
///     Transfer-Encoding headers, a header name with whitespace (obs-fold remnants): 400;
///   - Transfer-Encoding: chunked unless allow_chunked (cpp-httplib does not apply its payload
///     limit to chunked bodies): 411;
///   - POST, PUT or PATCH with no Content-Length (cpp-httplib would read until the peer closes):
///     411; a GET, HEAD, OPTIONS or DELETE carrying a body: 400;
///   - Content-Length above max_body_bytes: 413 naming the limit;
///   - header names and values totalling more than max_header_bytes: 431 naming the limit.
/// The same checks answer "Expect: 100-continue" (a refused request gets its final status instead
/// of 100 Continue). cpp-httplib's own error answers (400 on an unparsable request, 404, 413,
/// 414...) get
/// problem+json bodies through set_error_handler(); a known path with a wrong method is answered
/// 405 with an Allow header when the path is listed in `routes`.
/// Not covered (cpp-httplib 0.11 limits, see the top of this file): a read timeout bounds each
/// recv(), not a whole request, so a client trickling one byte per interval holds a worker
/// indefinitely; pipelined requests after the first in one packet are dropped (each request
/// reads through a fresh buffer); a form-urlencoded body over 8,192 bytes is 413 unless its route
/// reads its own body (read_whole_body()); an obs-folded line without a colon is dropped by
/// cpp-httplib before a handler can see it.
struct ServerLimits {
  /// Largest request body in bytes. Requires: >= 1. Default 1 MiB.
  std::size_t max_body_bytes = std::size_t{1} << 20;
  /// Largest total of header names and values in bytes (cpp-httplib separately refuses a line
  /// over 8192 bytes). Requires: >= 1. Default 16 KiB.
  std::size_t max_header_bytes = 16 * 1024;
  /// Longest wait for one read of the socket (per recv(), see above): a client silent for longer
  /// mid-request loses its connection. Requires: > 0. Default 2 s.
  std::chrono::milliseconds read_timeout = std::chrono::seconds(2);
  /// Longest wait for one write of the socket. Requires: > 0. Default 5 s.
  std::chrono::milliseconds write_timeout = std::chrono::seconds(5);
  /// Requests served on one connection before it is closed. Requires: >= 1. Default 100.
  std::size_t keep_alive_max_count = 100;
  /// How long an idle kept-alive connection may hold a worker thread, whole seconds.
  /// Requires: >= 1 s. Default 2 s.
  std::chrono::seconds keep_alive_timeout = std::chrono::seconds(2);
  /// TCP_NODELAY on accepted connections (without it each kept-alive answer can wait ~40 ms for
  /// a delayed ACK). Default true.
  bool tcp_nodelay = true;
  /// Share the port with other processes (SO_REUSEPORT). Default false: binding a port another
  /// socket listens on fails (only SO_REUSEADDR is set).
  bool reuse_port = false;
  /// Accept Transfer-Encoding: chunked request bodies. Their size is then NOT bounded by
  /// max_body_bytes (cpp-httplib 0.11). Default false: 411 Length Required.
  bool allow_chunked = false;
  /// Known path patterns (cpp-httplib regex syntax, whole path) and the methods each one allows
  /// ("GET, POST"), for 405 + Allow instead of 404. Default none.
  std::vector<std::pair<std::string, std::string>> routes;
  /// The application's own pre-routing handler, run after the checks above (apply_server_limits
  /// owns set_pre_routing_handler). Default none.
  httplib::Server::HandlerWithResponse pre_routing;
  /// The application's own logger, called after each answer is written (apply_server_limits
  /// owns set_logger: a refused HEAD request, whose answer has no body, is closed there).
  /// Default none.
  httplib::Logger logger;
};

/// Throws std::invalid_argument naming the field and value when a Requires line is broken.
void validate(const ServerLimits& limits);

/// Applies `limits` to `server`: set_payload_max_length, read/write timeouts, keep-alive count and
/// timeout, set_tcp_nodelay, set_socket_options (SO_REUSEADDR, plus SO_REUSEPORT only when asked),
/// and the pre-routing and error handlers described above. Call before bind_to_port()/listen().
/// Throws std::invalid_argument like validate().
///
/// Example:
///   httplib::Server server;
///   keel::store::apply_server_limits(server, {.max_body_bytes = 64 * 1024,
///                                             .routes = {{"/v1/charges", "POST"}}});
///   server.Post("/v1/charges", keel::store::read_whole_body(idem.wrap(handler)));
///   if (!server.bind_to_port("127.0.0.1", 8080)) ...  // in use: fails, never shares
void apply_server_limits(httplib::Server& server, ServerLimits limits);

/// `handler` as a route that reads its own body, for Post(), Put(), Patch() and Delete(): the
/// body is read through cpp-httplib's ContentReader, under set_payload_max_length() (so under
/// ServerLimits::max_body_bytes) like any other, and `handler` gets a copy of the request with
/// it (a form-urlencoded body parsed into params, a multipart one into files, as cpp-httplib
/// does). What it avoids: cpp-httplib answers a form-urlencoded body over 8,192 bytes with 413
/// whatever the payload limit (CPPHTTPLIB_FORM_URL_ENCODED_PAYLOAD_MAX_LENGTH, compiled into
/// Debian's libcpp-httplib, so no definition in keel can raise it), and that is curl's default
/// Content-Type for a body given with -d. A body that cannot be read is answered 400 (413 over
/// the payload limit) problem+json and the connection closed; `handler` does not run.
[[nodiscard]] httplib::Server::HandlerWithContentReader read_whole_body(
    httplib::Server::Handler handler);

/// Shuts down the accepted socket that `request` arrived on, found by its address pair in
/// /proc/self/fd (cpp-httplib does not expose it; Linux only, linear in the open descriptors).
/// Returns whether it was found. For answers that must close the connection, and for fault
/// injection that drops one.
bool shutdown_connection(const httplib::Request& request);

/// The framing and size checks of apply_server_limits() alone: Handled (with a problem+json
/// answer that closes the connection) when the request must be refused, else Unhandled.
[[nodiscard]] httplib::Server::HandlerResponse refuse_unsafe_request(
    const httplib::Request& request, httplib::Response& response, const ServerLimits& limits);

/// write_problem() and close the connection once the answer is written (for refusals whose
/// request body was not read).
void write_problem_and_close(httplib::Response& response, int status, std::string_view title,
                             std::string_view detail);

}  // namespace keel::store
