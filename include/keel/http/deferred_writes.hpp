// keel::http::DeferredWrites: where a client hands a write it could not deliver now ("queue for
// later", keel/core/fallback.hpp). When ClientOptions::fallbacks.deferred_writes points at one,
// both HTTP clients give it every write that carries an idempotency key and failed because its
// dependency is down (an open breaker, or retries exhausted on a transient failure); the call
// then returns StopReason::kQueued with Result::job_id, and the implementation delivers the
// request later with the same Idempotency-Key, so the receiver sees one logical operation. A
// write without a key is never handed over.
//
// keel::http defines only the interface, so that it depends on no store; the durable
// implementation is keel::store::QueuedWrites (keel/handlers/deferred_request.hpp, in
// keel::store_handlers), a job on a keel::store::JobQueue delivered by
// keel::store::DeferredRequestHandler.
//
// Thread-safety: implementations must be safe for concurrent use: a blocking Client calls defer
// from every thread that sends; keel::asio::HttpClient calls it on its executor, where it
// blocks the loop for as long as it runs (a local database write).
//
// Example:
//   class Outbox : public keel::http::DeferredWrites {
//     keel::Expected<keel::http::Deferral> defer(const keel::http::Request& r,
//                                                std::string_view key) override { ... }
//   };
//   Outbox outbox;
//   keel::http::Client client({.fallbacks = {.deferred_writes = &outbox}});
#pragma once

#include <string>
#include <string_view>

#include "keel/core/expected.hpp"
#include "keel/http/request.hpp"

namespace keel::http {

/// What defer() did: stored the request, found it stored already, or found another request
/// under the same key.
struct Deferral {
  /// kQueued, kAlreadyQueued or kKeyConflict (never kNone).
  DeferralStatus status = DeferralStatus::kQueued;
  /// The id of the job stored under the key: the new one, or the one already there.
  std::string job_id;
};

class DeferredWrites {
 public:
  virtual ~DeferredWrites() = default;

  /// Stores `request` (method, URL, header fields and body) to be sent later with
  /// `idempotency_key` as its Idempotency-Key. Returns kQueued and the id under which it was
  /// stored; kAlreadyQueued and the existing id when the same request (method, URL, body and
  /// the header fields that are not credentials) is already stored under that key; kKeyConflict
  /// and the existing id when a different one is: the client then reports the original failure,
  /// saying so (one key is one operation: a second, different write under it would never be
  /// delivered). An Error saying why nothing could be stored; the client then reports the
  /// original failure with that error. Must not throw.
  [[nodiscard]] virtual Expected<Deferral> defer(const Request& request,
                                                 std::string_view idempotency_key) = 0;
};

}  // namespace keel::http
