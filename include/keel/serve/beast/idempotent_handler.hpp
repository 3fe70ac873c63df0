// The idempotency flow for Boost.Beast servers: IdempotentHandler takes a parsed
// boost::beast::http::request<string_body> and the authenticated principal, refuses it when its
// caller's deadline (Keel-Deadline-Ms, keel/core/deadline_header.hpp) has already passed or when
// the admission limiter (keel/core/admission.hpp, optional) sheds it, and otherwise runs it through
// IdempotentRequestFlow (keel/idempotency/idempotency_flow.hpp) and returns the
// boost::beast::http::response<string_body> to send. Both refusals happen before the handler, and
// before any database work: a refused request costs no connection and no claim.
//
// The flow blocks (it claims a key, runs a transaction and commits): never call handle() on an
// event-loop thread. async_handle() checks the deadline and admission on the calling thread (the
// event loop: both are cheap and never block), then runs the flow on the executor given (a
// boost::asio::thread_pool's, or any other) and hands the response to a callback there. The
// admission slot is held from the check until the flow returns, so requests queued for the
// executor count as in flight. keel::store::beast::Server (keel/serve/beast/server.hpp) mounts it
// on a route; another Beast server calls async_handle() from its own session.
//
// A request nobody will read the answer of (its connection closed: the client went away, or the
// server's drain ran out of time) is abandoned: the flow stops at its next step and never commits
// after it (FlowRequest::abandoned). handle() takes the flag; async_handle() reads it from the
// Respond it is given (Respond::abandoned(), set by Server for the request's connection).
//
// Errors are application/problem+json (RFC 9457), as the flow's: 400 deadline exceeded, 503 +
// Retry-After when shed, and the flow's own answers.
//
// Thread-safety: handle() and async_handle() are safe to call from many threads at once. The
// options' store, pool, limiter, clock and hooks must outlive the handler and be safe for
// concurrent use; the handler object must outlive every async_handle() call's completion.
//
// Example (inside a Beast session, `req` a parsed request, `pool` a boost::asio::thread_pool):
//   keel::store::beast::IdempotentHandler charges(
//       {.flow = {.store = &store, .pool = &db_pool}, .limiter = &limiter},
//       [](const keel::store::beast::Request& req, keel::store::Connection& tx) {
//         tx.query("INSERT INTO charges (body) VALUES ($1)", {std::string(req.body())});
//         return keel::store::StoredResponse{201, {{"Content-Type", "application/json"}}, "{}"};
//       });
//   charges.async_handle(std::move(req), charges.principal(req), keel::steady_clock().now(),
//                        pool.get_executor(), [self](keel::store::beast::Response res) {
//                          // on a pool thread: post back to the session's strand, then write
//                          boost::asio::post(self->strand(), [self, res = std::move(res)] {...});
//                        });
#pragma once

#include <atomic>
#include <boost/asio/any_io_executor.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>
#include <concepts>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "keel/core/admission.hpp"
#include "keel/core/clock.hpp"
#include "keel/idempotency/idempotency_flow.hpp"

namespace keel::store::beast {

/// The request and response types of the adapter and of Server.
using Request = boost::beast::http::request<boost::beast::http::string_body>;
using Response = boost::beast::http::response<boost::beast::http::string_body>;

/// Answers one request: callable from any thread, once (Server ignores a second call, and a call
/// after the request's connection closed or the server stopped). Copyable; a copy answers the
/// same request. Server hands one to each on_async() handler; a lambda or std::function taking a
/// Response converts to one (its abandoned() is then null).
class Respond {
 public:
  Respond() = default;
  /// A Respond that calls `answer`.
  template <class F>
  requires(!std::same_as<std::remove_cvref_t<F>, Respond> &&
           std::is_invocable_v<std::remove_cvref_t<F>&, Response>)
      Respond(F&& answer)  // NOLINT(google-explicit-constructor): a lambda is a Respond
      : answer_(std::forward<F>(answer)) {}
  /// A Respond that calls `answer`, whose request is abandoned once `*abandoned` is set.
  Respond(std::function<void(Response)> answer, std::shared_ptr<const std::atomic<bool>> abandoned)
      : answer_(std::move(answer)), abandoned_(std::move(abandoned)) {}

  /// Sends `response` (does nothing on an empty Respond).
  void operator()(Response response) const {
    if (answer_) answer_(std::move(response));
  }
  /// Set (from any thread) once nobody will read the answer: the request's connection closed
  /// (the client went away, a write failed, or Server::stop()'s drain ran out of time). For
  /// FlowRequest::abandoned and for a handler's own work: stop, and commit nothing. Null when the
  /// Respond was made from a plain function. Valid as long as this Respond (or a copy) lives.
  [[nodiscard]] const std::atomic<bool>* abandoned() const noexcept { return abandoned_.get(); }
  /// Whether abandoned() is set.
  [[nodiscard]] bool is_abandoned() const noexcept {
    return abandoned_ != nullptr && abandoned_->load(std::memory_order_acquire);
  }
  [[nodiscard]] explicit operator bool() const noexcept { return static_cast<bool>(answer_); }

