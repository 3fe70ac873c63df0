// Fuzzes keel::http::parse_url: no crash, no UB, and every accepted URL obeys the contract (a
// lower-case http/https scheme, a non-empty lower-case host, a port in 1..65535, no space or
// control byte anywhere), and a refused one always says why.
#include <cstdint>
#include <cstdlib>
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
  }
  for (char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u == 0x7f) std::abort();
  }
  // Parsing is stable: the same text gives the same parts.
  const auto again = keel::http::parse_url(text);
  if (!again || again->host != url->host || again->port != url->port) std::abort();
  return 0;
}
