// HTTP middleware for cpp-httplib that applies the idempotency-key flow
// (keel/store/idempotency.hpp) around a POST or PATCH handler: it validates the Idempotency-Key,
// claims it, runs the handler inside a transaction it can write to, stores the response in that
// same transaction, and answers repeats with the replay, 409 + Retry-After or 422. Errors are
// application/problem+json (RFC 9457).
//
// Thread-safety: the returned handler is safe to call from cpp-httplib's worker threads at once;
// each call takes its own connection from the pool. The options' store, pool and hooks must
// outlive it and be safe for concurrent use.
//
// Example:
//   keel::store::IdempotencyMiddleware idem({.store = &store, .pool = &pool});
//   server.Post("/v1/charges", idem.wrap([](const httplib::Request& req,
//                                           keel::store::Connection& tx) {
//     tx.query("INSERT INTO charges ...", {...});
//     return keel::store::StoredResponse{201, {{"Content-Type", "application/json"}}, body};
//   }));
#pragma once

#include <httplib.h>

#include <functional>
#include <string>

#include "keel/retry.hpp"
#include "keel/store/idempotency.hpp"
#include "keel/store/transaction.hpp"

namespace keel::store {

/// What happened to one request, for metrics.
enum class IdempotencyOutcome : unsigned char {
  kExecuted,    // the handler ran and its response was stored
  kReplayed,    // a stored response was replayed
  kInProgress,  // 409: another request holds the key
  kMismatch,    // 422: the key was used with another request
  kInvalidKey,  // 400: missing or malformed key
  kNotStored,   // the handler answered an error (4xx/5xx): nothing stored, claim released
  kError,       // database trouble or a handler exception: 500/503, claim released
};

/// "executed", "replayed", "in_progress", "mismatch", "invalid_key", "not_stored", "error".
[[nodiscard]] std::string_view to_string(IdempotencyOutcome outcome) noexcept;

/// The handler: reads the request, writes through `tx` (a transaction is open), returns the
/// response. A 2xx/3xx response is stored and committed with the writes; anything else rolls
/// the writes back and is answered without being stored. It may run more than once (the
/// transaction is retried on serialization failures), so it must do nothing outside `tx`.
using TransactionalHandler =
    std::function<StoredResponse(const httplib::Request& request, Connection& tx)>;

/// Writes an RFC 9457 problem: Content-Type application/problem+json, {"type", "title",
/// "status", "detail"}.
void write_problem(httplib::Response& response, int status, std::string_view title,
                   std::string_view detail);

struct MiddlewareOptions {
  /// The record store. Required (non-null).
  const IdempotencyStore* store = nullptr;
  /// Where connections come from. Required (non-null).
  ConnectionPool* pool = nullptr;
  /// The principal a key is scoped to. Default: the Bearer token of Authorization, or
  /// "anonymous".
  std::function<std::string(const httplib::Request&)> principal;
  /// Retries of the handler's transaction. Default default_transaction_retry_policy().
  const RetryPolicy* transaction_policy = nullptr;
  /// Isolation of the handler's transaction. Default read committed.
  Isolation isolation = Isolation::kReadCommitted;
  /// Called once per request with its outcome. Default none.
  std::function<void(IdempotencyOutcome)> on_outcome;
  /// Called after the handler's transaction committed, before the response is sent. Default
  /// none. (keel serve's fault injection drops the connection here.)
  std::function<void(const httplib::Request&, httplib::Response&)> after_commit;
};

/// The default principal: "Authorization: Bearer <token>" gives <token>; otherwise "anonymous".
[[nodiscard]] std::string bearer_principal(const httplib::Request& request);

class IdempotencyMiddleware {
 public:
  /// Throws std::invalid_argument when store or pool is null.
  explicit IdempotencyMiddleware(MiddlewareOptions options);

  /// Wraps a handler; the result is what cpp-httplib's Post()/Patch() take.
  [[nodiscard]] httplib::Server::Handler wrap(TransactionalHandler handler) const;

 private:
  void handle(const TransactionalHandler& handler, const httplib::Request& request,
              httplib::Response& response) const;
  void report(IdempotencyOutcome outcome) const {
    if (options_.on_outcome) options_.on_outcome(outcome);
  }

  MiddlewareOptions options_;
};

}  // namespace keel::store
