#include "keel/store/server/rate_limiter.hpp"

#include "keel/retry_after.hpp"
#include "keel/store/server/idempotency_middleware.hpp"

namespace keel::store {

void write_rate_limited(httplib::Response& response, Duration wait, std::string_view detail) {
  response.set_header("Retry-After", format_retry_after(wait));
  write_problem_and_close(response, 429, "Too many requests", detail);
}

}  // namespace keel::store
