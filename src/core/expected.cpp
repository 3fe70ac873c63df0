#include "keel/core/expected.hpp"

#include <cstdio>
#include <stdexcept>

namespace keel {

std::string Error::message() const {
  std::string m;
  if (!context.empty()) m.append(context).append(": ");
  m.append(field);
  if (!problem.empty()) m.append(" ").append(problem);
  if (!got.empty()) m.append(" (got ").append(got).append(")");
  return m;
}

Error Error::in(std::string_view new_field, std::string_view new_context) const {
  Error e = *this;
  e.field = std::string(new_field);
  if (!new_context.empty()) e.context = std::string(new_context);
  return e;
}

void throw_invalid(Error error) { throw std::invalid_argument(error.message()); }

std::string byte_text(unsigned char byte) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "byte 0x";
  out += kHex[byte >> 4];
  out += kHex[byte & 0x0f];
  return out;
}

std::string quote_value(std::string_view text, std::size_t max_bytes) {
  std::string q = "'";
  bool cut = false;
  for (const char c : text) {
    if (q.size() > max_bytes) {  // the shown form is capped, escapes included
      cut = true;
      break;
    }
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", u);
      q += buf;
    } else {
      q += c;
    }
  }
  if (cut) q += "...";
  q += "'";
  return q;
}

}  // namespace keel
