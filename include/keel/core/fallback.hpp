// The fallback rule: which failed operations are worth another route than a plain failure. When
// the retries give up, a caller with a fallback can still do something useful: answer a read
// with a recent copy of the last good answer (stale while down), or hand a write to a durable
// queue that delivers it later with the same idempotency key (queue for later). Which stops and
// outcomes allow that is policy, decided here once, as a pure function; the adapters
// (keel::http::Client, keel::asio::HttpClient) only call it and carry the fallback out.
//
// The rule (each line tested in tests/unit/fallback_test.cpp):
//  - Only a dependency that is down or refusing falls back, never a request that is wrong: an
//    open circuit breaker (kCircuitOpen) always; attempts exhausted, the deadline or the retry
//    budget (kAttemptsExhausted, kDeadline, kBudgetExhausted) when the last outcome counts
//    against the dependency's health (transient, throttled, ambiguous: is_dependency_failure),
//    and the budget also when it refused before anything was sent. Success, permanent failures,
//    kNotSafeToRetry, cancellation and an operation already queued never fall back; nor does a
//    deadline that passed before any attempt (the caller's time ran out, not the dependency).
//  - A read (GET) may be answered from a cache of earlier answers, and only while the breaker
//    is open (kServeStale): a read that merely failed its retries is reported as it is, because
//    the dependency was just heard from and the caller should know. The age limit is the
//    cache's (keel/http/response_cache.hpp).
//  - A write may be queued for later (kDefer) only when it carries an idempotency key: the
//    receiver then sees one logical operation however many times it arrives. A write without a
//    key never falls back (delivering it later could apply it twice).
//
// Thread-safety: pure functions, safe to call from any thread.
//
// Example:
//   switch (keel::choose_fallback(result.reason, result.outcome,
//                                 {.read = is_get, .has_idempotency_key = !key.empty()})) {
//     case keel::FallbackKind::kServeStale: ... serve a cached answer ...
//     case keel::FallbackKind::kDefer: ... enqueue the write, report StopReason::kQueued ...
//     case keel::FallbackKind::kNone: ... report the failure ...
//   }
#pragma once

#include <string_view>

#include "keel/core/classify.hpp"
#include "keel/core/retry.hpp"

namespace keel {

/// What a failed operation may fall back to.
enum class FallbackKind : unsigned char {
  kNone,        // report the failure as it is
  kServeStale,  // answer the read with a cached earlier answer (within its age limit)
  kDefer,       // hand the write to a durable queue, delivered later with the same key
};

/// "none", "serve stale", "defer".
[[nodiscard]] std::string_view to_string(FallbackKind kind) noexcept;

/// What the rule needs to know about the operation.
struct FallbackOperation {
  /// A read whose answer may be served from a cache (a GET). Default false.
  bool read = false;
  /// The operation carries an idempotency key (a write without one is never deferred).
  /// Default false.
  bool has_idempotency_key = false;
};

/// Whether an operation that stopped with `reason` after `last` stopped because its dependency
/// is down or refusing (the first line of the rule above), whatever the operation.
[[nodiscard]] bool dependency_unavailable(StopReason reason, const Outcome& last) noexcept;

/// The fallback an operation that stopped with `reason` after `last` may take (the rule
/// above). kNone for a success.
[[nodiscard]] FallbackKind choose_fallback(StopReason reason, const Outcome& last,
                                           const FallbackOperation& operation) noexcept;

}  // namespace keel
