#include "keel/budget.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "keel/duration.hpp"

namespace keel {

namespace {

constexpr std::int64_t kMilli = 1000;

[[noreturn]] void reject(const char* type, const char* field, const std::string& requirement,
                         const std::string& got) {
  throw std::invalid_argument(std::string("keel::") + type + ": " + field + " must be " +
                              requirement + " (got " + got + ")");
}

std::string number(double v) {
  std::string s = std::to_string(v);
  while (s.size() > 1 && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// RatioBudget

// One time step of the window. `step` tags which step the milli-retries belong to; whoever moves
// the tag forward takes the old contents out of the balance (exactly once, by exchange).
struct RatioBudget::Bucket {
  alignas(64) std::atomic<std::int64_t> step{-1};
  std::atomic<std::int64_t> milli{0};
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
  deposit_milli_ = std::llround(options_.ratio * kMilli);
  const double window_s = std::chrono::duration<double>(options_.window).count();
  reserve_milli_ = std::llround(options_.reserve_per_second * window_s * kMilli);
  buckets_ = std::make_unique<Bucket[]>(static_cast<std::size_t>(options_.buckets));
  origin_ = clock_->now();
}

RatioBudget::~RatioBudget() = default;

std::int64_t RatioBudget::step_at(TimePoint now) const noexcept {
  const Duration since = now - origin_;
  return since <= Duration::zero() ? 0 : since / step_;
}

void RatioBudget::expire(std::int64_t step) noexcept {
  // Steps <= step - buckets have left the window.
  const std::int64_t first_live = step - options_.buckets + 1;
  std::int64_t through = expired_through_.load(std::memory_order_acquire);
  if (through >= first_live) return;
  for (int i = 0; i < options_.buckets; ++i) {
    Bucket& b = buckets_[static_cast<std::size_t>(i)];
    if (b.step.load(std::memory_order_acquire) < first_live) {
      const std::int64_t gone = b.milli.exchange(0, std::memory_order_acq_rel);
      if (gone != 0) balance_milli_.fetch_sub(gone, std::memory_order_acq_rel);
    }
  }
  while (through < first_live &&
         !expired_through_.compare_exchange_weak(through, first_live, std::memory_order_acq_rel)) {
  }
}

void RatioBudget::add(std::int64_t step, std::int64_t milli) noexcept {
  Bucket& b = buckets_[static_cast<std::size_t>(step % options_.buckets)];
  std::int64_t tag = b.step.load(std::memory_order_acquire);
  while (tag < step) {
    if (b.step.compare_exchange_weak(tag, step, std::memory_order_acq_rel)) {
      // This thread moved the bucket to a new step: what it held has left the window.
      const std::int64_t gone = b.milli.exchange(0, std::memory_order_acq_rel);
      if (gone != 0) balance_milli_.fetch_sub(gone, std::memory_order_acq_rel);
      break;
    }
  }
  // A late writer (tag > step) adds to the newer step: it then expires slightly later.
  b.milli.fetch_add(milli, std::memory_order_acq_rel);
}

void RatioBudget::on_first_attempt() noexcept {
  if (deposit_milli_ == 0) return;
  const std::int64_t step = step_at(clock_->now());
  expire(step);
  add(step, deposit_milli_);
  balance_milli_.fetch_add(deposit_milli_, std::memory_order_acq_rel);
}

bool RatioBudget::try_withdraw() noexcept {
  const std::int64_t step = step_at(clock_->now());
  expire(step);
  std::int64_t balance = balance_milli_.load(std::memory_order_acquire);
  do {
    if (balance + reserve_milli_ < kMilli) return false;
  } while (
      !balance_milli_.compare_exchange_weak(balance, balance - kMilli, std::memory_order_acq_rel));
  // The balance already paid; record the withdrawal in its step so that it expires too.
  add(step, -kMilli);
  return true;
}

RetryPermit RatioBudget::try_acquire_retry(const Outcome& /*failure*/) noexcept {
  RetryPermit permit;
  permit.granted = try_withdraw();
  return permit;
}

void RatioBudget::record(const Outcome& /*outcome*/, const RetryPermit& /*permit*/) noexcept {}

double RatioBudget::available() const noexcept {
  const std::int64_t first_live = step_at(clock_->now()) - options_.buckets + 1;
  std::int64_t live = 0;
  for (int i = 0; i < options_.buckets; ++i) {
    const Bucket& b = buckets_[static_cast<std::size_t>(i)];
    if (b.step.load(std::memory_order_acquire) >= first_live) {
      live += b.milli.load(std::memory_order_acquire);
    }
  }
  const std::int64_t total = live + reserve_milli_;
  return total <= 0 ? 0.0 : static_cast<double>(total / kMilli);
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

void TokenBucketBudget::record(const Outcome& outcome, const RetryPermit& permit) noexcept {
  if (outcome.kind != OutcomeKind::kSuccess) return;
  refund(permit.granted ? permit.cost : options_.success_refund);
}

double TokenBucketBudget::available() const noexcept {
  const int cost = options_.retry_cost;
  const int tokens = tokens_.load(std::memory_order_relaxed);
  if (cost == 0) return tokens > 0 ? static_cast<double>(tokens) : 0.0;
  return static_cast<double>(tokens / cost);
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
