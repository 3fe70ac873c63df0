// The one message format for invalid configuration, for every keel::core type that validates its
// options when it is built: "keel::TYPE: FIELD must be REQUIREMENT (got VALUE)". Private to
// keel::core.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace keel::detail {

/// Throws std::invalid_argument naming the type, the field, what it must be and what it was.
[[noreturn]] inline void reject(std::string_view type, std::string_view field,
                                std::string_view requirement, std::string_view got) {
  std::string m = "keel::";
  m.append(type).append(": ").append(field).append(" must be ").append(requirement);
  m.append(" (got ").append(got).append(")");
  throw std::invalid_argument(m);
}

/// A double without trailing zeros: 0.5, 10, 0.125.
[[nodiscard]] inline std::string format_number(double v) {
  std::string s = std::to_string(v);
  while (s.size() > 1 && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

}  // namespace keel::detail
