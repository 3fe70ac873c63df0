// Hedged requests through both HTTP clients over loopback: the blocking keel::http::Client (a
// curl multi handle per hedged operation) and keel::asio::HttpClient (the round's attempts as
// coroutines on one loop). The upstream answers by the request's Keel-Attempt, not by arrival
// order (a hedge can reach it first on a busy machine): typically attempt 1 hangs and the hedge
// answers at once. What it saw (Keel-Attempt, Idempotency-Key, bodies) proves what the client
// sent. Timing assertions are lower bounds, plus an upper bound far below the hung attempt's
// timeout.
#include <gtest/gtest.h>
#include <httplib.h>

#include <algorithm>
#include <asio/bind_cancellation_slot.hpp>
#include <asio/cancellation_signal.hpp>
#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>
#include <asio/steady_timer.hpp>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "asio_waiting.hpp"
#include "http_drivers.hpp"
#include "keel/asio/http_client.hpp"
#include "keel/core/breaker.hpp"
#include "keel/core/budget.hpp"
#include "keel/core/hedge.hpp"
#include "keel/http/client.hpp"

namespace {

using keel::test::when;

using keel::StopReason;
using keel::http::ClientOptions;
using keel::http::Request;
using keel::http::Result;
using std::chrono::milliseconds;
using std::chrono::seconds;

ClientOptions hedged(milliseconds delay, int max_hedges = 1) {
  ClientOptions o;
  o.retry.max_attempts = 2;
  o.retry.per_try_timeout = seconds(10);
  o.retry.overall_timeout = seconds(20);
  o.retry.backoff = {.base = milliseconds(1), .cap = milliseconds(5)};
  o.observability.log = [](std::string_view) {};
  o.hedge = keel::HedgeOptions{.delay = delay, .max_hedges = max_hedges};
  return o;
}

// An HTTP server on 127.0.0.1 (cpp-httplib, a thread per connection) that answers each request
// by its Keel-Attempt: hang until the server is destroyed; or wait until release() (at most 5 s,
// then answer all the same), or `delay`, and answer `status` with `body`. Records what it saw.
class AttemptServer {
 public:
  struct Answer {
    bool hang = false;
    bool held = false;  // answered once the test calls release()
    keel::Duration delay{};
    int status = 200;
    std::string body = "ok";
  };
  struct Seen {
    std::string attempt;  // Keel-Attempt
    std::string key;      // Idempotency-Key
    std::string body;
  };

  explicit AttemptServer(Answer otherwise, std::map<int, Answer> by_attempt = {})
      : otherwise_(std::move(otherwise)), by_attempt_(std::move(by_attempt)) {
    const auto handle = [this](const httplib::Request& req, httplib::Response& res) {
      const std::string attempt = req.get_header_value("Keel-Attempt");
      {
        std::lock_guard<std::mutex> lock(mutex_);
        seen_.push_back({attempt, req.get_header_value("Idempotency-Key"), req.body});
      }
      arrived_.notify_all();
      const auto found = by_attempt_.find(std::atoi(attempt.c_str()));
      const Answer& a = found != by_attempt_.end() ? found->second : otherwise_;
      std::unique_lock<std::mutex> lock(mutex_);
      if (a.hang) {
        released_.wait_for(lock, seconds(20), [this] { return stopping_; });
        return;  // the client has long gone
      }
      if (a.held) {
        released_.wait_for(lock, seconds(5), [this] { return stopping_ || release_; });
      }
      released_.wait_for(lock, a.delay, [this] { return stopping_; });
      res.status = a.status;
      res.set_content(a.body, "text/plain");
    };
    server_.Get(".*", handle);
    server_.Post(".*", handle);
    // A thread for every connection a test here can open (cpp-httplib's default is 8). A handler
    // keeps its thread until its answer is due, after the client has dropped the connection, and
    // an idle keep-alive connection keeps one too: with too few, a hedge's new connection would
    // wait for a thread until an earlier attempt's delay ran out.
    server_.new_task_queue = [] { return new httplib::ThreadPool(32); };
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
  }
  ~AttemptServer() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    released_.notify_all();
    server_.stop();
    thread_.join();
  }
  AttemptServer(const AttemptServer&) = delete;
  AttemptServer& operator=(const AttemptServer&) = delete;

