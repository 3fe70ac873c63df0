#include "keel/store/server/admission_middleware.hpp"

#include <algorithm>
#include <chrono>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "keel/expected.hpp"
#include "keel/retry_after.hpp"
#include "keel/store/server/idempotency_middleware.hpp"

namespace keel::store {

namespace {

std::optional<std::string_view> header(const httplib::Request& request, const char* name) {
  // A view into the request's own header map (case-insensitive): valid while the request is.
  const auto it = request.headers.find(name);
  if (it == request.headers.end()) return std::nullopt;
  return std::string_view(it->second);
}

}  // namespace

int request_attempt(const httplib::Request& request) {
  return attempt_number(
      {.keel_attempt = header(request, "Keel-Attempt"),
       .envoy_attempt_count = header(request, "x-envoy-attempt-count"),
       .grpc_previous_rpc_attempts = header(request, "grpc-previous-rpc-attempts")});
}

void write_shed(httplib::Response& response, const Admission& admission) {
  response.set_header("Retry-After", format_retry_after(admission.retry_after()));
  const bool retry = admission.reason() == ShedReason::kRetryOverLimit;
  write_problem(response, 503, "Overloaded",
                retry ? "the server is at its concurrency limit and sheds retries first; retry "
                        "after the Retry-After delay"
                      : "the server is over its concurrency limit and its queue bound; retry "
                        "after the Retry-After delay");
}

AdmissionMiddleware::AdmissionMiddleware(AdmissionMiddlewareOptions options)
    : options_(std::move(options)) {
  if (options_.limiter == nullptr) {
    throw_invalid({.context = "keel::store::AdmissionMiddlewareOptions",
                   .field = "limiter",
                   .problem = "must be set",
                   .got = "null"});
  }
}

httplib::Server::Handler AdmissionMiddleware::wrap(httplib::Server::Handler handler) const {
  return [options = options_, handler = std::move(handler)](const httplib::Request& request,
                                                            httplib::Response& response) {
    Admission admission = options.limiter->admit(request_attempt(request), thread_rng());
    if (!admission) {
      if (options.on_shed) options.on_shed(request, admission);
      write_shed(response, admission);
      return;
    }
    Clock& clock = options.clock != nullptr ? *options.clock : steady_clock();
    const TimePoint started = clock.now();
    handler(request, response);  // an exception releases the slot without a latency
    admission.release(clock.now() - started);
  };
}

}  // namespace keel::store
