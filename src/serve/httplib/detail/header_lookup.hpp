// The header fields of an httplib::Request as keel's one request translation reads them
// (keel/idempotency/request_translation.hpp). cpp-httplib's header map compares names
// without regard to case; the views point into the request.
#pragma once

#include <httplib.h>

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "keel/idempotency/request_translation.hpp"

namespace keel::store::detail {

class HttplibHeaders final : public HeaderLookup {
 public:
  explicit HttplibHeaders(const httplib::Request& request) noexcept : request_(request) {}

  [[nodiscard]] std::optional<std::string_view> first(std::string_view name) const override {
    // The first of equal names (what get_header_value() returns): multimap::find may give any.
    const auto range = request_.headers.equal_range(std::string(name));
    if (range.first == range.second) return std::nullopt;
    return std::string_view(range.first->second);
  }
  [[nodiscard]] std::size_t count(std::string_view name) const override {
    return request_.headers.count(std::string(name));
  }

 private:
  const httplib::Request& request_;
};

}  // namespace keel::store::detail
