// Keel-Deadline-Ms: the strict parser and the sender's formatting (see
// keel/core/deadline_header.hpp).
#include "keel/core/deadline_header.hpp"

#include <cstdint>

namespace keel {
namespace {

constexpr std::size_t kMaxDigits = 11;  // 365 days is 31536000000 ms: 11 digits

bool is_blank(char c) noexcept { return c == ' ' || c == '\t'; }

Error invalid(std::string_view problem, std::string_view value) {
  return Error{.context = {},
               .field = std::string(kDeadlineHeader),
               .problem = std::string(problem),
               .got = quote_value(value)};
}

}  // namespace

Expected<Duration> parse_deadline_header(std::string_view value) {
  std::string_view digits = value;
  while (!digits.empty() && is_blank(digits.front())) digits.remove_prefix(1);
  while (!digits.empty() && is_blank(digits.back())) digits.remove_suffix(1);
  if (digits.empty()) return invalid("is empty; expected whole milliseconds", value);
  if (digits.size() > kMaxDigits) {
    return invalid("has more than 11 digits; expected at most 365 days in milliseconds", value);
  }
  std::int64_t ms = 0;
  for (const char c : digits) {
    if (c < '0' || c > '9') {
      return invalid("must be whole milliseconds, ASCII digits only", value);
    }
    ms = ms * 10 + (c - '0');  // at most 11 digits: no overflow
  }
  const auto budget = std::chrono::milliseconds(ms);
  if (budget > kMaxPropagatedDeadline) {
    return invalid("is longer than 365 days", value);
  }
  return std::chrono::duration_cast<Duration>(budget);
}

std::string format_deadline_header(Duration remaining) {
  if (remaining <= Duration::zero()) return "0";
  if (remaining >= kMaxPropagatedDeadline) {
    return std::to_string(
        std::chrono::duration_cast<std::chrono::milliseconds>(kMaxPropagatedDeadline).count());
  }
  return std::to_string(std::chrono::floor<std::chrono::milliseconds>(remaining).count());
}

}  // namespace keel
