// The idempotency middleware for cpp-httplib: an adapter that copies an httplib::Request into
// the framework-neutral IdempotentRequestFlow (keel/store/idempotency/idempotency_flow.hpp) and its
// answer into the httplib::Response (see keel/store/server/idempotency_middleware.hpp).
#include "keel/store/server/idempotency_middleware.hpp"

#include <iterator>
#include <stdexcept>

#include "idempotency/detail/ascii.hpp"
#include "keel/deadline_header.hpp"
#include "keel/expected.hpp"
#include "serve/httplib/detail/close_after_answer.hpp"

namespace keel::store {
namespace {

using detail::iequals;

/// The first value of header `name` (what get_header_value() returns), viewing `request`.
std::optional<std::string_view> header_view(const httplib::Request& request, const char* name) {
  const auto range = request.headers.equal_range(name);
  if (range.first == range.second) return std::nullopt;
  return std::string_view(range.first->second);
}

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
  return principal_from_authorization(header_view(request, "Authorization"));
}

Deadline request_deadline(const httplib::Request& request, TimePoint arrival) {
  // A field sent twice is invalid, hence ignored.
  const auto deadlines = request.headers.equal_range(std::string(kDeadlineHeader));
  std::optional<std::string_view> deadline_header;
  if (deadlines.first != deadlines.second && std::next(deadlines.first) == deadlines.second) {
    deadline_header = deadlines.first->second;
  }
  return request_deadline(deadline_header, arrival);
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
  return {.method = request.method,
          .path = request.path,
          .idempotency_key = header_view(request, "Idempotency-Key"),
          .idempotency_key_fields = request.get_header_value_count("Idempotency-Key"),
          .content_type = header_view(request, "Content-Type").value_or(""),
          .body = request.body,
          .principal = principal,
          .deadline = request_deadline(request, steady_clock().now())};
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
