// WebhookHandler: a job attempt as one POST through keel::http::Client (see
// keel/handlers/webhook_handler.hpp).
#include "keel/handlers/webhook_handler.hpp"

#include <stdexcept>
#include <string_view>
#include <utility>

#include "keel/core/classify.hpp"
#include "keel/core/expected.hpp"
#include "keel/core/retry.hpp"
#include "keel/core/text.hpp"
#include "keel/http/request.hpp"
#include "keel/http/url.hpp"

namespace keel::store {

http::ClientOptions webhook_client_options(Duration timeout) {
  http::ClientOptions options;
  options.retry = {.max_attempts = 1, .per_try_timeout = timeout, .overall_timeout = timeout};
  options.observability.log = [](std::string_view) {};  // the queue records every attempt
  return options;
}

WebhookHandler::WebhookHandler(http::Client& client, std::string url)
    : client_(&client), url_(std::move(url)) {
  // The client's own check (http::parse_url): a URL it would refuse on every attempt is refused
  // here, once, rather than dead-lettering each job.
  if (auto parsed = http::parse_url(url_); !parsed) {
    throw_invalid(std::move(parsed).error().in("url", "keel::store::WebhookHandler"));
  }
  dependency_ = http::breaker_key(url_).value_or(url_);
}

AttemptReport WebhookHandler::operator()(const LeasedJob& job, const std::atomic<bool>&) const {
  http::Request request;
  request.method = "POST";
  request.url = url_;
  request.body = job.payload;
  request.idempotency_key = job.idempotency_key;
  // The queue's earlier attempts: this one is a retry for the budget, and Keel-Attempt says so.
  request.prior_attempts = job.attempt - 1;
  request.headers = {{"Content-Type", "application/json"},
                     {"Keel-Job-Attempt", std::to_string(job.attempt)}};
  return report_of(client_->send(request), dependency_);
}

AttemptReport report_of(const http::Result& r, std::string_view dependency) {
  AttemptReport report;
  report.outcome = r.outcome;
  if (r.ok()) return report;
  if (!r.outcome.attempted()) return AttemptReport::not_sent(r.outcome, r.reason, dependency);
  std::string error = describe(r.outcome);
  if (!r.error.empty()) error += ": " + r.error;
  if (r.response && !r.response->body.empty()) {
    // Any bytes a receiver sent: cut on a character boundary, what is not UTF-8 replaced.
    error += ": " + storable_text(r.response->body, kResponseExcerptBytes);
  }
  report.error = error;
  return report;
}

}  // namespace keel::store
