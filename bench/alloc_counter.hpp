// Counts heap allocations made by the benchmarked code (global operator new is replaced in
// alloc_counter.cpp), so each benchmark can report allocations per iteration.
#pragma once
#include <cstdint>

namespace keel::bench {
std::uint64_t allocations() noexcept;
}
