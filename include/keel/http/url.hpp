// keel::http::parse_url: the one check of a request URL, shared by keel::http::Client,
// keel::asio::HttpClient and breaker_key, so that a malformed URL is refused before
// any attempt (a usage error, not a network error retried three times).
//
// Accepted: an absolute URL whose scheme is http or https in any case, an authority with an
// optional userinfo, a host (a registered name, an IPv4 address or a bracketed IPv6 literal) and
// an optional port in 1..65535, then an optional path, query and fragment. A host name written in
// UTF-8 ("bücher.example", an internationalised domain name) is converted to its ASCII form
// ("xn--bcher-kva.example", IDNA2008 with UTS #46's mapping, by libidn2, whatever the process's
// locale): that is the name keel sends, looks up and keys its breakers by (Url::converted).
// Refused, with the reason: another scheme, no host, an unclosed "[", a host name with a
// character libcurl refuses in one (RFC 3986's sub-delims "!$&'()*+,;=" among them), a port that
// is empty of digits, zero, too large or not a number, any space or control character anywhere
// in the URL, any byte that is not UTF-8 (a Latin-1 byte: percent-encode it), and a non-ASCII
// host that is no valid internationalised name. So a URL parse_url accepts is one libcurl can
// send: a refusal here is a usage error, never an attempt that fails the same way every time
// (and should libcurl still refuse one, that is a permanent failure: NetError::kUnusableUrl).
//
// Thread-safety: pure functions.
//
// Example:
//   if (auto u = keel::http::parse_url("HTTP://Example.com:8080/x?y")) {
//     // u->scheme == "http", u->host == "example.com", u->port == 8080
//   } else {
//     // "URL has a port 99999 out of range (1-65535) (got 'http://h:99999/')"
//     std::cerr << u.error().message() << '\n';
//   }
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "keel/core/expected.hpp"

namespace keel::http {

/// The parts of a valid request URL that keel uses.
struct Url {
  /// "http" or "https", lower case.
  std::string scheme;
  /// The host in lower case, an internationalised name in its ASCII form ("xn--..."); an IPv6
  /// literal keeps its brackets ("[::1]").
  std::string host;
  /// The explicit port, or the scheme's default (80 or 443).
  int port = 0;
  /// The URL as keel sends it when its host was converted to its ASCII form (the text with only
  /// the host replaced); empty when the text is sent as given.
  std::string converted;
};

/// Longest URL accepted, in bytes.
inline constexpr std::size_t kMaxUrlBytes = 8192;

/// The URL's parts, or an Error (field "URL") when it is not a valid absolute http:// or
/// https:// URL.
[[nodiscard]] Expected<Url> parse_url(std::string_view text);

}  // namespace keel::http
