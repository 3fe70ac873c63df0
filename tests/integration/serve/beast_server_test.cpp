// keel::store_beast against hostile clients: keel::store::beast::Server on 127.0.0.1 port 0, the
// idempotency flow over a real SQLite file (and PostgreSQL for the pipelined charges), and raw
// sockets that trickle heads and bodies, pipeline requests, send oversized or conflicting framing,
// malformed Host fields and empty lines, hold connections open and go away mid-request; the stop
// with a worker blocked, and HealthCheck. Each test asserts behaviour; wall-clock bounds only when
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
#include "keel/idempotency/idempotency.hpp"
#include "keel/serve/beast/health_check.hpp"
#include "keel/serve/beast/server.hpp"
#include "support/test_support.hpp"

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
        IdempotentHandlerOptions{.flow = {.store = &store_,
                                          .pool = &pool_,
                                          .on_outcome =
                                              [this](IdempotencyOutcome outcome) {
                                                std::lock_guard lock(mu_);
                                                outcomes_.push_back(outcome);
                                                cv_.notify_all();
                                              },
                                          .log = [](std::string_view) {}},
                                 .limiter = limiter},
        [this](const Request& req, Connection& tx) -> StoredResponse {
          ++handled_;
          if (req.body() == "slow") {
            {
              std::lock_guard lock(mu_);
              ++slow_started_;
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
    // The same flow through on_async, keeping the Respond, so a test can see its abandoned().
    server_->on_async(http::verb::post, "/v1/observed", [this](Request req, Respond respond) {
      {
        std::lock_guard lock(mu_);
        observed_ = respond;
      }
      handler_->async_handle(std::move(req), "alice", handler_->clock().now(),
                             server_->worker_executor(), std::move(respond));
    });
    // A GET answered on a worker thread.
    server_->on_async(http::verb::get, "/worker", [this](const Request& req, Respond respond) {
      boost::asio::post(server_->worker_executor(), [respond, version = req.version()] {
        Response res{http::status::ok, version};
        res.set(http::field::content_type, "text/plain");
        res.body() = "from a worker\n";
        respond(std::move(res));
      });
    });
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
    ASSERT_TRUE(cv_.wait_for(lock, 10s, [this] { return slow_started_ > 0; }))
        << "the slow request never reached its handler";
  }
  /// The outcome of the `n`th flow to finish (1-based), once it has (nullopt after 10 s).
  std::optional<IdempotencyOutcome> outcome(std::size_t n) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, 10s, [&] { return outcomes_.size() >= n; })) return std::nullopt;
    return outcomes_[n - 1];
  }
  /// The Respond of the last /v1/observed request.
  Respond observed() {
    std::lock_guard lock(mu_);
    return observed_;
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
  int slow_started_ = 0;        // guarded by mu_: slow requests that reached the handler
  bool slow_released_ = false;  // guarded by mu_
  Respond observed_;            // guarded by mu_
  std::vector<IdempotencyOutcome> outcomes_;  // guarded by mu_: the flows' outcomes, in order
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

TEST_F(BeastServer, AtTheLimitTheOldestWaitingConnectionGivesItsSlotToAFreshOne) {
  Harness& h = start({.first_byte_timeout = 60000ms, .max_connections = 4});
  // Four connections that never send a byte, opened one after the other (oldest first).
  std::vector<std::unique_ptr<Raw>> held;
  for (std::size_t i = 0; i < 4; ++i) {
    held.push_back(std::make_unique<Raw>(h.port()));
    ASSERT_TRUE(held.back()->connected());
    ASSERT_TRUE(h.wait_connections(i + 1));
  }
  // A fresh request is answered; the oldest silent connection made room for it.
  Raw fresh(h.port());
  ASSERT_TRUE(fresh.send(kHealthz));
  EXPECT_EQ(fresh.answer().status, 200);
  EXPECT_TRUE(held[0]->wait_closed(5s)) << "the oldest idle connection kept its slot";
  EXPECT_TRUE(held[0]->text().empty()) << held[0]->text();
  ASSERT_TRUE(h.wait_connections(4));
  // A connection that is answered waits for its next request as the newest one: the next fresh
  // request takes the slot of held[2], the oldest silent one left, not that of held[1].
  ASSERT_TRUE(held[1]->send(kHealthz));
  EXPECT_EQ(held[1]->answer().status, 200);
  Raw again(h.port());
  ASSERT_TRUE(again.send(kHealthz));
  EXPECT_EQ(again.answer().status, 200);
  EXPECT_TRUE(held[2]->wait_closed(5s));
  EXPECT_FALSE(held[3]->wait_closed(100ms));
  EXPECT_FALSE(fresh.wait_closed(100ms));
  ASSERT_TRUE(held[1]->send(kHealthz));
  EXPECT_EQ(held[1]->answers(2).size(), 2u) << held[1]->text();
  held.clear();
  fresh.close();
  again.close();
  EXPECT_TRUE(h.wait_connections(0));
}

TEST_F(BeastServer, AtTheLimitAConnectionWhoseRequestIsHandledIsNeverDropped) {
  Harness& h = start({.max_connections = 1});
  Raw handled(h.port());
  ASSERT_TRUE(handled.send(post("handled", "slow")));
  h.wait_slow_started();
  Raw over(h.port());  // accepted by the kernel, then closed by the server: no slot to take
  (void)over.send(kHealthz);
  EXPECT_TRUE(over.wait_closed(5s));
  EXPECT_TRUE(over.text().empty()) << over.text();
  h.release_slow();
  EXPECT_EQ(handled.answer().status, 201);
  EXPECT_EQ(h.rows(), 1);
}

TEST_F(BeastServer, ASilentConnectionIsClosedAtTheFirstByteTimeout) {
  Harness& h = start({.first_byte_timeout = 300ms});
  Raw silent(h.port());
  ASSERT_TRUE(silent.connected());
  const auto opened = Clock::now();
  EXPECT_TRUE(silent.wait_closed(5s));
  const auto held_for = Clock::now() - opened;
  EXPECT_GE(held_for, 250ms);
  EXPECT_LT(held_for, bound(1000ms, 5000ms));
  EXPECT_TRUE(silent.text().empty()) << silent.text();
  // Empty lines are not a first byte: the deadline stays.
  Raw blank(h.port());
  const auto blank_opened = Clock::now();
  ASSERT_TRUE(blank.send("\r\n"));
  EXPECT_TRUE(blank.wait_closed(5s));
  EXPECT_LT(Clock::now() - blank_opened, bound(1000ms, 5000ms));
  // A client that sends its request at once is served as ever.
  h.expect_healthy();
  EXPECT_TRUE(h.wait_connections(0));
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

TEST_F(BeastServer, HeadIsAnsweredOnEveryGetRouteWithoutABody) {
  // RFC 9110 section 9.3.2: HEAD is GET without the body. /healthz is answered on the event
  // loop, /worker on a worker thread.
  Harness& h = start();
  for (const std::string path : {"/healthz", "/worker"}) {
    SCOPED_TRACE(path);
    Raw c(h.port());
    ASSERT_TRUE(c.send("GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n"));
    const Answer get = c.answer();
    ASSERT_EQ(get.status, 200);
    ASSERT_FALSE(get.body.empty());
    // The HEAD answer, then a GET behind it on the same connection: what follows the HEAD
    // answer's head must be the next status line, not a body.
    const std::size_t at = c.text().size();
    ASSERT_TRUE(c.send("HEAD " + path + " HTTP/1.1\r\nHost: x\r\n\r\n" + std::string(kHealthz)));
    for (const auto until = Clock::now() + 5s;
         c.text().find("ok\n", at) == std::string::npos && !c.closed() && Clock::now() < until;) {
      c.poll_read(50ms);
    }
    const std::string text = c.text().substr(at);
    ASSERT_EQ(text.rfind("HTTP/1.1 200 ", 0), 0u) << text;
    const std::size_t head_end = text.find("\r\n\r\n") + 4;
    const std::string head = text.substr(0, head_end);
    EXPECT_NE(head.find("Content-Length: " + std::to_string(get.body.size()) + "\r\n"),
              std::string::npos)
        << head;
    EXPECT_NE(head.find("Content-Type: text/plain"), std::string::npos) << head;
    EXPECT_EQ(text.compare(head_end, 13, "HTTP/1.1 200 "), 0) << "a body followed: " << text;
  }
  // A path with GET lists HEAD in a 405's Allow; one without GET does not.
  Raw c(h.port());
  ASSERT_TRUE(
      c.send("DELETE /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/charges HTTP/1.1\r\n"
             "Host: x\r\n\r\n"));
  const std::vector<Answer> all = c.answers(2);
  ASSERT_EQ(all.size(), 2u) << c.text();
  EXPECT_EQ(all[0].status, 405);
  EXPECT_TRUE(all[0].has("Allow: GET, HEAD\r\n")) << all[0].head;
  EXPECT_EQ(all[1].status, 405);
  EXPECT_TRUE(all[1].has("Allow: POST\r\n")) << all[1].head;
  // A HEAD that no GET answers: its 405 carries no body either.
  Raw refused(h.port());
  ASSERT_TRUE(refused.send("HEAD /v1/charges HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"));
  EXPECT_TRUE(refused.wait_closed(5s));
  ASSERT_EQ(refused.text().rfind("HTTP/1.1 405 ", 0), 0u) << refused.text();
  EXPECT_EQ(refused.text().find("\r\n\r\n") + 4, refused.text().size()) << refused.text();
}

TEST_F(BeastServer, HostMustBeOneValidFieldAndHttp11MustSendIt) {
  // RFC 9112 section 3.2: 400 to an HTTP/1.1 request without Host, to any request with two, and
  // to any with an invalid value; an empty Host is allowed (a target without an authority).
  Harness& h = start();
  const auto status_of = [&](const std::string& request) {
    Raw c(h.port());
    EXPECT_TRUE(c.send(request));
    for (const auto until = Clock::now() + 5s;
         c.text().find("\r\n\r\n") == std::string::npos && !c.closed() && Clock::now() < until;) {
      c.poll_read(50ms);
    }
    const std::string& text = c.text();
    return text.size() >= 12 ? std::stoi(text.substr(9, 3)) : 0;
  };
  for (const std::string refused : {
           "GET /healthz HTTP/1.1\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: x\r\nHost: x\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n",
           "GET /healthz HTTP/1.0\r\nHost: x\r\nHost: y\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: a b\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: a/b\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: user@a\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: a:b:c\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: a:80x\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: a%4\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: a\"b\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: [::1\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: []\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: [::1]x\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: a\x01"
           "b\r\n\r\n",
       }) {
    SCOPED_TRACE(refused);
    EXPECT_EQ(status_of(refused), 400);
  }
  for (const std::string accepted : {
           "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost:\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: example.com:8080\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:1\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: [::1]:80\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: a%41b_c~d\r\n\r\n",
           "GET /healthz HTTP/1.0\r\n\r\n",
       }) {
    SCOPED_TRACE(accepted);
    EXPECT_EQ(status_of(accepted), 200);
  }
  h.expect_healthy();
}

TEST_F(BeastServer, EmptyLinesBeforeARequestLineAreIgnoredUpToALimit) {
  // RFC 9112 section 2.2: a server SHOULD ignore at least one empty line before a request line.
  Harness& h = start({.first_byte_timeout = 500ms, .idle_timeout = 500ms});
  for (const std::string& before : {std::string("\r\n"), std::string("\n"),
                                    std::string("\r\n\r\n\r\n\r\n\r\n"), std::string(16, '\n')}) {
    SCOPED_TRACE(before.size());
    Raw c(h.port());
    ASSERT_TRUE(c.send(before + std::string(kHealthz)));
    EXPECT_EQ(c.answer().status, 200);
    // The same before a keep-alive connection's next request, sent apart.
    ASSERT_TRUE(c.send(before));
    ASSERT_TRUE(c.send(kHealthz));
    EXPECT_EQ(c.answers(2).size(), 2u) << c.text();
  }
  {
    // Past 16 empty lines: 400, and the connection closed.
    Raw c(h.port());
    ASSERT_TRUE(c.send(std::string(17, '\n') + std::string(kHealthz)));
    EXPECT_EQ(c.answer().status, 400);
    EXPECT_TRUE(c.wait_closed(5s));
  }
  {
    // Empty lines one at a time, never a request: closed at the first byte's deadline.
    Raw c(h.port());
    const auto began = Clock::now();
    for (int i = 0; i < 16 && !c.closed(); ++i) {
      if (!c.send("\r\n")) break;
      c.poll_read(50ms);
    }
    EXPECT_TRUE(c.wait_closed(5s));
    EXPECT_LT(Clock::now() - began, bound(1500ms, 6000ms));
  }
  h.expect_healthy();
}

TEST_F(BeastServer, AnHttp10ExpectationIsIgnoredAndHttp11GetsItsContinue) {
  // RFC 9110 section 10.1.1: a server MUST NOT send 100 to an HTTP/1.0 client.
  Harness& h = start();
  const std::string body = "expected";
  const auto head = [&](const std::string& version, const std::string& key) {
    return "POST /v1/charges " + version + "\r\nHost: x\r\nIdempotency-Key: " + key +
           "\r\nContent-Type: text/plain\r\nExpect: 100-continue\r\nContent-Length: " +
           std::to_string(body.size()) + "\r\n\r\n";
  };
  {
    Raw c(h.port());
    ASSERT_TRUE(c.send(head("HTTP/1.0", "expect-10")));
    c.poll_read(300ms);  // a 100 would be here by now
    EXPECT_TRUE(c.text().empty()) << c.text();
    ASSERT_TRUE(c.send(body));
    EXPECT_TRUE(c.wait_closed(5s));  // HTTP/1.0 without keep-alive: answered, then closed
    EXPECT_EQ(c.text().rfind("HTTP/1.0 201 ", 0), 0u) << c.text();
    EXPECT_EQ(c.text().find(" 100 "), std::string::npos) << c.text();
  }
  {
    Raw c(h.port());
    ASSERT_TRUE(c.send(head("HTTP/1.1", "expect-11")));
    for (const auto until = Clock::now() + 5s;
         c.text().find("\r\n\r\n") == std::string::npos && Clock::now() < until;) {
      c.poll_read(50ms);
    }
    EXPECT_EQ(c.text().rfind("HTTP/1.1 100 Continue\r\n", 0), 0u) << c.text();
    ASSERT_TRUE(c.send(body));
    for (const auto until = Clock::now() + 5s;
         c.text().find("HTTP/1.1 201 ") == std::string::npos && Clock::now() < until;) {
      c.poll_read(50ms);
    }
    EXPECT_NE(c.text().find("HTTP/1.1 201 "), std::string::npos) << c.text();
  }
  EXPECT_EQ(h.rows(), 2);
}

TEST_F(BeastServer, AClientThatGoesAwayAbandonsItsRequestAndNothingCommits) {
  Harness& h = start();
  {
    Raw c(h.port());
    ASSERT_TRUE(
        c.send("POST /v1/observed HTTP/1.1\r\nHost: x\r\nIdempotency-Key: gone\r\n"
               "Content-Type: text/plain\r\nContent-Length: 4\r\n\r\nslow"));
    h.wait_slow_started();
    EXPECT_FALSE(h.observed().is_abandoned());
  }  // the client closes its connection while the handler runs
  const auto until = Clock::now() + 5s;
  while (!h.observed().is_abandoned() && Clock::now() < until) std::this_thread::sleep_for(5ms);
  EXPECT_TRUE(h.observed().is_abandoned()) << "the server never saw the client go away";
  EXPECT_EQ(h.server().connections(), 0u);
  h.release_slow();
  // The handler's insert is rolled back: the flow checks the flag before it commits.
  EXPECT_EQ(h.outcome(1), IdempotencyOutcome::kDeadlineExceeded);
  EXPECT_EQ(h.handled(), 1);
  EXPECT_EQ(h.rows(), 0);
  // A pipelined request behind a slow one is not mistaken for the client going away.
  Raw c(h.port());
  ASSERT_TRUE(c.send(post("kept", "x") + std::string(kHealthz)));
  EXPECT_EQ(c.answers(2).size(), 2u) << c.text();
  EXPECT_EQ(h.rows(), 1);
}

TEST_F(BeastServer, StopReturnsWithinTheDrainWhileAWorkerIsBlockedAndNothingCommits) {
  Harness& h = start({.drain_timeout = 300ms});
  Raw busy(h.port());
  ASSERT_TRUE(busy.send(post("blocked", "slow")));
  h.wait_slow_started();
  const auto began = Clock::now();
  h.server().stop();
  const auto took = Clock::now() - began;
  EXPECT_GE(took, 300ms);
  EXPECT_LT(took, bound(300ms + kStopGrace + 250ms, 5000ms));
  EXPECT_EQ(h.server().stranded_workers(), 1u);
  EXPECT_TRUE(busy.wait_closed(5s));
  EXPECT_TRUE(busy.text().empty()) << busy.text();
  // The worker goes on once its handler returns; the flow sees its request abandoned and rolls
  // the insert back.
  h.release_slow();
  const auto until = Clock::now() + 5s;
  while (h.server().stranded_workers() > 0 && Clock::now() < until) {
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_EQ(h.server().stranded_workers(), 0u);
  EXPECT_EQ(h.outcome(1), IdempotencyOutcome::kDeadlineExceeded);
  EXPECT_EQ(h.handled(), 1);
  EXPECT_EQ(h.rows(), 0);
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
  EXPECT_THROW(Server({.first_byte_timeout = 0ms}), std::invalid_argument);
  EXPECT_THROW(Server({.header_timeout = 0ms}), std::invalid_argument);
  EXPECT_THROW(Server({.reserved_descriptors = 15}), std::invalid_argument);
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
  EXPECT_TRUE(answers[3].has("Allow: GET, HEAD\r\n")) << answers[3].head;
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

namespace keel::store::beast {
namespace {

/// A probe that blocks until opened, shared with the check's threads (one may outlive the test's
/// scope until it returns).
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;  // guarded by mu
  int probes = 0;     // guarded by mu
  int returned = 0;   // guarded by mu
  bool fail = false;  // guarded by mu

  static std::function<void(Connection&)> probe(std::shared_ptr<Gate> gate) {
    return [self = std::move(gate)](Connection& c) {
      std::unique_lock lock(self->mu);
      ++self->probes;
      self->cv.notify_all();
      self->cv.wait(lock, [self] { return self->open; });
      const bool failing = self->fail;
      ++self->returned;
      self->cv.notify_all();
      if (failing) throw std::runtime_error("the database refused");
      (void)c.query("SELECT 1");
    };
  }
  void release() {
    std::lock_guard lock(mu);
    open = true;
    cv.notify_all();
  }
  bool wait_returned(int n) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, 10s, [&] { return returned >= n; });
  }
};

/// One check: its result and how long it took.
std::future<std::pair<HealthResult, Clock::duration>> ask(HealthCheck& health) {
  auto answered = std::make_shared<std::promise<std::pair<HealthResult, Clock::duration>>>();
  auto result = answered->get_future();
  const auto asked = Clock::now();
  health.check([answered, asked](const HealthResult& r) {
    answered->set_value({r, Clock::now() - asked});
  });
  return result;
}

DatabaseUrl sqlite_url(const test::TempDir& dir) {
  return parse_database_url("sqlite:" + (dir.path() / "health.sqlite").string()).value();
}

TEST(BeastHealthCheck, AnswersWithinItsTimeoutWhileTheProbeHangsThenHealthyOnceItReturns) {
  test::TempDir dir;
  auto gate = std::make_shared<Gate>();
  HealthCheck health({.url = sqlite_url(dir), .timeout = 200ms, .probe = Gate::probe(gate)});
  // Three checks at once while the probe hangs: each answered timed out after 200 ms, and they
  // cost one probe between them.
  std::vector<std::future<std::pair<HealthResult, Clock::duration>>> checks;
  for (int i = 0; i < 3; ++i) checks.push_back(ask(health));
  for (auto& check : checks) {
    const auto [result, took] = check.get();
    EXPECT_EQ(result.health, Health::kTimedOut) << to_string(result.health);
    EXPECT_FALSE(result.error.empty());
    EXPECT_GE(took, 190ms);
    EXPECT_LT(took, bound(400ms, 5000ms));
  }
  // Another check while the same probe still hangs: no second probe, timed out again.
  EXPECT_EQ(ask(health).get().first.health, Health::kTimedOut);
  {
    std::lock_guard lock(gate->mu);
    EXPECT_EQ(gate->probes, 1);
  }
  // Once the database answers again, so does the check.
  gate->release();
  ASSERT_TRUE(gate->wait_returned(1));
  const auto [healthy, took] = ask(health).get();
  EXPECT_TRUE(healthy.healthy()) << healthy.error;
  EXPECT_LT(took, bound(200ms, 5000ms));
  {
    std::lock_guard lock(gate->mu);
    gate->fail = true;
  }
  const HealthResult failed = ask(health).get().first;
  EXPECT_EQ(failed.health, Health::kUnavailable);
  EXPECT_EQ(failed.error, "the database refused");
}

TEST(BeastHealthCheck, TheDefaultProbeAnswersOnItsOwnConnectionWhileAWriterHoldsTheDatabase) {
  test::TempDir dir;
  const DatabaseUrl url = sqlite_url(dir);
  auto writer = open_database(url);
  writer->execute("CREATE TABLE t (x INTEGER)");
  writer->begin();  // BEGIN IMMEDIATE: the write lock, held
  (void)writer->query("INSERT INTO t VALUES (1)");
  HealthCheck health({.url = url, .timeout = 500ms});
  const auto [result, took] = ask(health).get();
  EXPECT_TRUE(result.healthy()) << result.error;
  EXPECT_LT(took, bound(500ms, 5000ms));
  writer->rollback();
}

TEST(BeastHealthCheck, DestroyedWhileTheProbeHangsItReturnsAndAnswersTheWaitingChecks) {
  test::TempDir dir;
  auto gate = std::make_shared<Gate>();
  std::future<std::pair<HealthResult, Clock::duration>> waiting;
  const auto began = Clock::now();
  {
    HealthCheck health({.url = sqlite_url(dir), .timeout = 60000ms, .probe = Gate::probe(gate)});
    waiting = ask(health);
    const auto until = Clock::now() + 5s;
    for (bool probing = false; !probing && Clock::now() < until;) {
      std::lock_guard lock(gate->mu);
      probing = gate->probes == 1;
    }
  }
  EXPECT_LT(Clock::now() - began, bound(500ms, 5000ms));
  EXPECT_EQ(waiting.get().first.health, Health::kUnavailable);
  gate->release();  // the probe left behind returns, then its thread ends and lets go of it
  EXPECT_TRUE(gate->wait_returned(1));
  const auto until = Clock::now() + 5s;
  while (gate.use_count() > 1 && Clock::now() < until) std::this_thread::sleep_for(5ms);
  EXPECT_EQ(gate.use_count(), 1);
}

TEST(BeastHealthCheck, InvalidOptionsAreRejectedNamingTheField) {
  test::TempDir dir;
  try {
    const HealthCheck health({.url = sqlite_url(dir), .timeout = 0ms});
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("timeout"), std::string::npos) << e.what();
  }
  EXPECT_THROW(HealthCheck({}), std::invalid_argument);
}

}  // namespace
}  // namespace keel::store::beast
