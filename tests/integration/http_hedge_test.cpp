// Hedged requests through both HTTP clients over loopback: the blocking keel::http::Client (a
// curl multi handle per hedged operation) and keel::asio::HttpClient (the round's attempts as
// coroutines on one loop), against a keel::testing::FaultServer whose first request hangs and
// whose next answers at once. What the server saw (arrivals, Keel-Attempt, Idempotency-Key)
// proves what the client sent. Timing assertions are lower bounds, plus an upper bound far
// below the hung attempt's timeout.
#include <gtest/gtest.h>

#include <asio/bind_cancellation_slot.hpp>
#include <asio/cancellation_signal.hpp>
#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>
#include <asio/steady_timer.hpp>
#include <chrono>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "keel/asio/http_client.hpp"
#include "keel/breaker.hpp"
#include "keel/budget.hpp"
#include "keel/hedge.hpp"
#include "keel/http/client.hpp"
#include "keel/testing/fault_server.hpp"

namespace {

using keel::StopReason;
using keel::http::ClientOptions;
using keel::http::Request;
using keel::http::Result;
using keel::testing::Arrival;
using keel::testing::FaultServer;
using std::chrono::milliseconds;
using std::chrono::seconds;

ClientOptions hedged(milliseconds delay, int max_hedges = 1) {
  ClientOptions o;
  o.retry.max_attempts = 2;
  o.retry.per_try_timeout = seconds(10);
  o.retry.overall_timeout = seconds(20);
  o.retry.backoff = {.base = milliseconds(1), .cap = milliseconds(5)};
  o.log = [](std::string_view) {};
  o.hedge = keel::HedgeOptions{.delay = delay, .max_hedges = max_hedges};
  return o;
}

class BlockingDriver {
 public:
  static constexpr const char* kName = "blocking";
  explicit BlockingDriver(ClientOptions o) : client_(std::move(o)) {}
  Result send(const Request& r) { return client_.send(r); }

 private:
  keel::http::Client client_;
};

class AsyncDriver {
 public:
  static constexpr const char* kName = "async";
  explicit AsyncDriver(ClientOptions o) : client_(io_.get_executor(), std::move(o)) {}
  Result send(const Request& r) {
    std::optional<Result> out;
    std::exception_ptr error;
    ::asio::co_spawn(io_, client_.send(r), [&](std::exception_ptr e, Result v) {
      error = e;
      if (!e) out = std::move(v);
    });
    io_.restart();
    io_.run_for(seconds(30));
    if (error) std::rethrow_exception(error);
    EXPECT_TRUE(out.has_value()) << "the operation did not complete";
    EXPECT_EQ(client_.transfers_in_flight(), 0u);
    return out.value_or(Result{});
  }

 private:
  ::asio::io_context io_;
  keel::asio::HttpClient client_;
};

std::string header(const Arrival& a, std::string_view name) {
  auto v = keel::http::find_header(a.headers, name);
  return v ? std::string(*v) : std::string();
}

template <class Driver>
class HttpHedging : public ::testing::Test {};

struct DriverNames {
  template <class T>
  static std::string GetName(int) {
    return T::kName;
  }
};
using Drivers = ::testing::Types<BlockingDriver, AsyncDriver>;
TYPED_TEST_SUITE(HttpHedging, Drivers, DriverNames);

TYPED_TEST(HttpHedging, AHedgeAnswersWhileTheFirstAttemptHangs) {
  FaultServer server({.script = "hang,200/body=fast"});
  server.start();
  std::vector<keel::http::AttemptEvent> events;
  ClientOptions o = hedged(milliseconds(100));
  o.on_attempt = [&](const keel::http::AttemptEvent& e) { events.push_back(e); };
  TypeParam client(o);
  const Result r = client.send({.method = "GET", .url = server.url("/slow")});
  EXPECT_TRUE(r.ok()) << r.error;
  ASSERT_TRUE(r.response.has_value());
  EXPECT_EQ(r.response->body, "fast\n");
  EXPECT_EQ(r.attempts, 2);
  EXPECT_GE(r.elapsed, milliseconds(100));
  EXPECT_LT(r.elapsed, seconds(5));  // not the hung attempt's 10 s timeout
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 2u);
  EXPECT_EQ(header(arrivals[0], "Keel-Attempt"), "1");
  EXPECT_EQ(header(arrivals[1], "Keel-Attempt"), "2");
  EXPECT_GE(arrivals[1].at - arrivals[0].at, milliseconds(50));
  // The winner is reported; the cancelled attempt is not.
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].attempt, 2);
  EXPECT_EQ(events[0].reason, StopReason::kSuccess);
}

TYPED_TEST(HttpHedging, APostWithItsKeyIsHedgedWithTheSameKey) {
  FaultServer server({.script = "hang,201"});
  server.start();
  TypeParam client(hedged(milliseconds(50)));
  const Result r = client.send(
      {.method = "POST", .url = server.url("/pay"), .body = "amount=5", .idempotency_key = "k-1"});
  EXPECT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(r.idempotency_key, "k-1");
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 2u);
  EXPECT_EQ(header(arrivals[0], "Idempotency-Key"), "k-1");
  EXPECT_EQ(header(arrivals[1], "Idempotency-Key"), "k-1");
  EXPECT_EQ(arrivals[1].body, "amount=5");
}

TYPED_TEST(HttpHedging, APostWithoutAKeyIsNeverHedged) {
  FaultServer server({.script = "200/delay=300ms"});
  server.start();
  TypeParam client(hedged(milliseconds(20)));
  const Result r = client.send({.method = "POST",
                                .url = server.url("/pay"),
                                .body = "x",
                                .generate_idempotency_key = false});
  EXPECT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(r.attempts, 1);
  EXPECT_EQ(server.arrivals().size(), 1u);
}

