#include "keel/core/classify.hpp"

#include <gtest/gtest.h>

#include <cerrno>
#include <stdexcept>
#include <string>
#include <vector>

#include "keel/core/clock.hpp"
#include "keel/core/retry.hpp"

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
  // A URL the client cannot send is refused the same way on every attempt, sent or not.
  for (const bool sent : {false, true}) {
    const keel::Outcome o = keel::classify_network(keel::NetError::kUnusableUrl, sent);
    EXPECT_EQ(o.kind, OutcomeKind::kPermanent);
    EXPECT_FALSE(keel::is_dependency_failure(o.kind));
  }
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

TEST(ClassifyDatabase, EachSqlstateSaysWhatARetryNeeds) {
  using keel::DatabaseFailure;
  const struct {
    const char* state;
    DatabaseFailure failure;
  } cases[] = {
      {"40001", DatabaseFailure::kConflict},    {"40P01", DatabaseFailure::kConflict},
      {"55P03", DatabaseFailure::kBusy},        {"57014", DatabaseFailure::kBusy},
      {"08006", DatabaseFailure::kUnavailable}, {"08001", DatabaseFailure::kUnavailable},
      {"53300", DatabaseFailure::kUnavailable}, {"53100", DatabaseFailure::kUnavailable},
      {"25P03", DatabaseFailure::kUnavailable}, {"57P05", DatabaseFailure::kUnavailable},
      {"25006", DatabaseFailure::kWrongNode},   {"57P01", DatabaseFailure::kWrongNode},
      {"57P02", DatabaseFailure::kWrongNode},   {"57P03", DatabaseFailure::kWrongNode},
      {"23514", DatabaseFailure::kPermanent},   {"23505", DatabaseFailure::kPermanent},
      {"P0001", DatabaseFailure::kPermanent},   {"22P02", DatabaseFailure::kPermanent},
      {"42501", DatabaseFailure::kPermanent},   {"42P01", DatabaseFailure::kPermanent},
      {"XX000", DatabaseFailure::kPermanent},   {"", DatabaseFailure::kPermanent},
      {"5503", DatabaseFailure::kPermanent},    {"55p03", DatabaseFailure::kPermanent},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(keel::classify_database_sqlstate(c.state, false), c.failure) << c.state;
  }
}

TEST(ClassifyDatabase, ALostConnectionOrAServerGoingAwayDuringCommitIsInDoubt) {
  using keel::DatabaseFailure;
  for (const char* s : {"08006", "08000", "57P01", "57P02", "57P03"}) {
    EXPECT_EQ(keel::classify_database_sqlstate(s, true), DatabaseFailure::kInDoubt) << s;
    EXPECT_EQ(keel::classify_sqlstate(s, true).kind, OutcomeKind::kAmbiguous) << s;
  }
  // A rollback the server reported at COMMIT is definite; so is a constraint checked there.
  EXPECT_EQ(keel::classify_database_sqlstate("40001", true), DatabaseFailure::kConflict);
  EXPECT_EQ(keel::classify_database_sqlstate("23505", true), DatabaseFailure::kPermanent);
}

TEST(ClassifyDatabase, TheRetryEngineSeesEveryRetryableFailureAsTransient) {
  using keel::DatabaseFailure;
  EXPECT_EQ(keel::outcome_kind(DatabaseFailure::kConflict), OutcomeKind::kTransient);
  EXPECT_EQ(keel::outcome_kind(DatabaseFailure::kBusy), OutcomeKind::kTransient);
  EXPECT_EQ(keel::outcome_kind(DatabaseFailure::kUnavailable), OutcomeKind::kTransient);
  EXPECT_EQ(keel::outcome_kind(DatabaseFailure::kWrongNode), OutcomeKind::kTransient);
  EXPECT_EQ(keel::outcome_kind(DatabaseFailure::kInDoubt), OutcomeKind::kAmbiguous);
  EXPECT_EQ(keel::outcome_kind(DatabaseFailure::kPermanent), OutcomeKind::kPermanent);
  for (const char* s : {"25006", "55P03", "57014", "53300"}) {
    EXPECT_EQ(keel::classify_sqlstate(s, false).kind, OutcomeKind::kTransient) << s;
  }
}

