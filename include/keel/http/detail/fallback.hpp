// keel::http::detail: the fallbacks both HTTP clients apply once an operation's retries are
// done (keel/core/fallback.hpp decides which; ClientOptions::fallbacks.stale_responses and
// fallbacks.deferred_writes carry them out). Written once, here, and called by keel::http::Client
// and keel::asio::HttpClient right after the give-up line.
//
// Not part of keel's API: the clients' implementation (keel::http_attempt), subject to change.
//
// Thread-safety: safe to call from any thread; the cache and the deferred writes are safe for
// concurrent use.
#pragma once

#include "keel/core/classify.hpp"
#include "keel/core/clock.hpp"
#include "keel/http/options.hpp"
#include "keel/http/request.hpp"

namespace keel::http::detail {

/// After the operation of `request` (with `traits`) ended with `result`, at `now` on the
/// client's clock: a successful GET's response is stored in options.fallbacks.stale_responses; a
/// failure takes the fallback keel::choose_fallback allows, when the options provide it.
/// kServeStale: the cached answer becomes the result (kSuccess, Result::stale and stale_age;
/// written to the request's body sink when it has one); with no fresh copy the failure stays.
/// kDefer: a copy of the request (its prior_attempts counting this operation's attempts; no
/// deadline, ceiling or body sink, which belong to this call, not to the later delivery) goes to
/// options.fallbacks.deferred_writes with the result's Idempotency-Key; stored, the result becomes
/// kQueued with Result::job_id; refused, the failure stays and Result::error says why.
void apply_fallbacks(const ClientOptions& options, const Request& request,
                     const RequestTraits& traits, Result& result, TimePoint now);

}  // namespace keel::http::detail
