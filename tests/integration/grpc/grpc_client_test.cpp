// keel::grpc::Client over real gRPC on loopback: an in-process server whose answers each test
// scripts (scripted_payments.hpp), and a separate server process killed mid-call. Waits between
// attempts are on a ManualClock wherever the test is about the decision, not gRPC's timers.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "keel/core/grpc_status.hpp"
#include "keel/core/retry.hpp"
#include "keel/grpc/client.hpp"
#include "scripted_payments.hpp"
#include "temp_dir.hpp"

namespace {

using namespace std::chrono_literals;
using ::grpc::StatusCode;
using keel::StopReason;
using keel::grpc::CallResult;
using keel::grpc::CallSpec;
using keel::grpc::Client;
using keel::grpc::ClientOptions;
using keel::test::PaymentsServer;
using keel::test::ScriptedAnswer;

// gRPC sends a deadline as grpc-timeout in whole units, rounded up, and the server reads it from
// its own clock: what it sees may exceed the client's timeout by that rounding (5009 ms seen for
// 5 s).
constexpr auto kTimeoutRounding = 50ms;

ClientOptions options_for(const PaymentsServer& server, keel::Clock* clock) {
  ClientOptions o;
  o.target = server.target();
  o.clock = clock;
  o.retry.per_try_timeout = 5s;
  o.retry.overall_timeout = keel::kInfinite;
  o.log = [](std::string_view) {};
  return o;
}

CallResult charge(Client& client, keel::test::ChargeReply* reply, const CallSpec& spec = {}) {
  auto stub = keel::test::Payments::NewStub(client.channel());
  keel::test::ChargeRequest request;
  request.set_account("acct_1");
  request.set_amount_cents(500);
  return client.call(*stub, &keel::test::Payments::Stub::Charge, request, reply, spec);
}

std::string metadata(const keel::test::Arrival& a, const std::string& key) {
  const auto it = a.metadata.find(key);
  return it == a.metadata.end() ? std::string("<none>") : it->second;
}

class GrpcClient : public ::testing::Test {
 protected:
  PaymentsServer server;
  keel::ManualClock clock;
};

TEST_F(GrpcClient, AFirstTrySuccessIsOneAttemptWithAKeyAndNoPreviousAttempts) {
  ASSERT_TRUE(server.started());
  Client client(options_for(server, &clock));
  keel::test::ChargeReply reply;
  const CallResult r = charge(client, &reply);
  EXPECT_TRUE(r.ok()) << r.status.error_message();
  EXPECT_EQ(r.attempts, 1);
  EXPECT_EQ(reply.charge_id(), "ch_1");
  ASSERT_EQ(server.service().count(), 1U);
  const keel::test::Arrival a = server.service().arrivals()[0];
  EXPECT_EQ(metadata(a, "idempotency-key"), r.idempotency_key);
  EXPECT_EQ(r.idempotency_key.size(), 36U);
  EXPECT_EQ(metadata(a, "grpc-previous-rpc-attempts"), "<none>");
  // No finite deadline for the operation: no keel-deadline-ms; the attempt's own (5 s) travels.
  EXPECT_EQ(metadata(a, "keel-deadline-ms"), "<none>");
  ASSERT_TRUE(a.deadline_left.has_value());
  EXPECT_LE(*a.deadline_left, 5000ms + kTimeoutRounding);
  EXPECT_GT(*a.deadline_left, 3000ms);
  EXPECT_EQ(clock.slept(), keel::Duration::zero());
}

// Every status code, answered on every arrival: the server sees exactly the attempts core's
// table allows (gRPC's own retries are off), with a key and without one.
TEST_F(GrpcClient, EveryStatusCodeIsRetriedAsCoreClassifiesIt) {
  ASSERT_TRUE(server.started());
  struct Row {
    StatusCode code;
    int with_key;     // attempts of a keyed call, max_attempts 3
    int without_key;  // a call that is neither idempotent nor keyed
    StopReason reason_with_key;
  };
  const std::vector<Row> rows = {
      {StatusCode::OK, 1, 1, StopReason::kSuccess},
      {StatusCode::CANCELLED, 3, 1, StopReason::kAttemptsExhausted},
      {StatusCode::UNKNOWN, 2, 1, StopReason::kAttemptsExhausted},
      {StatusCode::INVALID_ARGUMENT, 1, 1, StopReason::kPermanent},
      {StatusCode::DEADLINE_EXCEEDED, 3, 1, StopReason::kAttemptsExhausted},
      {StatusCode::NOT_FOUND, 1, 1, StopReason::kPermanent},
      {StatusCode::ALREADY_EXISTS, 1, 1, StopReason::kPermanent},
      {StatusCode::PERMISSION_DENIED, 1, 1, StopReason::kPermanent},
      {StatusCode::RESOURCE_EXHAUSTED, 3, 3, StopReason::kAttemptsExhausted},
      {StatusCode::FAILED_PRECONDITION, 1, 1, StopReason::kPermanent},
      {StatusCode::ABORTED, 3, 3, StopReason::kAttemptsExhausted},
      {StatusCode::OUT_OF_RANGE, 1, 1, StopReason::kPermanent},
      {StatusCode::UNIMPLEMENTED, 1, 1, StopReason::kPermanent},
      {StatusCode::INTERNAL, 2, 1, StopReason::kAttemptsExhausted},
      {StatusCode::UNAVAILABLE, 3, 3, StopReason::kAttemptsExhausted},
      {StatusCode::DATA_LOSS, 1, 1, StopReason::kPermanent},
      {StatusCode::UNAUTHENTICATED, 1, 1, StopReason::kPermanent},
  };
  for (const Row& row : rows) {
    for (const bool keyed : {true, false}) {
      SCOPED_TRACE(std::string(keel::grpc_code_name(row.code)) + (keyed ? " keyed" : " unkeyed"));
      server.service().script({}, {.code = row.code, .trailers = {}, .delay = 0ms});
      const std::size_t before = server.service().count();
      Client client(options_for(server, &clock));
      keel::test::ChargeReply reply;
      const CallResult r = charge(client, &reply, {.send_idempotency_key = keyed});
      const int expected = keyed ? row.with_key : row.without_key;
      EXPECT_EQ(r.attempts, expected);
      EXPECT_EQ(server.service().count() - before, static_cast<std::size_t>(expected));
      EXPECT_EQ(r.status.error_code(), row.code);
      EXPECT_EQ(r.outcome.source, keel::OutcomeSource::kGrpc);
      EXPECT_EQ(r.outcome.code, static_cast<int>(row.code));
      if (keyed) {
        EXPECT_EQ(r.reason, row.reason_with_key) << keel::to_string(r.reason);
      } else if (row.without_key < row.with_key) {
        EXPECT_EQ(r.reason, StopReason::kNotSafeToRetry) << keel::to_string(r.reason);
      }
    }
  }
}

// A per-try timeout too long for gRPC's clock (now + it would overflow) is no deadline at all,
// not a deadline in the past.
TEST_F(GrpcClient, AnAbsurdlyLongAttemptTimeoutIsNoDeadline) {
  ASSERT_TRUE(server.started());
  for (const keel::Duration timeout :
       {keel::Duration(std::chrono::hours(24 * 365 * 200)), keel::kInfinite - 1ns}) {
    ClientOptions o = options_for(server, &clock);
    o.retry.per_try_timeout = timeout;
    Client client(o);
    keel::test::ChargeReply reply;
    const CallResult r = charge(client, &reply);
    EXPECT_TRUE(r.ok()) << r.status.error_message();
    EXPECT_EQ(r.attempts, 1);
  }
  for (const keel::test::Arrival& a : server.service().arrivals()) {
    EXPECT_FALSE(a.deadline_left.has_value());
  }
}

TEST_F(GrpcClient, AnIdempotentMethodIsRetriedWithoutAKey) {
  ASSERT_TRUE(server.started());
  server.service().script({{.code = StatusCode::DEADLINE_EXCEEDED, .trailers = {}, .delay = 0ms}});
  Client client(options_for(server, &clock));
  keel::test::ChargeReply reply;
  const CallResult r = charge(client, &reply, {.idempotent = true});
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r.attempts, 2);
  EXPECT_TRUE(r.idempotency_key.empty());
  for (const keel::test::Arrival& a : server.service().arrivals()) {
    EXPECT_EQ(metadata(a, "idempotency-key"), "<none>");
  }
}