TYPED_TEST(HttpHedging, WithAnEmptyBudgetNoHedgeIsSentAndTheCallWaits) {
  FaultServer server({.script = "200/delay=300ms/body=slow"});
  server.start();
  keel::TokenBucketBudget empty({.capacity = 4, .retry_cost = 5});  // never one retry's worth
  ClientOptions o = hedged(milliseconds(20));
  o.budget = &empty;
  TypeParam client(o);
  const Result r = client.send({.method = "GET", .url = server.url("/")});
  EXPECT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(r.response->body, "slow\n");
  EXPECT_EQ(r.attempts, 1);
  EXPECT_GE(r.elapsed, milliseconds(300));
  EXPECT_EQ(server.arrivals().size(), 1u);
}

TYPED_TEST(HttpHedging, EachHedgeIsChargedToTheBudget) {
  FaultServer server({.script = "hang,200"});
  server.start();
  keel::TokenBucketBudget budget({.capacity = 100, .retry_cost = 5, .success_refund = 0});
  ClientOptions o = hedged(milliseconds(30));
  o.budget = &budget;
  TypeParam client(o);
  EXPECT_TRUE(client.send({.method = "GET", .url = server.url("/")}).ok());
  EXPECT_EQ(budget.tokens(), 95);  // the hedge was sent: its cost stays
}

TYPED_TEST(HttpHedging, UpToMaxHedgesGoOneDelayApart) {
  FaultServer server({.script = "hang,hang,200/body=third"});
  server.start();
  TypeParam client(hedged(milliseconds(50), 2));
  const Result r = client.send({.method = "GET", .url = server.url("/")});
  EXPECT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(r.response->body, "third\n");
  EXPECT_EQ(r.attempts, 3);
  EXPECT_GE(r.elapsed, milliseconds(100));
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 3u);
  EXPECT_EQ(header(arrivals[2], "Keel-Attempt"), "3");
}

TYPED_TEST(HttpHedging, TheBreakerSeesTheWinnerAndNotTheCancelledAttempt) {
  FaultServer server({.script = "hang,200"});
  server.start();
  keel::BreakerRegistry breakers;
  ClientOptions o = hedged(milliseconds(30));
  o.breakers = &breakers;
  TypeParam client(o);
  EXPECT_TRUE(client.send({.method = "GET", .url = server.url("/")}).ok());
  const auto breaker = breakers.find(keel::http::breaker_key(server.url("/")).value());
  ASSERT_NE(breaker, nullptr);
  EXPECT_EQ(breaker->snapshot().calls, 1);
  EXPECT_EQ(breaker->snapshot().failures, 0);
}

TYPED_TEST(HttpHedging, AFailedHedgeWaitsForTheAttemptInFlight) {
  FaultServer server({.script = "200/delay=300ms/body=first,503"});
  server.start();
  keel::BreakerRegistry breakers;
  ClientOptions o = hedged(milliseconds(50));
  o.breakers = &breakers;
  TypeParam client(o);
  const Result r = client.send({.method = "GET", .url = server.url("/")});
  EXPECT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(r.response->body, "first\n");
  EXPECT_EQ(r.attempts, 2);
  EXPECT_EQ(server.arrivals().size(), 2u);
  const auto breaker = breakers.find(keel::http::breaker_key(server.url("/")).value());
  EXPECT_EQ(breaker->snapshot().calls, 2);
  EXPECT_EQ(breaker->snapshot().failures, 1);
}

TYPED_TEST(HttpHedging, OnlyTheWinnersBodyReachesTheSink) {
  FaultServer server({.script = "200/delay=400ms/body=slow,200/body=fast"});
  server.start();
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
  EXPECT_EQ(sunk, "fast\n");
  EXPECT_EQ(restarts, 1);
  EXPECT_TRUE(r.response->body.empty());
}

TEST(HttpHedgingBlocking, OneLayerDownDoesNotHedge) {
  FaultServer server({.script = "200/delay=200ms"});
  server.start();
  keel::http::Client client(hedged(milliseconds(20)));
  const keel::RetryScope outer;  // an enclosing keel retry loop on this thread
  const Result r = client.send({.method = "GET", .url = server.url("/")});
  EXPECT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(server.arrivals().size(), 1u);
}

TEST(HttpHedgingAsync, OneLayerDownInTheSameContextDoesNotHedge) {
  FaultServer server({.script = "200/delay=200ms"});
  server.start();
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
  EXPECT_EQ(server.arrivals().size(), 1u);
}

TEST(HttpHedgingAsync, CancellingAHedgedOperationStopsEveryAttempt) {
  FaultServer server({.script = "hang"});
  server.start();
  ::asio::io_context io;
  keel::asio::HttpClient client(io.get_executor(), hedged(milliseconds(20)));
  ::asio::cancellation_signal cancel;
  std::optional<Result> out;
  ::asio::co_spawn(io, client.send({.method = "GET", .url = server.url("/")}),
                   ::asio::bind_cancellation_slot(
                       cancel.slot(), [&](std::exception_ptr, Result r) { out = std::move(r); }));
  ::asio::steady_timer timer(io, milliseconds(150));
  timer.async_wait([&](std::error_code) {
    EXPECT_EQ(client.transfers_in_flight(), 2u);
    cancel.emit(::asio::cancellation_type::terminal);
  });
  io.run_for(seconds(10));
  ASSERT_TRUE(out.has_value());
  EXPECT_EQ(out->reason, StopReason::kCancelled);
  EXPECT_EQ(out->attempts, 2);
  EXPECT_EQ(client.transfers_in_flight(), 0u);
}

}  // namespace
