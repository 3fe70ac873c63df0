// A retry policy (part of the retry engine, keel/core/retry.hpp): RetryOptions, each with its
// contract and default, and RetryPolicy, the validated, immutable configuration many operations
// share.
//
// Thread-safety: a RetryPolicy is immutable and safe to share between threads and calls.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "keel/core/backoff.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/retry_events.hpp"

namespace keel {

class EventStream;  // keel/core/events.hpp

struct RetryOptions {
  /// Attempts in all, counting the first. Requires: >= 1. Default 3.
  int max_attempts = 3;
  /// Timeout of one attempt. Requires: > 0. Default none (kInfinite).
  Duration per_try_timeout = kInfinite;
  /// Deadline of the whole operation, from its start. Requires: > 0. Default none.
  Duration overall_timeout = kInfinite;
  /// Delay between attempts. Default full jitter, base 100 ms, cap 10 s.
  BackoffOptions backoff = {};
  /// Largest server-requested delay honoured. Requires: >= 0. Default 60 s.
  Duration retry_after_cap = std::chrono::seconds(60);
  /// An attempt is not started with less than this before the deadline. Requires: >= 0.
  /// Default 1 ms.
  Duration min_attempt_time = std::chrono::milliseconds(1);
  /// Called before each wait. Default none.
  std::function<void(const RetryEvent&)> on_retry;
  /// Called once when the operation stops without success. Default none.
  std::function<void(const GiveUpEvent&)> on_give_up;
  /// Where the operations of this policy publish their attempts, budget refusals and give-ups
  /// (keel/core/events.hpp). Non-owning; Requires: outlives the policy. Default none.
  EventStream* events = nullptr;
  /// Names the operations of this policy in their events (Event::operation). Default empty.
  std::string operation;
};

/// The retry options keel's network clients start from (keel::http::ClientOptions::retry, for
/// both HTTP clients, and keel::grpc::ClientOptions::retry): 3 attempts, per-try timeout 10 s,
/// overall deadline 30 s, and RetryOptions' own defaults for the rest (full jitter base 100 ms cap
/// 10 s, server-requested delays capped at 60 s).
[[nodiscard]] inline RetryOptions client_retry_options() {
  return {.max_attempts = 3,
          .per_try_timeout = std::chrono::seconds(10),
          .overall_timeout = std::chrono::seconds(30),
          .on_retry = {},
          .on_give_up = {},
          .operation = {}};
}

/// Validated, immutable retry configuration, shared by many operations.
class RetryPolicy {
 public:
  /// Throws std::invalid_argument naming the field and value when a Requires line is broken.
  explicit RetryPolicy(RetryOptions options = {});

  [[nodiscard]] const RetryOptions& options() const noexcept { return options_; }
  [[nodiscard]] const Backoff& backoff() const noexcept { return backoff_; }

 private:
  RetryOptions options_;
  Backoff backoff_;
};

}  // namespace keel
