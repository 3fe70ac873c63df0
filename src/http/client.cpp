#include "keel/http/client.hpp"

#include <curl/curl.h>

#include <array>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "hedged_send.hpp"
#include "idle_pool.hpp"
#include "keel/core/expected.hpp"
#include "keel/core/hedge.hpp"
#include "keel/http/detail/attempt.hpp"
#include "keel/http/detail/fallback.hpp"

namespace keel::http {

struct Client::Impl {
  explicit Impl(ClientOptions o)
      : options(std::move(o)),
        policy(options.retry),
        classifier(options.classify.responses),
        duplicate(options.classify.duplicate_success),
        guards(options) {
    if (options.hedge) hedge.emplace(*options.hedge);
    detail::check_options(options, "keel::http::ClientOptions");
    if (options.limits.max_idle_handles < 1) {
      throw_invalid({.context = "keel::http::ClientOptions",
                     .field = "limits.max_idle_handles",
                     .problem = "must be >= 1",
                     .got = std::to_string(options.limits.max_idle_handles)});
    }
    detail::global_init();
    share = curl_share_init();
    if (share == nullptr) throw std::runtime_error("keel::http: curl_share_init failed");
    curl_share_setopt(share, CURLSHOPT_LOCKFUNC, &Impl::lock);
    curl_share_setopt(share, CURLSHOPT_UNLOCKFUNC, &Impl::unlock);
    curl_share_setopt(share, CURLSHOPT_USERDATA, this);
    curl_share_setopt(share, CURLSHOPT_SHARE, CURL_LOCK_DATA_CONNECT);
    curl_share_setopt(share, CURLSHOPT_SHARE, CURL_LOCK_DATA_DNS);
    curl_share_setopt(share, CURLSHOPT_SHARE, CURL_LOCK_DATA_SSL_SESSION);
  }

  ~Impl() {
    idle.clear();  // the easy handles use the share: free them first
    curl_share_cleanup(share);
  }

  static void lock(CURL*, curl_lock_data data, curl_lock_access, void* user) {
    auto* self = static_cast<Impl*>(user);
    self->share_locks[static_cast<std::size_t>(data) % self->share_locks.size()].lock();
  }
  static void unlock(CURL*, curl_lock_data data, void* user) {
    auto* self = static_cast<Impl*>(user);
    self->share_locks[static_cast<std::size_t>(data) % self->share_locks.size()].unlock();
  }

  CURL* acquire() { return idle.acquire(); }
  void release(CURL* h) { idle.release(h); }

  detail::AttemptResult run_attempt(const Request& request, const RequestTraits& traits,
                                    const std::string& key, const AttemptInfo& info, Clock& clock) {
    CURL* h = acquire();
    struct Lease {
      Impl* impl;
      CURL* h;
      ~Lease() { impl->release(h); }
    } lease{this, h};
    curl_easy_reset(h);
    detail::CurlAttempt attempt(h, request, traits, key, info, options);
    curl_easy_setopt(h, CURLOPT_SHARE, share);
    if (std::optional<detail::AttemptResult> refused = attempt.start()) return *std::move(refused);
    return attempt.finish(curl_easy_perform(h), classifier, clock);
  }

  int send_hedged(const Request& request, const RequestTraits& traits, Result& result,
                  AdaptiveTimeout* timeout, Clock& clock, HedgeState& hedging, RetryState& state) {
    const detail::HedgedOperation op{.request = request,
                                     .traits = traits,
                                     .key = result.idempotency_key,
                                     .options = options,
                                     .classifier = classifier,
                                     .duplicate = duplicate ? &*duplicate : nullptr,
                                     .timeout = timeout,
                                     .clock = clock,
                                     .share = share,
                                     .acquire = [this] { return acquire(); },
                                     .release = [this](CURL* h) { release(h); }};
    return detail::send_hedged(op, *hedge, hedging, state, multis, result);
  }

