#include "keel/budget.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "detail/stripe.hpp"
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

// The window: `buckets` time steps, each tagged with the step it holds. Deposits go to the
// calling thread's stripe of the bucket; withdrawals to the bucket's count and to one running
// total. Whoever moves a bucket's tag forward (or sweeps it once it has left the window) empties
// it and takes its withdrawals out of the total, exactly once, by exchange.
struct RatioBudget::Window {
  struct alignas(64) Bucket {
    std::atomic<std::int64_t> step{-1};
    std::atomic<std::int64_t> withdrawn{0};  // milli-retries
  };

  int buckets = 0;
  int stripes = 1;
  std::unique_ptr<Bucket[]> slots;
  std::unique_ptr<detail::StripedCounter[]> deposits;  // buckets * stripes, milli-retries
  alignas(64) std::atomic<std::int64_t> withdrawn_total{0};
  alignas(64) std::atomic<std::int64_t> expired_through{0};  // steps below this are swept

  detail::StripedCounter& deposit_of(std::size_t bucket, std::uint32_t stripe) const noexcept {
    return deposits[bucket * static_cast<std::size_t>(stripes) +
                    (stripe & static_cast<std::uint32_t>(stripes - 1))];
  }

  void drain(std::size_t i) noexcept {
    for (int s = 0; s < stripes; ++s) {
      deposit_of(i, static_cast<std::uint32_t>(s)).value.store(0, std::memory_order_relaxed);
    }
    const std::int64_t w = slots[i].withdrawn.exchange(0, std::memory_order_acq_rel);
    if (w != 0) withdrawn_total.fetch_sub(w, std::memory_order_acq_rel);
  }

  void expire(std::int64_t step) noexcept {
    const std::int64_t first_live = step - buckets + 1;
    std::int64_t through = expired_through.load(std::memory_order_acquire);
    if (through >= first_live) return;
    for (int i = 0; i < buckets; ++i) {
      if (slots[static_cast<std::size_t>(i)].step.load(std::memory_order_acquire) < first_live) {
        drain(static_cast<std::size_t>(i));
      }
    }
    while (through < first_live &&
           !expired_through.compare_exchange_weak(through, first_live, std::memory_order_acq_rel)) {
    }
  }

  // The bucket of `step`, moved to that step if it still holds an older one. A late caller
  // (the bucket already holds a newer step) uses it as it is: its entry expires a little later.
  std::size_t bucket_at(std::int64_t step) noexcept {
    const auto i = static_cast<std::size_t>(step % buckets);
    Bucket& b = slots[i];
    std::int64_t tag = b.step.load(std::memory_order_acquire);
    while (tag < step) {
      if (b.step.compare_exchange_weak(tag, step, std::memory_order_acq_rel)) {
        drain(i);
        break;
      }
    }
    return i;
  }

  std::int64_t live_deposits(std::int64_t step) const noexcept {
    const std::int64_t first_live = step - buckets + 1;
    std::int64_t sum = 0;
    for (int i = 0; i < buckets; ++i) {
      if (slots[static_cast<std::size_t>(i)].step.load(std::memory_order_acquire) < first_live) {
        continue;
      }
      for (int s = 0; s < stripes; ++s) {
        sum += deposit_of(static_cast<std::size_t>(i), static_cast<std::uint32_t>(s))
                   .value.load(std::memory_order_acquire);
      }
    }
    return sum;
  }

  std::int64_t live_withdrawals(std::int64_t step) const noexcept {
    const std::int64_t first_live = step - buckets + 1;
    std::int64_t sum = 0;
    for (int i = 0; i < buckets; ++i) {
      const Bucket& b = slots[static_cast<std::size_t>(i)];
      if (b.step.load(std::memory_order_acquire) >= first_live) {
        sum += b.withdrawn.load(std::memory_order_acquire);
      }
    }
    return sum;
  }
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
  window_ = std::make_unique<Window>();
  window_->buckets = options_.buckets;
  window_->stripes = detail::stripe_count();
  window_->slots = std::make_unique<Window::Bucket[]>(static_cast<std::size_t>(options_.buckets));
  window_->deposits = std::make_unique<detail::StripedCounter[]>(
      static_cast<std::size_t>(options_.buckets) * static_cast<std::size_t>(window_->stripes));
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
  const std::size_t i = w.bucket_at(step);
  w.deposit_of(i, detail::stripe_id()).value.fetch_add(deposit_milli_, std::memory_order_acq_rel);
}

bool RatioBudget::try_withdraw_at(std::int64_t step) noexcept {
  Window& w = *window_;
  w.expire(step);
  // The compare-and-swap on the withdrawal total orders every withdrawal: of two threads that saw
  // the same last retry, the second one's swap fails and it checks again against the new total.
  std::int64_t withdrawn = w.withdrawn_total.load(std::memory_order_acquire);
  do {
    const std::int64_t balance = w.live_deposits(step) + reserve_milli_ - withdrawn;
    if (balance < kMilli) return false;
  } while (!w.withdrawn_total.compare_exchange_weak(withdrawn, withdrawn + kMilli,
                                                    std::memory_order_acq_rel));
  // Recorded in its step so that it leaves the window too.
  w.slots[w.bucket_at(step)].withdrawn.fetch_add(kMilli, std::memory_order_acq_rel);
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
  Window::Bucket& b = w.slots[static_cast<std::size_t>(permit.step % w.buckets)];
  if (b.step.load(std::memory_order_acquire) != permit.step) return;  // already left the window
  // Bucket first, then the total, so that a drain of this bucket between the two still takes
  // out exactly the bucket's net withdrawals. Only a drain between the step check above and the
  // bucket's update (the bucket moving to a newer step) can over-credit, by this one retry,
  // until that newer step leaves the window.
  b.withdrawn.fetch_sub(kMilli, std::memory_order_acq_rel);
  w.withdrawn_total.fetch_sub(kMilli, std::memory_order_acq_rel);
}

void RatioBudget::record(const Outcome& /*outcome*/, const RetryPermit& /*permit*/) noexcept {}

double RatioBudget::available() const noexcept {
  const std::int64_t step = step_at(clock_->now());
  const std::int64_t total =
      window_->live_deposits(step) + reserve_milli_ - window_->live_withdrawals(step);
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
