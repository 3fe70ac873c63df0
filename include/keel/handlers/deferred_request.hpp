// Queue for later, the durable half: keel::store::QueuedWrites is the keel::http::DeferredWrites
// (keel/http/deferred_writes.hpp) that stores a write an HTTP client could not deliver as a job
// on a keel::store::JobQueue, and keel::store::DeferredRequestHandler is the Worker's handler
// that sends it when its job runs. The job's idempotency key is the request's Idempotency-Key,
// and every delivery attempt sends it again, so the receiver sees the original attempts and the
// deliveries as one logical operation (it applies the write once). Deferring the same key twice
// on one queue is one job (the queue's own deduplication by key): the same request again is
// "already queued" (DeferralStatus::kAlreadyQueued, the same job), and a different request
// under a key already queued (another method, URL, body or header field that is not a
// credential) is refused (kKeyConflict): it would never be delivered, since the key is the
// first request's.
//
// The job's payload is the request as JSON (encode_deferred_request):
//   {"keel_deferred_request": 1, "method": "POST", "url": "http://...", "headers": [["Name",
//    "value"], ...], "body": "..." | "body_base64": "...", "prior_attempts": 3,
//    "secret_headers": ["X-Api-Key"]}
// The client's own header fields (Idempotency-Key, Keel-Attempt, Keel-Deadline-Ms) are not
// stored; prior_attempts counts the attempts made before the request was deferred, so the
// deliveries' Keel-Attempt goes on from them. A body that is not UTF-8 is stored in base64; a URL
// or header value that is not UTF-8 text cannot be stored as it is (QueuedWrites refuses it).
//
// Credentials: the values of Authorization, Proxy-Authorization, Cookie and the fields named in
// QueuedWritesOptions::secret_headers (listed in the payload's "secret_headers") ARE stored, in
// plain text, because the delivery needs them; protect the queue's database (file permissions,
// a PostgreSQL role) as you would the credentials. They are left out of the comparison of two
// requests under one key (a refreshed token is the same request), and every operator view shows
// the payload through redact_deferred_request.
//
// Thread-safety: QueuedWrites and DeferredRequestHandler are immutable after construction and
// safe for concurrent use (the pool and the client are); the free functions are pure.
//
// Example:
//   keel::store::ConnectionPool pool(*keel::store::parse_database_url("sqlite:outbox.db"));
//   keel::store::QueuedWrites outbox(pool, queue);
//   keel::http::Client client({.fallbacks = {.deferred_writes = &outbox}});
//   auto r = client.send(charge);   // r.reason == keel::StopReason::kQueued, r.job_id
//   ...
//   keel::http::Client sender(keel::store::webhook_client_options(std::chrono::seconds(30)));
//   keel::store::Worker worker(pool, queue, {.queue = "deferred-http"},
//                              keel::store::DeferredRequestHandler(sender));
#pragma once

#include <atomic>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/expected.hpp"
#include "keel/db/database.hpp"
#include "keel/http/client.hpp"
#include "keel/http/deferred_writes.hpp"
#include "keel/http/request.hpp"
#include "keel/queue/queue.hpp"

namespace keel::store {

/// The queue QueuedWrites uses unless told otherwise.
inline constexpr std::string_view kDeferredRequestQueue = "deferred-http";

/// Whether header field `name` (any case) carries a credential: Authorization,
/// Proxy-Authorization, Cookie, or one of `also`.
[[nodiscard]] bool is_credential_header(std::string_view name,
                                        std::span<const std::string> also = {});

/// The job payload of `request` (the format above); `secret_headers` are listed in its
/// "secret_headers" (when not empty). Requires: the URL and the header values are UTF-8 text
/// (keel::is_storable_text); bytes that are not are stored as U+FFFD. Throws std::bad_alloc only.
[[nodiscard]] std::string encode_deferred_request(const http::Request& request,
                                                  std::span<const std::string> secret_headers = {});

/// What two deferrals under one key are compared by: the method, the URL, the body and the
/// header fields (names in lower case, sorted) except the client's own and the credentials
/// (is_credential_header with `secret_headers`). Equal text, same request.
[[nodiscard]] std::string deferred_request_fingerprint(
    const http::Request& request, std::span<const std::string> secret_headers = {});

/// `payload` for an operator's eyes: a deferred request (the format above) with the value of
/// each credential header field (is_credential_header, with the payload's "secret_headers")
/// replaced by "[redacted]", re-serialised compactly; any other payload unchanged. Linear in the
/// payload's size and safe on any bytes (nothing nested deeper than a deferred request is
/// parsed). Throws std::bad_alloc only.
[[nodiscard]] std::string redact_deferred_request(std::string_view payload);

/// What redact_deferred_request writes in place of a credential.
inline constexpr std::string_view kRedacted = "[redacted]";

/// The request a payload holds: method, URL, header fields, body and prior_attempts. An Error
/// naming what is wrong when the payload is not a deferred request.
[[nodiscard]] Expected<http::Request> decode_deferred_request(std::string_view payload);

struct QueuedWritesOptions {
  /// The queue the jobs go to. Requires: a valid queue name. Default "deferred-http".
  std::string queue = std::string(kDeferredRequestQueue);
  /// Delivery attempts before a job is dead. 0: the queue's default. Requires: >= 0. Default 0.
  int max_attempts = 0;
  /// Header fields that carry credentials besides Authorization, Proxy-Authorization and Cookie
  /// (X-Api-Key, ...): stored for the delivery, left out of the comparison of two requests
  /// under one key, redacted in operator views. Requires: valid header names. Default none.
  std::vector<std::string> secret_headers;
};

class QueuedWrites final : public http::DeferredWrites {
 public:
  /// Throws std::invalid_argument naming the field when an option is invalid. Requires: pool
  /// and queue outlive it.
  QueuedWrites(ConnectionPool& pool, const JobQueue& queue, QueuedWritesOptions options = {});

  /// Enqueues `request` with `idempotency_key` as the job's key (migrating the queue's schema
  /// first when the database has none). Returns the job's id as decimal text: kQueued for a new
  /// job; for a key already on the queue, kAlreadyQueued when that job's request has the same
  /// deferred_request_fingerprint, kKeyConflict when not (nothing stored). An Error with the
  /// queue's or the database's message when nothing could be stored, and one naming the field
  /// when the URL or a header value is not UTF-8 text (a JSON payload cannot hold it as it is;
  /// the value is not quoted). Never throws.
  [[nodiscard]] Expected<http::Deferral> defer(const http::Request& request,
                                               std::string_view idempotency_key) override;

  [[nodiscard]] const QueuedWritesOptions& options() const noexcept { return options_; }

 private:
  ConnectionPool* pool_;
  const JobQueue* queue_;
  QueuedWritesOptions options_;
};

/// Sends each job's deferred request through `client` (give it webhook_client_options: the
/// queue is the retrying layer) with the job's key as Idempotency-Key and Keel-Job-Attempt; its
/// attempts are the stored prior_attempts plus the job's earlier ones. The report is
/// WebhookHandler's (report_of); a payload that is not a deferred request is a permanent
/// failure naming what is wrong.
class DeferredRequestHandler {
 public:
  /// Requires: client outlives the handler (and every copy of it).
  explicit DeferredRequestHandler(http::Client& client) : client_(&client) {}

  [[nodiscard]] AttemptReport operator()(const LeasedJob& job,
                                         const std::atomic<bool>& cancel) const;

 private:
  http::Client* client_;
};

}  // namespace keel::store
