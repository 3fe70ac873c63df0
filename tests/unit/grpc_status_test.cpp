// keel::classify_grpc_status and the grpc-retry-pushback-ms rules (keel/core/grpc_status.hpp), by
// table, and what core's retry decision does with them: a pushback is waited as Retry-After is
// (capped), a negative or malformed one stops the operation, INTERNAL is retried at most once.
#include "keel/core/grpc_status.hpp"

#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "keel/core/retry.hpp"

using namespace std::chrono_literals;
using keel::classify_grpc_status;
using keel::Duration;
using keel::GrpcCode;
using keel::GrpcPushback;
using keel::OutcomeKind;
using keel::parse_grpc_pushback;

namespace {

struct CodeRow {
  GrpcCode code;
  OutcomeKind kind;
};

TEST(GrpcStatus, EveryCodeHasItsKind) {
  const std::vector<CodeRow> rows = {
      {GrpcCode::kOk, OutcomeKind::kSuccess},
      {GrpcCode::kCancelled, OutcomeKind::kAmbiguous},
      {GrpcCode::kUnknown, OutcomeKind::kAmbiguous},
      {GrpcCode::kInvalidArgument, OutcomeKind::kPermanent},
      {GrpcCode::kDeadlineExceeded, OutcomeKind::kAmbiguous},
      {GrpcCode::kNotFound, OutcomeKind::kPermanent},
      {GrpcCode::kAlreadyExists, OutcomeKind::kPermanent},
      {GrpcCode::kPermissionDenied, OutcomeKind::kPermanent},
      {GrpcCode::kResourceExhausted, OutcomeKind::kThrottled},
      {GrpcCode::kFailedPrecondition, OutcomeKind::kPermanent},
      {GrpcCode::kAborted, OutcomeKind::kTransient},
      {GrpcCode::kOutOfRange, OutcomeKind::kPermanent},
      {GrpcCode::kUnimplemented, OutcomeKind::kPermanent},
      {GrpcCode::kInternal, OutcomeKind::kAmbiguous},
      {GrpcCode::kUnavailable, OutcomeKind::kTransient},
      {GrpcCode::kDataLoss, OutcomeKind::kPermanent},
      {GrpcCode::kUnauthenticated, OutcomeKind::kPermanent},
  };
  ASSERT_EQ(rows.size(), 17u);  // every code gRPC lists
  for (const CodeRow& row : rows) {
    const int code = static_cast<int>(row.code);
    const keel::Outcome o = classify_grpc_status(code);
    EXPECT_EQ(keel::to_string(o.kind), keel::to_string(row.kind)) << keel::grpc_code_name(code);
    EXPECT_EQ(o.source, keel::OutcomeSource::kGrpc);
    EXPECT_EQ(o.code, code);
    EXPECT_FALSE(o.has_server_delay());
    EXPECT_FALSE(o.timed_out);
  }
  EXPECT_EQ(keel::describe(classify_grpc_status(14)), "gRPC UNAVAILABLE (transient)");
}

// A code gRPC does not list is UNKNOWN: retried at most as often as INTERNAL, never taken for a
// success or a permanent answer.
TEST(GrpcStatus, UnlistedCodesAreReadAsUnknown) {
  for (const int code :
       {-1, 17, 99, 1000, std::numeric_limits<int>::min(), std::numeric_limits<int>::max()}) {
    const keel::Outcome o = classify_grpc_status(code);
    EXPECT_EQ(o.kind, OutcomeKind::kAmbiguous) << code;
    EXPECT_EQ(o.retry_limit, 1) << code;
    EXPECT_EQ(keel::grpc_code_name(code), "UNKNOWN_CODE");
  }
  for (const int limit : {0, 1, 3, 254}) {
    EXPECT_EQ(classify_grpc_status(13, {.max_retries_on_internal = limit}).retry_limit, limit);
    EXPECT_EQ(classify_grpc_status(2, {.max_retries_on_internal = limit}).retry_limit, limit);
  }
  EXPECT_EQ(classify_grpc_status(13, {.max_retries_on_internal = -5}).retry_limit, 0);
  EXPECT_EQ(classify_grpc_status(13, {.max_retries_on_internal = 9999}).retry_limit, 254);
}

TEST(GrpcStatus, DeadlineExceededTimedOutOnlyWhenTheCallersDeadlinePassed) {
  EXPECT_TRUE(classify_grpc_status(4, {.callers_deadline = true}).timed_out);
  EXPECT_FALSE(classify_grpc_status(4, {.callers_deadline = false}).timed_out);
  // Another code is not a timeout, whoever's deadline it was.
  EXPECT_FALSE(classify_grpc_status(14, {.callers_deadline = true}).timed_out);
}

struct PushbackRow {
  std::string value;
  GrpcPushback::Kind kind;
  Duration delay = Duration::zero();
};

TEST(GrpcPushbackTest, IntegersAreDelaysAndEverythingElseSaysDoNotRetry) {
  using enum GrpcPushback::Kind;
  const std::vector<PushbackRow> rows = {
      {"0", kDelay, 0ms},
      {"1", kDelay, 1ms},
      {"250", kDelay, 250ms},
      {"0000120", kDelay, 120ms},
      {"86400000", kDelay, 24h},
      // Past what a Duration holds: the longest wait, for the policy's cap to bound.
      {"99999999999999999999999999", kDelay, keel::kInfinite},
      {"-1", kNoRetry},
      {"-250", kNoRetry},
      {"", kNoRetry},
      {" 100", kNoRetry},
      {"100 ", kNoRetry},
      {"+100", kNoRetry},
      {"1.5", kNoRetry},
      {"1e3", kNoRetry},
      {"abc", kNoRetry},
      {"100ms", kNoRetry},
      {"0x10", kNoRetry},
      {std::string("1\0"
                   "2",
                   3),
       kNoRetry},
      {"\xd9\xa1", kNoRetry},  // ARABIC-INDIC DIGIT ONE: a digit, but not an ASCII one
      {"99999999999999999999999999x", kNoRetry},
  };
  for (const PushbackRow& row : rows) {
    const GrpcPushback p = parse_grpc_pushback(row.value);
    EXPECT_EQ(p.kind, row.kind) << "'" << row.value << "'";
    if (row.kind == kDelay) {
      EXPECT_EQ(p.delay, row.delay) << row.value;
    }
  }
  EXPECT_EQ(parse_grpc_pushback(std::nullopt).kind, kNone);
}

TEST(GrpcPushbackTest, AReceiversPushbackIsWholeMillisecondsAtLeastOne) {
  EXPECT_EQ(keel::format_grpc_pushback(Duration::zero()), "1");
  EXPECT_EQ(keel::format_grpc_pushback(-5s), "1");
  EXPECT_EQ(keel::format_grpc_pushback(1us), "1");
  EXPECT_EQ(keel::format_grpc_pushback(1500us), "2");
  EXPECT_EQ(keel::format_grpc_pushback(2s), "2000");
  // What it writes, the client reads back as the same wait (or the next millisecond up).
  for (const Duration d :
       {Duration(1ms), Duration(999ms), Duration(37s), Duration(keel::kInfinite)}) {
    const GrpcPushback back = parse_grpc_pushback(keel::format_grpc_pushback(d));
    ASSERT_EQ(back.kind, GrpcPushback::Kind::kDelay);
    EXPECT_GE(back.delay, std::min(d, Duration(keel::kInfinite)));
  }
}

keel::RetryPolicy policy() {
  return keel::RetryPolicy({.max_attempts = 5,
                            .backoff = {.base = 100ms, .cap = 10s},
                            .retry_after_cap = 30s,
                            .min_attempt_time = 1ms});
}

// What the engine does with each: the one retry decision, with the outcome a gRPC attempt gave.
TEST(GrpcStatus, CoresDecisionHonoursThePushbackCappedAndStopsOnANegativeOne) {
  const keel::RetryLimits limits{.max_attempts = 5, .safe_to_repeat = true};
  keel::Rng rng(7);
  const auto decide = [&](const keel::Outcome& o) {
    return keel::decide_retry(policy(), limits, {.attempts = 1}, o, rng);
  };
  for (const int code : {8, 14, 10, 13, 4}) {
    SCOPED_TRACE(keel::grpc_code_name(code));
    const auto waited = decide(classify_grpc_status(
        code, {.pushback = {.kind = GrpcPushback::Kind::kDelay, .delay = 1200ms}}));
    EXPECT_TRUE(waited.retry);
    EXPECT_EQ(waited.delay, 1200ms);
    const auto capped = decide(classify_grpc_status(
        code, {.pushback = {.kind = GrpcPushback::Kind::kDelay, .delay = keel::kInfinite}}));
    EXPECT_TRUE(capped.retry);
    EXPECT_EQ(capped.delay, 30s);
    const auto stopped =
        decide(classify_grpc_status(code, {.pushback = parse_grpc_pushback("-1")}));
    EXPECT_FALSE(stopped.retry);
    const auto garbage =
        decide(classify_grpc_status(code, {.pushback = parse_grpc_pushback("soon")}));
    EXPECT_FALSE(garbage.retry);
  }
  // A pushback never makes a permanent answer retryable, nor a non-idempotent call repeatable.
  EXPECT_FALSE(decide(classify_grpc_status(
                          3, {.pushback = {.kind = GrpcPushback::Kind::kDelay, .delay = 1ms}}))
                   .retry);
  const keel::RetryLimits unsafe{.max_attempts = 5, .safe_to_repeat = false};
  EXPECT_FALSE(
      keel::decide_retry(policy(), unsafe, {.attempts = 1}, classify_grpc_status(4), rng).retry);
  EXPECT_TRUE(
      keel::decide_retry(policy(), unsafe, {.attempts = 1}, classify_grpc_status(14), rng).retry);
  // INTERNAL: one retry in the operation, then no more.
  EXPECT_TRUE(decide(classify_grpc_status(13)).retry);
  EXPECT_FALSE(keel::decide_retry(policy(), limits, {.attempts = 2, .limited_retries = 1},
                                  classify_grpc_status(13), rng)
                   .retry);
}

}  // namespace
