// keel::store_beast against hostile clients: keel::store::beast::Server on 127.0.0.1 port 0, the
// idempotency flow over a real SQLite file (and PostgreSQL for the pipelined charges), and raw
// sockets that trickle heads and bodies, pipeline requests, send oversized or conflicting framing
// and hold connections open. Each test asserts behaviour; wall-clock bounds only when
// keel::test::kTimingAsserted (tests/build_kind.hpp).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/system/system_error.hpp>
#include <chrono>
#include <condition_variable>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "build_kind.hpp"
#include "keel/store/beast/server.hpp"
#include "keel/store/idempotency/idempotency.hpp"
#include "test_support.hpp"

namespace keel::store::beast {
namespace {

using namespace std::chrono_literals;
namespace http = boost::beast::http;
using Clock = std::chrono::steady_clock;

/// A bound that is asserted in the optimised build and loose under a sanitizer or in a debug build.
std::chrono::milliseconds bound(std::chrono::milliseconds tight, std::chrono::milliseconds loose) {
  return test::kTimingAsserted ? tight : loose;
}

/// One complete answer read off a connection.
struct Answer {
  int status = 0;
  std::string head;  // status line and header fields
  std::string body;
  [[nodiscard]] bool has(const std::string& header_line) const {
    return head.find(header_line) != std::string::npos;
  }
};

/// A raw TCP connection to 127.0.0.1:port.
class Raw {
 public:
  explicit Raw(int port) : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  }
  ~Raw() { close(); }
  Raw(const Raw&) = delete;
  Raw& operator=(const Raw&) = delete;

  [[nodiscard]] bool connected() const { return connected_; }
  /// Closes our end (the server stops waiting for it).
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    closed_ = true;
  }
  [[nodiscard]] bool closed() const { return closed_; }

  /// Writes all of `bytes` in one send() where the kernel takes it (false: the peer is gone).
  bool send(std::string_view bytes) {
    std::size_t sent = 0;
    while (sent < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return false;
      sent += static_cast<std::size_t>(n);
    }
    return true;
  }

  /// Reads what has arrived within `wait` (false once the peer closed).
  bool poll_read(std::chrono::milliseconds wait) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(wait.count())) <= 0) return !closed_;
    char buf[65536];
    const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    if (n <= 0) {
      closed_ = true;
      return false;
    }
    text_.append(buf, static_cast<std::size_t>(n));
    return true;
  }

  /// Reads until `count` complete answers have arrived, the peer closes or `timeout` passes.
  std::vector<Answer> answers(std::size_t count, std::chrono::milliseconds timeout = 10s) {
    const auto until = Clock::now() + timeout;
    while (parse().size() < count && !closed_ && Clock::now() < until) poll_read(50ms);
    return parse();
  }
  Answer answer(std::chrono::milliseconds timeout = 10s) {
    auto all = answers(1, timeout);
    return all.empty() ? Answer{} : all.front();
  }

  /// Waits until the peer closes; true when it did within `timeout`.
  bool wait_closed(std::chrono::milliseconds timeout) {
    const auto until = Clock::now() + timeout;
    while (!closed_ && Clock::now() < until) poll_read(50ms);
    return closed_;
  }

  [[nodiscard]] const std::string& text() const { return text_; }

 private:
  // The complete answers in text_ (Content-Length framed, as the server sends them).
  [[nodiscard]] std::vector<Answer> parse() const {
    std::vector<Answer> out;
    std::size_t at = 0;
    while (true) {
      const std::size_t end = text_.find("\r\n\r\n", at);
      if (end == std::string::npos) break;
      Answer a;
      a.head = text_.substr(at, end + 2 - at);
      if (a.head.rfind("HTTP/1.1 ", 0) != 0) break;
      a.status = std::stoi(a.head.substr(9, 3));
      std::size_t length = 0;
      const std::size_t cl = a.head.find("Content-Length: ");
      if (cl != std::string::npos) length = std::stoul(a.head.substr(cl + 16));
      if (text_.size() < end + 4 + length) break;
      a.body = text_.substr(end + 4, length);
      at = end + 4 + length;
      out.push_back(std::move(a));
    }
    return out;
  }

  int fd_;
  bool connected_ = false;
  bool closed_ = false;
  std::string text_;
};

