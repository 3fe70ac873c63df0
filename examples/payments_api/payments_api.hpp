// The payments API of `keel-demo serve` and of examples/payments_api/main.cpp: a small service that
// shows the receiver's half of safe retries, on keel::store::beast::Server
// (keel/serve/beast/server.hpp). POST /v1/charges goes through the idempotency flow
// (keel::store::beast::IdempotentHandler) on SQLite or PostgreSQL; GET /v1/charges/{id},
// GET /v1/charges?customer=ID, /healthz and /metrics. The routes that touch the database run on
// the server's worker threads; the refusals (the caller's own check, admission) on its event
// loop, before a request waits for a worker. /healthz checks the database on a connection and a
// thread of its own (keel::store::beast::HealthCheck), so it answers within health_timeout while
// every worker and pooled connection is held by blocked requests. A request whose client went
// away (or that the server's drain gave up on) is abandoned: its work is skipped if it has not
// started, and a charge not committed yet never is.
//
// Principals are stored by their keyed hash (keel::store::principal_scope under the scope
// secret), never as the credential: charges are visible to the principal that created them only.
// prepare_database() creates the schema, keeps the scope secret in the database when none is
// given, and upgrades schema 1 (plaintext principals) once.
//
// An example, not an installed library: the CLI's flags, rate limiting, admission control and
// fault injection are the caller's, plugged in through PaymentsApiOptions (refuse, limiter,
// before, after_commit, extra_metrics).
//
// Thread-safety: PaymentsApi's handlers are safe to run from the server's threads at once; the
// pool and the store it was given, and the PaymentsApi itself, must outlive the server.
//
// Example:
//   keel::store::ConnectionPool pool(url, {.max_connections = 8});
//   std::string secret = payments::prepare_database(*pool.acquire(), "");
//   const keel::store::IdempotencyStore records({.ttl = 24h});
//   payments::PaymentsApi api({.pool = &pool, .idempotency = &records, .scope_secret = secret});
//   keel::store::beast::Server server({.worker_threads = 8});
//   api.install(server);
//   server.start();
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "keel/core/admission.hpp"
#include "keel/core/expected.hpp"
#include "keel/db/database.hpp"
#include "keel/idempotency/idempotency.hpp"
#include "keel/json/json_check.hpp"
#include "keel/serve/beast/health_check.hpp"
#include "keel/serve/beast/idempotent_handler.hpp"
#include "keel/serve/beast/server.hpp"

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
[[nodiscard]] std::string scope_of(const keel::store::beast::Request& request,
                                   std::string_view secret);

/// The value of query parameter `name` in `target` (a request target), percent-decoded and with
/// '+' as a space; nullopt when absent.
[[nodiscard]] std::optional<std::string> query_param(std::string_view target,
                                                     std::string_view name);

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

struct PaymentsApiOptions {
  /// Required (non-null).
  keel::store::ConnectionPool* pool = nullptr;
  /// Required (non-null).
  const keel::store::IdempotencyStore* idempotency = nullptr;
  /// The key principals are hashed under. Required (non-empty): prepare_database() gives one.
  std::string scope_secret;
  /// Limits of the JSON bodies. Default keel::store::JsonLimits{}.
  keel::store::JsonLimits json_limits;
  /// The idempotency flow's FlowOptions::retry_after_spread: Retry-After of its 503 and
  /// 500 answers uniform over 1..N seconds. Requires: 1 to 3600. Default 3.
  int retry_after_spread = 3;
  /// Serve POST /v1/charges without the idempotency layer (for comparison). Default false.
  bool no_idempotency = false;
  /// How long GET /healthz waits for the database (on its own connection) before it answers
  /// 503. Requires: > 0. Default 1 s.
  std::chrono::milliseconds health_timeout{1000};
  /// Counters to update. Default none (the API keeps its own).
  Metrics* metrics = nullptr;
  /// Called on the event loop for each /v1 request before its work is queued, and must not block
  /// (a passed deadline, a rate limit, an injected 503): a response returned is the answer.
  /// Default none.
  std::function<std::optional<keel::store::beast::Response>(const keel::store::beast::Request&)>
      refuse;
  /// Admission control over every /v1 route, taken on the event loop after `refuse` (a shed
  /// request is answered 503 + Retry-After at once) and held until the route's work is done,
  /// its latency included. Must outlive the server. Default none.
  keel::AdmissionLimiter* limiter = nullptr;
  /// Called on the worker thread before each /v1 route's work, inside the admitted region (an
  /// injected delay, as a slow handler would be). Default none.
  std::function<void(const keel::store::beast::Request&)> before;
  /// Called on the worker thread after a charge committed, before its answer is sent; may
  /// replace the answer (keel::store::beast::no_answer() drops the connection). Default none.
  std::function<void(const keel::store::beast::Request&, keel::store::beast::Response&)>
      after_commit;
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

  /// Registers the routes on `server`. A route's exception is answered 503 + Retry-After
  /// problem+json, its text to stderr only. Requires: `server` not started.
  void install(keel::store::beast::Server& server);

  [[nodiscard]] Metrics& metrics() noexcept { return *metrics_; }

 private:
  /// A route's work, given the request, when it arrived (the start of its Keel-Deadline-Ms) and
  /// the flag set once nobody will read its answer (commit nothing after it).
  using Work = std::function<keel::store::beast::Response(const keel::store::beast::Request&,
                                                          keel::TimePoint arrival,
                                                          const std::atomic<bool>* abandoned)>;
  /// Routes `method` on `path` to `work`, run on the server's worker threads; a /v1 route
  /// (`guarded`) meets refuse and the limiter on the event loop first, then before.
  /// POST /v1/charges' transactional handler: parses the body and inserts the charge.
  [[nodiscard]] keel::store::StoredResponse create_charge(const keel::store::beast::Request& req,
                                                          keel::store::Connection& tx) const;
  void route(keel::store::beast::Server& server, boost::beast::http::verb method, std::string path,
             bool guarded, Work work);

  PaymentsApiOptions options_;
  std::unique_ptr<Metrics> own_metrics_;
  Metrics* metrics_;
  std::unique_ptr<keel::store::beast::IdempotentHandler> charges_;
  std::unique_ptr<keel::store::beast::HealthCheck> health_;
};

}  // namespace payments