TEST(ClassifyDatabase, SqliteBusyIsBusyAndALostCommitIsInDoubt) {
  using keel::DatabaseFailure;
  EXPECT_EQ(keel::classify_database_sqlite(5, false, false), DatabaseFailure::kBusy);
  EXPECT_EQ(keel::classify_database_sqlite(517, true, false), DatabaseFailure::kConflict);
  EXPECT_EQ(keel::classify_database_sqlite(261, false, false), DatabaseFailure::kBusy);
  EXPECT_EQ(keel::classify_database_sqlite(6, false, false), DatabaseFailure::kBusy);
  EXPECT_EQ(keel::classify_database_sqlite(10, true, true), DatabaseFailure::kInDoubt);
  EXPECT_EQ(keel::classify_database_sqlite(275, false, false),  // SQLITE_CONSTRAINT_CHECK
            DatabaseFailure::kPermanent);
  EXPECT_EQ(keel::classify_database_sqlite(1811, false, false),  // SQLITE_CONSTRAINT_TRIGGER
            DatabaseFailure::kPermanent);
  EXPECT_EQ(keel::classify_database_sqlite(14, false, false),  // SQLITE_CANTOPEN
            DatabaseFailure::kUnavailable);
  EXPECT_EQ(keel::classify_database_sqlite(13, false, false),  // SQLITE_FULL
            DatabaseFailure::kUnavailable);
  EXPECT_EQ(keel::classify_database_sqlite(11, false, false),  // SQLITE_CORRUPT
            DatabaseFailure::kPermanent);
}

TEST(ClassifySqlite, BusyAndLockedAreTransientWithTheirExtendedCodes) {
  EXPECT_EQ(keel::classify_sqlite(5, false, false).kind, OutcomeKind::kTransient);  // BUSY
  EXPECT_EQ(keel::classify_sqlite(6, false, false).kind, OutcomeKind::kTransient);  // LOCKED
  EXPECT_EQ(keel::classify_sqlite(517, false, false).kind,
            OutcomeKind::kTransient);  // SQLITE_BUSY_SNAPSHOT
  EXPECT_EQ(keel::classify_sqlite(262, false, false).kind,
            OutcomeKind::kTransient);  // SQLITE_LOCKED_SHAREDCACHE
  // A busy COMMIT left the transaction open and unapplied: not in doubt.
  EXPECT_EQ(keel::classify_sqlite(5, true, true).kind, OutcomeKind::kTransient);
}

TEST(ClassifySqlite, ALostConnectionDuringCommitIsAmbiguous) {
  EXPECT_EQ(keel::classify_sqlite(10, true, true).kind, OutcomeKind::kAmbiguous);  // IOERR
  EXPECT_EQ(keel::classify_sqlite(10, true, false).kind, OutcomeKind::kPermanent);
  EXPECT_EQ(keel::classify_sqlite(10, false, true).kind, OutcomeKind::kPermanent);
}

