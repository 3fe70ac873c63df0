#include "keel/asio/http_client.hpp"

#include <curl/curl.h>

#include <asio/use_awaitable.hpp>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "curl_multi.hpp"
#include "hedged_send.hpp"
#include "keel/asio/retry.hpp"
#include "keel/core/expected.hpp"
#include "keel/http/detail/attempt.hpp"
#include "keel/http/detail/fallback.hpp"

// GCC 12 reports -Wmismatched-new-delete inside Asio's awaitable frames when one coroutine
// co_awaits another of the same function (send() awaiting the duplicate lookup): Asio allocates
// frames with its own operator new and frees them with the matching sized operator delete, which
// GCC's inlined view does not pair up. Clang does not warn, and ASan checks the pairing for real.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

namespace keel::asio {
namespace {

struct EasyDeleter {
  void operator()(CURL* h) const noexcept { curl_easy_cleanup(h); }
};
using Easy = std::unique_ptr<CURL, EasyDeleter>;

using http::detail::AttemptResult;

// libcurl's transfer timeout fires first; CurlMulti aborts a transfer this long after it, as a
// backstop. The retry loop runs the attempts without a timer race of its own (kNoRace).
constexpr Duration kTimeoutGrace = std::chrono::milliseconds(250);

}  // namespace

struct HttpClient::Impl {
  Impl(::asio::any_io_executor ex, HttpClientOptions opts)
      : executor(std::move(ex)),
        options(std::move(opts)),
        policy(options.retry),
        classifier(options.classify.responses),
        duplicate(options.classify.duplicate_success),
        guards(options) {
    if (options.hedge) hedge.emplace(*options.hedge);
    http::detail::check_options(options, "keel::asio::HttpClientOptions");
    if (options.limits.max_host_connections < 0) {
      throw_invalid({.context = "keel::asio::HttpClientOptions",
                     .field = "limits.max_host_connections",
                     .problem = "must be >= 0",
                     .got = std::to_string(options.limits.max_host_connections)});
    }
    if (options.limits.max_transfers < 0) {
      throw_invalid({.context = "keel::asio::HttpClientOptions",
                     .field = "limits.max_transfers",
                     .problem = "must be >= 0",
                     .got = std::to_string(options.limits.max_transfers)});
    }
    multi = detail::CurlMulti::create(executor, options.limits.max_host_connections,
                                      static_cast<std::size_t>(options.limits.max_transfers));
  }

  // Runs attempt `engine_info` with its timeout shortened to the host's measured one
  // (`timeout`, nullptr: none), and records its latency there.
  ::asio::awaitable<AttemptResult> attempt(const HttpRequest& request, const RequestTraits& traits,
                                           const std::string& key, const AttemptInfo& engine_info,
                                           Clock& clock, AdaptiveTimeout* timeout) {
    const TimePoint began = clock.now();
    const AttemptInfo info = http::detail::adapt_attempt(engine_info, timeout, began);
    // An easy handle from the idle list (reset), returned to it when the attempt ends.
    struct Lease {
      Impl* impl;
      Easy easy;
      ~Lease() {
        if (easy && impl->idle.size() < kMaxIdleHandles) impl->idle.push_back(std::move(easy));
      }
    } lease{this, acquire()};
    CURL* h = lease.easy.get();
    http::detail::CurlAttempt attempt(h, request, traits, key, info, options);
    std::optional<AttemptResult> refused = attempt.start();
    if (refused) co_return std::move(*refused);
    // libcurl ends the transfer at info.timeout; the backstop, kTimeoutGrace later, in case it
    // does not.
    const detail::CurlMulti::Backstop backstop =
        info.timeout >= kInfinite
            ? detail::CurlMulti::kNoBackstop
            : std::chrono::steady_clock::now() +
                  detail::to_timer_duration(saturating_add(info.timeout, kTimeoutGrace));
    const CURLcode rc = co_await detail::async_perform(multi, h, backstop, ::asio::use_awaitable);
    if (rc == CURLE_ABORTED_BY_CALLBACK && !attempt.response_refused()) {
      // Aborted by the backstop, or cancelled by the caller (the loop then reports kCancelled).
      AttemptResult out;
      out.outcome = attempt_timeout_outcome();
      out.error = std::chrono::steady_clock::now() >= backstop
                      ? "timed out: no answer within the attempt's timeout"
                      : "cancelled";
      co_return out;
    }
    AttemptResult out = attempt.finish(rc, classifier, clock);
    const TimePoint ended = clock.now();
    http::detail::record_latency(timeout, out, ended - began, ended);
    co_return out;
  }

  Easy acquire() {
    if (!idle.empty()) {
      Easy easy = std::move(idle.back());
      idle.pop_back();
      curl_easy_reset(easy.get());
      return easy;
    }
    Easy easy(curl_easy_init());
    if (!easy) throw std::runtime_error("keel::asio: curl_easy_init failed");
    return easy;
  }

