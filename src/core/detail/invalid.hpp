// The one message format for invalid configuration, for every keel::core type that validates its
// options when it is built: "keel::TYPE: FIELD must be REQUIREMENT (got VALUE)", keel::Error's
// format (keel/expected.hpp). Private to keel::core.
#pragma once

#include <string>
#include <string_view>

#include "keel/expected.hpp"

namespace keel::detail {

/// Throws std::invalid_argument (keel::throw_invalid) naming the type, the field, what it must be
/// and what it was.
[[noreturn]] inline void reject(std::string_view type, std::string_view field,
                                std::string_view requirement, std::string_view got) {
  throw_invalid({.context = "keel::" + std::string(type),
                 .field = std::string(field),
                 .problem = "must be " + std::string(requirement),
                 .got = std::string(got)});
}

/// A double without trailing zeros: 0.5, 10, 0.125.
[[nodiscard]] inline std::string format_number(double v) {
  std::string s = std::to_string(v);
  while (s.size() > 1 && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

}  // namespace keel::detail
