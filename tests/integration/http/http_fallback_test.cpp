// The fallbacks of keel's HTTP clients over loopback, one suite for both drivers (the blocking
// keel::http::Client and keel::asio::HttpClient): stale while down (ClientOptions::
// fallbacks.stale_responses: a cached GET served while the host's breaker is open, never older than
// the cache's max_age) and queue for later (ClientOptions::fallbacks.deferred_writes: a keyed write
// handed over when the host is down, StopReason::kQueued). The upstream is a
// keel::faults::FaultServer; what it saw proves what was sent. The cache's ages are read on a
// keel::ManualClock.
#include <gtest/gtest.h>

#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>
#include <chrono>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "http_drivers.hpp"
#include "keel/asio/http_client.hpp"
#include "keel/core/breaker.hpp"
#include "keel/faults/fault_server.hpp"
#include "keel/http/client.hpp"
#include "keel/http/deferred_writes.hpp"
#include "keel/http/response_cache.hpp"

namespace {

using keel::test::header;

using keel::StopReason;
using keel::faults::FaultServer;
using keel::http::ClientOptions;
using keel::http::Request;
using keel::http::Result;
using namespace std::chrono_literals;

// An in-memory DeferredWrites: records what it was given; refuses when told to.
class Outbox final : public keel::http::DeferredWrites {
 public:
  struct Deferred {
    Request request;
    std::string key;
  };
  keel::Expected<keel::http::Deferral> defer(const Request& request,
                                             std::string_view key) override {
    std::lock_guard lock(mu);
    if (refuse) return keel::Error{.field = "the outbox", .problem = "is full"};
    if (answer) return *answer;
    deferred.push_back({request, std::string(key)});
    return keel::http::Deferral{.status = keel::http::DeferralStatus::kQueued,
                                .job_id = "job-" + std::to_string(deferred.size())};
  }
  std::mutex mu;
  bool refuse = false;                         // guarded by mu
  std::optional<keel::http::Deferral> answer;  // guarded by mu: what defer() says instead
  std::vector<Deferred> deferred;              // guarded by mu
};

// Fast retries, no give-up lines, a breaker that opens once its last two calls failed and stays
// open for a minute, and the cache's time on `clock`.
ClientOptions options(keel::BreakerRegistry& breakers, keel::ManualClock* clock = nullptr) {
  ClientOptions o;
  o.retry.max_attempts = 2;
  o.retry.per_try_timeout = 5s;
  o.retry.overall_timeout = 20s;
  o.retry.backoff = {.base = 1ms, .cap = 5ms};
  o.observability.log = [](std::string_view) {};
  o.brakes.breakers = &breakers;
  o.brakes.retry_budget = false;
  o.clock = clock;
  return o;
}

keel::BreakerRegistry tripping_breakers() {
  return keel::BreakerRegistry({.breaker = {.window = keel::BreakerWindow::kCount,
                                            .window_calls = 2,
                                            .minimum_calls = 2,
                                            .failure_rate_threshold = 1.0,
                                            .break_duration = 60s}});
}

template <class Driver>
class HttpFallbacks : public ::testing::Test {};

TYPED_TEST_SUITE(HttpFallbacks, keel::test::HttpDrivers, keel::test::HttpDriverNames);

TYPED_TEST(HttpFallbacks, AnOpenBreakerServesTheCachedAnswerNoOlderThanMaxAge) {
  FaultServer server({.script = "200/body=v1,503"});
  server.start();
  keel::ManualClock clock;
  keel::BreakerRegistry breakers = tripping_breakers();
  keel::http::ResponseCache cache({.max_age = 60s});
  ClientOptions o = options(breakers, &clock);
  o.fallbacks.stale_responses = &cache;
  TypeParam client(o);
  const Request get{.url = server.url("/price")};

  const Result fresh = client.send(get);
  ASSERT_TRUE(fresh.ok()) << fresh.error;
  EXPECT_FALSE(fresh.stale);
  EXPECT_EQ(cache.size(), 1u);

  // Two 503s: the retries give up and the breaker opens after them. A read that merely failed
  // is reported as it is.
  clock.advance(10s);
  const Result failed = client.send(get);
  EXPECT_EQ(failed.reason, StopReason::kAttemptsExhausted);
  EXPECT_FALSE(failed.stale);
  ASSERT_EQ(breakers.state(*keel::http::breaker_key(get.url)), keel::BreakerState::kOpen);

  // Open: nothing is sent, and the cached answer is the result, with its age.
  clock.advance(20s);
  const Result stale = client.send(get);
  EXPECT_TRUE(stale.ok()) << keel::to_string(stale.reason);
  EXPECT_TRUE(stale.stale);
  EXPECT_EQ(stale.attempts, 0);
  ASSERT_TRUE(stale.response);
  EXPECT_EQ(stale.response->status, 200);
  EXPECT_EQ(stale.response->body, "v1\n");
  EXPECT_GE(stale.stale_age, 30s);
  EXPECT_LT(stale.stale_age, 31s);
  EXPECT_EQ(server.arrivals().size(), 3u) << "the stale answer sent nothing";

  // Past max_age: the open breaker's failure, never an older answer.
  clock.advance(31s);
  const Result too_old = client.send(get);
  EXPECT_EQ(too_old.reason, StopReason::kCircuitOpen);
  EXPECT_FALSE(too_old.stale);
  EXPECT_FALSE(too_old.response);
  EXPECT_EQ(cache.size(), 0u);
}

TYPED_TEST(HttpFallbacks, AStaleAnswerGoesToTheBodySinkAndOnlyGetsAreServed) {
  FaultServer server({.script = "200/body=v1,503"});
  server.start();
  keel::BreakerRegistry breakers = tripping_breakers();
  keel::http::ResponseCache cache;
  ClientOptions o = options(breakers);
  o.fallbacks.stale_responses = &cache;
  TypeParam client(o);
  ASSERT_TRUE(client.send({.url = server.url("/doc")}).ok());
  (void)client.send({.url = server.url("/doc")});  // trips the breaker
  std::string sunk;
  Request streamed{.url = server.url("/doc")};
  streamed.body_sink.restart = [&] {
    sunk.clear();
    return true;
  };
  streamed.body_sink.write = [&](std::string_view data) {
    sunk += data;
    return true;
  };
  const Result r = client.send(streamed);
  EXPECT_TRUE(r.stale);
  EXPECT_EQ(sunk, "v1\n");
  ASSERT_TRUE(r.response);
  EXPECT_EQ(r.response->body, "") << "the body went to the sink, as a live answer's would";
  const Result head = client.send({.method = "HEAD", .url = server.url("/doc")});
  EXPECT_EQ(head.reason, StopReason::kCircuitOpen) << "only GET answers are cached";
}

TYPED_TEST(HttpFallbacks, AKeyedWriteThatGaveUpIsQueuedWithItsKeyAndRequest) {
  FaultServer server({.script = "503"});
  server.start();
  keel::BreakerRegistry breakers;  // the defaults: no trip within these few calls
  Outbox outbox;
  ClientOptions o = options(breakers);
  o.retry.max_attempts = 3;
  o.fallbacks.deferred_writes = &outbox;
  TypeParam client(o);
  Request post{.method = "POST",
               .url = server.url("/charges"),
               .headers = {{"Content-Type", "application/json"}},
               .body = R"({"amount":5})"};
  const Result r = client.send(post);
  EXPECT_EQ(r.reason, StopReason::kQueued);
  EXPECT_EQ(keel::to_string(r.reason), "queued");
  EXPECT_EQ(r.job_id, "job-1");
  EXPECT_EQ(r.attempts, 3);
  ASSERT_FALSE(r.idempotency_key.empty());
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 3u);
  for (const auto& a : arrivals) EXPECT_EQ(header(a, "Idempotency-Key"), r.idempotency_key);
  std::lock_guard lock(outbox.mu);
  ASSERT_EQ(outbox.deferred.size(), 1u);
  const Outbox::Deferred& d = outbox.deferred[0];
  EXPECT_EQ(d.key, r.idempotency_key) << "delivered later under the key the server already saw";
  EXPECT_EQ(d.request.method, "POST");
  EXPECT_EQ(d.request.url, post.url);
  EXPECT_EQ(d.request.body, post.body);
  EXPECT_EQ(d.request.headers, post.headers);
  EXPECT_EQ(d.request.prior_attempts, 3) << "Keel-Attempt goes on from the attempts made";
}