  ::asio::any_io_executor executor;
  HttpClientOptions options;
  RetryPolicy policy;
  HttpClassifier classifier;
  std::optional<DuplicateSuccessRule> duplicate;  // from options.classify.duplicate_success
  http::detail::OperationGuards guards;
  std::optional<HedgePolicy> hedge;  // from options.hedge
  static constexpr std::size_t kMaxIdleHandles = 64;
  std::vector<Easy> idle;  // handles of finished attempts, kept for reuse (executor-only)
  std::shared_ptr<detail::CurlMulti> multi;
};

HttpClient::HttpClient(::asio::any_io_executor executor, HttpClientOptions options)
    : impl_(std::make_shared<Impl>(std::move(executor), std::move(options))) {}

HttpClient::~HttpClient() = default;

const HttpClientOptions& HttpClient::options() const noexcept { return impl_->options; }

std::size_t HttpClient::transfers_in_flight() const noexcept { return impl_->multi->in_flight(); }

::asio::awaitable<HttpResult> HttpClient::send(HttpRequest request, RetryContext* context) {
  std::shared_ptr<Impl> impl = impl_;
  Clock& clock = impl->options.clock != nullptr ? *impl->options.clock : steady_clock();

  HttpResult result;
  const std::optional<RequestTraits> traits =
      http::detail::begin_operation(request, result, "keel::asio::HttpRequest");
  if (!traits) co_return result;

  // Set up outside the coroutine body proper: plain code, no declarations in conditions.
  std::shared_ptr<CircuitBreaker> breaker;  // held for the whole operation
  CallOptions call = impl->guards.call_options(request, *traits, clock, breaker);
  call.rng = impl->options.rng;
  call.context = context;
  const std::shared_ptr<AdaptiveTimeout> timeout = impl->guards.adaptive_timeout(request);

  // The last attempt's details, kept by the op for the result and the on_attempt hook, and the
  // outcome the engine was given for it (the duplicate-success rule reads it).
  std::string last_error;
  Outcome previous;
  auto op = [&](const AttemptInfo& info) -> ::asio::awaitable<AttemptResult> {
    last_error.clear();
    AttemptResult a = co_await impl->attempt(request, *traits, result.idempotency_key, info, clock,
                                             timeout.get());
    http::detail::apply_duplicate_success(impl->duplicate ? &*impl->duplicate : nullptr, previous,
                                          a);
    last_error = a.error;
    co_return a;
  };
  auto classify = [](const AttemptResult& a) { return a.outcome; };
  auto observer = [&](const AttemptInfo& info, const Outcome& outcome, const Decision& decision,
                      Duration took) {
    previous = outcome;
    http::detail::report_attempt(impl->options, request, info.number, outcome, last_error, took,
                                 decision);
  };

  // A hedged operation runs its rounds' attempts at once (hedged_send.hpp); the others are
  // keel::asio::retry's loop.
  std::optional<RetryState> hedged_state;
  std::optional<HedgeState> hedge;
  if (impl->hedge) {
    hedged_state.emplace(impl->policy, call);
    hedge.emplace(&*impl->hedge, impl->policy, call, *hedged_state);
  }
  RetryResult<AttemptResult> r;
  if (hedge && hedge->enabled()) {
    // The attempts run at once: each collects its body in memory, the winner's goes to the sink.
    std::optional<HttpRequest> unsunk;
    if (request.body_sink.write) {
      unsunk.emplace(request);
      unsunk->body_sink = {};
    }
    const HttpRequest& sent = unsunk ? *unsunk : request;
    auto hedged_op = [&](const AttemptInfo& info) {
      return impl->attempt(sent, *traits, result.idempotency_key, info, clock, timeout.get());
    };
    std::optional<RetryScope> scope;  // loops started in a hook are nested in this one
    if (context != nullptr) scope.emplace(context);
    r = co_await detail::hedged_loop(
        impl->executor, *impl->hedge, *hedge, *hedged_state,
        {impl->options, request, impl->duplicate ? &*impl->duplicate : nullptr, timeout.get()},
        hedged_op);
  } else {
    r = co_await detail::retry_loop<AttemptResult>(impl->executor, impl->policy, op, classify, call,
                                                   observer, detail::kNoRace);
  }

  if (r.value) {
    result.response = std::move(r.value->response);
    result.error = std::move(r.value->error);
  }
  result.outcome = r.outcome;
  result.reason = r.reason;
  result.attempts = r.attempts;
  result.elapsed = r.elapsed;
  if (result.reason == StopReason::kCancelled) result.error = "cancelled";
  http::detail::log_give_up(impl->options, request, result);
  http::detail::apply_fallbacks(impl->options, request, *traits, result, clock.now());
  if (std::optional<HttpRequest> lookup =
          http::detail::duplicate_lookup(impl->options, request, result)) {
    http::detail::adopt_lookup(result, co_await send(std::move(*lookup), context));
  }
  co_return result;
}

}  // namespace keel::asio
