// The cases of keel::http::Client that the typed suite of both clients (http_clients_test.cpp) does
// not run, against keel::faults::FaultServer over real loopback connections: Retry-After capped
// by the policy as the attempt hook sees it, many threads on one client, its per-host breakers,
// breakers shared between clients or turned off, a budget handed in, breaker keys and
// configuration checks; three cases whose checks go beyond the typed suite's (a caller's key
// through a retry to success, an HTTP-date Retry-After waited a whole second, one connection
// over five requests); and FaultServer's own script parser and log.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "fast_options.hpp"
#include "keel/core/breaker.hpp"
#include "keel/core/budget.hpp"
#include "keel/faults/fault_server.hpp"
#include "keel/http/client.hpp"
#include "support/waiting.hpp"

namespace keel::http {
namespace {

using faults::Arrival;
using faults::FaultServer;
using faults::FaultStep;
using faults::parse_fault_script;
using std::chrono::milliseconds;
using std::chrono::seconds;

using keel::test::arrivals_at_least;
using keel::test::fast_options;

std::string header(const Arrival& a, std::string_view name) {
  auto v = find_header(a.headers, name);
  return v ? std::string(*v) : std::string();
}

TEST(HttpClient, CallerSuppliedKeyIsSentUnchanged) {
  FaultServer server({.script = "500,200"});
  server.start();
  Client client(fast_options());
  const Result r =
      client.send({.method = "POST", .url = server.url("/job"), .idempotency_key = "job-42"});
  EXPECT_TRUE(r.ok());
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 2u) << "a 500 is retried once when the POST carries a key";
  for (const Arrival& a : arrivals) EXPECT_EQ(header(a, "Idempotency-Key"), "job-42");
}

TEST(HttpClient, HonoursRetryAfterAsAnHttpDate) {
  // The date has whole-second resolution, so "2 s from now" means at least 1 s of waiting.
  FaultServer server({.script = "429/retry-after-date=2,200"});
  server.start();
  Client client(fast_options());
  const Result r = client.send({.url = server.url("/date")});
  EXPECT_TRUE(r.ok());
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 2u);
  EXPECT_GE(arrivals[1].at - arrivals[0].at, seconds(1));
}

TEST(HttpClient, ReusesOneConnectionAcrossAttemptsAndRequests) {
  FaultServer server({.script = "503,200"});
  server.start();
  Client client(fast_options());
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(client.send({.url = server.url("/")}).ok());
  EXPECT_EQ(server.arrivals().size(), 6u);
  EXPECT_EQ(server.connections(), 1);
}

TEST(HttpClient, RetryAfterCappedByThePolicy) {
  FaultServer server({.script = "503/retry-after=3600,200"});
  server.start();
  ClientOptions o = fast_options();
  o.retry.retry_after_cap = milliseconds(50);
  std::vector<Duration> delays;
  o.observability.on_attempt = [&](const AttemptEvent& e) {
    if (e.will_retry) delays.push_back(e.delay);
  };
  Client client(o);
  const Result r = client.send({.url = server.url("/")});
  EXPECT_TRUE(r.ok());
  ASSERT_EQ(delays.size(), 1u);
  EXPECT_EQ(delays[0], milliseconds(50));
}

