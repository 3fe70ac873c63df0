// keel::http::ResponseCache: a bounded in-memory cache of successful GET responses, for serving
// a stale answer while a dependency's circuit breaker is open ("stale while down",
// keel/core/fallback.hpp). Both HTTP clients fill it with every successful GET when
// ClientOptions::fallbacks.stale_responses points at one, and answer from it, with Result::stale
// set, instead of failing with kCircuitOpen; a cached answer older than max_age is never served.
//
// Bounded in entries and bytes, least recently used first out. It is not an HTTP cache: it
// never answers while the dependency is healthy, and it reads no freshness headers but one
// refusal. The key is the URL as given plus the request's Accept and Authorization values (two
// callers with different credentials or formats never share an answer); any other request
// header a response varies on is not part of it. A response is not stored when it says
// Cache-Control: no-store, or Vary: *. No I/O and no clock of its own: the caller passes the
// time (the clients pass their ClientOptions::clock's now), so it is tested in virtual time.
//
// Thread-safety: safe for concurrent use (one mutex around the table); share one between
// clients, blocking or not. Requires: outlives the clients that use it.
//
// Example:
//   keel::http::ResponseCache cache({.max_entries = 1000, .max_age = std::chrono::minutes(10)});
//   keel::http::Client client({.fallbacks = {.stale_responses = &cache}});
//   auto r = client.send({.url = "http://prices.internal/eur"});
//   if (r.stale) log("served a copy " + keel::format_duration(r.stale_age) + " old");
#pragma once

#include <chrono>
#include <cstddef>
#include <list>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "keel/core/clock.hpp"
#include "keel/http/message.hpp"
#include "keel/http/request.hpp"

namespace keel::http {

struct ResponseCacheOptions {
  /// Entries kept at most. Requires: >= 1. Default 1024.
  std::size_t max_entries = 1024;
  /// Bytes kept at most: each entry counts its key, status line, header fields and body. A
  /// response larger than this is not stored. Requires: >= 1. Default 32 MiB.
  std::size_t max_bytes = std::size_t{32} * 1024 * 1024;
  /// The oldest answer ever served (since it was received); older entries are dropped when
  /// looked up. Requires: > 0. Default 5 min.
  Duration max_age = std::chrono::minutes(5);
};

/// An answer from the cache.
struct CachedResponse {
  Response response;
  /// How long ago it was received (<= ResponseCacheOptions::max_age).
  Duration age{};
};

class ResponseCache {
 public:
  /// Throws std::invalid_argument naming the field and value when a Requires line is broken.
  explicit ResponseCache(ResponseCacheOptions options = {});

  /// The cache key of `request` (URL, Accept, Authorization), or nullopt when it is not a GET.
  [[nodiscard]] static std::optional<std::string> key_of(const Request& request);

  /// Stores `response` (received at `now`) as the answer to `request`, replacing an earlier one
  /// and evicting the least recently used entries to stay within the bounds. Returns false, and
  /// stores nothing, when the request is not a GET, the response is not 2xx, it says
  /// Cache-Control: no-store or Vary: *, or it is larger than max_bytes.
  bool store(const Request& request, const Response& response, TimePoint now);

  /// The answer stored for `request` when it is at most max_age old at `now` (it becomes the
  /// most recently used); nullopt otherwise (an older entry is dropped).
  [[nodiscard]] std::optional<CachedResponse> lookup(const Request& request, TimePoint now);

  [[nodiscard]] std::size_t size() const;
  [[nodiscard]] std::size_t bytes() const;
  [[nodiscard]] const ResponseCacheOptions& options() const noexcept { return options_; }

 private:
  struct Entry {
    std::string key;
    Response response;
    TimePoint received;
    std::size_t bytes = 0;
  };
  using Lru = std::list<Entry>;  // most recently used first
  void erase(Lru::iterator it);  // Requires: mu_ held

  const ResponseCacheOptions options_;
  mutable std::mutex mu_;
  Lru lru_;                                               // GUARDED_BY(mu_)
  std::unordered_map<std::string, Lru::iterator> index_;  // GUARDED_BY(mu_)
  std::size_t bytes_ = 0;                                 // GUARDED_BY(mu_)
};

}  // namespace keel::http
