#include "keel/core/budget.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "detail/invalid.hpp"
#include "detail/time_window.hpp"
#include "keel/core/duration.hpp"

namespace keel {

namespace {

constexpr std::int64_t kMilli = 1000;

using detail::reject;

std::string number(double v) { return detail::format_number(v); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// RatioBudget

// The window is detail::StripedTimeWindow (shared with the breaker's time window): deposits go
// to the calling thread's stripe of the bucket; withdrawals to the bucket's shared counter and
// its running total.
struct RatioBudget::Window : detail::StripedTimeWindow<1> {
  static constexpr int kWithdrawn = 0;
};

RatioBudget::RatioBudget(RatioBudgetOptions options)
    : options_(options), clock_(options.clock != nullptr ? options.clock : &steady_clock()) {
  if (!(options_.ratio >= 0.0 && options_.ratio <= 1000.0)) {
    reject("RatioBudget", "ratio", "in [0, 1000]", number(options_.ratio));
  }
  if (!(options_.reserve_per_second >= 0.0 && options_.reserve_per_second <= 1e9)) {
    reject("RatioBudget", "reserve_per_second", "in [0, 1e9]", number(options_.reserve_per_second));
  }
  if (options_.window < std::chrono::milliseconds(1) ||
      options_.window > std::chrono::hours(24 * 365)) {
    reject("RatioBudget", "window", "in [1ms, 365d]", format_duration(options_.window));
  }
  if (options_.buckets < 1 || options_.buckets > 1000) {
    reject("RatioBudget", "buckets", "in [1, 1000]", std::to_string(options_.buckets));
  }
  step_ = options_.window / options_.buckets;
  if (step_ < std::chrono::microseconds(1)) {
    reject("RatioBudget", "buckets", "at most window / 1us", std::to_string(options_.buckets));
  }
  // Steps of 100 ms or more are placed by the coarse clock when the budget is on the process's
  // steady clock: the same monotonic time at the kernel tick's resolution, a few ns a read.
  if (clock_ == &steady_clock() && step_ >= std::chrono::milliseconds(100)) {
    clock_ = &coarse_clock();
  }
  deposit_milli_ = std::llround(options_.ratio * kMilli);
  const double window_s = std::chrono::duration<double>(options_.window).count();
  reserve_milli_ = std::llround(options_.reserve_per_second * window_s * kMilli);
  window_ = std::make_unique<Window>();
  window_->init(options_.buckets);
  origin_ = clock_->now();
}

RatioBudget::~RatioBudget() = default;

std::int64_t RatioBudget::step_at(TimePoint now) const noexcept {
  const Duration since = now - origin_;
  return since <= Duration::zero() ? 0 : since / step_;
}

void RatioBudget::on_first_attempt() noexcept {
  if (deposit_milli_ == 0) return;
  const std::int64_t step = step_at(clock_->now());
  Window& w = *window_;
  w.expire(step);
  w.add_striped(w.bucket_at(step), deposit_milli_);
}

bool RatioBudget::try_withdraw_at(std::int64_t step) noexcept {
  Window& w = *window_;
  w.expire(step);
  // The compare-and-swap on the withdrawal total orders every withdrawal: of two threads that saw
  // the same last retry, the second one's swap fails and it checks again against the new total.
  std::atomic<std::int64_t>& withdrawn = w.total(Window::kWithdrawn);
  std::int64_t seen = withdrawn.load(std::memory_order_acquire);
  do {
    const std::int64_t balance = w.live_striped(step) + reserve_milli_ - seen;
    if (balance < kMilli) return false;
  } while (!withdrawn.compare_exchange_weak(seen, seen + kMilli, std::memory_order_acq_rel));
  // Recorded in its step so that it leaves the window too.
  w.add_to_bucket(w.bucket_at(step), Window::kWithdrawn, kMilli);
  return true;
}

RetryPermit RatioBudget::try_acquire_retry(const Outcome& /*failure*/) noexcept {
  RetryPermit permit;
  const std::int64_t step = step_at(clock_->now());
  permit.granted = try_withdraw_at(step);
  if (permit.granted) permit.step = step;
  return permit;
}

void RatioBudget::cancel(const RetryPermit& permit) noexcept {
  if (!permit.granted || permit.step < 0) return;
  Window& w = *window_;
  const auto i = static_cast<int>(permit.step % w.buckets());
  if (w.step_of(i) != permit.step) return;  // already left the window
  // Bucket first, then the total, so that a drain of this bucket between the two still takes
  // out exactly the bucket's net withdrawals. Only a drain between the step check above and the
  // bucket's update (the bucket moving to a newer step) can over-credit, by this one retry,
  // until that newer step leaves the window.
  w.add_to_bucket(i, Window::kWithdrawn, -kMilli);
  w.total(Window::kWithdrawn).fetch_sub(kMilli, std::memory_order_acq_rel);
}

void RatioBudget::record(const Outcome& /*outcome*/, const RetryPermit& /*permit*/) noexcept {}

double RatioBudget::available() const noexcept {
  const std::int64_t step = step_at(clock_->now());
  const std::int64_t total =
      window_->live_striped(step) + reserve_milli_ - window_->live_shared(step, Window::kWithdrawn);
  return total <= 0 ? 0.0 : std::floor(static_cast<double>(total) / kMilli);
}

// ---------------------------------------------------------------------------------------------
// TokenBucketBudget

TokenBucketBudget::TokenBucketBudget(TokenBucketBudgetOptions options)
    : options_(options), tokens_(options.capacity) {
  if (options_.capacity < 1) {
    reject("TokenBucketBudget", "capacity", ">= 1", std::to_string(options_.capacity));
  }
  if (options_.retry_cost < 0) {
    reject("TokenBucketBudget", "retry_cost", ">= 0", std::to_string(options_.retry_cost));
  }
  if (options_.timeout_retry_cost < 0) {
    reject("TokenBucketBudget", "timeout_retry_cost", ">= 0",
           std::to_string(options_.timeout_retry_cost));
  }
  if (options_.success_refund < 0) {
    reject("TokenBucketBudget", "success_refund", ">= 0", std::to_string(options_.success_refund));
  }
}

RetryPermit TokenBucketBudget::try_acquire_retry(const Outcome& failure) noexcept {
  const int cost = failure.timed_out ? options_.timeout_retry_cost : options_.retry_cost;
  int tokens = tokens_.load(std::memory_order_acquire);
  do {
    if (tokens < cost) return {};
  } while (!tokens_.compare_exchange_weak(tokens, tokens - cost, std::memory_order_acq_rel));
  RetryPermit permit;
  permit.granted = true;
  permit.cost = cost;
  return permit;
}

void TokenBucketBudget::refund(int amount) noexcept {
  if (amount <= 0) return;
  int tokens = tokens_.load(std::memory_order_acquire);
  while (tokens < options_.capacity) {
    const int next = options_.capacity - tokens < amount ? options_.capacity : tokens + amount;
    if (tokens_.compare_exchange_weak(tokens, next, std::memory_order_acq_rel)) return;
  }
}

void TokenBucketBudget::cancel(const RetryPermit& permit) noexcept {
  if (permit.granted) refund(permit.cost);
}

void TokenBucketBudget::record(const Outcome& outcome, const RetryPermit& permit) noexcept {
  if (outcome.kind != OutcomeKind::kSuccess) return;
  refund(permit.granted ? permit.cost : options_.success_refund);
}

double TokenBucketBudget::available() const noexcept {
  const int cost = options_.retry_cost;
  const int tokens = tokens_.load(std::memory_order_relaxed);
  if (cost == 0) return tokens > 0 ? static_cast<double>(tokens) : 0.0;
  return std::floor(static_cast<double>(tokens) / cost);
}

// ---------------------------------------------------------------------------------------------
// ThrottleBudget

ThrottleBudget::ThrottleBudget(ThrottleBudgetOptions options) : options_(options) {
  if (!(options_.max_tokens > 0.0 && options_.max_tokens <= 1000.0)) {
    reject("ThrottleBudget", "max_tokens", "in (0, 1000]", number(options_.max_tokens));
  }
  if (!(options_.token_ratio > 0.0 && options_.token_ratio <= 1000.0)) {
    reject("ThrottleBudget", "token_ratio", "in (0, 1000]", number(options_.token_ratio));
  }
  max_milli_ = std::llround(options_.max_tokens * kMilli);
  ratio_milli_ = std::max<std::int64_t>(1, std::llround(options_.token_ratio * kMilli));
  milli_.store(max_milli_, std::memory_order_relaxed);
}

void ThrottleBudget::add(std::int64_t delta) noexcept {
  std::int64_t cur = milli_.load(std::memory_order_acquire);
  for (;;) {
    const std::int64_t next = std::clamp<std::int64_t>(cur + delta, 0, max_milli_);
    if (next == cur) return;  // already at the bound: nothing to write
    if (milli_.compare_exchange_weak(cur, next, std::memory_order_acq_rel)) return;
  }
}

void ThrottleBudget::record(const Outcome& outcome, const RetryPermit& /*permit*/) noexcept {
  if (outcome.kind == OutcomeKind::kSuccess) {
    add(ratio_milli_);
  } else if (is_dependency_failure(outcome.kind)) {
    add(-kMilli);
  }
}

bool ThrottleBudget::retry_allowed() const noexcept {
  return milli_.load(std::memory_order_acquire) * 2 > max_milli_;
}

RetryPermit ThrottleBudget::try_acquire_retry(const Outcome& /*failure*/) noexcept {
  RetryPermit permit;
  permit.granted = retry_allowed();
  return permit;
}

double ThrottleBudget::tokens() const noexcept {
  return static_cast<double>(milli_.load(std::memory_order_acquire)) / kMilli;
}

}  // namespace keel