TEST(HttpClient, ConcurrentRequestsFromManyThreads) {
  // Six failures stay under the default per-host breaker's trip rule (20 calls, 50%).
  FaultServer server({.script = "503*6,200"});
  server.start();
  Client client(fast_options(10));
  constexpr int kThreads = 4;
  constexpr int kPerThread = 20;
  std::atomic<int> ok{0};
  std::mutex keys_mutex;
  std::set<std::string> keys;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const bool post = (i % 2) == 0;
        const Result r = client.send(
            {.method = post ? "POST" : "GET", .url = server.url("/t" + std::to_string(t))});
        if (r.ok()) ok.fetch_add(1);
        if (post) {
          std::lock_guard<std::mutex> guard(keys_mutex);
          keys.insert(r.idempotency_key);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(ok.load(), kThreads * kPerThread);
  EXPECT_EQ(keys.size(), static_cast<std::size_t>(kThreads * kPerThread / 2));
  EXPECT_EQ(server.arrivals().size(), static_cast<std::size_t>(kThreads * kPerThread + 6));
  EXPECT_LE(server.connections(), kThreads * kPerThread) << "connections are reused";
}

TEST(HttpClient, PerHostBreakerOpensAndStopsCallsWithoutReachingTheHost) {
  FaultServer down({.script = "503"});
  FaultServer up({.script = "200"});
  down.start();
  up.start();
  ClientOptions o = fast_options(1);
  o.brakes.own_breakers.breaker = BreakerOptions::more_than_half_failed(seconds(30), 4);
  o.brakes.own_breakers.breaker.break_duration = seconds(60);
  Client client(o);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(client.send({.url = down.url("/")}).reason, StopReason::kAttemptsExhausted);
  }
  const Result refused = client.send({.url = down.url("/")});
  EXPECT_EQ(refused.reason, StopReason::kCircuitOpen);
  EXPECT_EQ(refused.attempts, 0);
  // Nothing was sent, so the outcome must not read as success (a job queue would mark the job
  // done): it is kNotAttempted, with the breaker's estimate of its next probe.
  EXPECT_EQ(refused.outcome.kind, keel::OutcomeKind::kNotAttempted);
  EXPECT_TRUE(refused.outcome.has_server_delay());
  EXPECT_FALSE(refused.response.has_value());
  EXPECT_EQ(down.arrivals().size(), 4u) << "an open breaker sends nothing";
  // Another host (another port) has its own breaker.
  EXPECT_TRUE(client.send({.url = up.url("/")}).ok());
  EXPECT_EQ(up.arrivals().size(), 1u);
}

TEST(HttpClient, BreakersCanBeSharedAndTurnedOff) {
  FaultServer down({.script = "503"});
  down.start();
  BreakerRegistry shared({.breaker = BreakerOptions::more_than_half_failed(seconds(30), 2)});
  ClientOptions o = fast_options(1);
  o.brakes.breakers = &shared;
  Client a(o);
  Client b(o);
  (void)a.send({.url = down.url("/")});
  (void)b.send({.url = down.url("/")});
  ASSERT_TRUE(shared.state(*breaker_key(down.url("/"))).has_value());
  EXPECT_EQ(*shared.state(*breaker_key(down.url("/"))), BreakerState::kOpen);
  EXPECT_EQ(a.send({.url = down.url("/")}).reason, StopReason::kCircuitOpen);
  ClientOptions off = fast_options(1);
  off.brakes.circuit_breakers = false;
  off.brakes.breakers = &shared;
  Client c(off);
  EXPECT_EQ(c.send({.url = down.url("/")}).reason, StopReason::kAttemptsExhausted);
  EXPECT_EQ(down.arrivals().size(), 3u);
}

TEST(HttpClient, RetryBudgetSharedByTheClientStopsRetries) {
  FaultServer server({.script = "503"});
  server.start();
  TokenBucketBudget budget({.capacity = 10, .retry_cost = 5});
  ClientOptions o = fast_options(5);
  o.brakes.budget = &budget;
  o.brakes.circuit_breakers = false;
  Client client(o);
  const Result first = client.send({.url = server.url("/")});
  EXPECT_EQ(first.reason, StopReason::kBudgetExhausted);
  EXPECT_EQ(first.attempts, 3) << "two retries of 5 tokens each fit in 10";
  const Result second = client.send({.url = server.url("/")});
  EXPECT_EQ(second.reason, StopReason::kBudgetExhausted);
  EXPECT_EQ(second.attempts, 1) << "the budget is shared by every request of the client";
  EXPECT_EQ(server.arrivals().size(), 4u);
}

