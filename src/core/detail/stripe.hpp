// Per-thread stripes for counters that many threads add to on a hot path (breaker windows, the
// ratio budget's deposits): each thread adds to its own cache line, and a reader sums the lines.
// Private to keel::core.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>

namespace keel::detail {

/// A counter on a cache line of its own.
struct alignas(64) StripedCounter {
  std::atomic<std::int64_t> value{0};
};

/// A small number that differs between threads: threads are numbered in the order they first
/// ask, so threads running at one time rarely share a stripe.
inline std::uint32_t stripe_id() noexcept {
  static std::atomic<std::uint32_t> next{0};
  thread_local const std::uint32_t id = next.fetch_add(1, std::memory_order_relaxed);
  return id;
}

/// Stripes per counter: twice the cores, at least 8, at most 64, a power of two.
inline int stripe_count() noexcept {
  const unsigned want = std::max(8U, std::min(64U, 2 * std::thread::hardware_concurrency()));
  int n = 1;
  while (static_cast<unsigned>(n) < want) n *= 2;
  return n;
}

}  // namespace keel::detail
