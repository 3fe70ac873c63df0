#include "keel/http/url.hpp"

#include <idn2.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

#include "keel/core/text.hpp"

namespace keel::http {
namespace {

char lower(char c) noexcept { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c + 32) : c; }

bool is_digit(char c) noexcept { return c >= '0' && c <= '9'; }

bool is_hex(char c) noexcept {
  return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

// A registered name's characters as libcurl takes them: RFC 3986's unreserved and pct-encoded
// (libcurl refuses the sub-delims "!$&'()*+,;=" in a host name, though RFC 3986 allows them), plus
// bytes of UTF-8 for an internationalised name (converted by ascii_host).
bool is_host_char(char c) noexcept {
  const auto u = static_cast<unsigned char>(c);
  if (u >= 0x80) return true;
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || is_digit(c)) return true;
  return c == '-' || c == '.' || c == '_' || c == '~' || c == '%';
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

bool is_ascii(std::string_view text) noexcept {
  return std::all_of(text.begin(), text.end(),
                     [](char c) { return static_cast<unsigned char>(c) < 0x80; });
}

// The ASCII form (A-labels, "xn--...") of an internationalised host name given in UTF-8: IDNA2008
// with UTS #46's mapping (lower case, NFC), non-transitional first and then transitional, as
// libcurl looks names up; but from UTF-8 whatever the process's locale (libcurl converts from the
// locale's encoding, so in a program that never called setlocale it refuses every such name).
// nullopt with libidn2's reason when it is not a valid name.
Expected<std::string> ascii_host(std::string_view host) {
  const std::string input(host);
  char* out = nullptr;
  int rc =
      idn2_lookup_u8(reinterpret_cast<const std::uint8_t*>(input.c_str()),
                     reinterpret_cast<std::uint8_t**>(&out), IDN2_NFC_INPUT | IDN2_NONTRANSITIONAL);
  if (rc != IDN2_OK) {
    rc = idn2_lookup_u8(reinterpret_cast<const std::uint8_t*>(input.c_str()),
                        reinterpret_cast<std::uint8_t**>(&out), IDN2_TRANSITIONAL);
  }
  if (rc != IDN2_OK) {
    return Error{.field = "host", .problem = idn2_strerror(rc), .got = quote_value(host)};
  }
  std::string ascii(out);
  idn2_free(out);
  // UTS #46 maps some characters to nothing (a soft hyphen): a host of only those is no host.
  if (ascii.empty()) {
    return Error{.field = "host",
                 .problem = "maps to " + quote_value(ascii) + ", which is not a host name",
                 .got = quote_value(host)};
  }
  // UTS #46 maps some characters to ones a host may not hold (a no-break space to a space).
  for (char c : ascii) {
    if (static_cast<unsigned char>(c) >= 0x80 || !is_host_char(c)) {
      return Error{.field = "host",
                   .problem = "maps to " + quote_value(ascii) + ", which is not a host name",
                   .got = quote_value(host)};
    }
  }
  return ascii;
}

}  // namespace

namespace {

// What is wrong with a URL's bytes, before its parts are read: a space or a control character
// (which must be percent-encoded), or bytes that are not UTF-8. nullopt when nothing is.
std::optional<std::string> byte_problem(std::string_view text) {
  for (std::size_t i = 0; i < text.size(); ++i) {
    const auto u = static_cast<unsigned char>(text[i]);
    if (u <= 0x20 || u == 0x7f) {
      return std::string(u == ' ' ? "has a space" : "has a control character") + " at byte " +
             std::to_string(i) + " (encode it, e.g. %20)";
    }
  }
  if (const std::size_t valid = storable_prefix_size(text); valid < text.size()) {
    const auto u = static_cast<unsigned char>(text[valid]);
    static constexpr char kHex[] = "0123456789ABCDEF";
    return "has a " + byte_text(u) + " at byte " + std::to_string(valid) +
           " that is not UTF-8 (percent-encode it: %" + kHex[u >> 4] + kHex[u & 0x0f] + ")";
  }
  return std::nullopt;
}

}  // namespace

Expected<Url> parse_url(std::string_view text) {
  if (text.empty()) return fail(text, "is empty");
  if (text.size() > kMaxUrlBytes) {
    return fail(text, "is " + std::to_string(text.size()) + " bytes, more than " +
                          std::to_string(kMaxUrlBytes));
  }
  if (std::optional<std::string> problem = byte_problem(text)) return fail(text, *problem);
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
  std::string ascii_name;  // an internationalised host's ASCII form, which `host` then views
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
    if (!is_ascii(host)) {
      // An internationalised name: sent, compared and keyed in its ASCII form.
      auto ascii = ascii_host(host);
      if (!ascii) {
        return fail(text, "has a host " + quote_value(host) +
                              " that is not a valid internationalised domain name (" +
                              ascii.error().problem + ")");
      }
      const auto begin = static_cast<std::size_t>(host.data() - text.data());
      url.converted.reserve(text.size() - host.size() + ascii->size());
      url.converted.append(text.substr(0, begin));
      url.converted.append(*ascii);
      url.converted.append(text.substr(begin + host.size()));
      ascii_name = std::move(*ascii);
      host = ascii_name;
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
