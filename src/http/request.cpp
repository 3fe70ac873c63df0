#include "keel/http/request.hpp"

#include <openssl/rand.h>

#include <array>
#include <stdexcept>
#include <string>
#include <utility>

namespace keel::http {

std::optional<std::string> breaker_key(const std::string& url) {
  const std::optional<Url> u = parse_url(url);
  if (!u) return std::nullopt;
  return u->host + ":" + std::to_string(u->port);
}

std::string check_request(const Request& request, std::string* key) {
  std::string why;
  if (!parse_url(request.url, &why)) return "invalid URL: " + why;
  std::string found = request.idempotency_key;
  for (const auto& [name, value] : request.headers) {
    if (std::string problem = check_header_field(name, value); !problem.empty()) return problem;
    if (!same_header_name(name, "Idempotency-Key")) continue;
    if (!found.empty() && found != value) {
      return "two different idempotency keys ('" + found.substr(0, 64) + "' and '" +
             value.substr(0, 64) + "')";
    }
    found = value;
  }
  if (!found.empty() || !request.idempotency_key.empty()) {
    if (std::string problem = check_idempotency_key(found); !problem.empty()) return problem;
  }
  for (char c : request.method) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u >= 0x7f) return "invalid method '" + request.method.substr(0, 32) + "'";
  }
  *key = std::move(found);
  return {};
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
