// A database health check for a /healthz route that must answer while the application's own work
// is stuck: it runs on a connection and a thread of its own (not the pool's, not the server's
// workers, which blocked requests may all hold), and answers within a bounded time whatever the
// database does. A check waits at most `timeout` for the probe (SELECT 1 by default); past it the
// check is answered kTimedOut, and a probe still blocked is left to return on its own (the checks
// that come meanwhile wait for it, each again for at most `timeout`). Checks that arrive while a
// probe runs share its result, so a burst of /healthz costs one query.
//
// Thread-safety: check() is safe to call from many threads at once and never blocks; `done` is
// called on one of the check's two threads (inside check() only once the destructor has begun).
// The destructor answers every
// waiting check kUnavailable and returns at once, leaving a blocked probe to finish on its own
// (it holds only its own connection).
//
// Example (a route of keel::store::beast::Server):
//   keel::store::beast::HealthCheck health({.url = pool.url()});
//   server.on_async(boost::beast::http::verb::get, "/healthz",
//                   [&health](keel::store::beast::Request req, keel::store::beast::Respond respond)
//                   {
//                     health.check([respond, version = req.version()](const HealthResult& r) {
//                       respond(r.healthy() ? ok(version) : unavailable(version));
//                     });
//                   });
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "keel/db/database.hpp"

namespace keel::store::beast {

enum class Health : unsigned char {
  kHealthy,      // the probe answered
  kUnavailable,  // the probe failed (the database refused the connection or the query)
  kTimedOut,     // the probe did not answer within the timeout
};

/// "healthy", "unavailable", "timed_out".
[[nodiscard]] std::string_view to_string(Health health) noexcept;

struct HealthResult {
  Health health = Health::kHealthy;
  /// For the server's log, never for the client: the database error, or what timed out.
  std::string error;

  [[nodiscard]] bool healthy() const noexcept { return health == Health::kHealthy; }
};

struct HealthCheckOptions {
  /// The database to check (ConnectionPool::url()). Required: a parsed URL.
  DatabaseUrl url;
  /// How long a check waits for the probe before it is answered kTimedOut. Requires: > 0.
  /// Default 1 s.
  std::chrono::milliseconds timeout{1000};
  /// The probe, run on the check's own connection; throws (DatabaseError or anything) when the
  /// database is not healthy. Default: SELECT 1.
  std::function<void(Connection&)> probe;
  /// How the check's connection is opened. Default: open_database(url) with a SQLite busy timeout
  /// and a PostgreSQL connect timeout of `timeout` (at least 1 s).
  std::function<std::unique_ptr<Connection>(const DatabaseUrl&)> open;
};

class HealthCheck {
 public:
  /// Throws std::invalid_argument naming the field when an option breaks its Requires line.
  explicit HealthCheck(HealthCheckOptions options);
  ~HealthCheck();
  HealthCheck(const HealthCheck&) = delete;
  HealthCheck& operator=(const HealthCheck&) = delete;

  /// Non-blocking: `done` is called once, within `timeout` (and the scheduling of a thread), with
  /// the result of a probe that ended after this call, or kTimedOut.
  void check(std::function<void(const HealthResult&)> done);

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace keel::store::beast