  ClientOptions options;
  RetryPolicy policy;
  HttpClassifier classifier;
  std::optional<DuplicateSuccessRule> duplicate;  // from options.classify.duplicate_success
  detail::OperationGuards guards;
  std::optional<HedgePolicy> hedge;  // from options.hedge
  detail::MultiPool multis;          // for hedged operations
  CURLSH* share = nullptr;
  std::array<std::mutex, CURL_LOCK_DATA_LAST> share_locks;  // one per shared kind
  detail::IdlePool<CURL> idle{static_cast<std::size_t>(options.limits.max_idle_handles),
                              &curl_easy_init, &curl_easy_cleanup, "curl_easy_init"};
};

Client::Client(ClientOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
Client::~Client() = default;

const ClientOptions& Client::options() const noexcept { return impl_->options; }

Result Client::send(const Request& request) {
  Impl& impl = *impl_;
  Clock& clock = impl.options.clock != nullptr ? *impl.options.clock : steady_clock();

  Result result;
  const std::optional<RequestTraits> traits =
      detail::begin_operation(request, result, "keel::http::Request");
  if (!traits) return result;
  std::shared_ptr<CircuitBreaker> breaker;  // held for the whole operation
  const CallOptions call = impl.guards.call_options(request, *traits, clock, breaker);
  const std::shared_ptr<AdaptiveTimeout> timeout = impl.guards.adaptive_timeout(request);
  detail::LimitGate limits(impl.guards.rate_limit(request), impl.guards.concurrency_limit(request),
                           impl.options.brakes.max_limit_wait);
  RetryState state(impl.policy, call);
  int hedged_sent = 0;              // requests a hedged operation sent
  std::optional<Duration> limited;  // the host's limits held the next attempt this much longer
  {
    RetryScope scope;  // a keel operation started from a hook is one layer down
    HedgeState hedge(impl.hedge ? &*impl.hedge : nullptr, impl.policy, call, state);
    if (hedge.enabled())
      hedged_sent = impl.send_hedged(request, *traits, result, timeout.get(), clock, hedge, state);
    // After a hedged operation the engine has stopped: this loop runs no attempt.
    while (!state.stopped()) {
      // The host's rate, pause and concurrency first: a wait there spends no attempt.
      if (limits.active() && (limited = limits.pass(clock, state.deadline()))) break;
      const AttemptStart start = state.start_attempt();
      if (!start.proceed) {
        (void)limits.finish(Outcome::not_attempted(), Duration::zero(), clock.now());
        break;
      }
      const TimePoint began = clock.now();
      const AttemptInfo info = detail::adapt_attempt(start.attempt, timeout.get(), began);
      detail::AttemptResult attempt =
          impl.run_attempt(request, *traits, result.idempotency_key, info, clock);
      detail::apply_duplicate_success(impl.duplicate ? &*impl.duplicate : nullptr,
                                      state.last_outcome(), attempt);
      const TimePoint ended = clock.now();
      const Duration took = ended - began;
      detail::record_latency(timeout.get(), attempt, took, ended);
      // A 429 or 503 with Retry-After that paused the host is the host's limit, not a failure.
      const Outcome engine_outcome =
          limits.active() ? limits.finish(attempt.outcome, took, ended) : attempt.outcome;
      const Decision decision = state.next(engine_outcome);
      result.outcome = engine_outcome;
      result.response = std::move(attempt.response);
      result.error = std::move(attempt.error);
      detail::report_attempt(impl.options, request, start.attempt.number, attempt.outcome,
                             result.error, took, decision);
      if (!decision.retry) break;
      if (limits.paused() && decision.delay > limits.wait_left()) {
        limited = decision.delay;  // the pause this answer asked for is longer than the wait
        break;
      }
      // wait: core: the retry engine's decision
      clock.sleep_for(decision.delay);
    }
    if (limited) state.cancel();  // a retry's budget grant is given back
  }
  result.attempts = hedged_sent > 0 ? hedged_sent : state.attempts();
  if (result.attempts == 0) result.outcome = state.last_outcome();  // kNotAttempted
  result.elapsed = state.elapsed();
  result.reason = state.stop_reason();
  if (limited) {
    // Nothing more was sent: the host's limits would have held the call past its wait.
    result.reason = StopReason::kLimited;
    if (result.attempts == 0 || !result.outcome.attempted()) {
      result.outcome = Outcome::not_attempted(*limited);
      result.outcome.in_line = limits.in_line();
    }
  } else if (limits.paused() && !result.outcome.attempted() &&
             result.reason == StopReason::kAttemptsExhausted) {
    result.reason = StopReason::kLimited;  // the last answer paused the host
  }
  detail::log_give_up(impl.options, request, result);
  detail::apply_fallbacks(impl.options, request, *traits, result, clock.now());
  // Out of the retry scope: the lookup is an operation of its own, not one layer down.
  if (std::optional<Request> lookup = detail::duplicate_lookup(impl.options, request, result)) {
    detail::adopt_lookup(result, send(*lookup));
  }
  return result;
}

}  // namespace keel::http
