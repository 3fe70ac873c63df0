// One suite, two drivers: the behaviour of keel's HTTP clients, checked against the same
// keel::faults::FaultServer over loopback, for the blocking keel::http::Client and for the
// non-blocking keel::asio::HttpClient (libcurl multi on an Asio loop). What the server saw
// (arrivals, Idempotency-Key, Keel-Attempt, times) proves what the client did. Timing assertions
// are lower bounds only.
//
// Tests that only the asynchronous client can have (cancellation, a thousand calls on one
// thread, per-host breakers) follow the typed suite.
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <asio/bind_cancellation_slot.hpp>
#include <asio/cancellation_signal.hpp>
#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <asio/steady_timer.hpp>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <regex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "asio_waiting.hpp"
#include "fast_options.hpp"
#include "http_drivers.hpp"
#include "keel/asio/http_client.hpp"
#include "keel/core/breaker.hpp"
#include "keel/core/deadline_header.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/latency.hpp"
#include "keel/faults/fault_server.hpp"
#include "keel/http/client.hpp"
#include "support/loopback_socket.hpp"

namespace {

using keel::test::arrivals_at_least;
using keel::test::when;

using keel::test::header;

using keel::OutcomeKind;
using keel::OutcomeSource;
using keel::StopReason;
using keel::faults::Arrival;
using keel::faults::FaultServer;
using keel::http::ClientOptions;
using keel::http::Request;
using keel::http::Result;
using std::chrono::milliseconds;
using std::chrono::seconds;

using keel::test::fast_options;

using keel::test::ClosedPort;

template <class Driver>
class HttpClients : public ::testing::Test {};

TYPED_TEST_SUITE(HttpClients, keel::test::HttpDrivers, keel::test::HttpDriverNames);

TYPED_TEST(HttpClients, TransientStatusesAreRetriedAndEachAttemptIsNumbered) {
  FaultServer server({.script = "503,502,200"});
  server.start();
  TypeParam client(fast_options(5));
  const Result r = client.send({.url = server.url("/thing")});
  EXPECT_TRUE(r.ok()) << keel::to_string(r.reason);
  EXPECT_EQ(r.attempts, 3);
  ASSERT_TRUE(r.response.has_value());
  EXPECT_EQ(r.response->status, 200);
  EXPECT_EQ(r.response->body, "ok\n");
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 3u);
  for (std::size_t i = 0; i < arrivals.size(); ++i) {
    EXPECT_EQ(header(arrivals[i], "Keel-Attempt"), std::to_string(i + 1));
    EXPECT_EQ(arrivals[i].target, "/thing");
    EXPECT_EQ(header(arrivals[i], "Idempotency-Key"), "") << "a GET carries no key";
  }
}

TYPED_TEST(HttpClients, APostCarriesOneGeneratedUuidKeyOnEveryAttempt) {
  FaultServer server({.script = "503*2,201"});
  server.start();
  TypeParam client(fast_options(3));
  const Result r = client.send({.method = "POST", .url = server.url("/pay"), .body = "{}"});
  EXPECT_TRUE(r.ok());
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 3u);
  const std::string key = header(arrivals[0], "Idempotency-Key");
  EXPECT_TRUE(std::regex_match(
      key, std::regex("[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")))
      << key;
  EXPECT_EQ(r.idempotency_key, key);
  for (const Arrival& a : arrivals) {
    EXPECT_EQ(header(a, "Idempotency-Key"), key);
    EXPECT_EQ(a.method, "POST");
    EXPECT_EQ(a.body, "{}");
  }
  // The next logical operation gets a key of its own.
  const Result next = client.send({.method = "PATCH", .url = server.url("/pay")});
  EXPECT_FALSE(next.idempotency_key.empty());
  EXPECT_NE(next.idempotency_key, key);
}

// The header's value on each arrival, parsed (-1: absent or invalid).
std::vector<long long> deadline_ms(const std::vector<Arrival>& arrivals) {
  std::vector<long long> out;
  for (const Arrival& a : arrivals) {
    auto v = keel::http::find_header(a.headers, keel::kDeadlineHeader);
    auto d = v ? keel::parse_deadline_header(*v) : keel::Expected<keel::Duration>(keel::Error{});
    out.push_back(d ? std::chrono::duration_cast<milliseconds>(*d).count() : -1);
  }
  return out;
}

TYPED_TEST(HttpClients, EveryAttemptCarriesTheDeadlineLeftWhichShrinksAcrossAttempts) {
  FaultServer server({.script = "503/delay=20ms*2,200"});
  server.start();
  TypeParam client(fast_options(3));  // overall_timeout 20 s, per_try_timeout 5 s
  const Result r = client.send({.url = server.url("/thing")});
  EXPECT_TRUE(r.ok()) << keel::to_string(r.reason);
  const std::vector<long long> left = deadline_ms(server.arrivals());
  ASSERT_EQ(left.size(), 3u);
  // The operation's 20 s less what has passed, not the attempt's 5 s timeout; the margin leaves
  // room for a first attempt that starts late on a loaded machine.
  EXPECT_GT(left[0], 10000);
  EXPECT_LE(left[0], 20000);
  for (std::size_t i = 1; i < left.size(); ++i) {
    EXPECT_LE(left[i], left[i - 1] - 20) << "attempt " << i + 1 << " after a 20 ms failure";
  }
}

