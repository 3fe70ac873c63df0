// The payments API of `keel-demo serve` as a program of its own: examples/payments_api's library on
// SQLite in a scratch folder, on keel::store::beast::Server listening on 127.0.0.1 (a port the
// kernel picks), called over loopback by keel::http::Client as a retrying caller would.
//
// The first committed charge loses its response (the connection is dropped after the commit, the
// failure a retry must not turn into a second charge). The client retries with the same
// Idempotency-Key, gets the stored 201 replayed, and the principal sees exactly one charge.
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <keel/db/database.hpp>
#include <keel/http/client.hpp>
#include <keel/idempotency/idempotency.hpp>
#include <keel/serve/beast/server.hpp>
#include <memory>
#include <stdexcept>
#include <string>

#include "payments_api.hpp"

namespace store = keel::store;
using namespace std::chrono_literals;

namespace {

std::filesystem::path make_temp_dir() {
  const char* base = std::getenv("TMPDIR");
  std::string pattern =
      std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/keel-payments.XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  return pattern;
}

bool check(bool condition, const char* what) {
  std::printf("  %s %s\n", condition ? "ok  " : "FAIL", what);
  return condition;
}

}  // namespace

int main() {
  const std::filesystem::path dir = make_temp_dir();
  bool ok = true;
  {
    // ---- the service
    store::ConnectionPool pool(
        store::parse_database_url("sqlite:" + (dir / "payments.db").string()).value());
    const std::string secret = payments::prepare_database(*pool.acquire(), "");
    const store::IdempotencyStore records({.ttl = 24h});
    std::atomic<int> dropped{0};
    payments::PaymentsApi api({.pool = &pool,
                               .idempotency = &records,
                               .scope_secret = secret,
                               .after_commit =
                                   [&](const store::beast::Request&, store::beast::Response& res) {
                                     // The first commit's response never reaches the caller.
                                     if (dropped.fetch_add(1) == 0) res = store::beast::no_answer();
                                   },
                               .log_prefix = "payments_api"});
    store::beast::Server server({.worker_threads = 4, .max_body_bytes = 64 * 1024});
    api.install(server);
    server.start();  // throws when 127.0.0.1 cannot be bound
    const int port = server.port();

    // ---- a caller
    auto client = std::make_unique<keel::http::Client>(keel::http::ClientOptions{
        .retry = {.max_attempts = 3, .backoff = {.base = 10ms, .cap = 50ms}}});
    const std::string base = "http://127.0.0.1:" + std::to_string(port);
    const keel::http::Headers token = {{"Authorization", "Bearer tok_example"}};
    const keel::http::Result charge =
        client->send({.method = "POST",
                      .url = base + "/v1/charges",
                      .headers = token,
                      .body = R"({"amount": 1250, "currency": "eur", "customer": "cus_1"})",
                      .idempotency_key = "order-77-charge-1"});
    const keel::http::Result list =
        client->send({.url = base + "/v1/charges?customer=cus_1", .headers = token});
    const keel::http::Result other =
        client->send({.url = base + "/v1/charges?customer=cus_1",
                      .headers = {{"Authorization", "Bearer tok_someone_else"}}});
    const keel::http::Result metrics = client->send({.url = base + "/metrics"});

    const auto body_of = [](const keel::http::Result& r) {
      return r.response ? r.response->body : std::string();
    };
    const auto replayed =
        charge.response ? keel::http::find_header(charge.response->headers, "Idempotent-Replayed")
                        : std::nullopt;
    std::printf("POST /v1/charges: HTTP %d after %d attempts: %s\n",
                charge.response ? charge.response->status : 0, charge.attempts,
                body_of(charge).c_str());
    std::printf("GET /v1/charges?customer=cus_1: %s\n", body_of(list).c_str());
    ok &= check(charge.ok() && charge.response->status == 201 && charge.attempts == 2,
                "the POST whose response was dropped was retried once: 201");
    ok &= check(replayed && *replayed == "true", "the retry got the stored 201 replayed");
    ok &= check(body_of(charge).find("\"currency\":\"EUR\"") != std::string::npos,
                "the charge as stored (currency upper-cased)");
    ok &= check(body_of(list).find("ch_") != std::string::npos &&
                    body_of(list).find("ch_") == body_of(list).rfind("ch_"),
                "the principal sees exactly one charge");
    ok &= check(body_of(other) == R"({"data":[]})", "another principal sees none");
    ok &= check(body_of(metrics).find("keel_charges_created_total 1\n") != std::string::npos &&
                    body_of(metrics).find("outcome=\"replayed\"} 1\n") != std::string::npos,
                "/metrics: one charge created, one replay");

    client.reset();  // close its kept-alive connections, so the server stops at once
    server.stop();
  }
  std::filesystem::remove_all(dir);
  std::printf("%s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
