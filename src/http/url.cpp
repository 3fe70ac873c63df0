#include "keel/http/url.hpp"

#include <algorithm>
#include <string>

namespace keel::http {
namespace {

char lower(char c) noexcept { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c + 32) : c; }

bool is_digit(char c) noexcept { return c >= '0' && c <= '9'; }

bool is_hex(char c) noexcept {
  return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

// A registered name's characters (RFC 3986 unreserved, sub-delims and pct-encoded), plus bytes
// of UTF-8 for an internationalised name.
bool is_host_char(char c) noexcept {
  const auto u = static_cast<unsigned char>(c);
  if (u >= 0x80) return true;
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || is_digit(c)) return true;
  switch (c) {
    case '-':
    case '.':
    case '_':
    case '~':
    case '%':
    case '!':
    case '$':
    case '&':
    case '\'':
    case '(':
    case ')':
    case '*':
    case '+':
    case ',':
    case ';':
    case '=':
      return true;
    default:
      return false;
  }
}

// The URL as a message may show it: any userinfo ("user:secret@") replaced by "***@".
std::string shown(std::string_view text) {
  const std::size_t scheme_end = text.find("://");
  const std::size_t begin = scheme_end == std::string_view::npos ? 0 : scheme_end + 3;
  const std::size_t end = std::min(text.find_first_of("/?#", begin), text.size());
  const std::size_t at = text.substr(begin, end - begin).rfind('@');
  if (at == std::string_view::npos) return std::string(text);
  return std::string(text.substr(0, begin)) + "***" + std::string(text.substr(begin + at));
}

Error fail(std::string_view text, std::string problem) {
  return Error{.field = "URL", .problem = std::move(problem), .got = quote_value(shown(text), 80)};
}

}  // namespace

Expected<Url> parse_url(std::string_view text) {
  if (text.empty()) return fail(text, "is empty");
  if (text.size() > kMaxUrlBytes) {
    return fail(text, "is " + std::to_string(text.size()) + " bytes, more than " +
                          std::to_string(kMaxUrlBytes));
  }
  for (std::size_t i = 0; i < text.size(); ++i) {
    const auto u = static_cast<unsigned char>(text[i]);
    if (u <= 0x20 || u == 0x7f) {
      return fail(text, std::string(u == ' ' ? "has a space" : "has a control character") +
                            " at byte " + std::to_string(i) + " (encode it, e.g. %20)");
    }
  }
  const std::size_t scheme_end = text.find("://");
  Url url;
  if (scheme_end != std::string_view::npos) {
    for (char c : text.substr(0, scheme_end)) url.scheme.push_back(lower(c));
  }
  if (url.scheme != "http" && url.scheme != "https") {
    return fail(text, "has no http:// or https:// scheme");
  }
  std::string_view authority = text.substr(scheme_end + 3);
  authority = authority.substr(0, authority.find_first_of("/?#"));
  if (const auto at = authority.rfind('@'); at != std::string_view::npos) {
    authority.remove_prefix(at + 1);
  }
  if (authority.empty()) return fail(text, "has no host");
  std::string_view host = authority;
  std::string_view port;
  bool has_port = false;
  if (authority.front() == '[') {  // IPv6 literal
    const auto close = authority.find(']');
    if (close == std::string_view::npos)
      return fail(text, "has an IPv6 address with no closing ']'");
    host = authority.substr(0, close + 1);
    const std::string_view inside = host.substr(1, host.size() - 2);
    if (inside.empty() || inside.find(':') == std::string_view::npos) {
      return fail(text, "has a host " + quote_value(host) + " that is not an IPv6 address");
    }
    for (char c : inside) {
      if (!is_hex(c) && c != ':' && c != '.') {
        return fail(text, "has a host " + quote_value(host) + " that is not an IPv6 address");
      }
    }
    const std::string_view rest = authority.substr(close + 1);
    if (!rest.empty()) {
      if (rest.front() != ':') {
        return fail(text, "has unexpected " + quote_value(rest) + " after the IPv6 address");
      }
      has_port = true;
      port = rest.substr(1);
    }
  } else {
    if (const auto colon = authority.find(':'); colon != std::string_view::npos) {
      host = authority.substr(0, colon);
      port = authority.substr(colon + 1);
      has_port = true;
    }
    if (host.empty()) return fail(text, "has no host");
    for (char c : host) {
      if (!is_host_char(c)) {
        return fail(text, "has a host " + quote_value(host) + " that contains " +
                              quote_value(std::string_view(&c, 1)));
      }
    }
    if (host.size() > 253) return fail(text, "has a host longer than 253 bytes");
  }
  if (has_port) {
    if (port.empty()) return fail(text, "has an empty port after ':'");
    if (port.size() > 5 || port.find_first_not_of("0123456789") != std::string_view::npos) {
      return fail(text, "has a port " + quote_value(port) + " that is not a number in 1-65535");
    }
    int value = 0;
    for (char c : port) value = value * 10 + (c - '0');
    if (value < 1 || value > 65535) {
      return fail(text, "has a port " + std::string(port) + " out of range (1-65535)");
    }
    url.port = value;
  } else {
    url.port = url.scheme == "https" ? 443 : 80;
  }
  url.host.reserve(host.size());
  for (char c : host) url.host.push_back(lower(c));
  return url;
}

}  // namespace keel::http
