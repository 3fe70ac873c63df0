// The receiver floor: the smallest cpp-httplib server that does what `keel-demo serve
// --no-idempotency` does for POST /v1/charges (parse the JSON body, insert one row into charges,
// answer 201 with the charge), with none of keel's layers. scripts/bench-serve.sh runs it next to
// keel-demo serve so that the cost of keel's server (limits, routing, metrics) and of the
// idempotency layer can each be read against it. keel-demo serve now runs on
// keel::store::beast::Server, so that reading includes the change of framework;
// scripts/bench-beast.sh's bare Beast server is the like-for-like floor.
//
//   keel_bench_serve_floor --db URL [--threads N]
//
// Listens on 127.0.0.1 on a free port and prints "listening on http://127.0.0.1:PORT". One
// database connection per server thread, TCP_NODELAY on (as keel-demo serve sets it).
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "keel/db/database.hpp"

namespace {

int usage() {
  std::fprintf(stderr, "usage: keel_bench_serve_floor --db URL [--threads N]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string db;
  int threads = 16;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--db") {
      db = argv[i + 1];
    } else if (flag == "--threads") {
      threads = std::atoi(argv[i + 1]);
    } else {
      return usage();
    }
  }
  if (db.empty() || threads < 1 || argc % 2 == 0) return usage();
  const auto url = keel::store::parse_database_url(db);
  if (!url) {
    std::fprintf(stderr, "keel_bench_serve_floor: %s\n", url.error().in("--db").message().c_str());
    return 2;
  }
  keel::store::migrate(*keel::store::open_database(*url), "floor",
                       {{"CREATE TABLE charges (id TEXT PRIMARY KEY, principal TEXT NOT NULL,"
                         " amount BIGINT NOT NULL, currency TEXT NOT NULL, customer TEXT NOT NULL,"
                         " created BIGINT NOT NULL);"
                         "CREATE INDEX charges_customer ON charges (principal, customer);"}});

  std::atomic<std::uint64_t> next_id{0};
  const auto prefix =
      std::to_string(std::chrono::system_clock::now().time_since_epoch().count() % 1000000000);
  httplib::Server server;
  server.set_tcp_nodelay(true);
  server.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  server.Post("/v1/charges", [&](const httplib::Request& req, httplib::Response& res) {
    thread_local std::unique_ptr<keel::store::Connection> conn;
    const auto body = nlohmann::json::parse(req.body, nullptr, false);
    if (body.is_discarded() || !body.contains("amount") || !body["amount"].is_number_integer() ||
        !body.contains("currency") || !body["currency"].is_string() || !body.contains("customer") ||
        !body["customer"].is_string()) {
      res.status = 400;
      return;
    }
    try {
      if (!conn || conn->broken()) conn = keel::store::open_database(*url);
      const std::string id = "ch_" + prefix + "_" + std::to_string(next_id.fetch_add(1));
      const std::int64_t created = std::chrono::duration_cast<std::chrono::seconds>(
                                       std::chrono::system_clock::now().time_since_epoch())
                                       .count();
      const std::int64_t amount = body["amount"].get<std::int64_t>();
      const std::string currency = body["currency"].get<std::string>();
      const std::string customer = body["customer"].get<std::string>();
      conn->query(
          "INSERT INTO charges (id, principal, amount, currency, customer, created)"
          " VALUES ($1, $2, $3, $4, $5, $6)",
          {id, "bench", amount, currency, customer, created});
      const nlohmann::json out = {{"id", id},
                                  {"amount", amount},
                                  {"currency", currency},
                                  {"customer", customer},
                                  {"created", created}};
      res.status = 201;
      res.set_header("Location", "/v1/charges/" + id);
      res.set_content(out.dump(), "application/json");
    } catch (const std::exception& e) {
      res.status = 500;
      res.set_content(e.what(), "text/plain");
    }
  });
  const int port = server.bind_to_any_port("127.0.0.1");
  if (port < 0) {
    std::fprintf(stderr, "keel_bench_serve_floor: cannot bind 127.0.0.1\n");
    return 1;
  }
  std::printf("listening on http://127.0.0.1:%d\n", port);
  std::fflush(stdout);
  return server.listen_after_bind() ? 0 : 1;
}
