// gRPC's status codes in keel's taxonomy, and the pushback a gRPC server sends
// (grpc-retry-pushback-ms, gRFC A6), as pure functions: core knows the numbers gRPC's
// specification fixes (doc/statuscodes.md), not the gRPC library, so an adapter over any gRPC
// stack classifies the same way.
//
// The table (docs/classification.md, "gRPC"):
//   OK                                    success
//   UNAVAILABLE                           transient (the server or the path to it is down)
//   ABORTED                               transient: a conflict (a transaction lost a race), as
//                                         SQLSTATE 40001 is; the whole call is run again
//   RESOURCE_EXHAUSTED                    throttled (a quota, or the server shedding load)
//   DEADLINE_EXCEEDED                     ambiguous (the server may have acted); timed_out when
//                                         the caller's own attempt deadline passed
//   CANCELLED                             ambiguous (cancelled on the way: it may have run)
//   INTERNAL, UNKNOWN, unlisted codes     ambiguous, retried at most max_retries_on_internal
//                                         times in one operation (as HTTP 500 is)
//   INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, PERMISSION_DENIED, FAILED_PRECONDITION,
//   OUT_OF_RANGE, UNIMPLEMENTED, DATA_LOSS, UNAUTHENTICATED
//                                         permanent: a retry fails the same way
// A pushback of N ms (a non-negative integer) is the server's delay, as Retry-After is (capped
// by the policy's retry_after_cap); a negative or malformed one means "do not retry" (A6), and
// the outcome then allows no retry whatever its code.
//
// Thread-safety: pure functions.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "keel/core/classify.hpp"
#include "keel/core/clock.hpp"

namespace keel {

/// gRPC's status codes, with the values on the wire.
enum class GrpcCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

/// The code's name as gRPC spells it ("UNAVAILABLE"); "UNKNOWN_CODE" for a value outside 0..16.
[[nodiscard]] std::string_view grpc_code_name(int code) noexcept;

/// What a grpc-retry-pushback-ms value asks for.
struct GrpcPushback {
  enum class Kind : unsigned char {
    kNone,     // no pushback: keel's own backoff decides
    kDelay,    // wait `delay` before the next attempt
    kNoRetry,  // negative or malformed: do not retry (gRFC A6)
  };
  Kind kind = Kind::kNone;
  /// kDelay: the wait, uncapped (kInfinite when it does not fit a Duration).
  Duration delay = Duration::zero();
};

/// Reads a grpc-retry-pushback-ms value: nullopt (absent) is kNone; a decimal integer of ASCII
/// digits, at least 0, is kDelay; anything else (empty, a sign, spaces, a fraction, text) is
/// kNoRetry.
[[nodiscard]] GrpcPushback parse_grpc_pushback(std::optional<std::string_view> value) noexcept;

/// The value a keel receiver sends: whole milliseconds rounded up, at least 1 (a pushback of 0
/// would invite an immediate retry); kInfinite gives the largest Duration in milliseconds.
[[nodiscard]] std::string format_grpc_pushback(Duration wait);

struct GrpcAttemptFacts {
  /// DEADLINE_EXCEEDED came because the caller's attempt deadline passed (the client library
  /// ended the call), not from the server: the attempt timed out.
  bool callers_deadline = false;
  /// What the response's grpc-retry-pushback-ms said.
  GrpcPushback pushback;
  /// How many retries an INTERNAL, UNKNOWN or unlisted code may cause in one operation.
  /// Requires: 0..254 (clamped). Default 1, as HTTP 500.
  int max_retries_on_internal = 1;
};

/// Classifies a gRPC status code (any int: an unlisted value is read as UNKNOWN, as gRPC's own
/// libraries do). The Outcome's source is kGrpc and its code the status code.
[[nodiscard]] Outcome classify_grpc_status(int code, const GrpcAttemptFacts& facts = {}) noexcept;

}  // namespace keel