TYPED_TEST(HttpClients, TheCeilingBoundsTheDeadlineSent) {
  FaultServer server({.script = "200"});
  server.start();
  TypeParam client(fast_options(3));
  const Result r =
      client.send({.url = server.url("/thing"),
                   .ceiling = keel::Deadline::after(keel::steady_clock(), seconds(10))});
  EXPECT_TRUE(r.ok());
  const std::vector<long long> left = deadline_ms(server.arrivals());
  ASSERT_EQ(left.size(), 1u);
  // At most the ceiling's 10 s, not the 20 s overall timeout; more than the 5 s per-try timeout,
  // with room for a late start.
  EXPECT_GT(left[0], 5000);
  EXPECT_LE(left[0], 10000);
}

TYPED_TEST(HttpClients, NoDeadlineSendsNoHeaderAndTheCallersOwnIsDropped) {
  FaultServer server({.script = "200"});
  server.start();
  ClientOptions c = fast_options(2);
  c.retry.overall_timeout = keel::kInfinite;
  TypeParam client(c);
  const Result r =
      client.send({.url = server.url("/thing"), .headers = {{"keel-deadline-ms", "999"}}});
  EXPECT_TRUE(r.ok());
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 1u);
  EXPECT_EQ(header(arrivals[0], keel::kDeadlineHeader), "");
}

TYPED_TEST(HttpClients, DeadlinePropagationCanBeSwitchedOff) {
  FaultServer server({.script = "200"});
  server.start();
  ClientOptions c = fast_options(2);
  c.transport.propagate_deadline = false;
  TypeParam client(c);
  EXPECT_TRUE(client.send({.url = server.url("/thing")}).ok());
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 1u);
  EXPECT_EQ(header(arrivals[0], keel::kDeadlineHeader), "");
}

TYPED_TEST(HttpClients, ACallerKeyIsSentUnchangedAndA500IsRetriedOnce) {
  FaultServer server({.script = "500"});
  server.start();
  TypeParam client(fast_options(5));
  const Result r =
      client.send({.method = "POST", .url = server.url("/job"), .idempotency_key = "job-42"});
  EXPECT_EQ(r.reason, StopReason::kAttemptsExhausted);
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 2u) << "a 500 causes at most one retry";
  for (const Arrival& a : arrivals) EXPECT_EQ(header(a, "Idempotency-Key"), "job-42");
}

TYPED_TEST(HttpClients, APermanentStatusIsNotRetriedAndItsBodyIsKept) {
  FaultServer server({.script = "400/body=missing-field,200"});
  server.start();
  TypeParam client(fast_options(5));
  const Result r = client.send({.method = "POST", .url = server.url("/x")});
  EXPECT_EQ(r.reason, StopReason::kPermanent);
  EXPECT_EQ(r.attempts, 1);
  ASSERT_TRUE(r.response.has_value());
  EXPECT_EQ(r.response->status, 400);
  EXPECT_EQ(r.response->body, "missing-field\n");
  EXPECT_EQ(server.arrivals().size(), 1u);
}

TYPED_TEST(HttpClients, RetryAfterSecondsIsWaitedAtLeast) {
  FaultServer server({.script = "503/retry-after=1,200"});
  server.start();
  TypeParam client(fast_options());
  const Result r = client.send({.url = server.url("/slow")});
  EXPECT_TRUE(r.ok());
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 2u);
  EXPECT_GE(arrivals[1].at - arrivals[0].at, seconds(1));
}

TYPED_TEST(HttpClients, RetryAfterAsAnHttpDateIsHonoured) {
  FaultServer server({.script = "429/retry-after-date=2,200"});
  server.start();
  TypeParam client(fast_options());
  const Result r = client.send({.url = server.url("/")});
  EXPECT_TRUE(r.ok());
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 2u);
  // The date has a one-second resolution: at least one second has passed.
  EXPECT_GE(arrivals[1].at - arrivals[0].at, milliseconds(900));
}

TYPED_TEST(HttpClients, RetryAfterBeyondTheDeadlineStopsWithDeadline) {
  FaultServer server({.script = "503/retry-after=30,200"});
  server.start();
  ClientOptions c = fast_options();
  c.retry.overall_timeout = seconds(2);
  TypeParam client(c);
  const Result r = client.send({.url = server.url("/")});
  EXPECT_EQ(r.reason, StopReason::kDeadline);
  EXPECT_EQ(r.attempts, 1);
  EXPECT_EQ(server.arrivals().size(), 1u);
}

