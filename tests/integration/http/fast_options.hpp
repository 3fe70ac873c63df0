// Client options for the HTTP tests over loopback: retries with a fast backoff, so that a test
// spends its time on the network, not on waiting.
#pragma once

#include <chrono>
#include <string_view>

#include "keel/http/client.hpp"

namespace keel::test {

/// `attempts` attempts, backoff base 1 ms and cap 5 ms, a per-try timeout of 5 s within an
/// overall 20 s, and no give-up log lines; everything else at the client's defaults.
inline http::ClientOptions fast_options(int attempts = 3) {
  http::ClientOptions o;
  o.retry.max_attempts = attempts;
  o.retry.per_try_timeout = std::chrono::seconds(5);
  o.retry.overall_timeout = std::chrono::seconds(20);
  o.retry.backoff = {.base = std::chrono::milliseconds(1), .cap = std::chrono::milliseconds(5)};
  o.observability.log = [](std::string_view) {};
  return o;
}

}  // namespace keel::test