TEST_F(GrpcClient, EveryAttemptCarriesTheSameKeyAndCountsThePreviousOnes) {
  ASSERT_TRUE(server.started());
  const ScriptedAnswer down{.code = StatusCode::UNAVAILABLE, .trailers = {}, .delay = 0ms};
  for (const int prior : {0, 2}) {
    SCOPED_TRACE("prior attempts " + std::to_string(prior));
    server.service().script({down, down});
    const std::size_t before = server.service().count();
    ClientOptions o = options_for(server, &clock);
    o.retry.max_attempts = 5;
    Client client(o);
    keel::test::ChargeReply reply;
    const CallResult r = charge(client, &reply,
                                {.idempotency_key = "order-42-charge",
                                 .prior_attempts = prior,
                                 .metadata = {{"x-tenant", "t1"}}});
    EXPECT_TRUE(r.ok()) << r.status.error_message();
    EXPECT_EQ(r.attempts, 3);
    EXPECT_EQ(r.idempotency_key, "order-42-charge");
    const std::vector<keel::test::Arrival> all = server.service().arrivals();
    ASSERT_EQ(all.size() - before, 3U);
    for (std::size_t i = 0; i < 3; ++i) {
      const keel::test::Arrival& a = all[before + i];
      EXPECT_EQ(metadata(a, "idempotency-key"), "order-42-charge");
      EXPECT_EQ(metadata(a, "x-tenant"), "t1");
      const int previous = static_cast<int>(i) + prior;
      EXPECT_EQ(metadata(a, "grpc-previous-rpc-attempts"),
                previous == 0 ? "<none>" : std::to_string(previous));
    }
  }
}

