// Retry budgets: fleet-level limits on retries, so that a struggling dependency is not hit by
// every caller's retries at once. Per-request limits (max_attempts) do not stop a retry storm; a
// budget shared by all calls to one dependency does. Three well-known models share one interface
// (see docs/budgets.md for the reasoning and the numbers):
//
//   RatioBudget       retries may be at most a fraction of recent first attempts (SRE book 10%,
//                     Finagle 20%), plus a small reserve per second, over a sliding window.
//   TokenBucketBudget the AWS SDKs' standard mode: 500 tokens, a retry costs 5 (10 after a
//                     timeout), a successful first attempt refunds 1, a successful retry its cost.
//   ThrottleBudget    gRPC retry throttling: tokens start at max; a failure takes 1, a success
//                     adds token_ratio; retries only while tokens > max / 2.
//
// Thread-safety: every budget is safe for concurrent use and lock-free. Reservation is atomic:
// when one retry is left, exactly one of two racing threads gets it. A budget is shared by all
// operations that call one dependency; it must outlive every operation that uses it.
//
// Example:
//   static keel::TokenBucketBudget budget;             // one per dependency
//   keel::CallOptions call;
//   call.budget = &budget;                            // the retry engine asks before each retry
//   auto r = keel::retry(policy, attempt, call);      // r.reason may be kBudgetExhausted
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string_view>

#include "keel/core/classify.hpp"
#include "keel/core/clock.hpp"

namespace keel {

/// The right to run one retry, returned by RetryBudget::try_acquire_retry and handed back with
/// that retry's outcome (so a token bucket can refund exactly what it charged).
struct RetryPermit {
  bool granted = false;
  /// What the retry cost, in the budget's own units (token-bucket tokens); 0 for other models.
  std::int32_t cost = 0;
  /// The ratio budget's window step the retry was withdrawn in (so cancel() can return it).
  std::int64_t step = -1;
  [[nodiscard]] explicit operator bool() const noexcept { return granted; }
};

/// One budget shared by all operations against one dependency. The retry engine calls, for each
/// operation: on_first_attempt() once; record() after every attempt with that attempt's permit
/// (a default RetryPermit for the first attempt); try_acquire_retry() before every retry.
class RetryBudget {
 public:
  virtual ~RetryBudget() = default;

  /// An operation's first attempt is starting (the ratio budget deposits here).
  virtual void on_first_attempt() noexcept = 0;

  /// Reserves one retry after `failure` (the outcome of the attempt that just failed). Returns a
  /// granted permit, or a refused one when the budget is empty. Atomic: never over-spends.
  [[nodiscard]] virtual RetryPermit try_acquire_retry(const Outcome& failure) noexcept = 0;

  /// Reports an attempt's outcome. `permit` is the permit the attempt ran under (default for a
  /// first attempt).
  virtual void record(const Outcome& outcome, const RetryPermit& permit) noexcept = 0;

  /// Gives back a granted permit whose retry never ran (the circuit breaker refused it, or the
  /// operation was cancelled during the wait). Ignored when !permit.granted. The default does
  /// nothing (right for a budget that charges nothing on a grant, as the throttle).
  virtual void cancel(const RetryPermit& permit) noexcept { (void)permit; }

  /// Retries that could be granted now, for metrics and health checks (a snapshot; other
  /// threads may change it at once). The throttle reports its token count.
  [[nodiscard]] virtual double available() const noexcept = 0;

  /// "ratio", "token bucket" or "throttle".
  [[nodiscard]] virtual std::string_view model() const noexcept = 0;
};

// ---------------------------------------------------------------------------------------------

struct RatioBudgetOptions {
  /// Retries allowed per first attempt in the window. Requires: in [0, 1000]. Default 0.1 (the
  /// SRE book's 10%; Finagle uses 0.2).
  double ratio = 0.1;
  /// Retries per second always allowed, so low-traffic callers can still retry (Finagle: 10).
  /// The window holds reserve_per_second * window seconds of them. Requires: >= 0. Default 10.
  double reserve_per_second = 10.0;
  /// How long deposits and withdrawals count (Finagle's ttl). Requires: >= 1 ms. Default 10 s.
  Duration window = std::chrono::seconds(10);
  /// The window slides in this many steps. Requires: in [1, 1000], window / buckets >= 1 us.
  /// Default 10.
  int buckets = 10;
  /// Where time comes from. keel::coarse_clock() is precise enough for second-long windows and
  /// much cheaper to read. Default keel::steady_clock(); with it, steps of 100 ms or more are
  /// read from keel::coarse_clock() (the same monotonic time at the kernel tick's resolution,
  /// 1-10 ms).
  Clock* clock = nullptr;
};

/// Retries may not exceed `ratio` of the first attempts seen in the last `window`, plus a reserve.
/// Each first attempt deposits `ratio` of a retry, each retry withdraws one; both leave the
/// balance when they fall out of the window. Lock-free: time buckets tagged with their step;
/// deposits go to per-thread stripes of the current bucket (no shared cache line written on a
/// first attempt); withdrawals are a compare-and-swap on one atomic total, checked against the
/// deposits in the window. Memory: about buckets x (stripes + 1) x 64 bytes (5-6 KB by default).
class RatioBudget final : public RetryBudget {
 public:
  /// Throws std::invalid_argument naming the field and value when a Requires line is broken.
  explicit RatioBudget(RatioBudgetOptions options = {});
  ~RatioBudget() override;
  RatioBudget(const RatioBudget&) = delete;
  RatioBudget& operator=(const RatioBudget&) = delete;