  [[nodiscard]] std::string url(const std::string& path = "/") const {
    return "http://127.0.0.1:" + std::to_string(port_) + path;
  }
  [[nodiscard]] std::vector<Seen> seen() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return seen_;
  }
  // What it saw once it has seen at least `n` requests, or after 5 s. Each connection has its
  // own server thread, which records a request once it has read it: when the client returns
  // after another attempt won, the thread of one that never got an answer may not have got
  // that far yet.
  [[nodiscard]] std::vector<Seen> seen_at_least(std::size_t n) const {
    std::unique_lock<std::mutex> lock(mutex_);
    arrived_.wait_for(lock, seconds(5), [&] { return seen_.size() >= n; });
    return seen_;
  }
  // The Keel-Attempt values seen (once there are at least `n`, or after 5 s), sorted.
  [[nodiscard]] std::vector<std::string> attempts(std::size_t n = 0) const {
    std::vector<std::string> out;
    for (const Seen& s : seen_at_least(n)) out.push_back(s.attempt);
    std::sort(out.begin(), out.end());
    return out;
  }
  // Lets the held answers go.
  void release() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      release_ = true;
    }
    released_.notify_all();
  }

 private:
  Answer otherwise_;
  std::map<int, Answer> by_attempt_;
  httplib::Server server_;
  int port_ = 0;
  std::thread thread_;
  mutable std::mutex mutex_;
  std::condition_variable released_;
  mutable std::condition_variable arrived_;
  bool stopping_ = false;   // GUARDED_BY(mutex_)
  bool release_ = false;    // GUARDED_BY(mutex_)
  std::vector<Seen> seen_;  // GUARDED_BY(mutex_)
};

const AttemptServer::Answer kHang{.hang = true};

template <class Driver>
class HttpHedging : public ::testing::Test {};

TYPED_TEST_SUITE(HttpHedging, keel::test::HttpDrivers, keel::test::HttpDriverNames);

TYPED_TEST(HttpHedging, AHedgeAnswersWhileTheFirstAttemptHangs) {
  AttemptServer server({.body = "fast"}, {{1, kHang}});
  std::vector<keel::http::AttemptEvent> events;
  ClientOptions o = hedged(milliseconds(100));
  o.observability.on_attempt = [&](const keel::http::AttemptEvent& e) { events.push_back(e); };
  TypeParam client(o);
  const Result r = client.send({.method = "GET", .url = server.url("/slow")});
  EXPECT_TRUE(r.ok()) << r.error;
  ASSERT_TRUE(r.response.has_value());
  EXPECT_EQ(r.response->body, "fast");
  EXPECT_EQ(r.attempts, 2);
  EXPECT_GE(r.elapsed, milliseconds(100));
  EXPECT_LT(r.elapsed, seconds(5));  // not the hung attempt's 10 s timeout
  EXPECT_EQ(server.attempts(2), (std::vector<std::string>{"1", "2"}));
  // The winner is reported; the cancelled attempt is not.
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].attempt, 2);
  EXPECT_EQ(events[0].reason, StopReason::kSuccess);
}

TYPED_TEST(HttpHedging, APostWithItsKeyIsHedgedWithTheSameKey) {
  AttemptServer server({.status = 201}, {{1, kHang}});
  TypeParam client(hedged(milliseconds(50)));
  const Result r = client.send(
      {.method = "POST", .url = server.url("/pay"), .body = "amount=5", .idempotency_key = "k-1"});
  EXPECT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(r.idempotency_key, "k-1");
  const auto seen = server.seen_at_least(2);
  ASSERT_EQ(seen.size(), 2u);
  for (const auto& s : seen) {
    EXPECT_EQ(s.key, "k-1");
    EXPECT_EQ(s.body, "amount=5");
  }
}

