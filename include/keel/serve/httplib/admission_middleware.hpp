// Admission control for cpp-httplib: wraps a handler so that, past a concurrency limit, requests
// are answered 503 + Retry-After + application/problem+json instead of being run, retries first
// (keel/core/admission.hpp has the decision and its two thresholds). The attempt number comes from
// Keel-Attempt, x-envoy-attempt-count or grpc-previous-rpc-attempts (request_attempt()).
//
// The wrapped handler runs after cpp-httplib has read the request body: what is saved is the
// handler's work (and what it calls), not the read. Put the limiter around every route that shares
// the resource it protects (one limiter for all of them), so their in-flight requests add up.
//
// Thread-safety: the returned handler is safe to call from cpp-httplib's worker threads at once.
// The limiter and the on_shed hook must outlive it; on_shed is called from those threads.
//
// Example:
//   keel::AdmissionLimiter limiter({.max_concurrency = 32, .queue_bound = 8});
//   keel::store::AdmissionMiddleware admission({.limiter = &limiter});
//   server.Post("/v1/charges", admission.wrap(idempotency.wrap(create_charge)));
#pragma once

#include <httplib.h>

#include <functional>

#include "keel/core/admission.hpp"

namespace keel::store {

/// The attempt number `request` declares (keel::attempt_number over its three headers): 1 when
/// it carries none.
[[nodiscard]] int request_attempt(const httplib::Request& request);

/// Writes the answer to a shed request: 503, Retry-After in whole seconds (the admission's
/// full-jitter delay rounded up, at least 1), and a problem+json body naming the reason.
/// Requires: !admission (a shed admission).
void write_shed(httplib::Response& response, const Admission& admission);

struct AdmissionMiddlewareOptions {
  /// The limiter shared by every wrapped route. Required (non-null).
  AdmissionLimiter* limiter = nullptr;
  /// Called for each shed request, before the answer is written. Default none.
  std::function<void(const httplib::Request&, const Admission&)> on_shed;
  /// Times each admitted handler, for the limiter's adaptive limit: from the handler's start
  /// (cpp-httplib reads a request on the thread that handles it, so a wait for a thread comes
  /// before the request is seen and is not counted; keel::store::beast::Server's handlers time
  /// from the arrival on its event loop). Default keel::steady_clock().
  Clock* clock = nullptr;
};

class AdmissionMiddleware {
 public:
  /// Throws std::invalid_argument when limiter is null.
  explicit AdmissionMiddleware(AdmissionMiddlewareOptions options);

  /// Wraps a handler: it runs holding an admission slot (released when it returns or throws;
  /// when it returns, with its latency, which an adaptive limiter learns from),
  /// or the request is answered by write_shed(). Each request draws its Retry-After from its
  /// thread's keel::thread_rng().
  [[nodiscard]] httplib::Server::Handler wrap(httplib::Server::Handler handler) const;

 private:
  AdmissionMiddlewareOptions options_;
};

}  // namespace keel::store