  void on_first_attempt() noexcept override;
  [[nodiscard]] RetryPermit try_acquire_retry(const Outcome& failure) noexcept override;
  void record(const Outcome& outcome, const RetryPermit& permit) noexcept override;
  /// Returns the withdrawal while its window step is still live (an expired one already left).
  void cancel(const RetryPermit& permit) noexcept override;
  [[nodiscard]] double available() const noexcept override;
  [[nodiscard]] std::string_view model() const noexcept override { return "ratio"; }

  /// Deposits one first attempt without an operation (for callers that drive budgets by hand).
  void deposit() noexcept { on_first_attempt(); }
  /// Tries to withdraw one retry; true when granted.
  [[nodiscard]] bool try_withdraw() noexcept { return try_withdraw_at(step_at(clock_->now())); }

  [[nodiscard]] const RatioBudgetOptions& options() const noexcept { return options_; }

 private:
  struct Window;
  [[nodiscard]] bool try_withdraw_at(std::int64_t step) noexcept;
  [[nodiscard]] std::int64_t step_at(TimePoint now) const noexcept;

  RatioBudgetOptions options_;
  Clock* clock_;
  TimePoint origin_{};
  Duration step_{};
  std::int64_t deposit_milli_ = 0;
  std::int64_t reserve_milli_ = 0;
  std::unique_ptr<Window> window_;
};

// ---------------------------------------------------------------------------------------------

struct TokenBucketBudgetOptions {
  /// Tokens when full (and at start). Requires: >= 1. Default 500 (AWS SDKs).
  int capacity = 500;
  /// Cost of a retry. Requires: >= 0. Default 5.
  int retry_cost = 5;
  /// Cost of a retry after an attempt that timed out (Outcome::timed_out). Requires: >= 0.
  /// Default 10.
  int timeout_retry_cost = 10;
  /// Refund for a first attempt that succeeds. Requires: >= 0. Default 1.
  int success_refund = 1;
};

/// The AWS SDKs' standard-mode retry quota. A successful retry refunds exactly what it cost;
/// with no tokens left there is no retry even with attempts left. Lock-free: one atomic, CAS.
/// A success on a full bucket writes nothing (no shared cache line is dirtied).
class TokenBucketBudget final : public RetryBudget {
 public:
  /// Throws std::invalid_argument naming the field and value when a Requires line is broken.
  explicit TokenBucketBudget(TokenBucketBudgetOptions options = {});

  void on_first_attempt() noexcept override {}
  [[nodiscard]] RetryPermit try_acquire_retry(const Outcome& failure) noexcept override;
  void record(const Outcome& outcome, const RetryPermit& permit) noexcept override;
  /// Refunds exactly what the permit cost.
  void cancel(const RetryPermit& permit) noexcept override;
  [[nodiscard]] double available() const noexcept override;
  [[nodiscard]] std::string_view model() const noexcept override { return "token bucket"; }

  [[nodiscard]] int tokens() const noexcept { return tokens_.load(std::memory_order_relaxed); }
  [[nodiscard]] const TokenBucketBudgetOptions& options() const noexcept { return options_; }

 private:
  void refund(int amount) noexcept;
  TokenBucketBudgetOptions options_;
  alignas(64) std::atomic<int> tokens_;
};

// ---------------------------------------------------------------------------------------------

struct ThrottleBudgetOptions {
  /// Tokens when full (and at start). Requires: in (0, 1000]. Default 10.
  double max_tokens = 10.0;
  /// Added per success. Requires: > 0; kept to 3 decimal places (as gRPC). Default 0.1.
  double token_ratio = 0.1;
};

/// gRPC's retry throttling: a dependency failure subtracts 1 token, a success adds token_ratio,
/// clamped to [0, max_tokens]; a retry is allowed only while tokens > max_tokens / 2. Kept as
/// milli-tokens in one atomic with a CAS clamp. Permanent failures (the caller's fault) do not
/// change the count. A success at max_tokens writes nothing.
class ThrottleBudget final : public RetryBudget {
 public:
  /// Throws std::invalid_argument naming the field and value when a Requires line is broken.
  explicit ThrottleBudget(ThrottleBudgetOptions options = {});

  void on_first_attempt() noexcept override {}
  /// Allowed while tokens > max / 2; spends nothing (the failure already cost a token).
  [[nodiscard]] RetryPermit try_acquire_retry(const Outcome& failure) noexcept override;
  void record(const Outcome& outcome, const RetryPermit& permit) noexcept override;
  [[nodiscard]] double available() const noexcept override { return tokens(); }
  [[nodiscard]] std::string_view model() const noexcept override { return "throttle"; }

  /// The current token count (milli-token precision).
  [[nodiscard]] double tokens() const noexcept;
  /// Whether a retry would be allowed now.
  [[nodiscard]] bool retry_allowed() const noexcept;
  [[nodiscard]] const ThrottleBudgetOptions& options() const noexcept { return options_; }

 private:
  void add(std::int64_t delta_milli) noexcept;
  ThrottleBudgetOptions options_;
  std::int64_t max_milli_ = 0;
  std::int64_t ratio_milli_ = 0;
  alignas(64) std::atomic<std::int64_t> milli_;
};

}  // namespace keel
