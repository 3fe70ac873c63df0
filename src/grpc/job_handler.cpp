// The queue's gRPC delivery: reports and client options (see keel/grpc/job_handler.hpp).
#include "keel/grpc/job_handler.hpp"

#include <string>
#include <utility>

#include "keel/core/classify.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "keel/core/retry.hpp"
#include "keel/core/text.hpp"

namespace keel::grpc {

namespace {
constexpr std::size_t kMessageExcerptBytes = 200;
}  // namespace

ClientOptions job_client_options(std::string target, Duration timeout) {
  if (timeout <= Duration::zero()) {
    throw_invalid({.context = "keel::grpc::job_client_options",
                   .field = "timeout",
                   .problem = "must be > 0",
                   .got = format_duration(timeout)});
  }
  ClientOptions options;
  options.target = std::move(target);
  options.retry = {.max_attempts = 1, .per_try_timeout = timeout, .overall_timeout = timeout};
  options.log = [](std::string_view) {};  // the queue records every attempt
  return options;
}

store::AttemptReport report_of(const CallResult& r, std::string_view target) {
  store::AttemptReport report;
  report.outcome = r.outcome;
  if (r.ok()) return report;
  if (!r.outcome.attempted()) return store::AttemptReport::not_sent(r.outcome, r.reason, target);
  report.error = describe(r.outcome);
  if (!r.status.error_message().empty()) {
    report.error += ": " + storable_text(r.status.error_message(), kMessageExcerptBytes);
  }
  return report;
}

store::AttemptReport unparsable_payload(std::string_view message_type, std::string_view problem) {
  store::AttemptReport report;
  report.outcome = Outcome::permanent();
  report.error = "the payload is not a " + std::string(message_type) +
                 " in protobuf's JSON form: " + storable_text(problem, kMessageExcerptBytes);
  return report;
}

}  // namespace keel::grpc