std::string post(const std::string& key, const std::string& body,
                 const std::string& content_type = "text/plain",
                 const std::string& extra_headers = "") {
  return "POST /v1/charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: " + key +
         "\r\nAuthorization: Bearer alice\r\nContent-Type: " + content_type +
         "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n" + extra_headers + "\r\n" +
         body;
}

constexpr std::string_view kHealthz = "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";

/// The server, a flow route POST /v1/charges that inserts its body into `charges` and answers it,
/// and GET /healthz, over a fresh database at `url`.
class Harness {
 public:
  Harness(const DatabaseUrl& url, ServerOptions options, AdmissionLimiter* limiter = nullptr)
      : pool_(url, PoolOptions{.max_connections = 8}) {
    {
      auto conn = pool_.acquire();
      IdempotencyStore::migrate(*conn);
      conn->execute("CREATE TABLE charges (body TEXT NOT NULL)");
    }
    handler_ = std::make_unique<IdempotentHandler>(
        IdempotentHandlerOptions{
            .flow = {.store = &store_, .pool = &pool_, .log = [](std::string_view) {}},
            .limiter = limiter},
        [this](const Request& req, Connection& tx) -> StoredResponse {
          ++handled_;
          if (req.body() == "slow") {
            {
              std::lock_guard lock(mu_);
              slow_started_ = true;
            }
            cv_.notify_all();
            std::unique_lock lock(mu_);
            cv_.wait(lock, [this] { return slow_released_; });
          }
          tx.query("INSERT INTO charges (body) VALUES ($1)", {req.body()});
          return {
              201, {{"Content-Type", "application/json"}}, "{\"charge\":\"" + req.body() + "\"}"};
        });
    options.log = [](std::string_view) {};
    server_ = std::make_unique<Server>(std::move(options));
    server_->on(http::verb::get, "/healthz", [](const Request& req) {
      Response res{http::status::ok, req.version()};
      res.set(http::field::content_type, "text/plain");
      res.body() = "ok\n";
      return res;
    });
    server_->on_idempotent(http::verb::post, "/v1/charges", *handler_);
    server_->start();
  }
  ~Harness() {
    release_slow();
    server_->stop();
  }

  [[nodiscard]] int port() const { return server_->port(); }
  [[nodiscard]] Server& server() { return *server_; }
  [[nodiscard]] int handled() const { return handled_.load(); }
  std::int64_t rows(const std::string& where = "") {
    return pool_.acquire()->query("SELECT COUNT(*) FROM charges" + where).integer(0, 0);
  }
  void wait_slow_started() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [this] { return slow_started_; });
  }
  void release_slow() {
    {
      std::lock_guard lock(mu_);
      slow_released_ = true;
    }
    cv_.notify_all();
  }
  void expect_healthy() {
    Raw c(port());
    ASSERT_TRUE(c.connected());
    ASSERT_TRUE(c.send(kHealthz));
    const Answer a = c.answer();
    EXPECT_EQ(a.status, 200);
    EXPECT_EQ(a.body, "ok\n");
  }
  /// Waits until the server holds `n` connections (at most 5 s).
  bool wait_connections(std::size_t n) {
    const auto until = Clock::now() + 5s;
    while (server_->connections() != n && Clock::now() < until) std::this_thread::sleep_for(10ms);
    return server_->connections() == n;
  }

 private:
  ConnectionPool pool_;
  IdempotencyStore store_;
  std::unique_ptr<IdempotentHandler> handler_;
  std::unique_ptr<Server> server_;
  std::atomic<int> handled_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool slow_started_ = false;   // guarded by mu_
  bool slow_released_ = false;  // guarded by mu_
};

class BeastServer : public ::testing::Test {
 protected:
  Harness& start(ServerOptions options = {}, AdmissionLimiter* limiter = nullptr) {
    const DatabaseUrl url =
        parse_database_url("sqlite:" + (dir_.path() / "db.sqlite").string()).value();
    harness_ = std::make_unique<Harness>(url, std::move(options), limiter);
    return *harness_;
  }

  test::TempDir dir_;
  std::unique_ptr<Harness> harness_;
};

