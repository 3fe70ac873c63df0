// Deadline propagation over HTTP: the Keel-Deadline-Ms request header, which tells a receiver how
// much of the caller's deadline is left when an attempt is sent, so that it does not start work
// whose answer nobody will wait for, and so that its own retry loops stop when the caller stops.
//
// The value is a relative budget in whole milliseconds ("Keel-Deadline-Ms: 2500"), as gRPC's
// grpc-timeout is, not an absolute time: caller and receiver never compare clocks, so clock skew
// between machines cannot shorten or stretch it. The receiver turns it back into a deadline on
// its own monotonic clock at arrival (arrival + budget); the time the request spent on the wire
// is the error, and it only makes the receiver's deadline later than the caller's, never
// earlier. keel's HTTP clients send it on every attempt of an operation that has a finite
// deadline (keel::http::ClientOptions::transport.propagate_deadline); see docs/deadlines.md.
//
// The parser is strict, as the header comes from outside: one to 11 ASCII digits (0 means "no
// time left"), at most kMaxPropagatedDeadline, surrounding spaces and tabs allowed (they are not
// part of an HTTP field value). Anything else (a sign, a fraction, a unit, a list such as a
// duplicated field folded into "100, 200", more digits, a longer budget) is an Error, and a
// receiver ignores an invalid header: the request is processed as if it had none.
//
// Thread-safety: pure functions.
//
// Example:
//   // sender
//   request.headers.emplace_back(keel::kDeadlineHeader,
//                                keel::format_deadline_header(deadline.remaining(clock.now())));
//   // receiver, at arrival
//   if (auto budget = keel::parse_deadline_header(value)) {
//     const keel::Deadline deadline = keel::Deadline::after(clock, *budget);
//   }
#pragma once

#include <chrono>
#include <string>
#include <string_view>

#include "keel/core/clock.hpp"
#include "keel/core/expected.hpp"

namespace keel {

/// The header's name.
inline constexpr std::string_view kDeadlineHeader = "Keel-Deadline-Ms";

/// The longest budget the header carries: 365 days. A sender clamps to it; a receiver refuses a
/// longer one (no deadline of a real request is that long: it is garbage or an attack).
inline constexpr Duration kMaxPropagatedDeadline = std::chrono::hours(24 * 365);

/// The budget a Keel-Deadline-Ms value carries. Error (field "Keel-Deadline-Ms") when the value
/// is empty, is not 1 to 11 ASCII digits between optional spaces and tabs, or is longer than
/// kMaxPropagatedDeadline. Never reads past `value`, never overflows.
[[nodiscard]] Expected<Duration> parse_deadline_header(std::string_view value);

/// The Keel-Deadline-Ms value for `remaining` (the time left before the deadline, when the
/// attempt is sent): whole milliseconds rounded down, so the receiver never believes it has more
/// time than the caller; 0 for zero or a negative duration; kMaxPropagatedDeadline for anything
/// longer (kInfinite included: send no header for an infinite deadline).
[[nodiscard]] std::string format_deadline_header(Duration remaining);

}  // namespace keel