TEST(ClassifySqlite, EverythingElseIsPermanent) {
  EXPECT_EQ(keel::classify_sqlite(1, false, false).kind, OutcomeKind::kPermanent);  // ERROR
  EXPECT_EQ(keel::classify_sqlite(2067, false, false).kind,
            OutcomeKind::kPermanent);  // SQLITE_CONSTRAINT_UNIQUE
  EXPECT_EQ(keel::classify_sqlite(0, false, false).kind, OutcomeKind::kPermanent);
  EXPECT_EQ(keel::classify_sqlite(-1, false, false).kind, OutcomeKind::kPermanent);
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

// ---------------------------------------------------------------------------------------------
// Duplicate as success

namespace {

const keel::DuplicateSuccessRule& already_exists() {
  static const keel::DuplicateSuccessRule rule(
      {.statuses = {409}, .body = keel::body_contains("already exists")});
  return rule;
}

// What one attempt of a scripted receiver answers: a status and body, or a network failure
// after the request was sent.
struct Reply {
  int status = 0;  // 0: the network failure `error`
  std::string body;
  keel::NetError error = keel::NetError::kTimedOut;
};

struct Ended {
  keel::StopReason reason = keel::StopReason::kSuccess;
  keel::Outcome outcome;
  int attempts = 0;
};

// One operation of a POST with an idempotency key, driven as the HTTP clients drive it: each
// response is classified, then handed to the rule with the previous attempt's outcome. Virtual
// time: the waits between attempts advance a ManualClock.
Ended run_post(const std::vector<Reply>& replies, const keel::DuplicateSuccessRule& rule) {
  keel::ManualClock clock;
  keel::Rng rng(7);
  keel::CallOptions call;
  call.clock = &clock;
  call.rng = &rng;
  call.safe_to_repeat = kPostWithKey.safe_to_repeat();
  keel::RetryPolicy policy({.max_attempts = static_cast<int>(replies.size())});
  keel::RetryState state(policy, call);
  Ended run;
  for (auto start = state.start_attempt(); start.proceed; start = state.start_attempt()) {
    const Reply& reply = replies.at(static_cast<std::size_t>(start.attempt.number - 1));
    keel::Outcome o = reply.status == 0 ? keel::classify_network(reply.error, true)
                                        : keel::classify_http_status(reply.status, kPostWithKey);
    if (reply.status != 0) o = rule.apply(state.last_outcome(), o, reply.body);
    run.outcome = o;
    const keel::Decision d = state.next(o);
    if (!d.retry) break;
    clock.sleep_for(d.delay);
  }
  run.reason = state.stop_reason();
  run.attempts = state.attempts();
  return run;
}

}  // namespace

TEST(DuplicateSuccess, AfterATimeoutAnAlreadyExistsIsTheFirstTrysSuccess) {
  const Ended r = run_post({{.error = keel::NetError::kTimedOut}, {409, "name already exists"}},
                           already_exists());
  EXPECT_EQ(r.reason, keel::StopReason::kSuccess);
  EXPECT_EQ(r.attempts, 2);
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kSuccess);
  EXPECT_TRUE(r.outcome.duplicate);
  EXPECT_EQ(r.outcome.code, 409);
  EXPECT_EQ(r.outcome.source, keel::OutcomeSource::kHttp);
  EXPECT_EQ(keel::describe(r.outcome), "HTTP 409 (success, duplicate of an earlier attempt)");
}

TEST(DuplicateSuccess, AfterAResetOrA500AsWell) {
  const Ended reset = run_post(
      {{.error = keel::NetError::kConnectionReset}, {409, "already exists"}}, already_exists());
  EXPECT_EQ(reset.reason, keel::StopReason::kSuccess);
  EXPECT_TRUE(reset.outcome.duplicate);
  const Ended five_hundred = run_post({{500, ""}, {409, "already exists"}}, already_exists());
  EXPECT_EQ(five_hundred.reason, keel::StopReason::kSuccess);
  EXPECT_TRUE(five_hundred.outcome.duplicate);
}

TEST(DuplicateSuccess, OnAFirstAttemptTheConflictStaysWhatItIs) {
  // With a key, a 409 is the receiver's "in progress" (throttled); without one it is permanent.
  // Neither becomes a success.
  const keel::Outcome first = already_exists().apply(
      keel::Outcome{}, keel::classify_http_status(409, kPost), "already exists");
  EXPECT_EQ(first.kind, OutcomeKind::kPermanent);
  EXPECT_FALSE(first.duplicate);
  const Ended r = run_post({{409, "already exists"}, {409, "already exists"}}, already_exists());
  EXPECT_NE(r.reason, keel::StopReason::kSuccess);
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kThrottled);
  EXPECT_FALSE(r.outcome.duplicate);
}