TEST_F(BeastServer, TricklingHeadsDoNotDelayAFreshHealthzAndAreCutAtTheHeaderDeadline) {
  Harness& h = start({.header_timeout = 1000ms});
  // 48 connections send a 300-byte head one byte every 50 ms: 15 s each if nobody cut them.
  const std::string head =
      "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + std::string(260, 'a') + "\r\n\r\n";
  std::vector<std::unique_ptr<Raw>> tricklers;
  tricklers.reserve(48);
  for (int i = 0; i < 48; ++i) tricklers.push_back(std::make_unique<Raw>(h.port()));
  std::atomic<bool> done{false};
  std::vector<Clock::duration> cut_after(tricklers.size(), Clock::duration::max());
  const auto began = Clock::now();
  std::thread trickle([&] {
    for (std::size_t at = 0; at < head.size() && !done; ++at) {
      bool any_open = false;
      for (std::size_t i = 0; i < tricklers.size(); ++i) {
        Raw& t = *tricklers[i];
        if (t.closed()) continue;
        t.poll_read(0ms);
        if (t.closed() || !t.send(head.substr(at, 1))) {
          if (cut_after[i] == Clock::duration::max()) cut_after[i] = Clock::now() - began;
          continue;
        }
        any_open = true;
      }
      if (!any_open) break;
      std::this_thread::sleep_for(50ms);
    }
  });
  std::this_thread::sleep_for(300ms);  // the tricklers are under way

  const auto asked = Clock::now();
  Raw fresh(h.port());
  ASSERT_TRUE(fresh.connected());
  ASSERT_TRUE(fresh.send(kHealthz));
  const Answer a = fresh.answer(10s);
  const auto answered_in = Clock::now() - asked;
  EXPECT_EQ(a.status, 200);
  EXPECT_LT(answered_in, bound(1000ms, 10000ms));

  trickle.join();
  for (std::size_t i = 0; i < tricklers.size(); ++i) {
    Raw& t = *tricklers[i];
    EXPECT_TRUE(t.closed() || t.wait_closed(5s)) << "trickler " << i << " was never cut";
    EXPECT_TRUE(t.text().empty()) << "a cut trickler got an answer: " << t.text();
    if (cut_after[i] != Clock::duration::max()) {
      EXPECT_LT(cut_after[i], bound(2500ms, 14000ms)) << "trickler " << i;
    }
  }
  done = true;
  h.expect_healthy();
}

TEST_F(BeastServer, TrickledBodyIsCutAtTheBodyDeadlineAndNothingIsWritten) {
  Harness& h = start({.body_timeout = 500ms});
  Raw slow(h.port());
  const std::string body(1000, 'x');
  ASSERT_TRUE(
      slow.send(post("slow-body", "").substr(0, post("slow-body", "").find("Content-Length")) +
                "Content-Length: 1000\r\n\r\n"));
  const auto began = Clock::now();
  for (std::size_t i = 0; i < body.size() && !slow.closed(); ++i) {
    if (!slow.send(body.substr(i, 1))) break;
    slow.poll_read(50ms);
  }
  EXPECT_TRUE(slow.closed() || slow.wait_closed(5s));
  EXPECT_LT(Clock::now() - began, bound(1500ms, 30000ms));
  EXPECT_TRUE(slow.text().empty()) << slow.text();
  EXPECT_EQ(h.handled(), 0);
  EXPECT_EQ(h.rows(), 0);
  h.expect_healthy();
}

TEST_F(BeastServer, IdleKeepAliveConnectionIsClosedAtTheIdleTimeout) {
  Harness& h = start({.idle_timeout = 300ms});
  Raw c(h.port());
  ASSERT_TRUE(c.send(kHealthz));
  const auto answered = Clock::now();
  EXPECT_EQ(c.answer().status, 200);
  EXPECT_FALSE(c.closed()) << "keep-alive: the connection stays open after the answer";
  EXPECT_TRUE(c.wait_closed(5s));
  EXPECT_LT(Clock::now() - answered, bound(1300ms, 5000ms));
  EXPECT_TRUE(h.wait_connections(0));
}

