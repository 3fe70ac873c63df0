// The one message format for invalid configuration, for every keel::core type that validates its
// options when it is built: "keel::TYPE: FIELD must be REQUIREMENT (got VALUE)", keel::Error's
// format (keel/core/expected.hpp). Private to keel::core.
#pragma once

#include <string>
#include <string_view>
#include <type_traits>

#include "keel/core/clock.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"

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

/// A refused value as the message shows it: text as given, an integer, a double without trailing
/// zeros, a duration as keel writes one (100ms).
[[nodiscard]] inline std::string got_text(std::string_view v) { return std::string(v); }
[[nodiscard]] inline std::string got_text(const char* v) { return v; }
[[nodiscard]] inline std::string got_text(double v) { return format_number(v); }
[[nodiscard]] inline std::string got_text(Duration d) { return format_duration(d); }
template <class T>
requires std::is_integral_v<T>
[[nodiscard]] std::string got_text(T v) { return std::to_string(v); }

/// The refusals of one options type: check("field", "requirement", value) throws reject(type,
/// ...) with the value's got_text. The one way a keel::core type refuses its options.
class OptionsCheck {
 public:
  explicit constexpr OptionsCheck(std::string_view type) noexcept : type_(type) {}
  template <class T>
  [[noreturn]] void operator()(std::string_view field, std::string_view requirement,
                               const T& got) const {
    reject(type_, field, requirement, got_text(got));
  }

 private:
  std::string_view type_;
};

}  // namespace keel::detail
