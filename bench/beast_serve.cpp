// POST /v1/charges on Boost.Beast three ways, for scripts/bench-beast.sh: the cost of the
// idempotency layer on keel::store::beast::Server, and the cost of that server against the
// smallest Beast server doing the same work. Every mode parses the JSON body, inserts one row into
// charges in its own transaction on a worker thread and answers 201 with the charge (the body
// bench/serve_floor.cpp answers):
//
//   layer     Server::on_idempotent: IdempotentRequestFlow claims the Idempotency-Key, runs the
//             insert in a transaction and stores the response in it (a pool of N connections)
//   nolayer   Server::on_async: the handler posts the insert, in a transaction, to a thread pool
//             of N workers with one connection each
//   record    nolayer, and the same transaction also inserts a completed keel_idempotency row
//             the size of the layer's: what the layer would cost if it cost only its record
//   bare      the smallest Beast server: one io_context thread accepting and reading, each request
//             handed to a thread pool of N workers with one connection each, keep-alive
//
//   keel_bench_beast_serve --mode layer|nolayer|record|bare --db URL [--workers N] [--requests N]
//
// Listens on 127.0.0.1 on a free port and prints "listening on http://127.0.0.1:PORT", then serves
// until SIGINT or SIGTERM. --requests N instead sends N charges to itself over one keep-alive
// connection, exits 0 when each was answered 201 and 1 otherwise (the smoke test).
#include <atomic>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

#include "keel/db/database.hpp"
#include "keel/db/transaction.hpp"
#include "keel/idempotency/idempotency.hpp"
#include "keel/serve/beast/idempotent_handler.hpp"
#include "keel/serve/beast/server.hpp"

namespace {

namespace asio = boost::asio;
namespace http = boost::beast::http;
using tcp = asio::ip::tcp;
using keel::store::Connection;
using keel::store::StoredResponse;
using keel::store::beast::Request;
using keel::store::beast::Response;

int usage() {
  std::fprintf(
      stderr,
      "usage: keel_bench_beast_serve --mode layer|nolayer|record|bare --db URL [--workers N]"
      " [--requests N]\n");
  return 2;
}

// The charge every mode writes: the same row and the same 201 body as bench/serve_floor.cpp.
class Charges {
 public:
  StoredResponse create(std::string_view body, Connection& tx) {
    const auto in = nlohmann::json::parse(body, nullptr, false);
    if (in.is_discarded() || !in.contains("amount") || !in["amount"].is_number_integer() ||
        !in.contains("currency") || !in["currency"].is_string() || !in.contains("customer") ||
        !in["customer"].is_string()) {
      return {400, {{"Content-Type", "text/plain"}}, "invalid charge\n"};
    }
    const std::string id = "ch_" + prefix_ + "_" + std::to_string(next_id_.fetch_add(1));
    const std::int64_t created = std::chrono::duration_cast<std::chrono::seconds>(
                                     std::chrono::system_clock::now().time_since_epoch())
                                     .count();
    const std::int64_t amount = in["amount"].get<std::int64_t>();
    const std::string currency = in["currency"].get<std::string>();
    const std::string customer = in["customer"].get<std::string>();
    tx.query(
        "INSERT INTO charges (id, principal, amount, currency, customer, created)"
        " VALUES ($1, $2, $3, $4, $5, $6)",
        {id, "bench", amount, currency, customer, created});
    const nlohmann::json out = {{"id", id},
                                {"amount", amount},
                                {"currency", currency},
                                {"customer", customer},
                                {"created", created}};
    return {
        201, {{"Content-Type", "application/json"}, {"Location", "/v1/charges/" + id}}, out.dump()};
  }

  // Without the layer: the insert in its own transaction on this thread's connection (one per
  // worker thread, opened on first use). With `record`, the transaction also inserts a completed
  // keel_idempotency row of the layer's shape and size (the record mode: the floor the layer
  // could reach if it cost nothing beyond writing its record).
  Response create_in_transaction(const Request& req, bool record = false) {
    thread_local std::unique_ptr<Connection> conn;
    StoredResponse out;
    try {
      if (!conn || conn->broken()) conn = keel::store::open_database(*url_);
      const auto tx = keel::store::with_transaction_retry(*conn, [&](Connection& t) {
        out = create(req.body(), t);
        if (record && out.status < 400) write_record(req, out, t);
        return out.status < 400;
      });
      if (!tx.committed() && tx.status != keel::store::TransactionStatus::kRolledBack) {
        out = {503, {{"Content-Type", "text/plain"}}, tx.error};
      }
    } catch (const std::exception& e) {
      out = {500, {{"Content-Type", "text/plain"}}, e.what()};
    }
    Response res{static_cast<http::status>(out.status), req.version()};
    for (const auto& [name, value] : out.headers) res.set(name, value);
    res.body() = std::move(out.body);
    res.prepare_payload();
    return res;
  }