TEST_F(GrpcClient, AnInvalidKeyIsRefusedBeforeAnythingIsSent) {
  ASSERT_TRUE(server.started());
  Client client(options_for(server, &clock));
  for (const std::string& key :
       {std::string(256, 'k'), std::string("has space"), std::string("line\nbreak"),
        std::string("\xd0\xba\xd0\xbb\xd1\x8e\xd1\x87"), std::string("tab\there")}) {
    SCOPED_TRACE(key.substr(0, 20));
    keel::test::ChargeReply reply;
    const CallResult r = charge(client, &reply, {.idempotency_key = key});
    EXPECT_EQ(r.reason, StopReason::kPermanent);
    EXPECT_EQ(r.attempts, 0);
    EXPECT_EQ(r.status.error_code(), StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(r.status.error_message().find("idempotency_key"), std::string::npos)
        << r.status.error_message();
  }
  EXPECT_EQ(server.service().count(), 0U);
}

// Metadata gRPC's own client would abort the process over (an API misuse), and names keel sets
// itself: refused before anything is sent. A -bin name carries any bytes.
TEST_F(GrpcClient, MetadataGrpcWouldRefuseIsRefusedBeforeAnythingIsSent) {
  ASSERT_TRUE(server.started());
  Client client(options_for(server, &clock));
  using Metadata = std::vector<std::pair<std::string, std::string>>;
  for (const Metadata& md : std::vector<Metadata>{
           {{"X-Tenant", "t1"}},
           {{"", "empty name"}},
           {{"\xd0\xba\xd0\xbb", "non-ascii name"}},
           {{"x tenant", "space in the name"}},
           {{"x-tenant", "\xd0\xba\xd0\xbb\xd1\x8e\xd1\x87"}},
           {{"x-tenant", "line\nbreak"}},
           {{"x-tenant", std::string("nul\0byte", 8)}},
           {{"idempotency-key", "mine"}},
           {{"grpc-previous-rpc-attempts", "7"}},
           {{"keel-deadline-ms", "5"}},
       }) {
    SCOPED_TRACE(md.front().first);
    keel::test::ChargeReply reply;
    const CallResult r = charge(client, &reply, {.metadata = md});
    EXPECT_EQ(r.attempts, 0);
    EXPECT_EQ(r.reason, StopReason::kPermanent);
    EXPECT_EQ(r.status.error_code(), StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(r.status.error_message().find("metadata"), std::string::npos)
        << r.status.error_message();
  }
  EXPECT_EQ(server.service().count(), 0U);
  keel::test::ChargeReply reply;
  const CallResult bin =
      charge(client, &reply, {.metadata = {{"x-trace-bin", std::string("\x00\xff\x10", 3)}}});
  EXPECT_TRUE(bin.ok()) << bin.status.error_message();
  ASSERT_EQ(server.service().count(), 1U);
  EXPECT_EQ(metadata(server.service().arrivals()[0], "x-trace-bin"),
            std::string("\x00\xff\x10", 3));
}

// A pushback is the wait before the next attempt, capped by retry_after_cap, whatever keel's own
// backoff would have been. gRPC reads the trailer itself and hands on its own reading: a sign or
// spaces around the digits are dropped, the last of two values is kept, and a value too large
// for its int64 comes out negative (so: no retry). 0 is no advice: keel's backoff (<= 100 ms).
TEST_F(GrpcClient, APushbackIsTheWaitBeforeTheNextAttempt) {
  ASSERT_TRUE(server.started());
  using Trailers = std::vector<std::pair<std::string, std::string>>;
  struct Point {
    Trailers trailers;
    std::optional<keel::Duration> waited;  // nullopt: no retry
  };
  const auto one = [](std::string v) { return Trailers{{"grpc-retry-pushback-ms", std::move(v)}}; };
  const std::vector<Point> points = {
      {one("1"), 1ms},
      {one("250"), 250ms},
      {one("4000"), 4000ms},
      {one("59999"), 59999ms},
      {one("60001"), 60s},
      {one("86400000"), 60s},
      {one("+5"), 5ms},
      {one(" 7 "), 7ms},
      {{{"grpc-retry-pushback-ms", "100"}, {"grpc-retry-pushback-ms", "200"}}, 200ms},
      {{{"grpc-retry-pushback-ms", "300"}, {"grpc-retry-pushback-ms", "300"}}, 300ms},
      {one("-1"), std::nullopt},
      {one("-250"), std::nullopt},
      {one("abc"), std::nullopt},
      {one(""), std::nullopt},
      {one("1.5"), std::nullopt},
      {one("5ms"), std::nullopt},
      {one("99999999999999999999999"), std::nullopt},
      {one(std::string(6000, '9')), std::nullopt},
  };
  for (const Point& p : points) {
    SCOPED_TRACE("pushback [" + p.trailers.back().second.substr(0, 30) + "]");
    for (const StatusCode code : {StatusCode::UNAVAILABLE, StatusCode::RESOURCE_EXHAUSTED}) {
      keel::ManualClock local;
      server.service().script({{.code = code, .trailers = p.trailers, .delay = 0ms}});
      const std::size_t before = server.service().count();
      Client client(options_for(server, &local));
      keel::test::ChargeReply reply;
      const CallResult r = charge(client, &reply);
      if (p.waited) {
        EXPECT_TRUE(r.ok()) << r.status.error_message() << " [" << r.pushback << "]";
        EXPECT_EQ(r.attempts, 2);
        EXPECT_EQ(local.slept(), *p.waited);
      } else {
        EXPECT_FALSE(r.ok());
        EXPECT_EQ(r.attempts, 1) << "[" << r.pushback << "] " << keel::to_string(r.reason);
        EXPECT_EQ(r.status.error_code(), code);
      }
      EXPECT_EQ(server.service().count() - before, static_cast<std::size_t>(r.attempts));
    }
  }
  keel::ManualClock local;
  server.service().script({{.code = StatusCode::UNAVAILABLE, .trailers = one("0"), .delay = 0ms}});
  Client client(options_for(server, &local));
  keel::test::ChargeReply reply;
  EXPECT_TRUE(charge(client, &reply).ok());
  EXPECT_LE(local.slept(), 100ms);
}

// Trailers a hostile or broken server sends: the call ends, classified, within its attempts.
TEST_F(GrpcClient, HostileTrailersEndTheCallCleanly) {
  ASSERT_TRUE(server.started());
  const std::vector<std::vector<std::pair<std::string, std::string>>> trailers = {
      {{"x-big", std::string(20000, 'a')}},
      {{"grpc-retry-pushback-ms-bin", std::string("\x00\x01\xff", 3)}},
      {{"x-many", "1"}, {"x-many", "2"}, {"x-many", "3"}, {"x-many", "4"}},
  };
  for (const auto& t : trailers) {
    SCOPED_TRACE(t.front().first);
    // A server of its own: an attempt the client gave up on (a connection dropped over an
    // oversized trailer) may still reach its server after the call returned.
    PaymentsServer own;
    ASSERT_TRUE(own.started());
    own.service().script({}, {.code = StatusCode::UNAVAILABLE, .trailers = t, .delay = 0ms});
    Client client(options_for(own, &clock));
    keel::test::ChargeReply reply;
    const CallResult r = charge(client, &reply);
    EXPECT_FALSE(r.ok());
    EXPECT_GE(r.attempts, 1);
    EXPECT_LE(r.attempts, 3);
    EXPECT_TRUE(own.service().wait_for_arrivals(1, 5000ms));
  }
}

// gRPC's timers, not a ManualClock: each attempt ends at its own timeout, and the server is told.
TEST_F(GrpcClient, AnAttemptEndsAtItsTimeoutAndTheServerSeesTheDeadlines) {
  ASSERT_TRUE(server.started());
  server.service().script({}, {.code = StatusCode::OK, .trailers = {}, .delay = 3000ms});
  ClientOptions o = options_for(server, nullptr);
  o.retry.per_try_timeout = 150ms;
  o.retry.overall_timeout = 20s;
  o.retry.backoff = {.base = 1ms, .cap = 5ms};
  Client client(o);
  keel::test::ChargeReply reply;
  const auto began = std::chrono::steady_clock::now();
  const CallResult r = charge(client, &reply);
  const auto took = std::chrono::steady_clock::now() - began;
  EXPECT_EQ(r.reason, StopReason::kAttemptsExhausted);
  EXPECT_EQ(r.attempts, 3);
  EXPECT_EQ(r.status.error_code(), StatusCode::DEADLINE_EXCEEDED);
  EXPECT_TRUE(r.outcome.timed_out);
  EXPECT_LT(took, 2500ms);  // three attempts of 150 ms, not one of 3 s
  ASSERT_EQ(server.service().count(), 3U);
  for (const keel::test::Arrival& a : server.service().arrivals()) {
    ASSERT_TRUE(a.deadline_left.has_value());
    EXPECT_LE(*a.deadline_left, 150ms + kTimeoutRounding);
    const long long left = std::stoll(metadata(a, "keel-deadline-ms"));
    EXPECT_GT(left, 15000);
    EXPECT_LE(left, 20000);
  }
}

TEST_F(GrpcClient, TheCallersDeadlineBoundsTheLastAttempt) {
  ASSERT_TRUE(server.started());
  server.service().script({}, {.code = StatusCode::OK, .trailers = {}, .delay = 3000ms});
  ClientOptions o = options_for(server, nullptr);
  o.retry.per_try_timeout = 2s;
  Client client(o);
  keel::test::ChargeReply reply;
  const CallResult r =
      charge(client, &reply, {.deadline = keel::Deadline::after(keel::steady_clock(), 300ms)});
  EXPECT_EQ(r.reason, StopReason::kDeadline);
  EXPECT_EQ(r.attempts, 1);
  ASSERT_EQ(server.service().count(), 1U);
  const keel::test::Arrival a = server.service().arrivals()[0];
  ASSERT_TRUE(a.deadline_left.has_value());
  EXPECT_LE(*a.deadline_left, 300ms + kTimeoutRounding);
  EXPECT_LE(std::stoll(metadata(a, "keel-deadline-ms")), 300);
}

TEST_F(GrpcClient, AnOpenBreakerSendsNothingAndAHalfOpenOneSendsOneTrial) {
  ASSERT_TRUE(server.started());
  keel::BreakerRegistry breakers({.breaker = {.minimum_calls = 4,
                                              .failure_rate_threshold = 0.5,
                                              .break_duration = 5s,
                                              .clock = &clock}});
  ClientOptions o = options_for(server, &clock);
  o.retry.max_attempts = 1;
  o.brakes.breakers = &breakers;
  o.brakes.breaker_key = "payments";
  Client client(o);
  server.service().script({}, {.code = StatusCode::UNAVAILABLE, .trailers = {}, .delay = 0ms});
  keel::test::ChargeReply reply;
  for (int i = 0; i < 4; ++i) (void)charge(client, &reply);
  EXPECT_EQ(server.service().count(), 4U);
  EXPECT_EQ(breakers.state("payments"), keel::BreakerState::kOpen);
  const CallResult refused = charge(client, &reply);
  EXPECT_EQ(refused.reason, StopReason::kCircuitOpen);
  EXPECT_EQ(refused.attempts, 0);
  EXPECT_EQ(refused.outcome.kind, keel::OutcomeKind::kNotAttempted);
  EXPECT_EQ(refused.status.error_code(), StatusCode::UNAVAILABLE);
  EXPECT_EQ(server.service().count(), 4U);  // nothing sent
  clock.advance(5s);
  server.service().script({}, {.code = StatusCode::OK, .trailers = {}, .delay = 0ms});
  const CallResult trial = charge(client, &reply);
  EXPECT_TRUE(trial.ok());
  EXPECT_EQ(server.service().count(), 5U);
  EXPECT_EQ(breakers.state("payments"), keel::BreakerState::kClosed);
}

TEST_F(GrpcClient, AnExhaustedBudgetStopsTheRetries) {
  ASSERT_TRUE(server.started());
  keel::TokenBucketBudget budget({.capacity = 10, .retry_cost = 5});
  ClientOptions o = options_for(server, &clock);
  o.retry.max_attempts = 10;
  o.brakes.budget = &budget;
  o.brakes.circuit_breakers = false;
  Client client(o);
  server.service().script({}, {.code = StatusCode::UNAVAILABLE, .trailers = {}, .delay = 0ms});
  keel::test::ChargeReply reply;
  const CallResult r = charge(client, &reply);
  EXPECT_EQ(r.reason, StopReason::kBudgetExhausted);
  EXPECT_EQ(r.attempts, 3);  // the first and two retries of 5 tokens each
  EXPECT_EQ(server.service().count(), 3U);
  EXPECT_EQ(r.status.error_code(), StatusCode::UNAVAILABLE);
}

TEST_F(GrpcClient, ChannelArgumentsThatTurnOnGrpcRetriesAreRefused) {
  ASSERT_TRUE(server.started());
  const auto refused = [&](const std::function<void(::grpc::ChannelArguments&)>& set,
                           const std::string& named) {
    ClientOptions o = options_for(server, &clock);
    set(o.arguments);
    try {
      Client client(o);
      ADD_FAILURE() << "built a client on arguments naming " << named;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(named), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("keel::grpc::ClientOptions"), std::string::npos);
    }
  };
  refused(
      [](::grpc::ChannelArguments& a) {
        a.SetServiceConfigJSON(R"({"methodConfig":[{"name":[{"service":"keel.test.Payments"}],)"
                               R"("retryPolicy":{"maxAttempts":4,"initialBackoff":"0.1s",)"
                               R"("maxBackoff":"1s","backoffMultiplier":2,)"
                               R"("retryableStatusCodes":["UNAVAILABLE"]}}]})");
      },
      "retryPolicy");
  refused(
      [](::grpc::ChannelArguments& a) {
        a.SetServiceConfigJSON(R"({"methodConfig":[{"name":[{}],"hedgingPolicy":)"
                               R"({"maxAttempts":2,"hedgingDelay":"0.1s"}}]})");
      },
      "hedgingPolicy");
  refused([](::grpc::ChannelArguments& a) { a.SetInt("grpc.enable_retries", 1); },
          "grpc.enable_retries");
  // A service config without a retry policy, and retries said off, are fine.
  ClientOptions o = options_for(server, &clock);
  o.arguments.SetServiceConfigJSON(R"({"loadBalancingConfig":[{"round_robin":{}}]})");
  o.arguments.SetInt("grpc.enable_retries", 0);
  Client client(o);
  keel::test::ChargeReply reply;
  EXPECT_TRUE(charge(client, &reply).ok());

  ClientOptions empty;
  EXPECT_THROW(Client{empty}, std::invalid_argument);
  ClientOptions internal = options_for(server, &clock);
  internal.max_retries_on_internal = 255;
  EXPECT_THROW(Client{internal}, std::invalid_argument);
}

// One retrying layer: inside a keel retry loop, a call makes one attempt, so three outer
// attempts reach the server three times, not nine.
TEST_F(GrpcClient, ACallInsideAKeelRetryLoopMakesOneAttempt) {
  ASSERT_TRUE(server.started());
  server.service().script({}, {.code = StatusCode::UNAVAILABLE, .trailers = {}, .delay = 0ms});
  Client client(options_for(server, &clock));
  const keel::RetryPolicy outer({.max_attempts = 3});
  int inner_attempts = 0;
  const auto result = keel::retry(
      outer,
      [&] {
        keel::test::ChargeReply reply;
        const CallResult r = charge(client, &reply);
        inner_attempts += r.attempts;
        return r.outcome;
      },
      keel::CallOptions{.clock = &clock});
  EXPECT_EQ(result.attempts, 3);
  EXPECT_EQ(inner_attempts, 3);
  EXPECT_EQ(server.service().count(), 3U);
}

// Hedging, through the stub's callback method: attempts run on gRPC's threads.
CallResult charge_async(Client& client, keel::test::ChargeReply* reply, const CallSpec& spec = {}) {
  auto stub = keel::test::Payments::NewStub(client.channel());
  keel::test::ChargeRequest request;
  request.set_account("acct_1");
  request.set_amount_cents(500);
  return client.call(*stub->async(), &keel::test::Payments::Stub::async::Charge, request, reply,
                     spec);
}

ClientOptions hedged(const PaymentsServer& server, keel::Duration delay) {
  ClientOptions o = options_for(server, nullptr);
  o.hedge = keel::HedgeOptions{.delay = delay, .max_hedges = 1};
  return o;
}

TEST_F(GrpcClient, AHedgeIsSentAfterTheDelayAndTheFirstAnswerWins) {
  ASSERT_TRUE(server.started());
  server.service().script({{.code = StatusCode::OK, .trailers = {}, .delay = 3000ms}});
  Client client(hedged(server, 50ms));
  keel::test::ChargeReply reply;
  const auto began = std::chrono::steady_clock::now();
  const CallResult r = charge_async(client, &reply);
  EXPECT_LT(std::chrono::steady_clock::now() - began, 2000ms);  // not the slow attempt's 3 s
  EXPECT_TRUE(r.ok()) << r.status.error_message();
  EXPECT_EQ(r.attempts, 2);
  EXPECT_EQ(reply.arrival(), 2);  // the hedge's answer
  // The slow attempt lost and was cancelled: the server sees it end.
  EXPECT_TRUE(server.service().wait_for_cancelled(1, 3000ms));
  const std::vector<keel::test::Arrival> all = server.service().arrivals();
  ASSERT_EQ(all.size(), 2U);
  EXPECT_EQ(metadata(all[0], "idempotency-key"), r.idempotency_key);
  EXPECT_EQ(metadata(all[1], "idempotency-key"), r.idempotency_key);
  EXPECT_EQ(metadata(all[1], "grpc-previous-rpc-attempts"), "1");
}

TEST_F(GrpcClient, AHedgeTheBudgetRefusesIsNotSentAndTheCallWaits) {
  ASSERT_TRUE(server.started());
  server.service().script({{.code = StatusCode::OK, .trailers = {}, .delay = 300ms}});
  keel::TokenBucketBudget budget({.capacity = 5, .retry_cost = 10});
  ClientOptions o = hedged(server, 20ms);
  o.brakes.budget = &budget;
  Client client(o);
  keel::test::ChargeReply reply;
  const auto began = std::chrono::steady_clock::now();
  const CallResult r = charge_async(client, &reply);
  EXPECT_GE(std::chrono::steady_clock::now() - began, 300ms);
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r.attempts, 1);
  EXPECT_EQ(server.service().count(), 1U);
}

