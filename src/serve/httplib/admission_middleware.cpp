#include "keel/serve/httplib/admission_middleware.hpp"

#include <algorithm>
#include <chrono>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "keel/core/expected.hpp"
#include "keel/serve/httplib/idempotency_middleware.hpp"
#include "serve/httplib/detail/header_lookup.hpp"

namespace keel::store {

int request_attempt(const httplib::Request& request) {
  return request_attempt(detail::HttplibHeaders(request));
}

void write_shed(httplib::Response& response, const Admission& admission) {
  write_flow_response(shed_response(admission), response);
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
    const TimePoint ended = clock.now();
    admission.release(ended - started, ended);
  };
}

}  // namespace keel::store
