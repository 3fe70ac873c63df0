// A program that uses every installed keel target through find_package(keel): an HTTP client,
// an SQLite database, the idempotency middleware, the simulator's scenario list and the Asio retry;
// keel::http_attempt through the request checks both HTTP clients share.
#include <asio/io_context.hpp>
#include <cstdio>
#include <keel/asio/retry.hpp>
#include <keel/db/database.hpp>
#include <keel/fleet/shared_breakers.hpp>
#include <keel/handlers/webhook_handler.hpp>
#include <keel/http/client.hpp>
#include <keel/http/request.hpp>
#include <keel/serve/httplib/idempotency_middleware.hpp>
#include <keel/sim/scenarios.hpp>

int consumer_metrics();
int consumer_beast();

int main() {
  keel::http::Client client;  // libcurl initialised, a breaker registry and a budget of its own
  auto conn =
      keel::store::open_database(keel::store::parse_database_url("sqlite::memory:").value());
  conn->execute("CREATE TABLE t (v INTEGER)");
  const auto rows = conn->query("SELECT 40 + $1", {keel::store::Value(2)});
  ::asio::io_context io;
  httplib::Request anonymous;  // keel::store_http: the principal of a request without a token
  const bool store_http_ok = keel::store::bearer_principal(anonymous).empty();
  const std::size_t scenarios = keel::sim::scenarios().size();
  // keel::store_handlers: a handler's client options, built without sending anything.
  const bool webhook_ok =
      keel::store::webhook_client_options(std::chrono::seconds(2)).retry.max_attempts == 1;
  const bool http_attempt_ok = keel::http::breaker_key("http://Example.com/") == "example.com:80";
  // keel::store_fleet: shared breakers refuse a database without notifications, by name.
  bool fleet_ok = false;
  try {
    keel::BreakerRegistry breakers;
    keel::store::SharedBreakers shared(breakers,
                                       keel::store::parse_database_url("sqlite::memory:").value());
  } catch (const std::invalid_argument& e) {
    fleet_ok = std::string(e.what()).find("PostgreSQL only") != std::string::npos;
  }
  std::printf("sqlite says %lld, %zu scenarios, max attempts %d\n",
              static_cast<long long>(rows.integer(0, 0)), scenarios,
              client.options().retry.max_attempts);
  if (consumer_metrics() != 0) return 1;  // metrics.cpp
  if (consumer_beast() != 0) return 1;    // beast.cpp
  return rows.integer(0, 0) == 42 && scenarios > 0 && store_http_ok && http_attempt_ok &&
                 webhook_ok && fleet_ok
             ? 0
             : 1;
}
