// keel::http::Client's limits on a host against keel::faults::FaultServer over loopback: what the
// server saw (arrival times) proves what the client did.
//   - A rate limit spaces the calls: 30 calls at 20/s arrive over about 1.4 s, never more than
//     rate + burst in a second.
//   - A 429 with Retry-After pauses the host: the next call waits for it (and its jitter) before
//     it is sent, and that 429 is handed to the engine as not attempted (no breaker failure).
//   - A call that may not wait that long stops with StopReason::kLimited: nothing sent, no
//     attempt spent, the wait as the outcome's server_delay.
//   - The adaptive concurrency limit bounds the calls in flight to one host.
// Timing bounds are lower bounds (waits at least this long), asserted in every build kind.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "fast_options.hpp"
#include "keel/core/rate_limit.hpp"
#include "keel/faults/fault_server.hpp"
#include "keel/http/client.hpp"

namespace keel::http {
namespace {

using faults::FaultServer;
using std::chrono::milliseconds;
using std::chrono::seconds;

using keel::test::fast_options;

TEST(HttpLimits, ARateLimitSpacesTheCallsToAHost) {
  FaultServer server({.script = "200"});
  server.start();
  RateLimitRegistry rates({.rate_per_s = 20, .burst = 2});
  ClientOptions o = fast_options(1);
  o.brakes.rate_limits = &rates;
  Client client(o);
  for (int i = 0; i < 30; ++i) ASSERT_TRUE(client.send({.url = server.url("/x")}).ok());
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 30u);
  // 3 at once (the burst), then one every 50 ms: 27 x 50 ms.
  EXPECT_GE(arrivals.back().at - arrivals.front().at, milliseconds(1300));
  int most = 0;
  for (std::size_t lo = 0, hi = 0; hi < arrivals.size(); ++hi) {
    while (arrivals[hi].at - arrivals[lo].at >= seconds(1)) ++lo;
    most = std::max(most, static_cast<int>(hi - lo + 1));
  }
  EXPECT_LE(most, 20 + 2 + 1);  // times as the server read them: one more for loopback jitter
  EXPECT_EQ(rates.find(*breaker_key(server.url("/x")))->stats().went, 30u);
}

TEST(HttpLimits, A429WithRetryAfterPausesTheHostAndIsNotAFailure) {
  FaultServer server({.script = "429/retry-after=1,200"});
  server.start();
  RateLimitRegistry rates({.release_spread = milliseconds(200)});  // no rate: pauses only
  BreakerRegistry breakers;
  ClientOptions o = fast_options(1);
  o.brakes.rate_limits = &rates;
  o.brakes.breakers = &breakers;
  Client client(o);
  const Result first = client.send({.url = server.url("/x")});
  EXPECT_EQ(first.reason, StopReason::kLimited);
  EXPECT_FALSE(first.outcome.attempted());  // the 429 asked for the pause: no failure
  EXPECT_EQ(first.outcome.server_delay, seconds(1));
  ASSERT_TRUE(first.response.has_value());
  EXPECT_EQ(first.response->status, 429);
  const auto breaker = breakers.find(*breaker_key(server.url("/x")));
  ASSERT_TRUE(breaker);
  EXPECT_EQ(breaker->snapshot().failures, 0);

  const Result second = client.send({.url = server.url("/x")});  // waits for the pause
  EXPECT_TRUE(second.ok()) << to_string(second.reason);
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 2u);
  EXPECT_GE(arrivals[1].at - arrivals[0].at, milliseconds(950));
}

TEST(HttpLimits, ACallThatMayNotWaitForTheLimitStopsWithoutSendingOrSpendingAnAttempt) {
  FaultServer server({.script = "429/retry-after=5,200"});
  server.start();
  RateLimitRegistry rates;
  ClientOptions o = fast_options(3);
  o.brakes.rate_limits = &rates;
  o.brakes.max_limit_wait = milliseconds(100);
  Client client(o);
  const Result first = client.send({.url = server.url("/x")});
  EXPECT_EQ(first.reason, StopReason::kLimited);
  EXPECT_EQ(first.attempts, 1);
  const Result second = client.send({.url = server.url("/x")});
  EXPECT_EQ(second.reason, StopReason::kLimited);
  EXPECT_EQ(second.attempts, 0);
  EXPECT_FALSE(second.outcome.attempted());
  EXPECT_GE(second.outcome.server_delay, seconds(4));
  EXPECT_EQ(server.arrivals().size(), 1u);  // nothing more was sent
}

// A dependency that answers 429 with Retry-After: 0 (or none) to every request: each answer is a
// throttled attempt, charged and backed off with core's jitter; nothing pauses the host and no
// request goes without an attempt spent (it was an endless loop of uncharged requests).
TEST(HttpLimits, A429WithRetryAfterZeroOrNoneIsAChargedAttemptWithABackoffNotALoop) {
  for (const std::string script : {"429/retry-after=0", "429"}) {
    FaultServer server({.script = script});
    server.start();
    RateLimitRegistry rates;  // pauses only, as --share-fleet without --rate-limit
    ClientOptions o = fast_options(4);
    o.retry.backoff = {.base = milliseconds(20), .cap = milliseconds(40)};
    o.brakes.rate_limits = &rates;
    Client client(o);
    const Result r = client.send({.url = server.url("/x")});
    EXPECT_EQ(r.reason, StopReason::kAttemptsExhausted) << script;
    EXPECT_EQ(r.attempts, 4) << script;
    EXPECT_TRUE(r.outcome.attempted()) << script;
    EXPECT_EQ(r.outcome.kind, OutcomeKind::kThrottled) << script;
    EXPECT_EQ(server.arrivals().size(), 4u) << script << ": one request per attempt";
    EXPECT_EQ(rates.find(*breaker_key(server.url("/x")))->stats().pauses, 0u) << script;
  }
}

TEST(HttpLimits, TheAdaptiveConcurrencyLimitBoundsTheCallsInFlightToAHost) {
  FaultServer server({.script = "200/delay=50ms"});
  server.start();
  ConcurrencyLimitRegistry limits({.initial_limit = 2, .max_limit = 2});
  ClientOptions o = fast_options(1);
  o.brakes.adaptive_concurrency = true;
  o.brakes.concurrency_limits = &limits;
  Client client(o);
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&] {
      if (client.send({.url = server.url("/x")}).ok()) ok.fetch_add(1);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 6);
  auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 6u);
  // Never more than 2 at once: the third arrival comes a response time after the first.
  std::sort(arrivals.begin(), arrivals.end(),
            [](const auto& a, const auto& b) { return a.at < b.at; });
  EXPECT_GE(arrivals[2].at - arrivals[0].at, milliseconds(40));
  EXPECT_GT(limits.get(*breaker_key(server.url("/x")))->stats().refused, 0u);
}

}  // namespace
}  // namespace keel::http
