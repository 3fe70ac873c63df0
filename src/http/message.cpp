#include "keel/http/message.hpp"

#include <algorithm>
#include <string>

#include "keel/core/expected.hpp"

namespace keel::http {
namespace {

char lower(char c) noexcept { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c + 32) : c; }

std::string_view trim(std::string_view s) noexcept {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() &&
         (s.back() == ' ' || s.back() == '\t' || s.back() == '\r' || s.back() == '\n')) {
    s.remove_suffix(1);
  }
  return s;
}

// tchar (RFC 9110 section 5.6.2).
bool is_tchar(char c) noexcept {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
  return std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

}  // namespace

bool same_header_name(std::string_view a, std::string_view b) noexcept {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(),
                    [](char x, char y) { return lower(x) == lower(y); });
}

std::optional<std::string_view> find_header(const Headers& headers,
                                            std::string_view name) noexcept {
  for (const auto& [key, value] : headers) {
    if (same_header_name(key, name)) return std::string_view(value);
  }
  return std::nullopt;
}

Expected<std::string> check_idempotency_key(std::string_view key) {
  return keel::check_idempotency_key(key).to_expected();
}

Expected<void> check_header_field(std::string_view name, std::string_view value) {
  if (name.empty()) {
    return Error{.field = "header name", .problem = "is empty"};
  }
  for (char c : name) {
    if (!is_tchar(c)) {
      return Error{.field = "header name",
                   .problem = "contains " + byte_text(static_cast<unsigned char>(c)),
                   .got = quote_value(name)};
    }
  }
  for (char c : value) {
    const auto u = static_cast<unsigned char>(c);
    if ((u < 0x20 && c != '\t') || u == 0x7f) {
      // The value is not quoted: it may be a credential (Authorization, Cookie).
      return Error{.field = "header " + quote_value(name),
                   .problem = "has a value with a control character (" + byte_text(u) + ")"};
    }
  }
  return {};
}

Expected<std::pair<std::string, std::string>> parse_header_field(std::string_view text) {
  const std::size_t colon = text.find(':');
  if (colon == std::string_view::npos) {
    return Error{.field = "header",
                 .problem = "must be 'Name: value' (found no ':')",
                 .got = quote_value(text)};
  }
  const std::string_view name = text.substr(0, colon);
  std::string_view value = text.substr(colon + 1);
  while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
  while (!value.empty() && (value.back() == ' ' || value.back() == '\t')) value.remove_suffix(1);
  if (auto checked = check_header_field(name, value); !checked) return std::move(checked).error();
  return std::pair<std::string, std::string>(name, value);
}

std::optional<int> parse_status_line(std::string_view line) noexcept {
  line = trim(line);
  if (!line.starts_with("HTTP/")) return std::nullopt;
  const std::size_t space = line.find(' ');
  if (space == std::string_view::npos || space == 5) return std::nullopt;
  const std::string_view rest = line.substr(space + 1);
  if (rest.size() < 3 || (rest.size() > 3 && rest[3] != ' ')) return std::nullopt;
  int code = 0;
  for (std::size_t i = 0; i < 3; ++i) {
    if (rest[i] < '0' || rest[i] > '9') return std::nullopt;
    code = code * 10 + (rest[i] - '0');
  }
  if (code < 100) return std::nullopt;
  return code;
}

bool ResponseHeadParser::feed(std::string_view line, Response& out) {
  if (!error_.empty()) return false;
  const bool status_line = line.starts_with("HTTP/");
  const std::size_t before = status_line ? 0 : bytes_;
  if (line.size() > max_bytes_ - std::min(before, max_bytes_)) {
    error_ = "the response head is larger than " + std::to_string(max_bytes_) +
             " bytes (max_header_bytes)";
    return false;
  }
  bytes_ = before + line.size();
  if (status_line) {
    // A new status line (after a 1xx, for instance): the final response starts over.
    out.status_line = std::string(trim(line));
    out.status = parse_status_line(line).value_or(0);
    out.headers.clear();
    return true;
  }
  const auto colon = line.find(':');
  if (colon != std::string_view::npos && colon > 0) {
    out.headers.emplace_back(std::string(line.substr(0, colon)),
                             std::string(trim(line.substr(colon + 1))));
  }
  return true;
}

}  // namespace keel::http