TYPED_TEST(HttpFallbacks, AWriteWithoutKeyAndAPermanentFailureAreNotQueued) {
  FaultServer server({.script = "503*2,400"});
  server.start();
  keel::BreakerRegistry breakers;
  Outbox outbox;
  ClientOptions o = options(breakers);
  o.fallbacks.deferred_writes = &outbox;
  TypeParam client(o);
  const Result no_key = client.send({.method = "POST",
                                     .url = server.url("/charges"),
                                     .body = "{}",
                                     .generate_idempotency_key = false});
  EXPECT_EQ(no_key.reason, StopReason::kAttemptsExhausted);
  EXPECT_TRUE(no_key.job_id.empty());
  const Result bad = client.send({.method = "POST", .url = server.url("/charges"), .body = "{}"});
  EXPECT_EQ(bad.reason, StopReason::kPermanent);
  std::lock_guard lock(outbox.mu);
  EXPECT_TRUE(outbox.deferred.empty());
}

TYPED_TEST(HttpFallbacks, AnOpenBreakerQueuesAKeyedWriteWithoutSendingIt) {
  FaultServer server({.script = "503"});
  server.start();
  keel::BreakerRegistry breakers = tripping_breakers();
  Outbox outbox;
  ClientOptions o = options(breakers);
  TypeParam tripper(o);
  (void)tripper.send({.url = server.url("/")});  // two 503s: open
  o.fallbacks.deferred_writes = &outbox;
  TypeParam client(o);
  const Result r = client.send({.method = "PUT",
                                .url = server.url("/accounts/7"),
                                .body = "{}",
                                .idempotency_key = "put-7-v2"});
  EXPECT_EQ(r.reason, StopReason::kQueued);
  EXPECT_EQ(r.attempts, 0);
  EXPECT_EQ(server.arrivals().size(), 2u) << "nothing reached the open breaker's host";
  std::lock_guard lock(outbox.mu);
  ASSERT_EQ(outbox.deferred.size(), 1u);
  EXPECT_EQ(outbox.deferred[0].key, "put-7-v2");
  EXPECT_EQ(outbox.deferred[0].request.prior_attempts, 0);
}

