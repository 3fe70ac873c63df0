// A job handler that delivers each job as a webhook: one HTTP POST of the job's payload per job
// attempt, through a keel::http::Client, with the job's idempotency key as Idempotency-Key and
// its earlier attempts as Request::prior_attempts (so the client's retry budget counts a second
// attempt as a retry, and Keel-Attempt on the wire says 2). The client classifies the response:
// 2xx is done; 408, 425, 502, 504 and network failures are transient, 429 and 503 throttled,
// 500 (and other 5xx but 501 and 505) ambiguous, all retried by the queue; other statuses are
// permanent. When the client sends nothing (the host's circuit breaker is open, the
// retry budget is empty) the report is kNotAttempted, and the Worker defers the job without
// charging an attempt, until the breaker's next probe.
//
// The queue is the retrying layer: give the client a policy of one attempt
// (webhook_client_options), or a job that always fails reaches the receiver max_attempts x the
// client's attempts times.
//
// Thread-safety: immutable after construction; operator() is safe to call from several threads
// at once (keel::http::Client is).
//
// Example:
//   keel::http::Client client(keel::store::webhook_client_options(std::chrono::seconds(30)));
//   keel::store::Worker worker(pool, queue, {.queue = "hooks", .concurrency = 4},
//                              keel::store::WebhookHandler(client, "https://api.example/hooks"));
//   worker.run();
#pragma once

#include <atomic>
#include <cstddef>
#include <string>
#include <string_view>

#include "keel/core/duration.hpp"
#include "keel/http/client.hpp"
#include "keel/http/options.hpp"
#include "keel/queue/queue.hpp"

namespace keel::store {

/// Client options for a WebhookHandler: one attempt per call (per-try and overall timeout
/// `timeout`), and no give-up line (the queue records every attempt); breakers and budget are
/// the client's defaults. Requires: timeout > 0.
[[nodiscard]] http::ClientOptions webhook_client_options(Duration timeout);

/// The longest excerpt of a failed response's body in a report, in bytes.
inline constexpr std::size_t kResponseExcerptBytes = 200;

/// The report of a job attempt whose request ended with `result`: kNotAttempted with why
/// nothing was sent when nothing was ("circuit open for HOST:PORT, next probe in 4.9s");
/// otherwise the outcome, with keel::describe of it, the client's error and the start of the
/// response body (at most kResponseExcerptBytes) for a failure: cut on a character boundary, with
/// bytes that are not UTF-8 replaced by U+FFFD and counted (keel::storable_text), so that a
/// Latin-1 body or a character cut by the excerpt never keeps the queue from storing it.
/// `dependency` names the host ("host:port").
[[nodiscard]] AttemptReport report_of(const http::Result& result, std::string_view dependency);

class WebhookHandler {
 public:
  /// Throws std::invalid_argument naming the URL when http::parse_url refuses it (not http:// or
  /// https://, a byte that is not UTF-8, a host libcurl cannot send to ...). Requires: client
  /// outlives the handler (and every copy of it).
  WebhookHandler(http::Client& client, std::string url);

  /// Sends one POST for `job` (Content-Type: application/json, Keel-Job-Attempt: the job's
  /// attempt number). The report's error names a failure: keel::describe of the outcome, the
  /// client's error and the start of the response body (report_of); for a deferral, why nothing
  /// was sent ("circuit open for HOST:PORT, next probe in 4.9s"). `cancel` is not watched: the
  /// client's timeout bounds the call. Never throws for a failed request.
  [[nodiscard]] AttemptReport operator()(const LeasedJob& job,
                                         const std::atomic<bool>& cancel) const;

  [[nodiscard]] const std::string& url() const noexcept { return url_; }
  /// The breaker key of the URL ("host:port", http::breaker_key), named in deferral reports.
  [[nodiscard]] const std::string& dependency() const noexcept { return dependency_; }

 private:
  http::Client* client_;
  std::string url_;
  std::string dependency_;
};

}  // namespace keel::store