TEST(HttpClient, BreakerKeyIsHostAndPort) {
  EXPECT_EQ(breaker_key("http://Example.COM/x"), "example.com:80");
  EXPECT_EQ(breaker_key("https://example.com/x"), "example.com:443");
  EXPECT_EQ(breaker_key("http://127.0.0.1:8080/"), "127.0.0.1:8080");
  EXPECT_EQ(breaker_key("http://user:pw@Host:81?q=1"), "host:81");
  EXPECT_EQ(breaker_key("http://[::1]:8080/x"), "[::1]:8080");
  EXPECT_EQ(breaker_key("HTTPS://[::1]/x"), "[::1]:443");
  EXPECT_FALSE(breaker_key("not a url").has_value());
  EXPECT_FALSE(breaker_key("http://host:port/").has_value());
  EXPECT_FALSE(breaker_key("http:///path").has_value());
  EXPECT_FALSE(breaker_key("ftp://host/").has_value());
}

TEST(HttpClient, RejectsInvalidConfigurationNamingTheField) {
  ClientOptions o;
  o.transport.connect_timeout = Duration::zero();
  try {
    Client client(o);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("connect_timeout"), std::string::npos);
  }
  ClientOptions bad_retry;
  bad_retry.retry.max_attempts = 0;
  EXPECT_THROW(Client{bad_retry}, std::invalid_argument);
}

TEST(IdempotencyKey, IsAVersion4UuidAndUnique) {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    const std::string k = make_idempotency_key();
    ASSERT_EQ(k.size(), 36u);
    EXPECT_EQ(k[14], '4');
    EXPECT_NE(std::string("89ab").find(k[19]), std::string::npos);
    seen.insert(k);
  }
  EXPECT_EQ(seen.size(), 1000u);
}

TEST(FaultScript, ParsesActionsModifiersAndRepeats) {
  auto steps = parse_fault_script(
      "503/retry-after=2*2, 429/retry-after-date=1, hang, reset, drop, "
      "200/delay=250ms/body=hi");
  ASSERT_TRUE(steps.has_value()) << steps.error().message();
  ASSERT_EQ(steps->size(), 7u);
  EXPECT_EQ((*steps)[0].status, 503);
  EXPECT_EQ((*steps)[1].retry_after_seconds, 2);
  EXPECT_TRUE((*steps)[2].retry_after_as_date);
  EXPECT_EQ((*steps)[3].action, FaultStep::Action::kHang);
  EXPECT_EQ((*steps)[4].action, FaultStep::Action::kReset);
  EXPECT_EQ((*steps)[5].action, FaultStep::Action::kDrop);
  EXPECT_EQ((*steps)[6].delay, milliseconds(250));
  EXPECT_EQ((*steps)[6].body, "hi");
}

TEST(FaultScript, RejectsBadStepsNamingThem) {
  for (const char* bad : {"", "ok", "99", "600", "503/retry-after=x", "200/delay=fast",
                          "200/colour=red", "503*0", "200,,200", "503/retry-after"}) {
    const auto steps = parse_fault_script(bad);
    ASSERT_FALSE(steps.has_value()) << bad;
    EXPECT_NE(steps.error().message().find("script"), std::string::npos) << bad;
  }
  EXPECT_THROW(FaultServer({.script = "nope"}), std::invalid_argument);
}

TEST(FaultServer, ReportsArrivalsAsJsonWithoutCountingControlRequests) {
  FaultServer server({.script = "200"});
  server.start();
  Client client(fast_options());
  ASSERT_TRUE(
      client.send({.method = "POST", .url = server.url("/a"), .idempotency_key = "k1"}).ok());
  const Result log = client.send({.url = server.url("/_keel/log")});
  ASSERT_TRUE(log.ok());
  EXPECT_NE(log.response->body.find("\"idempotency_key\":\"k1\""), std::string::npos)
      << log.response->body;
  EXPECT_NE(log.response->body.find("\"keel_attempt\":1"), std::string::npos);
  EXPECT_EQ(server.arrivals().size(), 1u);
}

}  // namespace
}  // namespace keel::http
