// Fuzzes the Keel-Deadline-Ms parser: no crash, no UB, every accepted budget lies in
// [0, kMaxPropagatedDeadline] in whole milliseconds and round-trips through
// format_deadline_header; a refusal names the header.
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <keel/core/deadline_header.hpp>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const keel::Expected<keel::Duration> budget = keel::parse_deadline_header(text);
  if (!budget) {
    if (budget.error().field != keel::kDeadlineHeader) std::abort();
    return 0;
  }
  const keel::Duration d = *budget;
  if (d < keel::Duration::zero() || d > keel::kMaxPropagatedDeadline) std::abort();
  if (d % std::chrono::milliseconds(1) != keel::Duration::zero()) std::abort();
  const auto again = keel::parse_deadline_header(keel::format_deadline_header(d));
  if (!again || *again != d) std::abort();
  return 0;
}