TYPED_TEST(HttpClients, TheDeadlineCutsAHungAttemptAndNoOtherStarts) {
  FaultServer server({.script = "hang"});
  server.start();
  ClientOptions c = fast_options(5);
  c.retry.per_try_timeout = seconds(10);
  TypeParam client(c);
  const Result r =
      client.send({.url = server.url("/hang"),
                   .deadline = keel::Deadline::after(keel::steady_clock(), seconds(2))});
  EXPECT_EQ(r.reason, StopReason::kDeadline);
  EXPECT_TRUE(r.outcome.timed_out);
  EXPECT_LT(r.elapsed, seconds(5)) << "cut by the deadline, not the 10 s per-try timeout";
  EXPECT_EQ(arrivals_at_least(server, 1).size(), 1u);
}

TYPED_TEST(HttpClients, PerTryTimeoutEndsAHungAttemptAndTheRetrySucceeds) {
  FaultServer server({.script = "hang,200"});
  server.start();
  ClientOptions c = fast_options(3);
  // Ends the hung first attempt (the overall timeout is 20 s) and bounds the retry too, which
  // opens a new connection: room for that on a slow machine.
  c.retry.per_try_timeout = seconds(2);
  std::vector<keel::Outcome> outcomes;
  c.observability.on_attempt = [&](const keel::http::AttemptEvent& e) {
    outcomes.push_back(e.outcome);
  };
  TypeParam client(c);
  const Result r = client.send({.url = server.url("/")});
  EXPECT_TRUE(r.ok());
  ASSERT_EQ(outcomes.size(), 2u);
  EXPECT_TRUE(outcomes[0].timed_out);
  EXPECT_EQ(outcomes[0].source, OutcomeSource::kNetwork);
  EXPECT_EQ(server.arrivals().size(), 2u);
}

TYPED_TEST(HttpClients, AdaptiveTimeoutsDropFromTheStaticTimeoutToTheMeasuredLatency) {
  // Twenty answers in about 20 ms, then a hang. The host's timeout is read from the registry
  // the client records into; the hang proves the attempt used it (the static one is 10 s).
  FaultServer server({.script = "200/delay=20ms*20,hang"});
  server.start();
  keel::AdaptiveTimeoutRegistry timeouts({.timeout = {.min_samples = 20}});
  ClientOptions c = fast_options(1);
  c.retry.per_try_timeout = seconds(10);
  c.brakes.adaptive_timeouts = true;
  c.brakes.timeouts = &timeouts;
  keel::Duration slowest{};
  std::vector<keel::Outcome> outcomes;
  c.observability.on_attempt = [&](const keel::http::AttemptEvent& e) {
    slowest = std::max(slowest, e.took);
    outcomes.push_back(e.outcome);
  };
  TypeParam client(c);
  const std::string url = server.url("/");
  const std::string host = keel::http::breaker_key(url).value();
  const auto now = [] { return keel::steady_clock().now(); };

  for (int i = 0; i < 19; ++i) ASSERT_TRUE(client.send({.url = url}).ok());
  const std::shared_ptr<keel::AdaptiveTimeout> t = timeouts.find(host);
  ASSERT_NE(t, nullptr);
  EXPECT_FALSE(t->computed(now()).has_value());  // 19 < min_samples: the static timeout
  EXPECT_EQ(t->timeout(now(), c.retry.per_try_timeout), seconds(10));

  ASSERT_TRUE(client.send({.url = url}).ok());
  ASSERT_TRUE(t->computed(now()).has_value());
  const keel::Duration warm = t->timeout(now(), c.retry.per_try_timeout);
  std::printf("slowest of 20 answers %s, timeout %s (static %s)\n",
              keel::format_duration(slowest).c_str(), keel::format_duration(warm).c_str(),
              keel::format_duration(c.retry.per_try_timeout).c_str());
  // p99.9 of 20 latencies is the slowest: about slowest x 1.25 + 25 ms, and at least
  // 20 ms x 1.25 + 25 ms (every answer waited 20 ms).
  EXPECT_GE(warm, milliseconds(50));
  EXPECT_LE(warm, keel::saturating_scale(slowest, 1.25 * (1 + 1.0 / 128)) + milliseconds(25));
  EXPECT_LT(warm, seconds(10));

  const Result hung = client.send({.url = url});
  EXPECT_TRUE(hung.outcome.timed_out);
  EXPECT_LT(hung.elapsed, seconds(5));
  ASSERT_EQ(outcomes.size(), 21u);
  EXPECT_TRUE(outcomes.back().timed_out);
  // The timeout was recorded at its limit, a lower bound of the latency: the timeout rises.
  EXPECT_GT(t->timeout(now(), c.retry.per_try_timeout), warm);
}

TYPED_TEST(HttpClients, ARefusedConnectionIsRetriedEvenForAPostWithoutKey) {
  const ClosedPort closed;  // refuses connections until the test ends
  TypeParam client(fast_options(3));
  const Result r =
      client.send({.method = "POST", .url = closed.url("/pay"), .generate_idempotency_key = false});
  EXPECT_EQ(r.reason, StopReason::kAttemptsExhausted);
  EXPECT_EQ(r.attempts, 3);
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kTransient);
  EXPECT_EQ(r.outcome.source, OutcomeSource::kNetwork);
  EXPECT_FALSE(r.response.has_value());
  EXPECT_FALSE(r.error.empty());
}

