#include "keel/classify.hpp"

#include <gtest/gtest.h>

#include <cerrno>

using namespace std::chrono_literals;
using keel::Method;
using keel::OutcomeKind;
using keel::RequestTraits;

namespace {
const RequestTraits kGet{Method::kGet, false};
const RequestTraits kPost{Method::kPost, false};
const RequestTraits kPostWithKey{Method::kPost, true};
OutcomeKind kind(int status, const RequestTraits& r = kGet) {
  return keel::classify_http_status(status, r).kind;
}
}  // namespace

TEST(ClassifyHttp, SeedTable) {
  for (int s : {200, 201, 204, 301, 304}) EXPECT_EQ(kind(s), OutcomeKind::kSuccess) << s;
  for (int s : {400, 401, 403, 404, 422}) EXPECT_EQ(kind(s), OutcomeKind::kPermanent) << s;
  for (int s : {408, 502, 504}) EXPECT_EQ(kind(s), OutcomeKind::kTransient) << s;
  for (int s : {429, 503}) EXPECT_EQ(kind(s), OutcomeKind::kThrottled) << s;
  EXPECT_EQ(kind(500), OutcomeKind::kAmbiguous);
  EXPECT_EQ(kind(501), OutcomeKind::kPermanent);
}

TEST(ClassifyHttp, FiveHundredIsRetriedAtMostOnceByDefault) {
  EXPECT_EQ(keel::classify_http_status(500, kGet).retry_limit, 1);
  EXPECT_EQ(keel::classify_http_status(500, kGet, std::nullopt, 3).retry_limit, 3);
  EXPECT_EQ(keel::classify_http_status(503, kGet).retry_limit, keel::Outcome::kNoRetryLimit);
}

TEST(ClassifyHttp, RetryAfterBecomesServerDelayOnThrottling) {
  auto o = keel::classify_http_status(429, kGet, 7s);
  EXPECT_EQ(o.kind, OutcomeKind::kThrottled);
  EXPECT_EQ(o.server_delay, 7s);
  EXPECT_FALSE(keel::classify_http_status(503, kGet).has_server_delay());
  // Retry-After on a 400 does not make it retryable.
  EXPECT_EQ(keel::classify_http_status(400, kGet, 1s).kind, OutcomeKind::kPermanent);
}

TEST(ClassifyHttp, ConflictIsRetryableOnlyWithAnIdempotencyKey) {
  EXPECT_EQ(kind(409, kPostWithKey), OutcomeKind::kThrottled);
  EXPECT_EQ(kind(409, kPost), OutcomeKind::kPermanent);
  EXPECT_EQ(kind(409, kGet), OutcomeKind::kPermanent);
}

TEST(ClassifyHttp, MethodAwareSafety) {
  for (Method m : {Method::kGet, Method::kHead, Method::kOptions, Method::kPut, Method::kDelete}) {
    EXPECT_TRUE(keel::is_idempotent(m));
    EXPECT_TRUE((RequestTraits{m, false}.safe_to_repeat()));
  }
  for (Method m : {Method::kPost, Method::kPatch, Method::kOther}) {
    EXPECT_FALSE(keel::is_idempotent(m));
    EXPECT_FALSE((RequestTraits{m, false}.safe_to_repeat()));
    EXPECT_TRUE((RequestTraits{m, true}.safe_to_repeat()));
  }
  EXPECT_EQ(keel::parse_method("PATCH"), Method::kPatch);
  EXPECT_EQ(keel::parse_method("patch"), Method::kOther);
}

TEST(ClassifyHttp, BodyHookFindsErrorsHiddenInA200) {
  keel::HttpClassifier classifier(
      {.body = [](int status, std::string_view body) -> std::optional<keel::Outcome> {
        if (status != 200) return std::nullopt;
        if (body.find("\"code\":\"RATE_LIMITED\"") != std::string_view::npos) {
          return keel::Outcome::throttled();
        }
        if (body.find("\"code\":\"NAME_TOO_LONG\"") != std::string_view::npos) {
          return keel::Outcome::permanent();
        }
        return std::nullopt;
      }});
  auto limited = classifier.classify(200, R"({"code":"RATE_LIMITED"})", kGet, 3s);
  EXPECT_EQ(limited.kind, OutcomeKind::kThrottled);
  EXPECT_EQ(limited.source, keel::OutcomeSource::kBody);
  EXPECT_EQ(limited.server_delay, 3s);
  EXPECT_EQ(classifier.classify(200, R"({"code":"NAME_TOO_LONG"})", kGet).kind,
            OutcomeKind::kPermanent);
  EXPECT_EQ(classifier.classify(200, R"({"ok":true})", kGet).kind, OutcomeKind::kSuccess);
  EXPECT_EQ(classifier.classify(503, "", kGet).kind, OutcomeKind::kThrottled);
  EXPECT_THROW(keel::HttpClassifier({.max_retries_on_500 = -1}), std::invalid_argument);
}

