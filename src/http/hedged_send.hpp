// Private to keel::http: the hedged operations of the blocking keel::http::Client. A hedged
// operation runs the attempts of a round at once on a libcurl multi handle of its own (from a
// pool the client keeps, so the success path does not create one per request), waiting in
// curl_multi_poll until a transfer finishes or the next hedge is due; keel::HedgeState decides
// when a hedge goes and which result ends the round, keel::RetryState what follows it. The easy
// handles come from the client's pool and share its connection cache.
//
// Thread-safety: MultiPool is safe for concurrent use; send_hedged runs one operation on the
// calling thread.
#pragma once

#include <curl/curl.h>

#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "idle_pool.hpp"
#include "keel/core/hedge.hpp"
#include "keel/core/retry.hpp"
#include "keel/http/detail/attempt.hpp"
#include "keel/http/options.hpp"
#include "keel/http/request.hpp"

namespace keel::http::detail {

/// Idle libcurl multi handles, kept for the next hedged operation (up to 8).
class MultiPool : public IdlePool<CURLM> {
 public:
  MultiPool()
      : IdlePool(
            8, &curl_multi_init, +[](CURLM* m) noexcept { curl_multi_cleanup(m); },
            "curl_multi_init") {}
};

/// What a hedged operation runs with: the request and the client's parts. Non-owning.
struct HedgedOperation {
  const Request& request;
  const RequestTraits& traits;
  const std::string& key;
  const ClientOptions& options;
  const HttpClassifier& classifier;
  const DuplicateSuccessRule* duplicate;  // nullptr: none
  AdaptiveTimeout* timeout;               // the host's; nullptr: none
  Clock& clock;
  CURLSH* share;
  std::function<CURL*()> acquire;  // an easy handle from the client's pool
  std::function<void(CURL*)> release;
};

/// Runs `retry`'s operation round by round with the hedges `hedge` allows (it must be
/// enabled), sleeping on op.clock between rounds, and fills `result`'s outcome, response and
/// error with the round's winner. Returns the requests sent (the operation's attempts).
[[nodiscard]] int send_hedged(const HedgedOperation& op, const HedgePolicy& policy,
                              HedgeState& hedge, RetryState& retry, MultiPool& multis,
                              Result& result);

}  // namespace keel::http::detail
