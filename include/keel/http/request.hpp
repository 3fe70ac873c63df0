// keel::http's request and result types, shared by both HTTP clients (the blocking
// keel::http::Client and keel::asio::HttpClient): what one logical operation asks for (Request),
// what it ended with (Result), what each attempt reports (AttemptEvent), and the request checks
// and keys both run before the first attempt. No libcurl here.
//
// Thread-safety: plain values; the free functions are safe to call from any thread.
//
// Example:
//   keel::http::Request r{.method = "POST", .url = "http://127.0.0.1:8080/pay", .body = "{}"};
//   if (auto key = keel::http::check_request(r); !key) std::cerr << key.error().message();
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "keel/core/classify.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/expected.hpp"
#include "keel/core/retry.hpp"
#include "keel/http/message.hpp"
#include "keel/http/url.hpp"

namespace keel::http {

/// A new idempotency key: a random (version 4) UUID in its 36-character text form, with 122
/// bits from OpenSSL's CSPRNG, formatted by keel::uuid_v4 (the one UUID form keel generates;
/// keel::store::new_job_key is the same generator). Throws std::runtime_error if the CSPRNG
/// cannot supply bytes.
[[nodiscard]] std::string make_idempotency_key();

/// The circuit-breaker key of a URL: its lower-case host and its port ("example.com:443"), or
/// nullopt when the URL is not valid (see parse_url).
[[nodiscard]] std::optional<std::string> breaker_key(const std::string& url);

/// Default ClientOptions::limits.max_response_bytes.
inline constexpr std::size_t kDefaultMaxResponseBytes = std::size_t{256} * 1024 * 1024;

/// One logical operation (it may take several attempts).
struct Request {
  /// Method token, sent as given. Default "GET".
  std::string method = "GET";
  /// Absolute http:// or https:// URL (scheme in any case). Requires: non-empty. A URL that
  /// parse_url refuses fails the request before any attempt (see Client::send).
  std::string url;
  /// Extra header fields, sent on every attempt. An Idempotency-Key among them (any case) is the
  /// request's key, as if given in idempotency_key: sent once, and it makes the request safe to
  /// repeat. Keel-Attempt and Keel-Deadline-Ms are the client's own and are dropped. Default none.
  Headers headers;
  /// Request body; sent when non-empty or when the method is POST, PUT or PATCH. Default empty.
  std::string body;
  /// Sent as Idempotency-Key on every attempt when non-empty (for example a key stored on a job
  /// record), in its canonical form ("k" is sent as k). Requires: empty or valid by
  /// check_idempotency_key, and the same key as any Idempotency-Key in headers. Default empty:
  /// the client generates one for POST and PATCH when generate_idempotency_key is true.
  std::string idempotency_key;
  /// Whether to generate a key for a POST or PATCH that has none (in idempotency_key or
  /// headers). A caller's key is always sent. Default true.
  bool generate_idempotency_key = true;
  /// The caller's deadline, combined with the policy's overall_timeout (the earlier wins).
  /// Default infinite.
  Deadline deadline = Deadline::infinite();
  /// An upper bound on the operation's deadline from the caller's own caller: in a request
  /// handler, the incoming request's deadline (keel::store::current_request_deadline(), from
  /// its Keel-Deadline-Ms). The engine applies the earliest of deadline, the policy's
  /// overall_timeout and this (CallOptions::ceiling). Default infinite (no bound).
  Deadline ceiling = Deadline::infinite();
  /// Attempts of this logical operation already made by a durable layer (a job queue's earlier
  /// attempts): the first attempt here is then a retry, asked of the retry budget before it is
  /// sent (CallOptions::prior_attempts), and Keel-Attempt counts on from them. Requires: >= 0.
  /// Default 0.
  int prior_attempts = 0;
  /// Where the response body goes instead of Response::body, for bodies too large to hold in
  /// memory (limits.max_response_bytes does not apply). Called on the thread running the attempt
  /// (the client's executor for keel::asio). `restart` runs before each attempt and must drop what
  /// an earlier attempt wrote, so that only the final attempt's body remains; `write` receives the
  /// body's bytes in order. Either returning false ends the attempt as a permanent local failure
  /// (Result::error says so). The body classifier hook then sees an empty body. Default none
  /// (both empty): the body is collected in Response::body.
  struct BodySink {
    std::function<bool()> restart;
    std::function<bool(std::string_view)> write;
  } body_sink;
};

/// Checks a request before any attempt: its URL (parse_url), its header fields
/// (check_header_field) and its Idempotency-Key (check_idempotency_key), and finds the caller's
/// key: Request::idempotency_key or an Idempotency-Key header (any case). Returns the caller's
/// key in its canonical form (keel/core/idempotency_key.hpp; empty when none), the form sent, when
/// the request can be sent; otherwise an Error saying why it cannot (an invalid key, two
/// different keys). Both clients run it first in send().
[[nodiscard]] Expected<std::string> check_request(const Request& request);

/// What ClientOptions::fallbacks.deferred_writes did with a failed write (Result::deferral).
enum class DeferralStatus : unsigned char {
  kNone,           // not handed over, or the hand-over failed (Result::error says why)
  kQueued,         // stored as a new job (StopReason::kQueued, Result::job_id)
  kAlreadyQueued,  // the same request was already stored under this key (kQueued, its job_id)
  kKeyConflict,    // a different request is stored under this key: not queued; the original
                   // failure stands, Result::job_id is the existing job and error says so
};

/// What send() returns: errors are values.
struct Result {
  /// The last attempt's response; empty when no attempt got one (network failure, or no attempt
  /// ran).
  std::optional<Response> response;
  /// The last attempt's classification; kNotAttempted when no attempt ran (open circuit, with
  /// the breaker's retry_in; budget refused; deadline already passed): nothing was sent.
  /// kPermanent, with no attempt, for a request that check_request refuses (error says why).
  Outcome outcome;
  /// Why the operation stopped (kSuccess on success).
  StopReason reason = StopReason::kSuccess;
  int attempts = 0;
  Duration elapsed{};
  /// libcurl's message for the last attempt's transport failure, or why the request was refused
  /// or the response could not be taken (head over limits.max_header_bytes, body
  /// over limits.max_response_bytes, a body sink that failed); empty otherwise.
  std::string error;
  /// The Idempotency-Key sent (generated or the caller's); empty when none.
  std::string idempotency_key;
  /// The response is a cached earlier answer (ClientOptions::fallbacks.stale_responses), served
  /// because the host's circuit breaker was open: reason is kSuccess and outcome a success with the
  /// cached status; attempts counts those made before the breaker refused (usually none).
  /// Default false.
  bool stale = false;
  /// With stale: how long ago the cached answer was received (within the cache's max_age).
  Duration stale_age{};
  /// With StopReason::kQueued: the id ClientOptions::fallbacks.deferred_writes stored the request
  /// under, to be delivered later with idempotency_key. With DeferralStatus::kKeyConflict: the id
  /// of the other request stored under that key. Empty otherwise.
  std::string job_id;
  /// What the deferred writes did with the request. Default kNone.
  DeferralStatus deferral = DeferralStatus::kNone;

  [[nodiscard]] bool ok() const noexcept { return reason == StopReason::kSuccess; }
};

/// Passed to ClientOptions::observability.on_attempt after every attempt. The fields and words are
/// those of keel::Event's kAttemptFinished (keel/core/events.hpp): the outcome, and the decision as
/// keel::format_decision writes it.
struct AttemptEvent {
  std::string_view method;
  std::string_view url;
  int attempt = 1;          // 1 for the first
  Outcome outcome;          // its classification
  std::string_view error;   // libcurl's message for a transport failure, else empty
  Duration took{};          // how long the attempt ran
  bool will_retry = false;  // another attempt follows
  Duration delay{};         // the wait before it (when will_retry)
  StopReason reason = StopReason::kSuccess;  // why the operation stops (when !will_retry)
};

}  // namespace keel::http