TYPED_TEST(HttpFallbacks, AFailedEnqueueReturnsTheOriginalFailureSayingSo) {
  FaultServer server({.script = "503"});
  server.start();
  keel::BreakerRegistry breakers;
  Outbox outbox;
  outbox.refuse = true;
  ClientOptions o = options(breakers);
  o.fallbacks.deferred_writes = &outbox;
  TypeParam client(o);
  const Result r = client.send({.method = "POST", .url = server.url("/charges"), .body = "{}"});
  EXPECT_EQ(r.reason, StopReason::kAttemptsExhausted);
  EXPECT_TRUE(r.job_id.empty());
  EXPECT_NE(r.error.find("queueing the request for later failed: the outbox is full"),
            std::string::npos)
      << r.error;
  ASSERT_TRUE(r.response);
  EXPECT_EQ(r.response->status, 503) << "the last response is kept";
}

TYPED_TEST(HttpFallbacks, AKeyAlreadyQueuedIsQueuedOnceAndAnotherRequestUnderItIsNot) {
  FaultServer server({.script = "503"});
  server.start();
  keel::BreakerRegistry breakers;
  Outbox outbox;
  ClientOptions o = options(breakers);
  o.fallbacks.deferred_writes = &outbox;
  TypeParam client(o);
  const Request post{
      .method = "POST", .url = server.url("/charges"), .body = "{}", .idempotency_key = "charge-1"};
  const Result first = client.send(post);
  EXPECT_EQ(first.reason, StopReason::kQueued);
  EXPECT_EQ(first.deferral, keel::http::DeferralStatus::kQueued);
  {
    std::lock_guard lock(outbox.mu);
    outbox.answer = keel::http::Deferral{.status = keel::http::DeferralStatus::kAlreadyQueued,
                                         .job_id = "job-1"};
  }
  const Result again = client.send(post);
  EXPECT_EQ(again.reason, StopReason::kQueued);
  EXPECT_EQ(again.deferral, keel::http::DeferralStatus::kAlreadyQueued);
  EXPECT_EQ(again.job_id, "job-1");
  {
    std::lock_guard lock(outbox.mu);
    outbox.answer =
        keel::http::Deferral{.status = keel::http::DeferralStatus::kKeyConflict, .job_id = "job-1"};
  }
  const Result other = client.send(post);
  EXPECT_EQ(other.reason, StopReason::kAttemptsExhausted) << "the original failure stands";
  EXPECT_EQ(other.deferral, keel::http::DeferralStatus::kKeyConflict);
  EXPECT_EQ(other.job_id, "job-1") << "the job that holds the key";
  EXPECT_NE(other.error.find("not queued for later: Idempotency-Key 'charge-1' is already queued "
                             "as job job-1 with a different request"),
            std::string::npos)
      << other.error;
}

}  // namespace