TYPED_TEST(HttpClients, AnAmbiguousPostWithoutKeyIsNotRetried) {
  FaultServer server({.script = "drop,200"});
  server.start();
  TypeParam client(fast_options(5));
  const Result r =
      client.send({.method = "POST", .url = server.url("/pay"), .generate_idempotency_key = false});
  EXPECT_EQ(r.reason, StopReason::kNotSafeToRetry);
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kAmbiguous);
  EXPECT_EQ(server.arrivals().size(), 1u);
  EXPECT_EQ(header(server.arrivals()[0], "Idempotency-Key"), "");
}

TYPED_TEST(HttpClients, AnAmbiguousPostWithKeyIsRetriedWithTheSameKey) {
  FaultServer server({.script = "drop,reset,200"});
  server.start();
  TypeParam client(fast_options(5));
  const Result r = client.send({.method = "POST", .url = server.url("/pay"), .body = "x"});
  EXPECT_TRUE(r.ok());
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 3u);
  EXPECT_EQ(header(arrivals[0], "Idempotency-Key"), header(arrivals[2], "Idempotency-Key"));
  EXPECT_EQ(header(arrivals[1], "Idempotency-Key"), header(arrivals[2], "Idempotency-Key"));
}

// The receiver creates the resource on the first request and the answer is lost; the retry, with
// the same key, meets "already exists". With the duplicate-success rule that is the first try's
// success.
ClientOptions already_exists(int attempts = 3) {
  ClientOptions c = fast_options(attempts);
  c.classify.duplicate_success = keel::DuplicateSuccessOptions{
      .statuses = {409}, .body = keel::body_contains("already exists")};
  return c;
}

TYPED_TEST(HttpClients, AnAlreadyExistsAfterADroppedResponseIsTheFirstTrysSuccess) {
  FaultServer server({.script = "drop,409/body=name already exists"});
  server.start();
  std::vector<keel::Outcome> observed;
  ClientOptions c = already_exists();
  c.observability.on_attempt = [&](const keel::http::AttemptEvent& e) {
    observed.push_back(e.outcome);
  };
  TypeParam client(c);
  const Result r = client.send({.method = "POST", .url = server.url("/videos"), .body = "v"});
  EXPECT_TRUE(r.ok()) << keel::describe(r.outcome);
  EXPECT_EQ(r.reason, StopReason::kSuccess);
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kSuccess);
  EXPECT_TRUE(r.outcome.duplicate);
  EXPECT_EQ(r.outcome.code, 409);
  EXPECT_EQ(r.attempts, 2);
  ASSERT_TRUE(r.response.has_value());
  EXPECT_EQ(r.response->status, 409);
  EXPECT_EQ(r.response->body, "name already exists\n");
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 2u);
  const std::string key = header(arrivals[0], "Idempotency-Key");
  EXPECT_FALSE(key.empty());
  EXPECT_EQ(header(arrivals[1], "Idempotency-Key"), key);
  EXPECT_EQ(r.idempotency_key, key);
  EXPECT_EQ(header(arrivals[0], "Keel-Attempt"), "1");
  EXPECT_EQ(header(arrivals[1], "Keel-Attempt"), "2");
  ASSERT_EQ(observed.size(), 2u);
  EXPECT_EQ(observed[0].kind, OutcomeKind::kAmbiguous);
  EXPECT_TRUE(observed[1].duplicate);
}

TYPED_TEST(HttpClients, TheSameConflictOnAFirstAttemptIsAFailure) {
  FaultServer server({.script = "409/body=name already exists"});
  server.start();
  TypeParam client(already_exists());
  // Without a key a 409 is permanent: one request, a failure.
  const Result r = client.send(
      {.method = "POST", .url = server.url("/videos"), .generate_idempotency_key = false});
  EXPECT_EQ(r.reason, StopReason::kPermanent);
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kPermanent);
  EXPECT_FALSE(r.outcome.duplicate);
  EXPECT_EQ(server.arrivals().size(), 1u);
  // With a key a 409 is the receiver's "in progress": retried, and each retry follows a 409
  // (not ambiguous), so it never turns into a success.
  server.reset();
  const Result keyed = client.send({.method = "POST", .url = server.url("/videos")});
  EXPECT_FALSE(keyed.ok());
  EXPECT_EQ(keyed.reason, StopReason::kAttemptsExhausted);
  EXPECT_FALSE(keyed.outcome.duplicate);
  EXPECT_EQ(server.arrivals().size(), 3u);
}