 private:
  std::function<void(Response)> answer_;
  std::shared_ptr<const std::atomic<bool>> abandoned_;
};

/// The application's handler: writes through `tx` (a transaction is open) and returns the
/// response, with FlowHandler's contract (keel/idempotency/idempotency_flow.hpp): it may run
/// more than once, must do nothing outside `tx`, and an exception is answered 500.
using TransactionalHandler = std::function<StoredResponse(const Request&, Connection& tx)>;

struct IdempotentHandlerOptions {
  /// The flow's options (store and pool required; see FlowOptions). Its clock, when set, is also
  /// the clock of the deadline check and of the admission latency.
  FlowOptions flow;
  /// Admission control shared by every route that uses the same resource. Default none: every
  /// request is admitted.
  AdmissionLimiter* limiter = nullptr;
  /// Called for each shed request, before its answer is built. Default none.
  std::function<void(const Request&, const Admission&)> on_shed;
  /// The principal of a request, for principal(). Default: the Bearer token of its Authorization
  /// header (principal_from_authorization()). Verify credentials in it, or before.
  std::function<std::string(const Request&)> principal;
};

/// The attempt number `request` declares (Keel-Attempt, x-envoy-attempt-count,
/// grpc-previous-rpc-attempts; keel::attempt_number): 1 when it carries none.
[[nodiscard]] int request_attempt(const Request& request);

/// The deadline of a request that arrived at `arrival`: arrival + its Keel-Deadline-Ms; infinite
/// when the header is absent, invalid or sent more than once.
[[nodiscard]] Deadline request_deadline(const Request& request, TimePoint arrival);

/// `answer` as a Beast response of HTTP version `version` (11 or 10): its status, headers and body,
/// Content-Length set. Connection and keep-alive are left to the server.
[[nodiscard]] Response to_response(const FlowResponse& answer, unsigned version = 11);

/// A problem+json response (RFC 9457): `status`, application/problem+json, the body of
/// problem_json(status, title, detail).
[[nodiscard]] Response problem_response(int status, std::string_view title, std::string_view detail,
                                        unsigned version = 11);

/// The answer to a request that `admission` shed: 503 problem+json with its Retry-After, the
/// detail saying whether it was shed as a retry or past the queue bound. What IdempotentHandler
/// answers, for routes that take admission themselves. Requires: `admission` was shed (false).
[[nodiscard]] Response shed_response(const Admission& admission, unsigned version = 11);

class IdempotentHandler {
 public:
  /// Throws std::invalid_argument naming the field when the flow's options are invalid (see
  /// IdempotentRequestFlow) or `handler` is empty.
  IdempotentHandler(IdempotentHandlerOptions options, TransactionalHandler handler);

  /// The principal of `request` (IdempotentHandlerOptions::principal).
  [[nodiscard]] std::string principal(const Request& request) const;

  /// Blocking: the deadline check, admission, then the flow, on the calling thread (not an
  /// event-loop thread). `arrival` is when the request was read (the start of its
  /// Keel-Deadline-Ms budget). `abandoned` (optional, must outlive the call): once set, the flow
  /// stops at its next step and commits nothing (FlowRequest::abandoned). Never throws for a
  /// database or handler failure (those are answers), only std::bad_alloc and the like.
  [[nodiscard]] Response handle(const Request& request, std::string_view principal,
                                TimePoint arrival,
                                const std::atomic<bool>* abandoned = nullptr) const;

  /// Non-blocking: the deadline check and admission on the calling thread; a refused request's
  /// answer is passed to `done` before async_handle() returns. An admitted one runs the flow on
  /// `executor`, abandoned once done.abandoned() is set, and `done` is called there with its
  /// answer. `done` is called exactly once, unless the executor drops the work (a stopped thread
  /// pool), in which case the admission slot is released without it.
  void async_handle(Request request, std::string principal, TimePoint arrival,
                    const boost::asio::any_io_executor& executor, Respond done) const;

  [[nodiscard]] const IdempotentRequestFlow& flow() const noexcept { return flow_; }
  /// The clock deadlines and latencies are read on: FlowOptions::clock, or keel::steady_clock().
  [[nodiscard]] Clock& clock() const noexcept;

 private:
  // The refusal of `request` before the handler runs (deadline passed, or shed), or nullopt with
  // `admission` holding its slot (or empty when there is no limiter).
  [[nodiscard]] std::optional<Response> refuse(const Request& request, TimePoint arrival,
                                               Admission& admission) const;
  // The flow for an admitted request; releases `admission` with the latency.
  [[nodiscard]] Response run(const Request& request, std::string_view principal, TimePoint arrival,
                             Admission& admission, const std::atomic<bool>* abandoned) const;

  IdempotentHandlerOptions options_;
  TransactionalHandler handler_;
  IdempotentRequestFlow flow_;
};

}  // namespace keel::store::beast
