// The idempotency middleware for cpp-httplib: an adapter that copies an httplib::Request into
// the framework-neutral IdempotentRequestFlow (keel/idempotency/idempotency_flow.hpp) and its
// answer into the httplib::Response (see keel/serve/httplib/idempotency_middleware.hpp).
#include "keel/serve/httplib/idempotency_middleware.hpp"

#include <stdexcept>

#include "idempotency/detail/ascii.hpp"
#include "keel/core/expected.hpp"
#include "serve/httplib/detail/close_after_answer.hpp"
#include "serve/httplib/detail/header_lookup.hpp"

namespace keel::store {
namespace {

using detail::iequals;

/// FlowOptions from the middleware's options (the fields they share); IdempotentRequestFlow's
/// constructor validates them.
FlowOptions flow_options(const MiddlewareOptions& o) {
  return {.store = o.store,
          .pool = o.pool,
          .scope_secret = o.scope_secret,
          .transaction_policy = o.transaction_policy,
          .isolation = o.isolation,
          .on_outcome = o.on_outcome,
          .json_limits = o.json_limits,
          .max_key_bytes = o.max_key_bytes,
          .retry_after_spread = o.retry_after_spread,
          .random = o.random,
          .log = o.log};
}

}  // namespace

void write_problem(httplib::Response& response, int status, std::string_view title,
                   std::string_view detail) {
  response.status = status;
  response.set_content(problem_json(status, title, detail), "application/problem+json");
}

std::string bearer_principal(const httplib::Request& request) {
  return principal_from_headers(detail::HttplibHeaders(request));
}

Deadline request_deadline(const httplib::Request& request, TimePoint arrival) {
  return request_deadline(detail::HttplibHeaders(request), arrival);
}

httplib::Server::HandlerResponse refuse_expired_deadline(const httplib::Request& request,
                                                         httplib::Response& response) {
  const TimePoint now = steady_clock().now();
  if (!request_deadline(request, now).expired(now)) {
    return httplib::Server::HandlerResponse::Unhandled;
  }
  write_flow_response(deadline_exceeded_response("before it arrived"), response);
  detail::close_after_answer(response);
  return httplib::Server::HandlerResponse::Handled;
}

FlowRequest flow_request(const httplib::Request& request, std::string_view principal) {
  // Arrival: now, as the middleware sees the request (cpp-httplib has read it; an admission
  // wrapper outside this one has admitted it).
  return flow_request(detail::HttplibHeaders(request), request.method, request.path, request.body,
                      principal, request_deadline(request, steady_clock().now()));
}

void write_flow_response(const FlowResponse& answer, httplib::Response& response) {
  response.status = answer.status;
  std::string content_type = "application/octet-stream";
  for (const auto& [name, value] : answer.headers) {
    if (iequals(name, "Content-Type")) {
      content_type = value;
    } else {
      response.set_header(name, value);
    }
  }
  response.set_content(answer.body, content_type);
}

std::string IdempotencyMiddleware::scope(const httplib::Request& request) const {
  return flow_.scope(options_.principal(request));
}

IdempotencyMiddleware::IdempotencyMiddleware(MiddlewareOptions options)
    : options_(std::move(options)), flow_(flow_options(options_)) {
  if (!options_.principal) options_.principal = bearer_principal;
}

httplib::Server::Handler IdempotencyMiddleware::wrap(TransactionalHandler handler) const {
  return [this, handler = std::move(handler)](const httplib::Request& request,
                                              httplib::Response& response) {
    handle(handler, request, response);
  };
}

void IdempotencyMiddleware::handle(const TransactionalHandler& handler,
                                   const httplib::Request& request,
                                   httplib::Response& response) const {
  const std::string principal = options_.principal(request);
  const FlowResponse answer = flow_.run(flow_request(request, principal),
                                        [&](Connection& tx) { return handler(request, tx); });
  write_flow_response(answer, response);
  if (metrics_outcome(answer.outcome) == IdempotencyOutcome::kExecuted && options_.after_commit) {
    options_.after_commit(request, response);
  }
}

}  // namespace keel::store