TYPED_TEST(HttpClients, AnAlreadyExistsAfterA503IsNotASuccess) {
  FaultServer server({.script = "503,409/body=name already exists"});
  server.start();
  TypeParam client(already_exists(2));
  const Result r = client.send({.method = "POST", .url = server.url("/videos")});
  EXPECT_FALSE(r.ok());
  EXPECT_FALSE(r.outcome.duplicate);
  EXPECT_EQ(r.outcome.code, 409);
  EXPECT_EQ(server.arrivals().size(), 2u);
}

TYPED_TEST(HttpClients, WithoutTheRuleAnAlreadyExistsAfterADropIsNotASuccess) {
  FaultServer server({.script = "drop,409/body=name already exists"});
  server.start();
  TypeParam client(fast_options(2));
  const Result r = client.send({.method = "POST", .url = server.url("/videos")});
  EXPECT_FALSE(r.ok());
  EXPECT_FALSE(r.outcome.duplicate);
  EXPECT_EQ(server.arrivals().size(), 2u);
}

TYPED_TEST(HttpClients, TheLookupFetchesTheResourceADuplicateFoundAlreadyThere) {
  FaultServer server({.script = "drop,409/body=name already exists,200/body=the video"});
  server.start();
  ClientOptions c = already_exists();
  int lookups = 0;
  c.classify.duplicate_lookup =
      [&](const Request& sent, const keel::http::Response& duplicate) -> std::optional<Request> {
    ++lookups;
    EXPECT_EQ(sent.method, "POST");
    EXPECT_EQ(duplicate.status, 409);
    return Request{.url = server.url("/videos/v1")};
  };
  TypeParam client(c);
  const Result r = client.send({.method = "POST", .url = server.url("/videos"), .body = "v"});
  EXPECT_TRUE(r.ok()) << keel::describe(r.outcome);
  EXPECT_TRUE(r.outcome.duplicate);
  EXPECT_EQ(r.outcome.code, 200);
  ASSERT_TRUE(r.response.has_value());
  EXPECT_EQ(r.response->body, "the video\n");
  EXPECT_EQ(r.attempts, 3);
  EXPECT_EQ(lookups, 1);
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 3u);
  EXPECT_EQ(arrivals[2].method, "GET");
  EXPECT_EQ(arrivals[2].target, "/videos/v1");
  EXPECT_EQ(r.idempotency_key, header(arrivals[0], "Idempotency-Key"));

  // No lookup for a plain success, and nullopt keeps the duplicate answer.
  server.set_script("drop,409/body=name already exists");
  server.reset();
  c.classify.duplicate_lookup = [&](const Request&,
                                    const keel::http::Response&) -> std::optional<Request> {
    ++lookups;
    return std::nullopt;
  };
  TypeParam keeps(c);
  const Result kept = keeps.send({.method = "POST", .url = server.url("/videos")});
  EXPECT_TRUE(kept.ok());
  EXPECT_TRUE(kept.outcome.duplicate);
  EXPECT_EQ(kept.response->status, 409);
  EXPECT_EQ(lookups, 2);
  server.set_script("201");
  server.reset();
  EXPECT_TRUE(keeps.send({.method = "POST", .url = server.url("/videos")}).ok());
  EXPECT_EQ(lookups, 2);
}

TYPED_TEST(HttpClients, ADuplicateSuccessRuleWithAnInvalidStatusIsRejected) {
  ClientOptions c = fast_options();
  c.classify.duplicate_success = keel::DuplicateSuccessOptions{.statuses = {201}};
  EXPECT_THROW(TypeParam client(c), std::invalid_argument);
}

TYPED_TEST(HttpClients, TheBodyHookTurnsAnErrorInsideA200IntoARetry) {
  FaultServer server({.script = "200/body=error:busy,200/body=done"});
  server.start();
  ClientOptions c = fast_options();
  c.classify.responses.body = [](int status,
                                 std::string_view body) -> std::optional<keel::Outcome> {
    if (status == 200 && body.starts_with("error")) return keel::Outcome::transient();
    return std::nullopt;
  };
  TypeParam client(c);
  const Result r = client.send({.url = server.url("/")});
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r.response->body, "done\n");
  EXPECT_EQ(server.arrivals().size(), 2u);
}

