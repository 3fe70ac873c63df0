#include "keel/http/request.hpp"

#include <openssl/rand.h>

#include <array>
#include <stdexcept>
#include <string>
#include <utility>

namespace keel::http {

std::optional<std::string> breaker_key(const std::string& url) {
  const Expected<Url> u = parse_url(url);
  if (!u) return std::nullopt;
  return u->host + ":" + std::to_string(u->port);
}

Expected<std::string> check_request(const Request& request) {
  if (auto url = parse_url(request.url); !url) return std::move(url).error();
  // The key in its canonical form: "k" and k given twice are one key, sent bare.
  std::string found;
  if (!request.idempotency_key.empty()) {
    auto key = check_idempotency_key(request.idempotency_key);
    if (!key) return std::move(key).error();
    found = std::move(*key);
  }
  for (const auto& [name, value] : request.headers) {
    if (auto field = check_header_field(name, value); !field) return std::move(field).error();
    if (!same_header_name(name, "Idempotency-Key")) continue;
    auto key = check_idempotency_key(value);
    if (!key) return std::move(key).error();
    if (!found.empty() && found != *key) {
      return Error{.field = "Idempotency-Key",
                   .problem = "is given twice with different values " + quote_value(found),
                   .got = quote_value(value)};
    }
    found = std::move(*key);
  }
  for (char c : request.method) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u >= 0x7f) {
      return Error{
          .field = "method", .problem = "must be a token", .got = quote_value(request.method, 32)};
    }
  }
  return found;
}

std::string make_idempotency_key() {
  std::array<unsigned char, 16> b{};
  if (RAND_bytes(b.data(), static_cast<int>(b.size())) != 1) {
    throw std::runtime_error("keel::http: the CSPRNG (RAND_bytes) could not supply bytes");
  }
  b[6] = static_cast<unsigned char>((b[6] & 0x0f) | 0x40);  // version 4
  b[8] = static_cast<unsigned char>((b[8] & 0x3f) | 0x80);  // RFC 4122 variant
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(36);
  for (std::size_t i = 0; i < b.size(); ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out.push_back('-');
    out.push_back(kHex[b[i] >> 4]);
    out.push_back(kHex[b[i] & 0x0f]);
  }
  return out;
}

}  // namespace keel::http