TEST(DuplicateSuccess, NotAfterA503WhichSaysNothingHappened) {
  const Ended r = run_post({{503, ""}, {409, "already exists"}}, already_exists());
  EXPECT_NE(r.reason, keel::StopReason::kSuccess);
  EXPECT_EQ(r.attempts, 2);
  EXPECT_FALSE(r.outcome.duplicate);
  EXPECT_EQ(r.outcome.code, 409);
  // Nor after a refused connection (transient: nothing reached the receiver).
  const Ended refused = run_post(
      {{.error = keel::NetError::kConnectionRefused}, {409, "already exists"}}, already_exists());
  EXPECT_FALSE(refused.outcome.duplicate);
  EXPECT_NE(refused.reason, keel::StopReason::kSuccess);
}

TEST(DuplicateSuccess, TheBodyPredicateAndTheStatusSetAreRespected) {
  const keel::Outcome lost = keel::classify_network(keel::NetError::kTimedOut, true);
  const auto apply = [&](const keel::DuplicateSuccessRule& rule, int status,
                         std::string_view body) {
    return rule.apply(lost, keel::classify_http_status(status, kPost), body);
  };
  EXPECT_TRUE(apply(already_exists(), 409, R"({"error":"name already exists"})").duplicate);
  const keel::Outcome other = apply(already_exists(), 409, R"({"error":"version mismatch"})");
  EXPECT_FALSE(other.duplicate);
  EXPECT_EQ(other.kind, OutcomeKind::kPermanent);
  EXPECT_FALSE(apply(already_exists(), 422, "already exists").duplicate);
  EXPECT_FALSE(apply(already_exists(), 409, "Already Exists").duplicate) << "case-sensitive";

  const keel::DuplicateSuccessRule any_body({.statuses = {409, 422}});
  EXPECT_TRUE(apply(any_body, 422, "").duplicate);
  EXPECT_TRUE(apply(any_body, 409, "whatever").duplicate);
  EXPECT_TRUE(any_body.matches(422, ""));
  EXPECT_FALSE(any_body.matches(400, ""));

  // A network failure is not a response: never a duplicate.
  EXPECT_FALSE(any_body.apply(lost, lost, "").duplicate);
  // A custom predicate sees the body.
  const keel::DuplicateSuccessRule custom(
      {.body = [](std::string_view b) { return b.starts_with("{\"code\":\"DUPLICATE\""); }});
  EXPECT_TRUE(apply(custom, 409, R"({"code":"DUPLICATE"})").duplicate);
  EXPECT_FALSE(apply(custom, 409, R"({"code":"LOCKED"})").duplicate);
}

TEST(DuplicateSuccess, AServerDelayOrRetryLimitDoesNotSurviveTheMapping) {
  const keel::DuplicateSuccessRule rule({.statuses = {503}});
  const keel::Outcome lost = keel::classify_network(keel::NetError::kTimedOut, true);
  const keel::Outcome o = rule.apply(lost, keel::classify_http_status(503, kPost, 5s), "");
  EXPECT_EQ(o.kind, OutcomeKind::kSuccess);
  EXPECT_FALSE(o.has_server_delay());
  EXPECT_EQ(o.retry_limit, keel::Outcome::kNoRetryLimit);
}

TEST(DuplicateSuccess, RejectsAnEmptyOrOutOfRangeStatusSetNamingTheField) {
  EXPECT_THROW(keel::DuplicateSuccessRule({.statuses = {}}), std::invalid_argument);
  try {
    keel::DuplicateSuccessRule rule({.statuses = {409, 200}});
    FAIL() << "a 200 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("statuses"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("200"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(keel::DuplicateSuccessRule({.statuses = {400, 599}}));
}
