// A service with idempotent POSTs: keel::store's idempotency middleware on cpp-httplib, with the
// records and the business table in one SQLite file.
//
// The service listens on 127.0.0.1 (a port the kernel picks) and the example calls it over
// loopback with keel::http::Client, as a retrying caller would:
//   1. POST /v1/charges with Idempotency-Key K   -> 201, one charge written
//   2. the same POST with the same key again     -> the stored 201, Idempotent-Replayed: true,
//                                                   still one charge (the retry of a lost reply)
//   3. the same key with another body            -> 422: a key names one request
// The handler's write and the stored response commit in one transaction, so a crash between
// them cannot leave a charge without its record (or a record without its charge).
#include <stdlib.h>

#include <cstdio>
#include <filesystem>
#include <keel/db/database.hpp>
#include <keel/db/row_cursor.hpp>
#include <keel/http/client.hpp>
#include <keel/idempotency/idempotency.hpp>
#include <keel/serve/httplib/idempotency_middleware.hpp>
#include <memory>
#include <string>
#include <thread>

namespace store = keel::store;

namespace {

std::filesystem::path make_temp_dir() {
  const char* base = std::getenv("TMPDIR");
  std::string pattern =
      std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/keel-example.XXXXXX";
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
    {
      auto conn = pool.acquire();
      store::IdempotencyStore::migrate(*conn);
      store::migrate(*conn, "example_charges",
                     {{"CREATE TABLE charges (id INTEGER PRIMARY KEY, body TEXT NOT NULL)"}});
    }
    const store::IdempotencyStore records({.ttl = std::chrono::hours(24)});
    const store::IdempotencyMiddleware idempotency({.store = &records, .pool = &pool});

    httplib::Server server;
    // Body, header and framing limits, timeouts, TCP_NODELAY and an exclusive port.
    store::apply_server_limits(server,
                               {.max_body_bytes = 64 * 1024, .routes = {{"/v1/charges", "POST"}}});
    server.Post(
        "/v1/charges", idempotency.wrap([](const httplib::Request& request, store::Connection& tx) {
          // Everything the handler writes goes through `tx`; a real handler validates the body.
          const auto rows =
              tx.query("INSERT INTO charges (body) VALUES ($1) RETURNING id", {request.body});
          return store::StoredResponse{201,
                                       {{"Content-Type", "application/json"}},
                                       R"({"charge": )" + store::RowCursor(rows, 0).text() + "}\n"};
        }));
    const int port = server.bind_to_any_port("127.0.0.1");
    if (port <= 0) {
      std::fprintf(stderr, "cannot bind 127.0.0.1\n");
      return 1;
    }
    std::thread listener([&] { server.listen_after_bind(); });

    // ---- a caller
    auto client = std::make_unique<keel::http::Client>();  // keeps its connections open
    const std::string url = "http://127.0.0.1:" + std::to_string(port) + "/v1/charges";
    const std::string key = "order-77-charge-1";  // stored with the order, reused on every retry
    const std::string body = R"({"amount": 1250, "currency": "EUR", "customer": "cus_1"})";

    const auto first =
        client->send({.method = "POST", .url = url, .body = body, .idempotency_key = key});
    const auto second =
        client->send({.method = "POST", .url = url, .body = body, .idempotency_key = key});
    const auto other = client->send({.method = "POST",
                                     .url = url,
                                     .body = R"({"amount": 9999, "currency": "EUR"})",
                                     .idempotency_key = key});

    const auto status = [](const keel::http::Result& r) {
      return r.response ? r.response->status : 0;
    };
    const auto body_of = [](const keel::http::Result& r) {
      return r.response ? r.response->body : std::string();
    };
    std::printf("1st: HTTP %d %s", status(first), body_of(first).c_str());
    std::printf("2nd: HTTP %d %s", status(second), body_of(second).c_str());
    std::printf("3rd: HTTP %d (same key, another body)\n", status(other));

    const auto replayed =
        second.response ? keel::http::find_header(second.response->headers, "Idempotent-Replayed")
                        : std::nullopt;
    std::int64_t charges = -1;
    {
      auto conn = pool.acquire();
      const store::Rows rows = conn->query("SELECT COUNT(*) FROM charges");
      charges = store::RowCursor(rows, 0).integer();
    }
    ok &= check(status(first) == 201, "the first POST ran the handler: 201");
    ok &= check(status(second) == 201 && body_of(second) == body_of(first),
                "the repeat got the stored response");
    ok &= check(replayed && *replayed == "true", "the repeat carries Idempotent-Replayed: true");
    ok &= check(status(other) == 422, "the key reused with another body: 422");
    ok &= check(charges == 1, "one charge in the database");

    client.reset();  // close its kept-alive connections, so the server stops at once
    server.stop();
    listener.join();
  }
  std::filesystem::remove_all(dir);
  std::printf("%s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