TEST_F(GrpcClient, ACallThatIsNotSafeToRepeatIsNotHedged) {
  ASSERT_TRUE(server.started());
  server.service().script({{.code = StatusCode::OK, .trailers = {}, .delay = 300ms}});
  Client client(hedged(server, 20ms));
  keel::test::ChargeReply reply;
  const CallResult r = charge_async(client, &reply, {.send_idempotency_key = false});
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r.attempts, 1);
  EXPECT_EQ(server.service().count(), 1U);
}

// Both attempts of a round fail: the round ends when the last one answers, and the engine
// retries it as one failed attempt.
TEST_F(GrpcClient, ARoundWhoseAttemptsAllFailIsRetriedAsOne) {
  ASSERT_TRUE(server.started());
  server.service().script({{.code = StatusCode::UNAVAILABLE, .trailers = {}, .delay = 200ms},
                           {.code = StatusCode::UNAVAILABLE, .trailers = {}, .delay = 0ms}});
  ClientOptions o = hedged(server, 20ms);
  o.retry.backoff = {.base = 1ms, .cap = 5ms};
  Client client(o);
  keel::test::ChargeReply reply;
  const CallResult r = charge_async(client, &reply);
  EXPECT_TRUE(r.ok()) << r.status.error_message();
  EXPECT_GE(r.attempts, 3);  // the first round's two, then the second round's first
  EXPECT_EQ(reply.arrival(), static_cast<int>(server.service().count()));
}