TYPED_TEST(HttpClients, EveryAttemptIsObservedAndGivingUpLogsOneLine) {
  FaultServer server({.script = "503"});
  server.start();
  ClientOptions c = fast_options(3);
  std::vector<int> numbers;
  std::vector<bool> will_retry;
  std::vector<StopReason> reasons;
  std::vector<std::string> lines;
  c.observability.on_attempt = [&](const keel::http::AttemptEvent& e) {
    numbers.push_back(e.attempt);
    will_retry.push_back(e.will_retry);
    reasons.push_back(e.reason);
    EXPECT_EQ(e.outcome.code, 503);
    EXPECT_EQ(e.method, "DELETE");
  };
  c.observability.log = [&](std::string_view line) { lines.emplace_back(line); };
  TypeParam client(c);
  const std::string url = server.url("/down");
  const Result r = client.send({.method = "DELETE", .url = url});
  EXPECT_EQ(r.reason, StopReason::kAttemptsExhausted);
  EXPECT_EQ(numbers, (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(will_retry, (std::vector<bool>{true, true, false}));
  ASSERT_EQ(reasons.size(), 3u);
  EXPECT_EQ(reasons[2], StopReason::kAttemptsExhausted);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("gave up after 3 attempts"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("DELETE " + url), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("attempts exhausted"), std::string::npos) << lines[0];
}

TYPED_TEST(HttpClients, OneConnectionServesTheAttemptsAndTheNextRequest) {
  FaultServer server({.script = "503,200"});
  server.start();
  TypeParam client(fast_options());
  EXPECT_TRUE(client.send({.url = server.url("/a")}).ok());
  EXPECT_TRUE(client.send({.url = server.url("/b")}).ok());
  EXPECT_EQ(server.arrivals().size(), 3u);
  EXPECT_EQ(server.connections(), 1);
}

// ---------------------------------------------------------------------------------------------
// The asynchronous client only.

using keel::asio::HttpClient;

// Sends `request` on `client` with `cancel`'s slot bound to it, runs `io` until it completes (at
// most 20 s) and returns the result.
Result send_cancellable(::asio::io_context& io, HttpClient& client, Request request,
                        ::asio::cancellation_signal& cancel) {
  std::optional<Result> out;
  ::asio::co_spawn(
      io, client.send(std::move(request)),
      ::asio::bind_cancellation_slot(cancel.slot(), [&](std::exception_ptr e, Result r) {
        EXPECT_FALSE(e);
        out = std::move(r);
      }));
  io.run_for(seconds(20));
  EXPECT_TRUE(out.has_value()) << "the operation did not complete";
  return out.value_or(Result{});
}

TEST(AsioHttpClient, CancellingDuringAnAttemptRemovesTheTransferAndReportsCancelled) {
  FaultServer server({.script = "hang"});
  server.start();
  ::asio::io_context io;
  ClientOptions c = fast_options(3);
  HttpClient client(io.get_executor(),
                    {.retry = c.retry, .observability = {.log = c.observability.log}});
  // Cancelled once the server holds the request, which it never answers: during the attempt.
  ::asio::cancellation_signal cancel;
  ::asio::steady_timer poll(io);
  when(
      poll, [&] { return !server.arrivals().empty(); },
      [&] { cancel.emit(::asio::cancellation_type::terminal); });
  const Result r = send_cancellable(io, client, {.url = server.url("/hang")}, cancel);
  EXPECT_EQ(r.reason, StopReason::kCancelled);
  EXPECT_EQ(r.attempts, 1);
  EXPECT_LT(r.elapsed, seconds(5)) << "not cut by the 5 s per-try timeout";
  EXPECT_EQ(client.transfers_in_flight(), 0u);
  EXPECT_EQ(server.arrivals().size(), 1u);
}

TEST(AsioHttpClient, CancellingDuringTheWaitStopsBeforeTheNextAttempt) {
  FaultServer server({.script = "503/retry-after=30,200"});
  server.start();
  ::asio::io_context io;
  ClientOptions c = fast_options(3);
  c.retry.overall_timeout = seconds(120);
  // Cancelled when the first attempt's 503 is in and a retry is due. The hook runs inside the
  // loop, before its 30 s wait starts; the emit is posted, so it lands in that wait.
  ::asio::cancellation_signal cancel;
  const auto cancel_before_the_retry = [&](const keel::http::AttemptEvent& e) {
    if (e.will_retry) {
      ::asio::post(io, [&] { cancel.emit(::asio::cancellation_type::terminal); });
    }
  };
  HttpClient client(io.get_executor(), {.retry = c.retry,
                                        .observability = {.on_attempt = cancel_before_the_retry,
                                                          .log = c.observability.log}});
  const Result r = send_cancellable(io, client, {.url = server.url("/")}, cancel);
  EXPECT_EQ(r.reason, StopReason::kCancelled);
  EXPECT_EQ(r.attempts, 1);
  EXPECT_LT(r.elapsed, seconds(30));
  ASSERT_TRUE(r.response.has_value());
  EXPECT_EQ(r.response->status, 503);
  EXPECT_EQ(server.arrivals().size(), 1u);
}

// Per-host breakers: one host failing opens its own breaker only.
TEST(AsioHttpClient, APerHostBreakerStopsCallsToTheFailingHostOnly) {
  FaultServer down({.script = "503"});
  FaultServer up({.script = "200"});
  down.start();
  up.start();
  keel::BreakerRegistry breakers({.breaker = {.window = keel::BreakerWindow::kCount,
                                              .window_calls = 4,
                                              .minimum_calls = 4,
                                              .break_duration = seconds(60)}});
  ::asio::io_context io;
  ClientOptions c = fast_options(2);
  HttpClient client(io.get_executor(), {.retry = c.retry,
                                        .brakes = {.breakers = &breakers},
                                        .observability = {.log = c.observability.log}});
  ASSERT_TRUE(client.options().brakes.circuit_breakers);
  std::vector<StopReason> reasons;
  ::asio::co_spawn(
      io,
      [&]() -> ::asio::awaitable<void> {
        // Named requests: GCC 12 mishandles temporaries built inside a co_await expression.
        const Request to_down{.url = down.url("/")};
        const Request to_up{.url = up.url("/")};
        for (int i = 0; i < 3; ++i) {
          const Result r = co_await client.send(to_down);
          reasons.push_back(r.reason);
          if (r.attempts == 0) {
            EXPECT_EQ(r.outcome.kind, keel::OutcomeKind::kNotAttempted) << "nothing was sent";
          }
        }
        const Result r = co_await client.send(to_up);
        reasons.push_back(r.reason);
      },
      [](std::exception_ptr e) { EXPECT_FALSE(e); });
  io.run_for(seconds(20));
  EXPECT_EQ(reasons,
            (std::vector<StopReason>{StopReason::kAttemptsExhausted, StopReason::kAttemptsExhausted,
                                     StopReason::kCircuitOpen, StopReason::kSuccess}));
  EXPECT_EQ(down.arrivals().size(), 4u) << "no request reaches an open breaker's host";
  EXPECT_EQ(breakers.state("127.0.0.1:" + std::to_string(down.port())), keel::BreakerState::kOpen);
  EXPECT_EQ(breakers.state("127.0.0.1:" + std::to_string(up.port())), keel::BreakerState::kClosed);
}

// The client's own retry budget (on by default, as in keel::http::Client): a dependency that
// always fails gets at most capacity / retry_cost retries from all operations together.
TEST(AsioHttpClient, TheOwnRetryBudgetLimitsRetriesAcrossOperations) {
  FaultServer server({.script = "503"});
  server.start();
  ::asio::io_context io;
  ClientOptions c = fast_options(3);
  HttpClient client(io.get_executor(), {.retry = c.retry,
                                        .brakes = {.circuit_breakers = false,
                                                   .own_budget = {.capacity = 10, .retry_cost = 5}},
                                        .observability = {.log = c.observability.log}});
  std::vector<StopReason> reasons;
  ::asio::co_spawn(
      io,
      [&]() -> ::asio::awaitable<void> {
        const Request request{.url = server.url("/")};
        for (int i = 0; i < 3; ++i) {
          const Result r = co_await client.send(request);
          reasons.push_back(r.reason);
        }
      },
      [](std::exception_ptr e) { EXPECT_FALSE(e); });
  io.run_for(seconds(20));
  // 10 tokens: two retries in all; the first operation spends them.
  EXPECT_EQ(reasons,
            (std::vector<StopReason>{StopReason::kAttemptsExhausted, StopReason::kBudgetExhausted,
                                     StopReason::kBudgetExhausted}));
  EXPECT_EQ(server.arrivals().size(), 5u);
}

// With max_transfers = 1 a second operation waits in the client's queue while the first hangs;
// cancelling the waiting one takes it out of the queue, and the hung one is then cancelled too.
TEST(AsioHttpClient, CancellingAQueuedTransferTakesItOutOfTheQueue) {
  FaultServer server({.script = "hang"});
  server.start();
  ::asio::io_context io;
  ClientOptions c = fast_options(1);
  HttpClient client(io.get_executor(), {.retry = c.retry,
                                        .observability = {.log = c.observability.log},
                                        .limits = {.max_transfers = 1}});
  ::asio::cancellation_signal first_cancel;
  ::asio::cancellation_signal second_cancel;
  std::vector<std::pair<int, StopReason>> done;
  const Request request{.url = server.url("/hang")};
  ::asio::co_spawn(
      io, client.send(request),
      ::asio::bind_cancellation_slot(first_cancel.slot(), [&](std::exception_ptr, Result r) {
        done.emplace_back(1, r.reason);
      }));
  ::asio::co_spawn(
      io, client.send(request),
      ::asio::bind_cancellation_slot(second_cancel.slot(), [&](std::exception_ptr, Result r) {
        done.emplace_back(2, r.reason);
      }));
  // Once the server holds the first request (which it never answers) the second one is cancelled
  // in the queue; once that has completed, the first one is cancelled too.
  std::size_t in_flight_before = 0;
  ::asio::steady_timer poll(io);
  when(
      poll, [&] { return !server.arrivals().empty(); },
      [&] {
        in_flight_before = client.transfers_in_flight();
        second_cancel.emit(::asio::cancellation_type::terminal);
        when(
            poll, [&] { return !done.empty(); },
            [&] { first_cancel.emit(::asio::cancellation_type::terminal); });
      });
  io.run_for(seconds(20));
  EXPECT_EQ(in_flight_before, 2u);
  EXPECT_EQ(done, (std::vector<std::pair<int, StopReason>>{{2, StopReason::kCancelled},
                                                           {1, StopReason::kCancelled}}));
  EXPECT_EQ(client.transfers_in_flight(), 0u);
  EXPECT_EQ(server.arrivals().size(), 1u) << "the queued request never started";
}

TEST(AsioHttpClient, RejectsInvalidConfigurationNamingTheField) {
  ::asio::io_context io;
  try {
    HttpClient client(io.get_executor(),
                      {.transport = {.connect_timeout = keel::Duration::zero()}});
    FAIL() << "accepted connect_timeout = 0";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("connect_timeout"), std::string::npos) << e.what();
  }
  try {
    HttpClient client(io.get_executor(), {.limits = {.max_transfers = -1}});
    FAIL() << "accepted max_transfers = -1";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("max_transfers"), std::string::npos) << e.what();
  }
  try {
    HttpClient client(io.get_executor(), {.retry = {.max_attempts = 0}});
    FAIL() << "accepted max_attempts = 0";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("max_attempts"), std::string::npos) << e.what();
  }
}

