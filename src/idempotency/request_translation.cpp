#include "keel/idempotency/request_translation.hpp"

#include "keel/core/deadline_header.hpp"
#include "keel/core/retry_after.hpp"

namespace keel::store {

int request_attempt(const HeaderLookup& headers) {
  return attempt_number(
      {.keel_attempt = headers.first("Keel-Attempt"),
       .envoy_attempt_count = headers.first("x-envoy-attempt-count"),
       .grpc_previous_rpc_attempts = headers.first("grpc-previous-rpc-attempts")});
}

Deadline request_deadline(const HeaderLookup& headers, TimePoint arrival) {
  std::optional<std::string_view> value;
  if (headers.count(kDeadlineHeader) == 1) value = headers.first(kDeadlineHeader);
  return request_deadline(value, arrival);
}

std::string principal_from_headers(const HeaderLookup& headers) {
  return principal_from_authorization(headers.first("Authorization"));
}

FlowRequest flow_request(const HeaderLookup& headers, std::string_view method,
                         std::string_view path, std::string_view body, std::string_view principal,
                         Deadline deadline) {
  return {.method = method,
          .path = path,
          .idempotency_key = headers.first("Idempotency-Key"),
          .idempotency_key_fields = headers.count("Idempotency-Key"),
          .content_type = headers.first("Content-Type").value_or(""),
          .body = body,
          .principal = principal,
          .deadline = deadline};
}

FlowResponse shed_response(const Admission& admission) {
  const bool retry = admission.reason() == ShedReason::kRetryOverLimit;
  return {.status = 503,
          .headers = {{"Content-Type", "application/problem+json"},
                      {"Retry-After", format_retry_after(admission.retry_after())}},
          .body = problem_json(
              503, "Overloaded",
              retry ? "the server is at its concurrency limit and sheds retries first; retry "
                      "after the Retry-After delay"
                    : "the server is over its concurrency limit and its queue bound; retry "
                      "after the Retry-After delay")};
}

}  // namespace keel::store