TEST_F(BeastServer, ConnectionsPastTheLimitAreClosedAndOthersAreServedAfter) {
  Harness& h = start({.max_connections = 4});
  std::vector<std::unique_ptr<Raw>> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(std::make_unique<Raw>(h.port()));
    ASSERT_TRUE(held.back()->connected());
  }
  ASSERT_TRUE(h.wait_connections(4));
  Raw over(h.port());  // accepted by the kernel, then closed by the server
  (void)over.send(kHealthz);
  EXPECT_TRUE(over.wait_closed(5s));
  EXPECT_TRUE(over.text().empty()) << over.text();
  // The held ones still work.
  ASSERT_TRUE(held.front()->send(kHealthz));
  EXPECT_EQ(held.front()->answer().status, 200);
  held.clear();
  ASSERT_TRUE(h.wait_connections(0));
  h.expect_healthy();
}

TEST_F(BeastServer, OversizedHeadIs431) {
  Harness& h = start({.max_header_bytes = 1024});
  Raw c(h.port());
  ASSERT_TRUE(
      c.send("GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + std::string(2000, 'a') + "\r\n\r\n"));
  const Answer a = c.answer();
  EXPECT_EQ(a.status, 431);
  EXPECT_TRUE(a.has("Content-Type: application/problem+json")) << a.head;
  EXPECT_TRUE(c.wait_closed(5s));
  h.expect_healthy();
}

TEST_F(BeastServer, OversizedBodyIs413WhateverItsContentType) {
  constexpr std::size_t kLimit = std::size_t{2} * 1024 * 1024;
  Harness& h = start({.max_body_bytes = kLimit});
  int i = 0;
  for (const std::string type :
       {"application/json", "application/x-www-form-urlencoded", "text/plain"}) {
    SCOPED_TRACE(type);
    const std::string body = type == "application/json" ? "\"" + std::string(kLimit - 1, 'a') + "\""
                                                        : "a=" + std::string(kLimit - 1, 'b');
    ASSERT_EQ(body.size(), kLimit + 1);
    Raw c(h.port());
    ASSERT_TRUE(c.send(post("big-" + std::to_string(i++), body, type)));
    const Answer a = c.answer();
    EXPECT_EQ(a.status, 413);
    EXPECT_TRUE(a.has("Content-Type: application/problem+json")) << a.head;
    EXPECT_TRUE(c.wait_closed(5s));
  }
  {
    SCOPED_TRACE("chunked");
    Raw c(h.port());
    std::string chunked =
        "POST /v1/charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: big-chunked\r\n"
        "Content-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n";
    for (int k = 0; k < 3; ++k) chunked += "100000\r\n" + std::string(0x100000, 'c') + "\r\n";
    chunked += "0\r\n\r\n";
    ASSERT_TRUE(c.send(chunked));
    EXPECT_EQ(c.answer().status, 413);
    EXPECT_TRUE(c.wait_closed(5s));
  }
  EXPECT_EQ(h.handled(), 0);
  EXPECT_EQ(h.rows(), 0);
}

TEST_F(BeastServer, OneMebibyteFormBodyUnderATwoMebibyteLimitIsAccepted) {
  Harness& h = start({.max_body_bytes = std::size_t{2} * 1024 * 1024});
  Raw c(h.port());
  const std::string body = "a=" + std::string(1024 * 1024 - 2, 'b');
  ASSERT_TRUE(c.send(post("form-1mib", body, "application/x-www-form-urlencoded")));
  EXPECT_EQ(c.answer().status, 201);
  EXPECT_EQ(h.rows(), 1);
}

TEST_F(BeastServer, FramingConflictsAre400AndTheConnectionIsClosed) {
  Harness& h = start();
  const std::string smuggled(kHealthz);
  const std::string start_line =
      "POST /v1/charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: f\r\nContent-Type: text/plain\r\n";
  for (const std::string& request : {
           start_line + "Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
           start_line +
               "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
           start_line +
               "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
           start_line + "Transfer-Encoding: gzip\r\n\r\nhello",
           start_line + "Transfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
       }) {
    SCOPED_TRACE(request);
    Raw c(h.port());
    ASSERT_TRUE(c.send(request + smuggled));
    const std::vector<Answer> all = c.answers(2, 3s);
    ASSERT_FALSE(all.empty());
    EXPECT_EQ(all.front().status, 400);
    EXPECT_TRUE(all.front().has("Content-Type: application/problem+json"));
    EXPECT_EQ(all.size(), 1u) << "bytes after a refused request were read as another request";
    EXPECT_TRUE(c.wait_closed(5s));
  }
  EXPECT_EQ(h.handled(), 0);
  EXPECT_EQ(h.rows(), 0);
}

TEST_F(BeastServer, TwoIdempotencyKeyFieldsAre400ProblemJson) {
  Harness& h = start();
  Raw c(h.port());
  ASSERT_TRUE(c.send(post("k1", "x", "text/plain", "Idempotency-Key: k2\r\n")));
  const Answer a = c.answer();
  EXPECT_EQ(a.status, 400);
  EXPECT_TRUE(a.has("Content-Type: application/problem+json")) << a.head;
  EXPECT_EQ(h.handled(), 0);
  EXPECT_EQ(h.rows(), 0);
}

TEST_F(BeastServer, ExpiredCallerDeadlineIsRefusedBeforeTheHandler) {
  Harness& h = start();
  Raw c(h.port());
  ASSERT_TRUE(c.send(post("late", "x", "text/plain", "Keel-Deadline-Ms: 0\r\n")));
  const Answer a = c.answer();
  EXPECT_EQ(a.status, 400);
  EXPECT_NE(a.body.find("Deadline exceeded"), std::string::npos) << a.body;
  EXPECT_EQ(h.handled(), 0);
}

TEST_F(BeastServer, ShedRequestIsAnswered503BeforeTheHandler) {
  AdmissionLimiter limiter({.max_concurrency = 1, .queue_bound = 0});
  Harness& h = start({}, &limiter);
  Raw busy(h.port());
  ASSERT_TRUE(busy.send(post("busy", "slow")));
  h.wait_slow_started();
  Raw shed(h.port());
  ASSERT_TRUE(shed.send(post("shed", "x")));
  const Answer a = shed.answer();
  EXPECT_EQ(a.status, 503);
  EXPECT_TRUE(a.has("Retry-After: ")) << a.head;
  EXPECT_TRUE(a.has("Content-Type: application/problem+json")) << a.head;
  h.release_slow();
  EXPECT_EQ(busy.answer().status, 201);
  EXPECT_EQ(h.handled(), 1);
}

TEST_F(BeastServer, GracefulShutdownAnswersTheRequestInFlightAndRefusesNewConnections) {
  Harness& h = start({.drain_timeout = 10000ms});
  Raw idle(h.port());
  ASSERT_TRUE(idle.send(kHealthz));
  ASSERT_EQ(idle.answer().status, 200);
  Raw busy(h.port());
  ASSERT_TRUE(busy.send(post("in-flight", "slow")));
  h.wait_slow_started();
  std::thread stopping([&] { h.server().stop(); });
  bool refused = false;
  for (int i = 0; i < 500 && !refused; ++i) {
    Raw probe(h.port());
    refused = !probe.connected();
    if (!refused) std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(refused) << "a new connection was accepted after stop()";
  EXPECT_TRUE(idle.wait_closed(5s)) << "the idle connection was not closed at once";
  EXPECT_FALSE(busy.closed());
  h.release_slow();
  const Answer a = busy.answer();
  EXPECT_EQ(a.status, 201);
  EXPECT_TRUE(a.has("Connection: close")) << a.head;
  EXPECT_TRUE(busy.wait_closed(5s));
  busy.close();
  stopping.join();
  EXPECT_EQ(h.rows(), 1);
}

TEST_F(BeastServer, HeadAnswerCarriesNoBodyAndTheNextRequestIsAnswered) {
  Harness& h = start();
  Raw c(h.port());
  ASSERT_TRUE(c.send("HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n" + std::string(kHealthz)));
  const auto until = Clock::now() + 5s;
  while (c.text().find("ok\n") == std::string::npos && !c.closed() && Clock::now() < until) {
    c.poll_read(50ms);
  }
  // 405 (no HEAD route) with its Content-Length and no body, then the GET's 200.
  const std::string& text = c.text();
  ASSERT_EQ(text.rfind("HTTP/1.1 405", 0), 0u) << text;
  const std::size_t second = text.find("\r\n\r\n") + 4;
  EXPECT_EQ(text.compare(second, 12, "HTTP/1.1 200"), 0) << text;
}

TEST_F(BeastServer, StartThrowsWhenThePortIsTaken) {
  Harness& h = start();
  Server other({.port = static_cast<std::uint16_t>(h.port())});
  EXPECT_THROW(other.start(), boost::system::system_error);
  h.expect_healthy();
}

TEST(BeastIdempotentHandler, RunsTheFlowOnTheGivenExecutorAndReplaysTheRepeat) {
  // The adapter on its own, as a user's Beast session would call it.
  test::TempDir dir;
  ConnectionPool pool(parse_database_url("sqlite:" + (dir.path() / "db.sqlite").string()).value());
  IdempotencyStore store;
  IdempotencyStore::migrate(*pool.acquire());
  std::atomic<int> runs{0};
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<bool> ran_elsewhere{false};
  IdempotentHandler charges(
      {.flow = {.store = &store, .pool = &pool}}, [&](const Request& req, Connection&) {
        ++runs;
        ran_elsewhere = std::this_thread::get_id() != caller;
        return StoredResponse{201, {{"Content-Type", "text/plain"}}, "charged " + req.body()};
      });
  Request req{http::verb::post, "/v1/charges?source=test", 11};
  req.set("Idempotency-Key", "own-server-1");
  req.set(http::field::authorization, "Bearer alice");
  req.set(http::field::content_type, "text/plain");
  req.body() = "5";
  req.prepare_payload();
  EXPECT_EQ(charges.principal(req), "alice");

  boost::asio::thread_pool workers(2);
  std::promise<Response> answered;
  charges.async_handle(req, charges.principal(req), charges.clock().now(), workers.get_executor(),
                       [&](Response res) { answered.set_value(std::move(res)); });
  const Response first = answered.get_future().get();
  EXPECT_EQ(first.result_int(), 201u);
  EXPECT_EQ(first.body(), "charged 5");
  EXPECT_EQ(first[http::field::content_type], "text/plain");
  EXPECT_TRUE(ran_elsewhere) << "the flow ran on the calling thread, not the executor";

  const Response again = charges.handle(req, "alice", charges.clock().now());
  EXPECT_EQ(again.result_int(), 201u);
  EXPECT_EQ(again["Idempotent-Replayed"], "true");
  EXPECT_EQ(again.body(), "charged 5");
  EXPECT_EQ(runs.load(), 1);

  // A passed deadline is answered on the calling thread, before the handler.
  req.set("Idempotency-Key", "own-server-2");
  req.set("Keel-Deadline-Ms", "0");
  std::promise<Response> refused;
  charges.async_handle(req, "alice", charges.clock().now(), workers.get_executor(),
                       [&](Response res) { refused.set_value(std::move(res)); });
  EXPECT_EQ(refused.get_future().get().result_int(), 400u);
  EXPECT_EQ(runs.load(), 1);
  workers.join();
}

/// The pipelined charges on both backends.
class BeastPipelining : public test::BackendTest {};

TEST_P(BeastPipelining, PipelinedPostsAreAnsweredInOrderEachWrittenOnce) {
  Harness h(url(), {});
  std::int64_t expected_rows = 0;
  int key = 0;
  for (const int n : {3, 10}) {
    SCOPED_TRACE(n);
    std::string burst;
    std::vector<std::string> bodies;
    for (int i = 0; i < n; ++i) {
      bodies.push_back("charge-" + std::to_string(key));
      burst += post("pipe-" + std::to_string(key++), bodies.back());
    }
    Raw c(h.port());
    ASSERT_TRUE(c.send(burst));  // one send: the requests arrive together
    const std::vector<Answer> all = c.answers(static_cast<std::size_t>(n));
    ASSERT_EQ(all.size(), static_cast<std::size_t>(n)) << c.text();
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(all[i].status, 201);
      EXPECT_EQ(all[i].body, "{\"charge\":\"" + bodies[i] + "\"}") << "answer " << i;
    }
    expected_rows += n;
    EXPECT_EQ(h.rows(), expected_rows);
    for (const std::string& body : bodies) {
      EXPECT_EQ(h.rows(" WHERE body = '" + body + "'"), 1) << body;
    }
  }
  // The same key twice in one burst: executed once, then replayed.
  Raw c(h.port());
  ASSERT_TRUE(c.send(post("pipe-repeat", "again") + post("pipe-repeat", "again")));
  const std::vector<Answer> all = c.answers(2);
  ASSERT_EQ(all.size(), 2u) << c.text();
  EXPECT_EQ(all[0].status, 201);
  EXPECT_FALSE(all[0].has("Idempotent-Replayed: true"));
  EXPECT_EQ(all[1].status, 201);
  EXPECT_TRUE(all[1].has("Idempotent-Replayed: true")) << all[1].head;
  EXPECT_EQ(all[1].body, all[0].body);
  EXPECT_EQ(h.rows(" WHERE body = 'again'"), 1);
}

INSTANTIATE_TEST_SUITE_P(Backends, BeastPipelining,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

TEST(BeastServerOptions, InvalidOptionsAreRejectedNamingTheField) {
  EXPECT_THROW(Server({.event_loop_threads = 0}), std::invalid_argument);
  EXPECT_THROW(Server({.header_timeout = 0ms}), std::invalid_argument);
  EXPECT_THROW(Server({.max_header_bytes = 10}), std::invalid_argument);
  try {
    const Server server({.max_body_bytes = 0});
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("max_body_bytes"), std::string::npos) << e.what();
  }
}

TEST(BeastServerRoutes, SubtreesNoAnswerAndTheWorkerExecutor) {
  Server server({.log = [](std::string_view) {}});
  const auto echo = [](std::string text) {
    return [text](const Request& req) {
      Response res{http::status::ok, req.version()};
      res.body() = text.empty() ? std::string(req.target()) : text;
      return res;
    };
  };
  server.on(http::verb::get, "/items/*", echo(""));
  server.on(http::verb::get, "/items", echo("list"));
  server.on(http::verb::get, "/drop", [](const Request&) { return no_answer(); });
  server.on_async(http::verb::get, "/blocking", [&server](Request req, Respond respond) {
    boost::asio::post(server.worker_executor(), [respond, version = req.version()] {
      Response res{http::status::ok, version};
      res.body() = "worker";
      respond(std::move(res));
    });
  });
  server.start();
  Raw c(server.port());
  ASSERT_TRUE(
      c.send("GET /items/ch_1?x=1 HTTP/1.1\r\nHost: x\r\n\r\nGET /items HTTP/1.1\r\nHost: x\r\n\r\n"
             "GET /items/ HTTP/1.1\r\nHost: x\r\n\r\nDELETE /items/a HTTP/1.1\r\nHost: x\r\n\r\n"
             "GET /blocking HTTP/1.1\r\nHost: x\r\n\r\n"));
  const auto answers = c.answers(5);
  ASSERT_EQ(answers.size(), 5u) << c.text();
  EXPECT_EQ(answers[0].status, 200);
  EXPECT_EQ(answers[0].body, "/items/ch_1?x=1");
  EXPECT_EQ(answers[1].body, "list");
  EXPECT_EQ(answers[2].status, 404);  // a subtree route needs a path under it
  EXPECT_EQ(answers[3].status, 405);
  EXPECT_TRUE(answers[3].has("Allow: GET\r\n")) << answers[3].head;
  EXPECT_EQ(answers[4].body, "worker");
  Raw dropped(server.port());
  ASSERT_TRUE(dropped.send("GET /drop HTTP/1.1\r\nHost: x\r\n\r\n"));
  EXPECT_TRUE(dropped.wait_closed(5s));
  EXPECT_TRUE(dropped.text().empty()) << dropped.text();
  server.stop();
}

TEST(BeastServerOptions, APortInUseFailsStartUnlessEveryListenerSharesIt) {
  Server first({.reuse_port = true, .log = [](std::string_view) {}});
  first.start();
  Server second({.port = first.port(), .reuse_port = true, .log = [](std::string_view) {}});
  EXPECT_NO_THROW(second.start());
  Server third({.port = first.port(), .log = [](std::string_view) {}});
  EXPECT_THROW(third.start(), boost::system::system_error);
}

}  // namespace
}  // namespace keel::store::beast