TYPED_TEST(HttpHedging, APostWithoutAKeyIsNeverHedged) {
  AttemptServer server({.delay = milliseconds(300)});
  TypeParam client(hedged(milliseconds(20)));
  const Result r = client.send({.method = "POST",
                                .url = server.url("/pay"),
                                .body = "x",
                                .generate_idempotency_key = false});
  EXPECT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(r.attempts, 1);
  EXPECT_EQ(server.attempts(), (std::vector<std::string>{"1"}));
}

TYPED_TEST(HttpHedging, WithAnEmptyBudgetNoHedgeIsSentAndTheCallWaits) {
  AttemptServer server({.delay = milliseconds(300), .body = "slow"});
  keel::TokenBucketBudget empty({.capacity = 4, .retry_cost = 5});  // never one retry's worth
  ClientOptions o = hedged(milliseconds(20));
  o.brakes.budget = &empty;
  TypeParam client(o);
  const Result r = client.send({.method = "GET", .url = server.url("/")});
  EXPECT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(r.response->body, "slow");
  EXPECT_EQ(r.attempts, 1);
  EXPECT_GE(r.elapsed, milliseconds(300));
  EXPECT_EQ(server.attempts(), (std::vector<std::string>{"1"}));
}

TYPED_TEST(HttpHedging, EachHedgeIsChargedToTheBudget) {
  AttemptServer server({}, {{1, kHang}});
  keel::TokenBucketBudget budget({.capacity = 100, .retry_cost = 5, .success_refund = 0});
  ClientOptions o = hedged(milliseconds(30));
  o.brakes.budget = &budget;
  TypeParam client(o);
  EXPECT_TRUE(client.send({.method = "GET", .url = server.url("/")}).ok());
  EXPECT_EQ(budget.tokens(), 95);  // the hedge was sent: its cost stays
}

TYPED_TEST(HttpHedging, UpToMaxHedgesGoOneDelayApart) {
  AttemptServer server({.body = "third"}, {{1, kHang}, {2, kHang}});
  TypeParam client(hedged(milliseconds(50), 2));
  const Result r = client.send({.method = "GET", .url = server.url("/")});
  EXPECT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(r.response->body, "third");
  EXPECT_EQ(r.attempts, 3);
  EXPECT_GE(r.elapsed, milliseconds(100));
  EXPECT_EQ(server.attempts(3), (std::vector<std::string>{"1", "2", "3"}));
}

TYPED_TEST(HttpHedging, TheBreakerSeesTheWinnerAndNotTheCancelledAttempt) {
  AttemptServer server({}, {{1, kHang}});
  keel::BreakerRegistry breakers;
  ClientOptions o = hedged(milliseconds(30));
  o.brakes.breakers = &breakers;
  TypeParam client(o);
  EXPECT_TRUE(client.send({.method = "GET", .url = server.url("/")}).ok());
  const auto breaker = breakers.find(keel::http::breaker_key(server.url("/")).value());
  ASSERT_NE(breaker, nullptr);
  EXPECT_EQ(breaker->snapshot().calls, 1);
  EXPECT_EQ(breaker->snapshot().failures, 0);
}

TYPED_TEST(HttpHedging, AFailedHedgeWaitsForTheAttemptInFlight) {
  // Attempt 1 is answered once the client has taken the hedge's 503 (on_attempt reports it), so
  // the hedge has failed while attempt 1 is in flight however long its new connection took.
  AttemptServer server({.status = 503}, {{1, {.held = true, .body = "first"}}});
  keel::BreakerRegistry breakers;
  ClientOptions o = hedged(milliseconds(50));
  o.brakes.breakers = &breakers;
  o.observability.on_attempt = [&](const keel::http::AttemptEvent& e) {
    if (e.attempt == 2) server.release();
  };
  TypeParam client(o);
  const Result r = client.send({.method = "GET", .url = server.url("/")});
  EXPECT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(r.response->body, "first");
  EXPECT_EQ(r.attempts, 2);
  EXPECT_EQ(server.attempts(), (std::vector<std::string>{"1", "2"}));
  const auto breaker = breakers.find(keel::http::breaker_key(server.url("/")).value());
  EXPECT_EQ(breaker->snapshot().calls, 2);
  EXPECT_EQ(breaker->snapshot().failures, 1);
}

