// Fuzzes keel::http::parse_url: no crash, no UB, and every accepted URL obeys the contract (a
// lower-case http/https scheme, a non-empty lower-case ASCII host of the characters libcurl
// takes, a port in 1..65535, no space or control byte anywhere, valid UTF-8; an internationalised
// host converted, the converted URL ASCII in its host and accepted as it is), and a refused one
// always says why.
#include <cstdint>
#include <cstdlib>
#include <keel/core/text.hpp>
#include <keel/http/url.hpp>
#include <string>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto url = keel::http::parse_url(text);
  if (!url) {
    if (url.error().problem.empty()) std::abort();  // a refusal always says why
    return 0;
  }
  if (url->scheme != "http" && url->scheme != "https") std::abort();
  if (url->host.empty() || url->port < 1 || url->port > 65535) std::abort();
  for (char c : url->host) {
    if (c >= 'A' && c <= 'Z') std::abort();
    if (static_cast<unsigned char>(c) >= 0x80) std::abort();  // converted to its ASCII form
    if (url->host.front() != '[' && !((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                                      c == '-' || c == '.' || c == '_' || c == '~' || c == '%')) {
      std::abort();  // a character libcurl refuses in a host name
    }
  }
  for (char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u == 0x7f) std::abort();
  }
  if (!keel::is_storable_text(text)) std::abort();
  if (!url->converted.empty()) {
    // The converted URL is accepted as it is, with the same parts.
    const auto sent = keel::http::parse_url(url->converted);
    if (!sent || !sent->converted.empty() || sent->host != url->host || sent->port != url->port) {
      std::abort();
    }
  }
  // Parsing is stable: the same text gives the same parts.
  const auto again = keel::http::parse_url(text);
  if (!again || again->host != url->host || again->port != url->port) std::abort();
  return 0;
}
