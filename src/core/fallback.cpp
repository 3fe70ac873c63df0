// The fallback rule (see keel/core/fallback.hpp).
#include "keel/core/fallback.hpp"

namespace keel {

std::string_view to_string(FallbackKind kind) noexcept {
  switch (kind) {
    case FallbackKind::kNone:
      return "none";
    case FallbackKind::kServeStale:
      return "serve stale";
    case FallbackKind::kDefer:
      return "defer";
  }
  return "unknown";
}

bool dependency_unavailable(StopReason reason, const Outcome& last) noexcept {
  switch (reason) {
    case StopReason::kCircuitOpen:
    case StopReason::kLimited:
      return true;
    case StopReason::kBudgetExhausted:
      // Refused before anything was sent (a durable layer's retry) or after a failed attempt.
      return last.kind == OutcomeKind::kNotAttempted || is_dependency_failure(last.kind);
    case StopReason::kAttemptsExhausted:
    case StopReason::kDeadline:
      return is_dependency_failure(last.kind);
    case StopReason::kSuccess:
    case StopReason::kPermanent:
    case StopReason::kNotSafeToRetry:
    case StopReason::kCancelled:
    case StopReason::kQueued:
      return false;
  }
  return false;
}

FallbackKind choose_fallback(StopReason reason, const Outcome& last,
                             const FallbackOperation& operation) noexcept {
  if (!dependency_unavailable(reason, last)) return FallbackKind::kNone;
  if (operation.read) {
    return reason == StopReason::kCircuitOpen ? FallbackKind::kServeStale : FallbackKind::kNone;
  }
  return operation.has_idempotency_key ? FallbackKind::kDefer : FallbackKind::kNone;
}

}  // namespace keel