// A flaky upstream that fails request i's first i % 3 attempts (it reads Keel-Attempt), so each
// operation's outcome is known in advance however the requests interleave.
class FlakyUpstream {
 public:
  FlakyUpstream() {
    server_.new_task_queue = [] { return new httplib::ThreadPool(16); };
    server_.set_keep_alive_max_count(1000);
    server_.set_tcp_nodelay(true);  // else Nagle and delayed ACKs add 40 ms per response
    server_.Get(R"(/op/(\d+))", [this](const httplib::Request& req, httplib::Response& res) {
      ++requests_;
      const int i = std::stoi(req.matches[1]);
      const int attempt = std::stoi(req.get_header_value("Keel-Attempt"));
      if (attempt <= i % 3) {
        res.status = 503;
      } else {
        res.status = 200;
        res.set_content(std::to_string(i), "text/plain");
      }
    });
    // cpp-httplib 0.11 listens with a backlog of 5 and the client opens 16 connections at once: the
    // kernel drops a handshake that finds the queue full and it completes only when retried, a
    // second or more later. The listening socket, seen here before it is bound, gets SOMAXCONN.
    int listener = -1;
    server_.set_socket_options([&listener](socket_t fd) {
      httplib::default_socket_options(fd);
      listener = fd;
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    EXPECT_GT(port_, 0);
    EXPECT_EQ(::listen(listener, SOMAXCONN), 0);
    // bind_to_any_port also listens: connections queue until the accept loop starts.
    thread_ = std::thread([this] { server_.listen_after_bind(); });
  }
  ~FlakyUpstream() {
    server_.stop();
    thread_.join();
  }
  [[nodiscard]] std::string url(int i) const {
    return "http://127.0.0.1:" + std::to_string(port_) + "/op/" + std::to_string(i);
  }
  [[nodiscard]] int requests() const { return requests_.load(); }

 private:
  httplib::Server server_;
  int port_ = 0;
  std::thread thread_;
  std::atomic<int> requests_{0};
};

TEST(AsioHttpClient, AThousandConcurrentRetryingCallsOnOneThread) {
  FlakyUpstream upstream;
  ::asio::io_context io(1);
  ClientOptions c = fast_options(3);
  // What is checked is the attempts and bodies, not timeouts. An attempt's timeout counts its
  // wait for one of the 32 transfer slots, behind up to a thousand first attempts: a slow run
  // (sanitizers, a loaded machine) would turn a per-try timeout into extra attempts. run_for
  // below is what bounds the test.
  c.retry.per_try_timeout = keel::kInfinite;
  c.retry.overall_timeout = seconds(100);
  HttpClient client(io.get_executor(),
                    {.retry = c.retry,
                     // A third of the first attempts fail by design: no breaker, no budget.
                     .brakes = {.circuit_breakers = false, .retry_budget = false},
                     .observability = {.log = c.observability.log},
                     .limits = {.max_host_connections = 16, .max_transfers = 32}});
  constexpr int kCalls = 1000;
  std::vector<int> attempts(kCalls, 0);
  std::vector<std::string> bodies(kCalls);
  int done = 0;
  for (int i = 0; i < kCalls; ++i) {
    ::asio::co_spawn(
        io, client.send({.url = upstream.url(i)}), [&, i](std::exception_ptr e, Result r) {
          EXPECT_FALSE(e);
          EXPECT_TRUE(r.ok()) << i << ": " << keel::to_string(r.reason) << " " << r.error;
          attempts[static_cast<std::size_t>(i)] = r.attempts;
          if (r.response) bodies[static_cast<std::size_t>(i)] = r.response->body;
          ++done;
        });
  }
  io.run_for(seconds(50));
  ASSERT_EQ(done, kCalls);
  int expected_requests = 0;
  for (int i = 0; i < kCalls; ++i) {
    const auto k = static_cast<std::size_t>(i);
    EXPECT_EQ(attempts[k], i % 3 + 1) << i;
    EXPECT_EQ(bodies[k], std::to_string(i)) << i;
    expected_requests += i % 3 + 1;
  }
  EXPECT_EQ(upstream.requests(), expected_requests);
  EXPECT_EQ(client.transfers_in_flight(), 0u);
}

}  // namespace
