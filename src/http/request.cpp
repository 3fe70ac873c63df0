#include "keel/http/request.hpp"

#include <string>
#include <utility>

#include "keel/core/idempotency_key.hpp"
#include "keel/detail/secure_random.hpp"

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

std::string make_idempotency_key() { return keel::detail::random_idempotency_key("keel::http"); }

}  // namespace keel::http
