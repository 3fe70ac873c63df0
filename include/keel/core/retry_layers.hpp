// Retries at one layer only (part of the retry engine, keel/core/retry.hpp): a keel retry loop
// started inside another makes a single attempt unless told otherwise (NestedRetries), so that
// three nested layers of 3 attempts reach the bottom 3 times, not 27. RetryScope marks a running
// loop on this thread, RetryContext across threads for asynchronous code.
//
// Thread-safety: RetryContext is safe for concurrent use; a RetryScope belongs to its thread.
#pragma once

#include <atomic>

namespace keel {

/// What a keel retry loop does when it starts inside another keel retry loop.
enum class NestedRetries : unsigned char {
  kSingleAttempt,  // one attempt; the outer loop does the retrying (the default)
  kRetry,          // retry as configured: the layers multiply (3 x 3 x 3 = 27 calls)
};

/// Marks "a keel retry loop is running" for asynchronous code, where a thread-local cannot follow
/// the operation from thread to thread. Give the outer and the inner operations the same context
/// (CallOptions::context); the outer one enters it (RetryScope, or keel::retry does) while it
/// runs. Safe for concurrent use. Requires: outlives the operations that use it.
class RetryContext {
 public:
  /// Retry loops currently inside this context.
  [[nodiscard]] int depth() const noexcept { return depth_.load(std::memory_order_acquire); }
  void enter() noexcept { depth_.fetch_add(1, std::memory_order_acq_rel); }
  void leave() noexcept { depth_.fetch_sub(1, std::memory_order_acq_rel); }

 private:
  std::atomic<int> depth_{0};
};

/// While alive, marks a keel retry loop as running on this thread (or in `context` when given).
/// keel::retry opens one around its loop; code that drives RetryState by hand opens one around
/// the calls that may start inner keel operations. Not copyable; in the thread mode it must be
/// destroyed on the thread that created it.
class RetryScope {
 public:
  explicit RetryScope(RetryContext* context = nullptr) noexcept;
  ~RetryScope();
  RetryScope(const RetryScope&) = delete;
  RetryScope& operator=(const RetryScope&) = delete;

 private:
  RetryContext* context_;
};

/// Keel retry loops running around the caller: in `context` when given, else on this thread.
[[nodiscard]] int retry_depth(const RetryContext* context = nullptr) noexcept;

namespace detail {
// This thread's retry depth. Inline, with a constant initializer, so that the retry loop's
// scope and depth check are a plain thread-local access where they are used.
inline thread_local constinit int t_retry_depth = 0;
}  // namespace detail

inline RetryScope::RetryScope(RetryContext* context) noexcept : context_(context) {
  if (context_ != nullptr) {
    context_->enter();
  } else {
    ++detail::t_retry_depth;
  }
}

inline RetryScope::~RetryScope() {
  if (context_ != nullptr) {
    context_->leave();
  } else {
    --detail::t_retry_depth;
  }
}

inline int retry_depth(const RetryContext* context) noexcept {
  return context != nullptr ? context->depth() : detail::t_retry_depth;
}

}  // namespace keel
