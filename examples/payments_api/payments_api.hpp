// The payments API of `keel-demo serve` and of examples/payments_api/main.cpp: a small service that
// shows the receiver's half of safe retries. POST /v1/charges goes through the idempotency
// middleware (keel/store/server/idempotency_middleware.hpp) on SQLite or PostgreSQL;
// GET /v1/charges/{id}, GET /v1/charges?customer=ID, /healthz and /metrics.
//
// Principals are stored by their keyed hash (keel::store::principal_scope under the scope
// secret), never as the credential: charges are visible to the principal that created them only.
// prepare_database() creates the schema, keeps the scope secret in the database when none is
// given, and upgrades schema 1 (plaintext principals) once.
//
// An example, not an installed library: the CLI's flags, rate limiting, admission control and
// fault injection are the caller's, plugged in through PaymentsApiOptions (guard, after_commit,
// extra_metrics).
//
// Thread-safety: PaymentsApi's handlers are safe to run from cpp-httplib's worker threads at once;
// the pool and the store it was given, and the PaymentsApi itself, must outlive the server.
//
// Example:
//   keel::store::ConnectionPool pool(url, {.max_connections = 8});
//   std::string secret = payments::prepare_database(*pool.acquire(), "");
//   const keel::store::IdempotencyStore records({.ttl = 24h});
//   payments::PaymentsApi api({.pool = &pool, .idempotency = &records, .scope_secret = secret});
//   httplib::Server server;
//   api.install(server);
#pragma once

#include <httplib.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "keel/admission.hpp"
#include "keel/expected.hpp"
#include "keel/store/db/database.hpp"
#include "keel/store/idempotency/idempotency.hpp"
#include "keel/store/json/json_check.hpp"
#include "keel/store/server/idempotency_middleware.hpp"

namespace payments {

/// A charge as POST /v1/charges takes it.
struct ChargeInput {
  std::int64_t amount = 0;
  std::string currency;  // three letters, upper-cased
  std::string customer;
};

/// Parses and checks a charge body: a JSON object (within `limits`, no duplicate members) with a
/// positive integer "amount", a 3-letter "currency" and a non-empty "customer" of at most 255
/// characters. Otherwise an Error naming the member, for the client's problem detail.
[[nodiscard]] keel::Expected<ChargeInput> parse_charge(const std::string& body,
                                                       const keel::store::JsonLimits& limits);

/// Random lower-case hex from OpenSSL's generator, 2 * bytes digits. Throws std::runtime_error
/// when the generator fails.
[[nodiscard]] std::string random_hex(std::size_t bytes);

/// Migrates the idempotency records and the payments schema on `connection`. With an empty
/// `scope_secret`, the database's own secret is used (created on first use, so that every server
/// on the database scopes a credential the same way). Upgrades payments schema 1, which stored
/// credentials as they came, by hashing each stored principal once. Returns the secret in use.
[[nodiscard]] std::string prepare_database(keel::store::Connection& connection,
                                           std::string scope_secret);

/// The stored scope of the request's principal (its bearer token, hashed under `secret`).
[[nodiscard]] std::string scope_of(const httplib::Request& request, std::string_view secret);

/// The API's counters, as /metrics shows them.
struct Metrics {
  std::atomic<std::uint64_t> outcomes[keel::store::kIdempotencyOutcomes] = {};
  std::atomic<std::uint64_t> charges_created{0};
  std::atomic<std::uint64_t> rate_limited{0};
  std::atomic<std::uint64_t> rate_limit_principals{0};

  /// The counters in the Prometheus text format.
  [[nodiscard]] std::string render() const;
};

/// An admission limiter's counters in the Prometheus text format (keel_admission_*).
[[nodiscard]] std::string render_admission(const keel::AdmissionStats& stats);

/// cpp-httplib 0.11 listens with a backlog of 5: a burst of concurrent connections overflows it
/// and clients see resets. Calling listen() again on the socket bound to `port` (found in
/// /proc/self/fd) raises the backlog to SOMAXCONN (Linux). Call it after binding.
void widen_backlog(int port);

/// The API's routes and the methods each allows, for keel::store::ServerLimits::routes.
[[nodiscard]] std::vector<std::pair<std::string, std::string>> routes();

struct PaymentsApiOptions {
  /// Required (non-null).
  keel::store::ConnectionPool* pool = nullptr;
  /// Required (non-null).
  const keel::store::IdempotencyStore* idempotency = nullptr;
  /// The key principals are hashed under. Required (non-empty): prepare_database() gives one.
  std::string scope_secret;
  /// Limits of the JSON bodies. Default keel::store::JsonLimits{}.
  keel::store::JsonLimits json_limits;
  /// The idempotency layer's MiddlewareOptions::retry_after_spread: Retry-After of its 503 and
  /// 500 answers uniform over 1..N seconds. Requires: 1 to 3600. Default 3.
  int retry_after_spread = 3;
  /// Serve POST /v1/charges without the idempotency layer (for comparison). Default false.
  bool no_idempotency = false;
  /// Counters to update. Default none (the API keeps its own).
  Metrics* metrics = nullptr;
  /// Wraps each /v1 handler (admission control, injected delays). Default none.
  std::function<httplib::Server::Handler(httplib::Server::Handler)> guard;
  /// Called after a charge committed, before its answer is written. Default none.
  std::function<void(const httplib::Request&)> after_commit;
  /// Text appended to /metrics. Default none.
  std::function<std::string()> extra_metrics;
  /// Prefix of the lines written to stderr. Default "payments".
  std::string log_prefix = "payments";
};

class PaymentsApi {
 public:
  /// Throws std::invalid_argument when a required option is missing.
  explicit PaymentsApi(PaymentsApiOptions options);
  PaymentsApi(const PaymentsApi&) = delete;
  PaymentsApi& operator=(const PaymentsApi&) = delete;
  ~PaymentsApi();

  /// Registers the routes on `server` and its exception handler (a 503 problem, the reason to
  /// stderr only).
  void install(httplib::Server& server);

  [[nodiscard]] Metrics& metrics() noexcept { return *metrics_; }

 private:
  PaymentsApiOptions options_;
  std::unique_ptr<Metrics> own_metrics_;
  Metrics* metrics_;
  std::unique_ptr<keel::store::IdempotencyMiddleware> middleware_;
};

}  // namespace payments
