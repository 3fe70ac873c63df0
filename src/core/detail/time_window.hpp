// The striped sliding time window that the circuit breaker's time window and the ratio budget
// share: `buckets` time steps, each tagged with the step it holds. Every bucket has one striped
// counter (each thread adds to its own cache line: the breaker's calls, the budget's deposits)
// and kShared plain counters that also feed running totals (the breaker's failures and slow
// calls, the budget's withdrawals). Whoever moves a bucket's tag forward, or sweeps it once it
// has left the window, empties it and takes its shared counts out of the totals, exactly once,
// by exchange. Recording into the current bucket is lock-free; moving a bucket to a new step
// holds it (its tag reads kRotating) for the few stores that empty it. Private to keel::core.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <thread>

#include "stripe.hpp"

namespace keel::detail {

template <int kShared>
class StripedTimeWindow {
 public:
  struct alignas(64) Bucket {
    std::atomic<std::int64_t> step{-1};
    std::atomic<std::int64_t> shared[kShared] = {};
  };

  /// Requires: buckets >= 1; called once, before any other member.
  void init(int buckets) {
    buckets_ = buckets;
    stripes_ = stripe_count();
    slots_ = std::make_unique<Bucket[]>(static_cast<std::size_t>(buckets));
    striped_ = std::make_unique<StripedCounter[]>(static_cast<std::size_t>(buckets) *
                                                  static_cast<std::size_t>(stripes_));
  }

  [[nodiscard]] int buckets() const noexcept { return buckets_; }

  /// Sweeps the buckets that left the window ending at `step` (once per step, whoever comes
  /// first).
  void expire(std::int64_t step) noexcept {
    const std::int64_t first_live = step - buckets_ + 1;
    std::int64_t through = expired_through_.load(std::memory_order_acquire);
    if (through >= first_live) return;
    for (int i = 0; i < buckets_; ++i) {
      Bucket& b = slot(i);
      std::int64_t tag = b.step.load(std::memory_order_acquire);
      // Held while it is emptied, so that nobody records into it meanwhile; the tag is kept.
      if (tag != kRotating && tag < first_live &&
          b.step.compare_exchange_strong(tag, kRotating, std::memory_order_acq_rel)) {
        drain(i);
        b.step.store(tag, std::memory_order_release);
      }
    }
    while (through < first_live && !expired_through_.compare_exchange_weak(
                                       through, first_live, std::memory_order_acq_rel)) {
    }
  }

  /// The bucket of `step`, moved to that step if it still holds an older one. The mover holds
  /// the bucket (its tag reads kRotating) while it empties it, and others wait for the new tag,
  /// so no record lands in a bucket that is then emptied. A late caller (the bucket already
  /// holds a newer step) uses it as it is: its entry expires a little later.
  [[nodiscard]] int bucket_at(std::int64_t step) noexcept {
    const auto i = static_cast<int>(step % buckets_);
    Bucket& b = slot(i);
    for (;;) {
      std::int64_t tag = b.step.load(std::memory_order_acquire);
      if (tag == kRotating) {
        std::this_thread::yield();  // another thread is emptying it: a handful of stores
        continue;
      }
      if (tag >= step) return i;
      if (b.step.compare_exchange_weak(tag, kRotating, std::memory_order_acq_rel)) {
        drain(i);
        b.step.store(step, std::memory_order_release);
        return i;
      }
    }
  }

  /// Adds to this thread's stripe of bucket i.
  void add_striped(int i, std::int64_t v) noexcept {
    striped_of(i, stripe_id()).value.fetch_add(v, std::memory_order_acq_rel);
  }

  /// Adds to shared counter k of bucket i and to its running total.
  void add_shared(int i, int k, std::int64_t v) noexcept {
    slot(i).shared[k].fetch_add(v, std::memory_order_acq_rel);
    totals_[k].fetch_add(v, std::memory_order_acq_rel);
  }

  /// The running total of shared counter k over the buckets not yet drained. For a caller that
  /// reserves by compare-and-swap on it (then records into a bucket with add_to_bucket).
  [[nodiscard]] std::atomic<std::int64_t>& total(int k) noexcept { return totals_[k]; }
  [[nodiscard]] std::int64_t total(int k) const noexcept {
    return totals_[k].load(std::memory_order_acquire);
  }
  /// Adds to shared counter k of bucket i only (its total was already changed by the caller).
  void add_to_bucket(int i, int k, std::int64_t v) noexcept {
    slot(i).shared[k].fetch_add(v, std::memory_order_acq_rel);
  }
  /// The step bucket i holds now.
  [[nodiscard]] std::int64_t step_of(int i) const noexcept {
    return slot(i).step.load(std::memory_order_acquire);
  }

  /// Sum of the striped counters of the buckets live in the window ending at `step`.
  [[nodiscard]] std::int64_t live_striped(std::int64_t step) const noexcept {
    const std::int64_t first_live = step - buckets_ + 1;
    std::int64_t sum = 0;
    for (int i = 0; i < buckets_; ++i) {
      if (slot(i).step.load(std::memory_order_acquire) < first_live) continue;
      for (int s = 0; s < stripes_; ++s) {
        sum += striped_of(i, static_cast<std::uint32_t>(s)).value.load(std::memory_order_acquire);
      }
    }
    return sum;
  }

  /// Sum of shared counter k of the buckets live in the window ending at `step` (no sweep).
  [[nodiscard]] std::int64_t live_shared(std::int64_t step, int k) const noexcept {
    const std::int64_t first_live = step - buckets_ + 1;
    std::int64_t sum = 0;
    for (int i = 0; i < buckets_; ++i) {
      const Bucket& b = slot(i);
      if (b.step.load(std::memory_order_acquire) >= first_live) {
        sum += b.shared[k].load(std::memory_order_acquire);
      }
    }
    return sum;
  }

  /// Empties every bucket.
  void clear() noexcept {
    for (int i = 0; i < buckets_; ++i) drain(i);
  }

 private:
  Bucket& slot(int i) const noexcept { return slots_[static_cast<std::size_t>(i)]; }
  StripedCounter& striped_of(int bucket, std::uint32_t stripe) const noexcept {
    return striped_[static_cast<std::size_t>(bucket) * static_cast<std::size_t>(stripes_) +
                    (stripe & static_cast<std::uint32_t>(stripes_ - 1))];
  }

  // Empties one bucket, taking its shared counts out of the totals.
  void drain(int i) noexcept {
    for (int s = 0; s < stripes_; ++s) {
      striped_of(i, static_cast<std::uint32_t>(s)).value.store(0, std::memory_order_relaxed);
    }
    for (int k = 0; k < kShared; ++k) {
      const std::int64_t v = slot(i).shared[k].exchange(0, std::memory_order_acq_rel);
      if (v != 0) totals_[k].fetch_sub(v, std::memory_order_acq_rel);
    }
  }

  // A bucket's tag while one thread empties it (below every real step and the initial -1).
  static constexpr std::int64_t kRotating = INT64_MIN;

  int buckets_ = 0;
  int stripes_ = 1;
  std::unique_ptr<Bucket[]> slots_;
  std::unique_ptr<StripedCounter[]> striped_;  // buckets * stripes
  alignas(64) std::atomic<std::int64_t> totals_[kShared] = {};
  alignas(64) std::atomic<std::int64_t> expired_through_{0};
};

}  // namespace keel::detail