TEST_F(GrpcClient, WithoutAHedgePolicyTheCallbackPathRetriesAsTheBlockingOne) {
  ASSERT_TRUE(server.started());
  const ScriptedAnswer down{.code = StatusCode::UNAVAILABLE, .trailers = {}, .delay = 0ms};
  server.service().script({down, down});
  Client client(options_for(server, &clock));
  keel::test::ChargeReply reply;
  const CallResult r = charge_async(client, &reply);
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r.attempts, 3);
  EXPECT_EQ(reply.arrival(), 3);
  EXPECT_GT(clock.slept(), keel::Duration::zero());  // core's backoff, on the call's clock
}

// The server process is killed while it holds the call and a successor listens on the same port
// after an outage of some length: the retries reach the successor (the waits between attempts
// let the channel reconnect), with the same key and the count of the attempts before.
TEST(GrpcClientProcess, AServerKilledMidCallIsRetriedOnItsSuccessor) {
  const std::string server_bin = KEEL_GRPC_TEST_SERVER;
  for (const int down_ms : {0, 400, 1500}) {
    SCOPED_TRACE("successor after " + std::to_string(down_ms) + " ms");
    keel::test::TempDir dir("keel-grpc");
    // posix_spawn, not fork: gRPC's fork handlers would act on this process's connections.
    const auto spawn = [&](int port, const std::string& name, long delay_ms) {
      std::vector<std::string> args = {server_bin,
                                       "--port",
                                       std::to_string(port),
                                       "--port-file",
                                       (dir.path() / (name + ".port")).string(),
                                       "--arrivals-file",
                                       (dir.path() / (name + ".arrivals")).string(),
                                       "--delay-ms",
                                       std::to_string(delay_ms)};
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      pid_t pid = -1;
      if (posix_spawn(&pid, server_bin.c_str(), nullptr, nullptr, argv.data(), environ) != 0) {
        return pid_t{-1};
      }
      return pid;
    };
    const auto read_port = [&](const std::string& name) {
      const std::filesystem::path file = dir.path() / (name + ".port");
      for (int i = 0; i < 1000 && !std::filesystem::exists(file); ++i) {
        std::this_thread::sleep_for(10ms);
      }
      int port = 0;
      std::ifstream(file) >> port;
      return port;
    };
    const auto lines = [&](const std::string& name) {
      std::vector<std::string> out;
      std::ifstream in(dir.path() / (name + ".arrivals"));
      for (std::string line; std::getline(in, line);) out.push_back(line);
      return out;
    };

    const pid_t first = spawn(0, "first", 30000);
    ASSERT_GT(first, 0);
    const int port = read_port("first");
    ASSERT_GT(port, 0);

    ClientOptions o;
    o.target = "127.0.0.1:" + std::to_string(port);
    o.retry.max_attempts = 60;
    o.retry.per_try_timeout = 10s;
    o.retry.overall_timeout = 40s;
    o.retry.backoff = {.base = 50ms, .cap = 400ms};
    // About the reconnection: with a breaker, the outage's fast failures would open it (as they
    // should) before a late successor listens.
    o.brakes.circuit_breakers = false;
    o.log = [](std::string_view) {};
    Client client(o);
    CallResult result;
    keel::test::ChargeReply reply;
    std::thread caller([&] { result = charge(client, &reply); });

    for (int i = 0; i < 1000 && lines("first").empty(); ++i) std::this_thread::sleep_for(10ms);
    ASSERT_EQ(lines("first").size(), 1U);
    kill(first, SIGKILL);
    waitpid(first, nullptr, 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(down_ms));
    const pid_t second = spawn(port, "second", 0);
    EXPECT_EQ(read_port("second"), port);
    caller.join();
    kill(second, SIGTERM);
    waitpid(second, nullptr, 0);

    EXPECT_TRUE(result.ok()) << keel::to_string(result.reason) << ": "
                             << result.status.error_message();
    EXPECT_GE(result.attempts, 2);
    const std::vector<std::string> answered = lines("second");
    ASSERT_EQ(answered.size(), 1U);
    std::istringstream first_line(lines("first")[0]);
    std::istringstream second_line(answered[0]);
    std::string first_key;
    std::string second_key;
    int first_previous = -1;
    int second_previous = -1;
    first_line >> first_key >> first_previous;
    second_line >> second_key >> second_previous;
    EXPECT_EQ(first_key, result.idempotency_key);
    EXPECT_EQ(second_key, result.idempotency_key);
    EXPECT_EQ(first_previous, 0);
    EXPECT_EQ(second_previous, result.attempts - 1);
  }
}

}  // namespace
