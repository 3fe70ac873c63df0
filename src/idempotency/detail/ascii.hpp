// ASCII helpers for the HTTP-facing parts of keel::store (header names and tokens compare
// case-insensitively, RFC 9110 section 5.1). Private to keel::store_idempotency and
// keel::store_http.
#pragma once

#include <cstddef>
#include <string_view>

namespace keel::store::detail {

/// Whether `a` and `b` are equal ignoring ASCII case.
[[nodiscard]] inline bool iequals(std::string_view a, std::string_view b) noexcept {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c; };
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

}  // namespace keel::store::detail
