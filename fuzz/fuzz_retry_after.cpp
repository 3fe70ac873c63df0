// Fuzzes the Retry-After and HTTP-date parsers: no crash, no UB, and every accepted value obeys
// the contract (non-negative delay; dates round-trip through format_http_date).
#include <cstdint>
#include <cstdlib>
#include <keel/core/retry_after.hpp>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const keel::WallTime now{std::chrono::seconds(1795910400)};
  if (auto d = keel::parse_retry_after(text, now)) {
    if (*d < keel::Duration::zero()) std::abort();
  }
  if (auto t = keel::parse_http_date(text, now)) {
    const auto again = keel::parse_http_date(keel::format_http_date(*t), now);
    if (!again || *again != *t) std::abort();
  }
  return 0;
}
