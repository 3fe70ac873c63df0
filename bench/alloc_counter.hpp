// Counts heap allocations made by the benchmarked code (global operator new is replaced in
// alloc_counter.cpp), so each benchmark can report allocations per iteration: in the whole
// process, or on the calling thread only (a benchmark whose server runs on another thread).
//
// Thread-safety: both counters may be read from any thread at any time.
#pragma once
#include <cstdint>

namespace keel::bench {
/// operator new calls in the process so far.
[[nodiscard]] std::uint64_t allocations() noexcept;
/// operator new calls made by the calling thread so far.
[[nodiscard]] std::uint64_t thread_allocations() noexcept;
}  // namespace keel::bench
