#include "keel/serve/httplib/rate_limiter.hpp"

#include "keel/core/retry_after.hpp"
#include "keel/serve/httplib/idempotency_middleware.hpp"

namespace keel::store {

void write_rate_limited(httplib::Response& response, Duration wait, std::string_view detail) {
  response.set_header("Retry-After", format_retry_after(wait));
  write_problem_and_close(response, 429, "Too many requests", detail);
}

}  // namespace keel::store
