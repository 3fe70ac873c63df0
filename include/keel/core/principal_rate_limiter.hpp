// keel::PrincipalRateLimiter: a receiver's rate limit per principal, with no server framework in
// it (keel::AdmissionLimiter's neighbour: admission bounds the requests in flight, this the
// requests a second). Token buckets of `rate` tokens a second, bursts of up to `rate` (at least
// 1), keyed by the principal's scope (a keyed hash of the credential, never the credential) in a
// table of at most `capacity` entries; the least recently used entry is evicted when it is full,
// so memory is bounded whatever the number of distinct credentials. A principal not in the table
// (a new one, an evicted one) and unauthenticated requests (the empty scope) draw from one shared
// bucket of the same rate: rotating credentials buys no more than `rate` admissions a second in
// total. The answer is the wait until a token is free, for a 429's Retry-After.
//
// Thread-safety: every member is safe for concurrent use (one mutex).
//
// Example:
//   keel::PrincipalRateLimiter limiter(100.0, 10000);
//   if (const keel::Duration wait = limiter.admit(scope); wait > keel::Duration::zero()) {
//     // answer 429 with Retry-After: keel::format_retry_after(wait)
//   }
#pragma once

#include <cstddef>
#include <functional>
#include <list>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "keel/core/clock.hpp"

namespace keel {

class PrincipalRateLimiter {
 public:
  /// Requires: rate > 0 and finite, capacity >= 1. Throws std::invalid_argument naming the field
  /// otherwise. `clock` (default the steady clock) must outlive the limiter.
  PrincipalRateLimiter(double rate, std::size_t capacity, Clock& clock = steady_clock());
  /// Zero when admitted; otherwise how long until a token is available. The empty scope is the
  /// anonymous caller's: it always draws from the shared bucket.
  [[nodiscard]] Duration admit(std::string_view scope);
  /// Principals with a bucket of their own (at most the capacity).
  [[nodiscard]] std::size_t size();

 private:
  struct Bucket {
    double tokens;
    TimePoint last;
  };
  [[nodiscard]] Duration take(Bucket& b, TimePoint now) const;

  using Entry = std::pair<std::string, Bucket>;
  // Looked up by string_view: a principal that has a bucket costs no allocation.
  struct Hash {
    using is_transparent = void;
    [[nodiscard]] std::size_t operator()(std::string_view s) const noexcept {
      return std::hash<std::string_view>{}(s);
    }
  };
  double rate_;
  double burst_;
  std::size_t capacity_;
  Clock* clock_;
  std::mutex mu_;
  Bucket shared_;         // guarded by mu_
  std::list<Entry> lru_;  // guarded by mu_
  std::unordered_map<std::string, std::list<Entry>::iterator, Hash, std::equal_to<>>
      index_;  // guarded by mu_
};

}  // namespace keel