  explicit Charges(const keel::store::DatabaseUrl* url) : url_(url) {}

 private:
  // What the layer stores, written directly: its scope, key, fingerprint and token are as long
  // as the layer's (64, the request's, 64 and 32 characters), and the response as it stores it.
  static void write_record(const Request& req, const StoredResponse& out, Connection& tx) {
    const std::string key(req["Idempotency-Key"]);
    nlohmann::json headers = nlohmann::json::array();
    for (const auto& [name, value] : out.headers) headers.push_back({name, value});
    const std::int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
                                 std::chrono::system_clock::now().time_since_epoch())
                                 .count();
    tx.query(
        "INSERT INTO keel_idempotency (scope, idem_key, fingerprint, status, lock_token,"
        " lock_expires_ms, response_status, response_headers, response_body, created_ms)"
        " VALUES ($1, $2, $3, 'completed', $4, $5, $6, $7, $8, $9)",
        {"p:" + std::string(64, 'a'), key, std::string(64, 'f'), std::string(32, 't'), now + 60000,
         out.status, headers.dump(), out.body, now});
  }

 private:
  const keel::store::DatabaseUrl* url_;
  std::atomic<std::uint64_t> next_id_{0};
  const std::string prefix_ =
      std::to_string(std::chrono::system_clock::now().time_since_epoch().count() % 1000000000);
};

// ---- bare: one io_context thread, requests handed to a thread pool
class BareSession : public std::enable_shared_from_this<BareSession> {
 public:
  BareSession(tcp::socket socket, asio::thread_pool& workers, Charges& charges)
      : stream_(std::move(socket)), workers_(workers), charges_(charges) {}

  void read() {
    req_ = {};
    http::async_read(stream_, buffer_, req_,
                     [self = shared_from_this()](boost::beast::error_code ec, std::size_t) {
                       if (ec) return self->close();
                       self->work();
                     });
  }

 private:
  void work() {
    asio::post(workers_, [self = shared_from_this()] {
      Response res = self->req_.method() == http::verb::post && self->req_.target() == "/v1/charges"
                         ? self->charges_.create_in_transaction(self->req_)
                         : Response{http::status::not_found, self->req_.version()};
      asio::post(self->stream_.get_executor(),
                 [self, res = std::move(res)]() mutable { self->write(std::move(res)); });
    });
  }

  void write(Response res) {
    res_ = std::move(res);
    res_.keep_alive(req_.keep_alive());
    res_.prepare_payload();
    http::async_write(stream_, res_,
                      [self = shared_from_this()](boost::beast::error_code ec, std::size_t) {
                        if (ec || !self->res_.keep_alive()) return self->close();
                        self->read();
                      });
  }

  void close() {
    boost::beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
  }

  boost::beast::tcp_stream stream_;
  boost::beast::flat_buffer buffer_;
  asio::thread_pool& workers_;
  Charges& charges_;
  Request req_;
  Response res_;
};

void accept(tcp::acceptor& acceptor, asio::thread_pool& workers, Charges& charges) {
  acceptor.async_accept([&](boost::beast::error_code ec, tcp::socket socket) {
    if (ec) return;
    socket.set_option(tcp::no_delay(true), ec);
    std::make_shared<BareSession>(std::move(socket), workers, charges)->read();
    accept(acceptor, workers, charges);
  });
}

// ---- --requests: N charges to ourselves over one keep-alive connection
bool send_charges(std::uint16_t port, int requests) {
  asio::io_context io;
  tcp::socket socket(io);
  socket.connect({asio::ip::make_address("127.0.0.1"), port});
  boost::beast::flat_buffer buffer;
  for (int i = 0; i < requests; ++i) {
    Request req{http::verb::post, "/v1/charges", 11};
    req.set(http::field::host, "127.0.0.1");
    req.set(http::field::content_type, "application/json");
    req.set(http::field::authorization, "Bearer bench");
    req.set("Idempotency-Key",
            "smoke-" + std::to_string(std::time(nullptr)) + "-" + std::to_string(i));
    req.body() = R"({"amount": 1250, "currency": "EUR", "customer": "cus_bench"})";
    req.prepare_payload();
    http::write(socket, req);
    Response res;
    http::read(socket, buffer, res);
    if (res.result() != http::status::created ||
        res.body().find("\"id\":\"ch_") == std::string::npos) {
      std::fprintf(stderr, "keel_bench_beast_serve: request %d answered %d: %s\n", i + 1,
                   res.result_int(), res.body().c_str());
      return false;
    }
  }
  std::printf("%d requests answered 201\n", requests);
  return true;
}

