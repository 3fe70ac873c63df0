// gRPC's status codes in keel's taxonomy and the pushback header (keel/core/grpc_status.hpp).
#include "keel/core/grpc_status.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <limits>

namespace keel {

std::string_view grpc_code_name(int code) noexcept {
  static constexpr std::array<std::string_view, 17> kNames = {"OK",
                                                              "CANCELLED",
                                                              "UNKNOWN",
                                                              "INVALID_ARGUMENT",
                                                              "DEADLINE_EXCEEDED",
                                                              "NOT_FOUND",
                                                              "ALREADY_EXISTS",
                                                              "PERMISSION_DENIED",
                                                              "RESOURCE_EXHAUSTED",
                                                              "FAILED_PRECONDITION",
                                                              "ABORTED",
                                                              "OUT_OF_RANGE",
                                                              "UNIMPLEMENTED",
                                                              "INTERNAL",
                                                              "UNAVAILABLE",
                                                              "DATA_LOSS",
                                                              "UNAUTHENTICATED"};
  if (code < 0 || code >= static_cast<int>(kNames.size())) return "UNKNOWN_CODE";
  return kNames[static_cast<std::size_t>(code)];
}

GrpcPushback parse_grpc_pushback(std::optional<std::string_view> value) noexcept {
  if (!value) return {};
  const GrpcPushback no_retry{.kind = GrpcPushback::Kind::kNoRetry};
  if (value->empty()) return no_retry;
  // Milliseconds in a Duration (nanoseconds): more than this many does not fit.
  constexpr std::int64_t kMaxMs = std::numeric_limits<Duration::rep>::max() / 1'000'000;
  std::int64_t ms = 0;
  bool overflow = false;
  for (const char c : *value) {
    if (c < '0' || c > '9') return no_retry;
    if (ms > (kMaxMs - (c - '0')) / 10) overflow = true;  // keep reading: a later byte may be bad
    if (!overflow) ms = ms * 10 + (c - '0');
  }
  // The largest whole milliseconds a Duration holds is what format_grpc_pushback writes for
  // kInfinite: read back as kInfinite.
  if (overflow || ms >= kMaxMs) return {.kind = GrpcPushback::Kind::kDelay, .delay = kInfinite};
  return {.kind = GrpcPushback::Kind::kDelay, .delay = std::chrono::milliseconds(ms)};
}

std::string format_grpc_pushback(Duration wait) {
  if (wait >= kInfinite) return std::to_string(kInfinite.count() / 1'000'000);
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(wait).count();
  return std::to_string(std::max<std::int64_t>(ms, 1));
}

Outcome classify_grpc_status(int code, const GrpcAttemptFacts& facts) noexcept {
  Outcome o;
  o.source = OutcomeSource::kGrpc;
  o.code = code;
  switch (code) {
    case static_cast<int>(GrpcCode::kOk):
      o.kind = OutcomeKind::kSuccess;
      return o;  // a pushback on a success asks nothing
    case static_cast<int>(GrpcCode::kUnavailable):
    case static_cast<int>(GrpcCode::kAborted):
      o.kind = OutcomeKind::kTransient;
      break;
    case static_cast<int>(GrpcCode::kResourceExhausted):
      o.kind = OutcomeKind::kThrottled;
      break;
    case static_cast<int>(GrpcCode::kDeadlineExceeded):
      o.kind = OutcomeKind::kAmbiguous;
      o.timed_out = facts.callers_deadline;
      break;
    case static_cast<int>(GrpcCode::kCancelled):
      o.kind = OutcomeKind::kAmbiguous;
      break;
    case static_cast<int>(GrpcCode::kInvalidArgument):
    case static_cast<int>(GrpcCode::kNotFound):
    case static_cast<int>(GrpcCode::kAlreadyExists):
    case static_cast<int>(GrpcCode::kPermissionDenied):
    case static_cast<int>(GrpcCode::kFailedPrecondition):
    case static_cast<int>(GrpcCode::kOutOfRange):
    case static_cast<int>(GrpcCode::kUnimplemented):
    case static_cast<int>(GrpcCode::kDataLoss):
    case static_cast<int>(GrpcCode::kUnauthenticated):
      o.kind = OutcomeKind::kPermanent;
      return o;  // nothing to retry, so nothing to wait for
    default:     // INTERNAL, UNKNOWN and codes gRPC does not list
      o.kind = OutcomeKind::kAmbiguous;
      o.retry_limit = static_cast<std::uint8_t>(std::clamp(facts.max_retries_on_internal, 0, 254));
      break;
  }
  switch (facts.pushback.kind) {
    case GrpcPushback::Kind::kNone:
      break;
    case GrpcPushback::Kind::kDelay:
      o.server_delay = facts.pushback.delay;
      break;
    case GrpcPushback::Kind::kNoRetry:
      o.retry_limit = 0;  // no retry may follow this outcome in the operation
      break;
  }
  return o;
}

}  // namespace keel
