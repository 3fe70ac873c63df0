// The idempotency flow as a Boost.Beast handler (see keel/serve/beast/idempotent_handler.hpp).
#include "keel/serve/beast/idempotent_handler.hpp"

#include <boost/asio/post.hpp>
#include <boost/beast/core/string.hpp>
#include <boost/beast/http/field.hpp>
#include <memory>
#include <utility>

#include "keel/core/expected.hpp"
#include "keel/core/random.hpp"
#include "keel/idempotency/request_translation.hpp"

namespace keel::store::beast {
namespace {

namespace http = boost::beast::http;

std::string_view view(boost::beast::string_view s) { return {s.data(), s.size()}; }

/// The request's header fields as keel's one request translation reads them (Beast compares
/// names without regard to case).
class BeastHeaders final : public HeaderLookup {
 public:
  explicit BeastHeaders(const Request& request) noexcept : request_(request) {}
  [[nodiscard]] std::optional<std::string_view> first(std::string_view name) const override {
    const auto it = request_.find(boost::beast::string_view(name.data(), name.size()));
    if (it == request_.end()) return std::nullopt;
    return view(it->value());
  }
  [[nodiscard]] std::size_t count(std::string_view name) const override {
    return request_.count(boost::beast::string_view(name.data(), name.size()));
  }

 private:
  const Request& request_;
};

/// The request target without its query string (what identifies the operation, as the
/// cpp-httplib adapter's request.path).
std::string_view path_of(const Request& request) {
  const std::string_view target = view(request.target());
  return target.substr(0, target.find('?'));
}

}  // namespace

int request_attempt(const Request& request) {
  return keel::store::request_attempt(BeastHeaders(request));
}

Deadline request_deadline(const Request& request, TimePoint arrival) {
  return keel::store::request_deadline(BeastHeaders(request), arrival);
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
  return to_response(keel::store::shed_response(admission), version);
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
  return keel::store::principal_from_headers(BeastHeaders(request));
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
  FlowRequest flow_request = keel::store::flow_request(
      BeastHeaders(request), view(request.method_string()), path_of(request), request.body(),
      principal, request_deadline(request, arrival));
  flow_request.abandoned = abandoned;
  const FlowResponse answer =
      flow_.run(flow_request, [&](Connection& tx) { return handler_(request, tx); });
  // From the request's arrival, not the flow's start: the wait for a worker thread is the queue
  // an adaptive limit must see.
  const TimePoint ended = clock().now();
  admission.release(ended - arrival, ended);
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