void announce(std::uint16_t port) {
  std::printf("listening on http://127.0.0.1:%u\n", static_cast<unsigned>(port));
  std::fflush(stdout);
}

// Blocks until SIGINT or SIGTERM.
void wait_for_signal() {
  asio::io_context io;
  asio::signal_set signals(io, SIGINT, SIGTERM);
  signals.async_wait([](boost::beast::error_code, int) {});
  io.run();
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode;
  std::string db;
  int workers = 16;
  int requests = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--mode") {
      mode = argv[i + 1];
    } else if (flag == "--db") {
      db = argv[i + 1];
    } else if (flag == "--workers") {
      workers = std::atoi(argv[i + 1]);
    } else if (flag == "--requests") {
      requests = std::atoi(argv[i + 1]);
    } else {
      return usage();
    }
  }
  if ((mode != "layer" && mode != "nolayer" && mode != "record" && mode != "bare") || db.empty() ||
      workers < 1 || requests < 0 || argc % 2 == 0) {
    return usage();
  }
  const auto url = keel::store::parse_database_url(db);
  if (!url) {
    std::fprintf(stderr, "keel_bench_beast_serve: %s\n", url.error().in("--db").message().c_str());
    return 2;
  }
  {
    const auto conn = keel::store::open_database(*url);
    keel::store::migrate(
        *conn, "beast_bench",
        {{"CREATE TABLE charges (id TEXT PRIMARY KEY, principal TEXT NOT NULL,"
          " amount BIGINT NOT NULL, currency TEXT NOT NULL, customer TEXT NOT NULL,"
          " created BIGINT NOT NULL);"
          "CREATE INDEX charges_customer ON charges (principal, customer);"}});
    if (mode == "layer" || mode == "record") keel::store::IdempotencyStore::migrate(*conn);
  }
  Charges charges(&*url);

  if (mode == "bare") {
    asio::io_context io;
    asio::thread_pool pool(static_cast<std::size_t>(workers));
    tcp::acceptor acceptor(io, {asio::ip::make_address("127.0.0.1"), 0});
    accept(acceptor, pool, charges);
    asio::signal_set signals(io, SIGINT, SIGTERM);
    signals.async_wait([&](boost::beast::error_code, int) { io.stop(); });
    const std::uint16_t port = acceptor.local_endpoint().port();
    announce(port);
    bool ok = true;
    if (requests > 0) {
      std::thread loop([&] { io.run(); });
      ok = send_charges(port, requests);
      io.stop();
      loop.join();
    } else {
      io.run();
    }
    pool.join();
    return ok ? 0 : 1;
  }

  keel::store::beast::Server server(
      {.worker_threads = mode == "layer" ? workers : 1, .drain_timeout = std::chrono::seconds(1)});
  keel::store::ConnectionPool db_pool(*url, {.max_connections = workers});
  const keel::store::IdempotencyStore records;
  std::optional<keel::store::beast::IdempotentHandler> idempotent;
  asio::thread_pool pool(mode == "layer" ? 1 : static_cast<std::size_t>(workers));
  if (mode == "layer") {
    idempotent.emplace(
        keel::store::beast::IdempotentHandlerOptions{
            .flow = {.store = &records, .pool = &db_pool, .scope_secret = "beast-bench-scope-key"}},
        [&](const Request& req, Connection& tx) { return charges.create(req.body(), tx); });
    server.on_idempotent(http::verb::post, "/v1/charges", *idempotent);
  } else {
    server.on_async(http::verb::post, "/v1/charges",
                    [&](Request req, keel::store::beast::Respond respond) {
                      asio::post(pool, [&charges, record = mode == "record", req = std::move(req),
                                        respond = std::move(respond)] {
                        respond(charges.create_in_transaction(req, record));
                      });
                    });
  }
  server.start();
  announce(server.port());
  const bool ok = requests > 0 ? send_charges(server.port(), requests) : (wait_for_signal(), true);
  server.stop();
  pool.join();
  return ok ? 0 : 1;
}