TYPED_TEST(HttpHedging, OnlyTheWinnersBodyReachesTheSink) {
  // The hedge, sent at 50 ms on a connection of its own, wins when it is answered before attempt
  // 1 is, at 3 s (the per-try timeout is 10 s). Destroying the server ends that wait early.
  AttemptServer server({.body = "fast"}, {{1, {.delay = seconds(3), .body = "slow"}}});
  std::string sunk;
  int restarts = 0;
  Request request{.method = "GET", .url = server.url("/")};
  request.body_sink.restart = [&] {
    ++restarts;
    sunk.clear();
    return true;
  };
  request.body_sink.write = [&](std::string_view data) {
    sunk.append(data);
    return true;
  };
  TypeParam client(hedged(milliseconds(50)));
  const Result r = client.send(request);
  EXPECT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(sunk, "fast");
  EXPECT_EQ(restarts, 1);
  EXPECT_TRUE(r.response->body.empty());
}

TEST(HttpHedgingBlocking, OneLayerDownDoesNotHedge) {
  AttemptServer server({.delay = milliseconds(200)});
  keel::http::Client client(hedged(milliseconds(20)));
  const keel::RetryScope outer;  // an enclosing keel retry loop on this thread
  const Result r = client.send({.method = "GET", .url = server.url("/")});
  EXPECT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(server.attempts(), (std::vector<std::string>{"1"}));
}

TEST(HttpHedgingBlocking, ThreadsShareTheClientsHedgedOperations) {
  // Each hedge, sent at 20 ms, wins when it is answered before its attempt 1 is, at 3 s (the
  // per-try timeout is 10 s). Destroying the server ends the cancelled attempts' waits.
  AttemptServer server({}, {{1, {.delay = seconds(3)}}});
  keel::http::Client client(hedged(milliseconds(20)));
  constexpr int kThreads = 4;
  constexpr int kEach = 3;
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kEach; ++i) {
        const Result r = client.send({.method = "GET", .url = server.url("/")});
        if (r.ok() && r.attempts == 2) ok.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), kThreads * kEach);
}

TEST(HttpHedgingAsync, OneLayerDownInTheSameContextDoesNotHedge) {
  AttemptServer server({.delay = milliseconds(200)});
  ::asio::io_context io;
  keel::asio::HttpClient client(io.get_executor(), hedged(milliseconds(20)));
  keel::RetryContext context;
  context.enter();  // an enclosing asynchronous retry loop
  std::optional<Result> out;
  ::asio::co_spawn(io, client.send({.method = "GET", .url = server.url("/")}, &context),
                   [&](std::exception_ptr, Result r) { out = std::move(r); });
  io.run_for(seconds(10));
  context.leave();
  ASSERT_TRUE(out.has_value());
  EXPECT_TRUE(out->ok()) << out->error;
  EXPECT_EQ(server.attempts(), (std::vector<std::string>{"1"}));
}

TEST(HttpHedgingAsync, CancellingAHedgedOperationStopsEveryAttempt) {
  AttemptServer server(kHang);
  ::asio::io_context io;
  keel::asio::HttpClient client(io.get_executor(), hedged(milliseconds(20)));
  ::asio::cancellation_signal cancel;
  std::optional<Result> out;
  ::asio::co_spawn(io, client.send({.method = "GET", .url = server.url("/")}),
                   ::asio::bind_cancellation_slot(
                       cancel.slot(), [&](std::exception_ptr, Result r) { out = std::move(r); }));
  // Cancelled once the server holds both requests (it answers neither): attempt 1 and the hedge.
  ::asio::steady_timer poll(io);
  when(
      poll, [&] { return server.seen().size() >= 2; },
      [&] {
        EXPECT_EQ(client.transfers_in_flight(), 2u);
        cancel.emit(::asio::cancellation_type::terminal);
      });
  io.run_for(seconds(20));
  ASSERT_TRUE(out.has_value());
  EXPECT_EQ(out->reason, StopReason::kCancelled);
  EXPECT_EQ(out->attempts, 2);
  EXPECT_EQ(client.transfers_in_flight(), 0u);
}

}  // namespace
