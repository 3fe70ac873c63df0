// keel::store::RateLimiter: keel::PrincipalRateLimiter (keel/core/principal_rate_limiter.hpp, core)
// keyed by the idempotency flow's stored scope (principal_scope()), where kAnonymousScope is the
// anonymous caller's, and the cpp-httplib answer to a request over its rate.
//
// Thread-safety: as PrincipalRateLimiter; write_rate_limited writes one response.
//
// Example (a pre-routing handler answering 429 + Retry-After beyond 100 requests a second):
//   keel::store::RateLimiter limiter(100.0, 10000);
//   const keel::Duration wait = limiter.admit(middleware.scope(request));
//   if (wait > keel::Duration::zero()) {
//     keel::store::write_rate_limited(response, wait, "the limit is 100 requests a second");
//     return httplib::Server::HandlerResponse::Handled;
//   }
#pragma once

#include <httplib.h>

#include <string>
#include <string_view>

#include "keel/core/clock.hpp"
#include "keel/core/principal_rate_limiter.hpp"
#include "keel/idempotency/idempotency_flow.hpp"

namespace keel::store {

class RateLimiter : public PrincipalRateLimiter {
 public:
  using PrincipalRateLimiter::PrincipalRateLimiter;
  /// As PrincipalRateLimiter::admit, with kAnonymousScope the anonymous caller's scope.
  [[nodiscard]] Duration admit(std::string_view scope) {
    return PrincipalRateLimiter::admit(scope == kAnonymousScope ? std::string_view() : scope);
  }
};

/// Writes the answer to a request over its rate: 429, Retry-After in whole seconds (`wait`
/// rounded up, at least 1), a problem+json body with `detail`, and the connection closed after
/// it (write_problem_and_close()).
void write_rate_limited(httplib::Response& response, Duration wait, std::string_view detail);

}  // namespace keel::store
