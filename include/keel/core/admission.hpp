// Receiver-side admission control that sheds retries first. In a retry storm the receiver is the
// one place that sees the whole fleet: clients already say which attempt a request is
// (Keel-Attempt, Envoy's x-envoy-attempt-count, gRPC's grpc-previous-rpc-attempts), so when the
// server is full it can refuse the retries, whose first attempt it already paid for, before the
// first attempts of new work. AdmissionLimiter is a concurrency limiter with two thresholds:
//
//   in flight < max_concurrency                      every request is admitted;
//   max_concurrency <= in flight < max + queue_bound  only first attempts are admitted (retries
//                                                    are shed with reason kRetryOverLimit);
//   in flight >= max_concurrency + queue_bound        every request is shed (first attempts
//                                                    with reason kOverCapacity).
//
// "In flight" counts admitted requests whose Admission has not been released yet. Nothing waits
// inside the limiter: the queue_bound first attempts beyond max_concurrency run at once (they
// queue for the server's threads or its dependency, not here). A shed request gets a Retry-After
// drawn with full jitter, uniform on [0, retry_after_max), from the caller's generator, so shed
// clients do not come back in step. See docs/admission.md for the reasoning and the numbers.
//
// Also here: attempt_number(), which reads the attempt number from any of the three headers.
//
// With latency_threshold set, the limit adapts (AIMD on the latencies the caller reports). With
// `adaptive` set, the limit is an AdaptiveConcurrencyLimit's (keel/core/concurrency_limit.hpp):
// found from the latencies reported through Admission::release(latency, now) against the receiver's
// own baseline, no threshold to choose; retries are still shed first.
//
// Thread-safety: AdmissionLimiter is safe for concurrent use and lock-free (one atomic in-flight
// count and one atomic limit, changed by compare-and-swap; relaxed atomic counters). An Admission
// is not thread-safe (move it, do not share it) and must not outlive its limiter.
//
// Example:
//   static keel::AdmissionLimiter limiter({.max_concurrency = 64, .queue_bound = 16});
//   const int attempt = keel::attempt_number({.keel_attempt = header("Keel-Attempt")});
//   keel::Admission a = limiter.admit(attempt, keel::thread_rng());
//   if (!a) return answer_503(a.retry_after());   // a.reason(): why it was shed
//   handle();                                     // a releases its slot when destroyed
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>

#include "keel/core/clock.hpp"
#include "keel/core/concurrency_limit.hpp"
#include "keel/core/random.hpp"

namespace keel {

/// Why a request was shed.
enum class ShedReason : unsigned char {
  kNone,            // admitted
  kRetryOverLimit,  // a retry (attempt > 1) while max_concurrency requests were in flight
  kOverCapacity,    // a first attempt while max_concurrency + queue_bound were in flight
};

/// How many ShedReason values there are (for arrays of counters, kNone included).
inline constexpr int kShedReasons = 3;

/// "none", "retry", "over_capacity" (metric label values).
[[nodiscard]] std::string_view to_string(ShedReason reason) noexcept;

struct AdmissionOptions {
  /// Requests in flight beyond which retries are shed. Requires: >= 1. Default 64.
  std::int64_t max_concurrency = 64;
  /// First attempts admitted beyond max_concurrency before they are shed too (0: one limit for
  /// all, a plain concurrency limit that does not prefer first attempts). Under an adaptive
  /// limit (latency_threshold or adaptive) it is the queue at the limit's highest, and shrinks
  /// with the limit: queue_bound x limit / highest, rounded down, at least 1. Requires: >= 0.
  /// Default 16.
  std::int64_t queue_bound = 16;
  /// Upper end of the full-jitter Retry-After of shed requests: U(0, retry_after_max).
  /// Requires: > 0. Default 10 s.
  Duration retry_after_max = std::chrono::seconds(10);
  /// Adaptive limit (AIMD on latency, as Netflix concurrency-limits' AIMDLimit): when > 0, the
  /// limit retries are shed at starts at max_concurrency and moves with the latencies reported
  /// through Admission::release(latency): one above this threshold, of a request admitted with
  /// at least the limit in flight (itself included), multiplies it by backoff_ratio (rounded
  /// down, at least 1 less); a limit's worth of answers at or under it, each while at least
  /// half the limit was in use, adds 1 (as TCP's congestion avoidance grows by one a round
  /// trip); it stays in [min_concurrency, max_concurrency]. A slow answer of a request admitted
  /// below the limit changes nothing: the dependency is slow, not queued behind this limit (it
  /// keeps up with more in flight), and a cut would only shed. Report the latency from the
  /// request's arrival, so that a wait for the server's threads counts. First attempts are
  /// shed at the current limit + its queue (queue_bound scaled to it). Requires: >= 0.
  /// Default 0 (a fixed limit).
  Duration latency_threshold = Duration::zero();
  /// Lowest adaptive limit. Requires: in [1, max_concurrency]; the default unless
  /// latency_threshold > 0. Default 1.
  std::int64_t min_concurrency = 1;
  /// Multiplicative decrease of the adaptive limit. Requires: in [0.5, 1); the default unless
  /// latency_threshold > 0. Default 0.9.
  double backoff_ratio = 0.9;
  /// Adaptive limit found from latency against the receiver's baseline (keel::
  /// AdaptiveConcurrencyLimit, docs/concurrency.md): when set, retries are shed at its limit and
  /// first attempts at its limit + its queue (queue_bound scaled to it); it learns from
  /// Admission::release(latency, now). max_concurrency is then ignored (the options' max_limit
  /// bounds it). Requires: latency_threshold == 0 (one adaptive mode). Default none.
  std::optional<ConcurrencyLimitOptions> adaptive;
};

class AdmissionLimiter;

/// The answer of AdmissionLimiter::admit: admitted (true) with a slot that is released when the
/// Admission is destroyed or release() is called, or shed (false) with a reason and a delay.
/// Move-only.
class Admission {
 public:
  Admission() = default;
  Admission(Admission&& other) noexcept;
  Admission& operator=(Admission&& other) noexcept;
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;
  ~Admission() { release(); }

