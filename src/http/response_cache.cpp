// ResponseCache: bounded LRU of successful GET responses (see keel/http/response_cache.hpp).
#include "keel/http/response_cache.hpp"

#include <cctype>
#include <string>
#include <string_view>
#include <utility>

#include "keel/core/classify.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"

namespace keel::http {
namespace {

// Whether a comma-separated header value holds `token` (ASCII case-insensitive, spaces around
// each element ignored).
bool has_token(std::string_view value, std::string_view token) {
  while (!value.empty()) {
    const std::size_t comma = value.find(',');
    std::string_view item = value.substr(0, comma);
    while (!item.empty() && (item.front() == ' ' || item.front() == '\t')) item.remove_prefix(1);
    while (!item.empty() && (item.back() == ' ' || item.back() == '\t')) item.remove_suffix(1);
    if (item.size() == token.size()) {
      bool same = true;
      for (std::size_t i = 0; i < item.size() && same; ++i) {
        same = std::tolower(static_cast<unsigned char>(item[i])) ==
               std::tolower(static_cast<unsigned char>(token[i]));
      }
      if (same) return true;
    }
    if (comma == std::string_view::npos) break;
    value.remove_prefix(comma + 1);
  }
  return false;
}

bool any_header_has(const Headers& headers, std::string_view name, std::string_view token) {
  for (const auto& [n, v] : headers) {
    if (same_header_name(n, name) && has_token(v, token)) return true;
  }
  return false;
}

std::size_t size_of(const std::string& key, const Response& response) {
  std::size_t n = key.size() + response.status_line.size() + response.body.size();
  for (const auto& [name, value] : response.headers) n += name.size() + value.size();
  return n;
}

}  // namespace

ResponseCache::ResponseCache(ResponseCacheOptions options) : options_(options) {
  if (options_.max_entries < 1) {
    throw_invalid({.context = "keel::http::ResponseCacheOptions",
                   .field = "max_entries",
                   .problem = "must be >= 1",
                   .got = "0"});
  }
  if (options_.max_bytes < 1) {
    throw_invalid({.context = "keel::http::ResponseCacheOptions",
                   .field = "max_bytes",
                   .problem = "must be >= 1",
                   .got = "0"});
  }
  if (options_.max_age <= Duration::zero()) {
    throw_invalid({.context = "keel::http::ResponseCacheOptions",
                   .field = "max_age",
                   .problem = "must be > 0",
                   .got = format_duration(options_.max_age)});
  }
}

std::optional<std::string> ResponseCache::key_of(const Request& request) {
  if (parse_method(request.method) != Method::kGet) return std::nullopt;
  // NUL cannot occur in a URL or a header value that check_request accepts.
  std::string key = request.url;
  for (const std::string_view name : {"Accept", "Authorization"}) {
    key += '\0';
    if (const auto value = find_header(request.headers, name)) key += *value;
  }
  return key;
}

bool ResponseCache::store(const Request& request, const Response& response, TimePoint now) {
  std::optional<std::string> key = key_of(request);
  if (!key || response.status < 200 || response.status > 299) return false;
  if (any_header_has(response.headers, "Cache-Control", "no-store") ||
      any_header_has(response.headers, "Vary", "*")) {
    return false;
  }
  const std::size_t bytes = size_of(*key, response);
  if (bytes > options_.max_bytes) return false;
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = index_.find(*key); it != index_.end()) erase(it->second);
  while (!lru_.empty() &&
         (lru_.size() >= options_.max_entries || bytes_ + bytes > options_.max_bytes)) {
    erase(std::prev(lru_.end()));
  }
  lru_.push_front(Entry{.key = *key, .response = response, .received = now, .bytes = bytes});
  index_.emplace(std::move(*key), lru_.begin());
  bytes_ += bytes;
  return true;
}

std::optional<CachedResponse> ResponseCache::lookup(const Request& request, TimePoint now) {
  const std::optional<std::string> key = key_of(request);
  if (!key) return std::nullopt;
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = index_.find(*key);
  if (it == index_.end()) return std::nullopt;
  const Duration age = now - it->second->received;
  if (age > options_.max_age) {
    erase(it->second);
    return std::nullopt;
  }
  lru_.splice(lru_.begin(), lru_, it->second);  // most recently used
  return CachedResponse{.response = it->second->response, .age = age};
}

std::size_t ResponseCache::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lru_.size();
}

std::size_t ResponseCache::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

void ResponseCache::erase(Lru::iterator it) {
  bytes_ -= it->bytes;
  index_.erase(it->key);
  lru_.erase(it);
}

}  // namespace keel::http
