// The idempotency flow as a Boost.Beast handler (see keel/store/beast/idempotent_handler.hpp).
#include "keel/store/beast/idempotent_handler.hpp"

#include <boost/asio/post.hpp>
#include <boost/beast/core/string.hpp>
#include <boost/beast/http/field.hpp>
#include <memory>
#include <utility>

#include "keel/deadline_header.hpp"
#include "keel/expected.hpp"
#include "keel/random.hpp"
#include "keel/retry_after.hpp"

namespace keel::store::beast {
namespace {

namespace http = boost::beast::http;

std::string_view view(boost::beast::string_view s) { return {s.data(), s.size()}; }

/// The first value of header `name`, viewing `request`; nullopt when absent.
std::optional<std::string_view> header(const Request& request, std::string_view name) {
  const auto it = request.find(boost::beast::string_view(name.data(), name.size()));
  if (it == request.end()) return std::nullopt;
  return view(it->value());
}

/// The request target without its query string (what identifies the operation, as the
/// cpp-httplib adapter's request.path).
std::string_view path_of(const Request& request) {
  const std::string_view target = view(request.target());
  return target.substr(0, target.find('?'));
}

std::size_t header_count(const Request& request, std::string_view name) {
  return request.count(boost::beast::string_view(name.data(), name.size()));
}

}  // namespace

int request_attempt(const Request& request) {
  return attempt_number(
      {.keel_attempt = header(request, "Keel-Attempt"),
       .envoy_attempt_count = header(request, "x-envoy-attempt-count"),
       .grpc_previous_rpc_attempts = header(request, "grpc-previous-rpc-attempts")});
}

Deadline request_deadline(const Request& request, TimePoint arrival) {
  // A field sent twice is invalid, hence ignored (as the cpp-httplib adapter does).
  std::optional<std::string_view> value;
  if (header_count(request, kDeadlineHeader) == 1) value = header(request, kDeadlineHeader);
  return keel::store::request_deadline(value, arrival);
}

Response to_response(const FlowResponse& answer, unsigned version) {
  Response res{static_cast<http::status>(answer.status), version};
  bool typed = false;
  for (const auto& [name, value] : answer.headers) {
    if (boost::beast::iequals(name, "Content-Type")) typed = true;
    res.insert(name, value);
  }
  if (!typed) res.set(http::field::content_type, "application/octet-stream");
  res.body() = answer.body;
  res.prepare_payload();
  return res;
}

Response problem_response(int status, std::string_view title, std::string_view detail,
                          unsigned version) {
  Response res{static_cast<http::status>(status), version};
  res.set(http::field::content_type, "application/problem+json");
  res.body() = problem_json(status, title, detail);
  res.prepare_payload();
  return res;
}

Response shed_response(const Admission& admission, unsigned version) {
  const bool retry = admission.reason() == ShedReason::kRetryOverLimit;
  Response res = problem_response(
      503, "Overloaded",
      retry ? "the server is at its concurrency limit and sheds retries first; retry after the "
              "Retry-After delay"
            : "the server is over its concurrency limit and its queue bound; retry after the "
              "Retry-After delay",
      version);
  res.set(http::field::retry_after, format_retry_after(admission.retry_after()));
  return res;
}

IdempotentHandler::IdempotentHandler(IdempotentHandlerOptions options, TransactionalHandler handler)
    : options_(std::move(options)), handler_(std::move(handler)), flow_(options_.flow) {
  if (!handler_) {
    throw_invalid({.context = "keel::store::beast::IdempotentHandler",
                   .field = "handler",
                   .problem = "must be set",
                   .got = "empty"});
  }
}

Clock& IdempotentHandler::clock() const noexcept {
  return options_.flow.clock != nullptr ? *options_.flow.clock : steady_clock();
}

std::string IdempotentHandler::principal(const Request& request) const {
  if (options_.principal) return options_.principal(request);
  return principal_from_authorization(header(request, "Authorization"));
}

std::optional<Response> IdempotentHandler::refuse(const Request& request, TimePoint arrival,
                                                  Admission& admission) const {
  const TimePoint now = clock().now();
  if (request_deadline(request, arrival).expired(now)) {
    return to_response(deadline_exceeded_response("before it arrived"), request.version());
  }
  if (options_.limiter == nullptr) return std::nullopt;
  admission = options_.limiter->admit(request_attempt(request), thread_rng());
  if (admission) return std::nullopt;
  if (options_.on_shed) options_.on_shed(request, admission);
  return shed_response(admission, request.version());
}

Response IdempotentHandler::run(const Request& request, std::string_view principal,
                                TimePoint arrival, Admission& admission,
                                const std::atomic<bool>* abandoned) const {
  const TimePoint started = clock().now();
  const FlowRequest flow_request{.method = view(request.method_string()),
                                 .path = path_of(request),
                                 .idempotency_key = header(request, "Idempotency-Key"),
                                 .idempotency_key_fields = header_count(request, "Idempotency-Key"),
                                 .content_type = header(request, "Content-Type").value_or(""),
                                 .body = request.body(),
                                 .principal = principal,
                                 .deadline = request_deadline(request, arrival),
                                 .abandoned = abandoned};
  const FlowResponse answer =
      flow_.run(flow_request, [&](Connection& tx) { return handler_(request, tx); });
  admission.release(clock().now() - started);
  return to_response(answer, request.version());
}

Response IdempotentHandler::handle(const Request& request, std::string_view principal,
                                   TimePoint arrival, const std::atomic<bool>* abandoned) const {
  Admission admission;
  if (auto refused = refuse(request, arrival, admission)) return std::move(*refused);
  return run(request, principal, arrival, admission, abandoned);
}

void IdempotentHandler::async_handle(Request request, std::string principal, TimePoint arrival,
                                     const boost::asio::any_io_executor& executor,
                                     Respond done) const {
  Admission admission;
  if (auto refused = refuse(request, arrival, admission)) {
    done(std::move(*refused));
    return;
  }
  // Move-only state in a shared_ptr: the work item must be copyable for some executors.
  struct Work {
    Request request;
    std::string principal;
    Admission admission;
    Respond done;
  };
  auto work = std::make_shared<Work>(
      Work{std::move(request), std::move(principal), std::move(admission), std::move(done)});
  boost::asio::post(executor, [this, work, arrival] {
    Response res =
        run(work->request, work->principal, arrival, work->admission, work->done.abandoned());
    work->done(std::move(res));
  });
}

}  // namespace keel::store::beast
