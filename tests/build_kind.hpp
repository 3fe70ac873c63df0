// What kind of build the tests run in, for the few tests whose bounds depend on it: wall-clock
// bounds are asserted, and long statistical loops run in full, only in the optimised build
// without a sanitizer (`make test`); the sanitizer builds (`make sanitize`) check the same
// behaviour without the timing bounds, over fewer seeds where a loop is long.
#pragma once

#include <cstdint>

namespace keel::test {

#if defined(NDEBUG) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
inline constexpr bool kTimingAsserted = true;
#else
inline constexpr bool kTimingAsserted = false;
#endif

/// Seeds for a statistical loop: `full` in the optimised build, `reduced` under a sanitizer or in
/// a debug build.
[[nodiscard]] constexpr std::uint64_t seeds(std::uint64_t full, std::uint64_t reduced) {
  return kTimingAsserted ? full : reduced;
}

}  // namespace keel::test
