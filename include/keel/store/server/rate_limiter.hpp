// keel::store::RateLimiter: per-principal rate limiting for a receiver. Token buckets of `rate`
// tokens a second, bursts of up to `rate` (at least 1), keyed by the principal's stored scope
// (principal_scope(): a keyed hash, never the credential) in a table of at most `capacity`
// entries; the least recently used entry is evicted when it is full, so memory is bounded
// whatever the number of distinct credentials. A principal not in the table (a new one, an
// evicted one) and unauthenticated requests (kAnonymousScope) draw from one shared bucket of the
// same rate: rotating credentials buys no more than `rate` admissions a second in total.
//
// Thread-safety: every member is safe for concurrent use (one mutex).
//
// Example (a pre-routing handler answering 429 + Retry-After beyond 100 requests a second):
//   keel::store::RateLimiter limiter(100.0, 10000);
//   const keel::Duration wait = limiter.admit(middleware.scope(request));
//   if (wait > keel::Duration::zero()) {
//     keel::store::write_rate_limited(response, wait, "the limit is 100 requests a second");
//     return httplib::Server::HandlerResponse::Handled;
//   }
#pragma once

#include <httplib.h>

#include <cstddef>
#include <list>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "keel/clock.hpp"

namespace keel::store {

class RateLimiter {
 public:
  /// Requires: rate > 0 and finite, capacity >= 1. Throws std::invalid_argument naming the field
  /// otherwise.
  RateLimiter(double rate, std::size_t capacity);
  /// Zero when admitted; otherwise how long until a token is available.
  [[nodiscard]] Duration admit(const std::string& scope);
  /// Principals with a bucket of their own (at most the capacity).
  [[nodiscard]] std::size_t size();

 private:
  struct Bucket {
    double tokens;
    TimePoint last;
  };
  [[nodiscard]] Duration take(Bucket& b, TimePoint now) const;

  using Entry = std::pair<std::string, Bucket>;
  double rate_;
  double burst_;
  std::size_t capacity_;
  std::mutex mu_;
  Bucket shared_;                                                      // guarded by mu_
  std::list<Entry> lru_;                                               // guarded by mu_
  std::unordered_map<std::string, std::list<Entry>::iterator> index_;  // guarded by mu_
};

/// Writes the answer to a request over its rate: 429, Retry-After in whole seconds (`wait`
/// rounded up, at least 1), a problem+json body with `detail`, and the connection closed after
/// it (write_problem_and_close()).
void write_rate_limited(httplib::Response& response, Duration wait, std::string_view detail);

}  // namespace keel::store