  [[nodiscard]] bool admitted() const noexcept { return reason_ == ShedReason::kNone && limiter_; }
  [[nodiscard]] explicit operator bool() const noexcept { return admitted(); }
  /// kNone when admitted.
  [[nodiscard]] ShedReason reason() const noexcept { return reason_; }
  /// How long a shed client should wait (full jitter); zero when admitted.
  [[nodiscard]] Duration retry_after() const noexcept { return retry_after_; }
  /// Gives the slot back (idempotent; nothing for a shed request).
  void release() noexcept;
  /// Gives the slot back and reports how long the request took (the adaptive limit's signal;
  /// ignored by a fixed limit). Only the first release of an admission counts.
  void release(Duration latency) noexcept;
  /// The same, with the time it ended: what the `adaptive` limit needs to end its windows.
  void release(Duration latency, TimePoint now) noexcept;

 private:
  friend class AdmissionLimiter;
  AdmissionLimiter* limiter_ = nullptr;
  ShedReason reason_ = ShedReason::kNone;
  std::int64_t in_flight_at_admit_ = 0;  // including this request
  Duration retry_after_{};
};

/// Counters since the limiter was built (a snapshot; each field is read on its own).
struct AdmissionStats {
  std::int64_t in_flight = 0;
  std::int64_t limit = 0;  // the limit retries are shed at now (max_concurrency when fixed)
  std::uint64_t admitted_first = 0;       // first attempts admitted
  std::uint64_t admitted_retry = 0;       // retries admitted
  std::uint64_t shed[kShedReasons] = {};  // by ShedReason (shed[0], kNone, stays 0)
};

class AdmissionLimiter {
 public:
  /// Throws std::invalid_argument naming the field and value when a Requires line is broken.
  explicit AdmissionLimiter(AdmissionOptions options = {});
  AdmissionLimiter(const AdmissionLimiter&) = delete;
  AdmissionLimiter& operator=(const AdmissionLimiter&) = delete;

  /// Admits or sheds one request. `attempt` is its attempt number (1 for a first attempt; values
  /// below 1 count as 1); `gen` draws the Retry-After of a shed request (a thread's own
  /// generator: keel::thread_rng(), or a seeded keel::Rng in tests). Never blocks.
  [[nodiscard]] Admission admit(int attempt, BitGenRef gen) noexcept;

  [[nodiscard]] std::int64_t in_flight() const noexcept {
    return in_flight_.load(std::memory_order_relaxed);
  }
  /// The limit retries are shed at now: max_concurrency, or the adaptive limit.
  [[nodiscard]] std::int64_t limit() const noexcept {
    return adaptive_ ? adaptive_->limit() : limit_.load(std::memory_order_relaxed);
  }
  [[nodiscard]] AdmissionStats stats() const noexcept;
  [[nodiscard]] const AdmissionOptions& options() const noexcept { return options_; }

 private:
  friend class Admission;
  void release_one() noexcept { in_flight_.fetch_sub(1, std::memory_order_release); }
  [[nodiscard]] std::int64_t queue_at(std::int64_t limit) const noexcept;
  void on_latency(Duration latency, std::int64_t in_flight_at_admit) noexcept;
  void on_latency(Duration latency, TimePoint now, std::int64_t in_flight_at_admit) noexcept;

  AdmissionOptions options_;
  std::atomic<std::int64_t> in_flight_{0};
  std::atomic<std::int64_t> limit_{0};
  std::atomic<std::int64_t> grow_credit_{0};  // fast busy answers since the limit last moved
  std::unique_ptr<AdaptiveConcurrencyLimit> adaptive_;  // with options_.adaptive
  std::atomic<std::uint64_t> admitted_first_{0};
  std::atomic<std::uint64_t> admitted_retry_{0};
  std::atomic<std::uint64_t> shed_[kShedReasons] = {};
};

/// The attempt-number headers a request may carry, as received (absent: nullopt).
struct AttemptHeaders {
  /// Keel-Attempt: the attempt number, 1 for the first attempt (keel's clients).
  std::optional<std::string_view> keel_attempt;
  /// x-envoy-attempt-count: the attempt number, 1 for the first (Envoy).
  std::optional<std::string_view> envoy_attempt_count;
  /// grpc-previous-rpc-attempts: attempts made before this one, 0 for the first (gRPC).
  std::optional<std::string_view> grpc_previous_rpc_attempts;
};

/// The attempt number a request declares: the largest of the headers present and valid (a value
/// that is not 1*DIGIT, after optional whitespace, is ignored; gRPC's count of previous attempts
/// plus one), clamped to [1, 1000000]. 1 when none is present or valid: a client that says
/// nothing is treated as sending a first attempt.
[[nodiscard]] int attempt_number(const AttemptHeaders& headers) noexcept;

}  // namespace keel
