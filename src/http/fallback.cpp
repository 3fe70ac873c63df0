// The fallbacks both HTTP clients apply after an operation (see keel/http/detail/fallback.hpp).
#include "keel/http/detail/fallback.hpp"

#include <exception>
#include <optional>
#include <string>
#include <utility>

#include "keel/core/fallback.hpp"
#include "keel/http/deferred_writes.hpp"
#include "keel/http/response_cache.hpp"

namespace keel::http::detail {
namespace {

// GET, HEAD and OPTIONS read; the others write.
bool is_read(Method method) noexcept {
  return method == Method::kGet || method == Method::kHead || method == Method::kOptions;
}

bool has_body_sink(const Request& request) noexcept {
  return static_cast<bool>(request.body_sink.write);
}

// The cached answer as the result; false (result untouched) when there is no fresh copy or the
// request's body sink refuses it.
bool serve_stale(ResponseCache& cache, const Request& request, Result& result, TimePoint now) {
  std::optional<CachedResponse> cached = cache.lookup(request, now);
  if (!cached) return false;
  if (has_body_sink(request)) {
    if (request.body_sink.restart && !request.body_sink.restart()) return false;
    if (!request.body_sink.write(cached->response.body)) return false;
    cached->response.body.clear();  // it went to the sink, as a live answer's would
  }
  result.outcome = Outcome::success();
  result.outcome.source = OutcomeSource::kHttp;
  result.outcome.code = cached->response.status;
  result.response = std::move(cached->response);
  result.reason = StopReason::kSuccess;
  result.error.clear();
  result.stale = true;
  result.stale_age = cached->age;
  return true;
}

void defer(DeferredWrites& writes, const Request& request, Result& result) {
  Request copy = request;
  copy.prior_attempts = request.prior_attempts + result.attempts;  // Keel-Attempt counts on
  copy.body_sink = {};
  // The caller's deadline bound this operation, not the later delivery.
  copy.deadline = Deadline::infinite();
  copy.ceiling = Deadline::infinite();
  Expected<Deferral> job = Error{.field = "defer", .problem = "failed"};
  try {
    job = writes.defer(copy, result.idempotency_key);
  } catch (const std::exception& e) {  // the interface says it must not throw; nothing is lost
    job = Error{.field = "defer", .problem = std::string("threw: ") + e.what()};
  }
  if (!job) {
    if (!result.error.empty()) result.error += "; ";
    result.error += "queueing the request for later failed: " + job.error().message();
    return;
  }
  if (job->status == DeferralStatus::kKeyConflict) {
    if (!result.error.empty()) result.error += "; ";
    result.error += "not queued for later: Idempotency-Key '" + result.idempotency_key +
                    "' is already queued as job " + job->job_id +
                    " with a different request (method, URL, header fields or body); use a new "
                    "key for a new request";
    result.job_id = std::move(job->job_id);
    result.deferral = DeferralStatus::kKeyConflict;
    return;
  }
  result.reason = StopReason::kQueued;
  result.job_id = std::move(job->job_id);
  result.deferral = job->status == DeferralStatus::kAlreadyQueued ? DeferralStatus::kAlreadyQueued
                                                                  : DeferralStatus::kQueued;
}

}  // namespace

void apply_fallbacks(const ClientOptions& options, const Request& request,
                     const RequestTraits& traits, Result& result, TimePoint now) {
  if (result.ok()) {
    if (options.fallbacks.stale_responses != nullptr && traits.method == Method::kGet &&
        result.response && !result.outcome.duplicate && !has_body_sink(request)) {
      (void)options.fallbacks.stale_responses->store(request, *result.response, now);
    }
    return;
  }
  const FallbackKind kind = choose_fallback(
      result.reason, result.outcome,
      {.read = is_read(traits.method), .has_idempotency_key = !result.idempotency_key.empty()});
  if (kind == FallbackKind::kServeStale && options.fallbacks.stale_responses != nullptr) {
    (void)serve_stale(*options.fallbacks.stale_responses, request, result, now);
  } else if (kind == FallbackKind::kDefer && options.fallbacks.deferred_writes != nullptr) {
    defer(*options.fallbacks.deferred_writes, request, result);
  }
}

}  // namespace keel::http::detail