TEST(ClassifyNetwork, BeforeSendingEverythingIsTransient) {
  for (auto e : {keel::NetError::kConnectionRefused, keel::NetError::kConnectionReset,
                 keel::NetError::kTimedOut, keel::NetError::kHostUnreachable,
                 keel::NetError::kNetworkUnreachable, keel::NetError::kDnsTemporary}) {
    EXPECT_EQ(keel::classify_network(e, false).kind, OutcomeKind::kTransient);
  }
  EXPECT_EQ(keel::classify_network(keel::NetError::kDnsNotFound, false).kind,
            OutcomeKind::kPermanent);
}

TEST(ClassifyNetwork, AfterSendingATimeoutOrResetIsAmbiguous) {
  auto timeout = keel::classify_network(keel::NetError::kTimedOut, true);
  EXPECT_EQ(timeout.kind, OutcomeKind::kAmbiguous);
  EXPECT_TRUE(timeout.timed_out);
  EXPECT_EQ(keel::classify_network(keel::NetError::kConnectionReset, true).kind,
            OutcomeKind::kAmbiguous);
  EXPECT_EQ(keel::classify_network(keel::NetError::kConnectionRefused, true).kind,
            OutcomeKind::kTransient);
}

TEST(ClassifyNetwork, ErrnoMapping) {
  EXPECT_EQ(keel::net_error_from_errno(ECONNRESET), keel::NetError::kConnectionReset);
  EXPECT_EQ(keel::net_error_from_errno(ECONNREFUSED), keel::NetError::kConnectionRefused);
  EXPECT_EQ(keel::net_error_from_errno(ETIMEDOUT), keel::NetError::kTimedOut);
  EXPECT_EQ(keel::net_error_from_errno(EHOSTUNREACH), keel::NetError::kHostUnreachable);
  EXPECT_EQ(keel::net_error_from_errno(ENETUNREACH), keel::NetError::kNetworkUnreachable);
  EXPECT_FALSE(keel::net_error_from_errno(ENOENT));
}

TEST(ClassifySqlstate, RetryTheWholeTransactionOnSerializationAndDeadlock) {
  EXPECT_EQ(keel::classify_sqlstate("40001", false).kind, OutcomeKind::kTransient);
  EXPECT_EQ(keel::classify_sqlstate("40P01", false).kind, OutcomeKind::kTransient);
  EXPECT_EQ(keel::classify_sqlstate("40001", true).kind, OutcomeKind::kTransient);
  EXPECT_STREQ(keel::classify_sqlstate("40P01", false).sqlstate, "40P01");
}

TEST(ClassifySqlstate, ConnectionLossIsTransientExceptDuringCommit) {
  EXPECT_EQ(keel::classify_sqlstate("08006", false).kind, OutcomeKind::kTransient);
  EXPECT_EQ(keel::classify_sqlstate("08006", true).kind, OutcomeKind::kAmbiguous);
  EXPECT_EQ(keel::classify_sqlstate("08000", true).kind, OutcomeKind::kAmbiguous);
}

TEST(ClassifySqlstate, EverythingElseIsPermanent) {
  for (const char* s :
       {"23505", "42P01", "22P02", "40002", "XX000", "", "4000", "40001x", "4o001"}) {
    EXPECT_EQ(keel::classify_sqlstate(s, false).kind, OutcomeKind::kPermanent) << s;
  }
}

TEST(Describe, NamesSourceAndKind) {
  EXPECT_EQ(keel::describe(keel::classify_http_status(503, kGet, 2s)),
            "HTTP 503 (throttled, Retry-After 2s)");
  EXPECT_EQ(keel::describe(keel::classify_network(keel::NetError::kConnectionReset, true)),
            "network: connection reset (ambiguous)");
  EXPECT_EQ(keel::describe(keel::classify_sqlstate("40001", false)), "SQLSTATE 40001 (transient)");
  EXPECT_EQ(keel::describe(keel::Outcome::transient()), "transient");
}

TEST(OutcomeKinds, DependencyFailures) {
  EXPECT_TRUE(keel::is_dependency_failure(OutcomeKind::kTransient));
  EXPECT_TRUE(keel::is_dependency_failure(OutcomeKind::kThrottled));
  EXPECT_TRUE(keel::is_dependency_failure(OutcomeKind::kAmbiguous));
  EXPECT_FALSE(keel::is_dependency_failure(OutcomeKind::kPermanent));
  EXPECT_FALSE(keel::is_dependency_failure(OutcomeKind::kSuccess));
}
