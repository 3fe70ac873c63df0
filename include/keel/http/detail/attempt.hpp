// keel::http::detail: the one libcurl attempt that both HTTP clients run, and the steps of an
// operation they share around it. keel::http::Client drives a CurlAttempt with
// curl_easy_perform, keel::asio::HttpClient through its curl multi handle on an Asio loop; every
// HTTP rule of an attempt (the request's header fields, Keel-Attempt, Idempotency-Key and
// Keel-Deadline-Ms, the connect and whole-attempt timeouts, the head and body limits, the body
// sink, the classification of statuses, Retry-After and libcurl errors) is written here once.
//
// Not part of keel's API: the clients' implementation (keel::http_attempt), subject to change.
//
// Thread-safety: a CurlAttempt is one attempt, used by one thread at a time; OperationGuards is
// safe for concurrent use; the free functions are safe to call from any thread.
//
// Example (the blocking client):
//   CurlAttempt attempt(easy, request, traits, key, info, options);
//   if (auto refused = attempt.start()) return *refused;
//   return attempt.finish(curl_easy_perform(easy), classifier, clock);
#pragma once

#include <curl/curl.h>

#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "keel/core/breaker.hpp"
#include "keel/core/budget.hpp"
#include "keel/core/classify.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/concurrency_limit.hpp"
#include "keel/core/hedge.hpp"
#include "keel/core/latency.hpp"
#include "keel/core/rate_limit.hpp"
#include "keel/core/retry.hpp"
#include "keel/http/message.hpp"
#include "keel/http/options.hpp"
#include "keel/http/request.hpp"

namespace keel::http::detail {

/// curl_global_init, once per process. Throws std::runtime_error when it fails.
void global_init();

/// Milliseconds for libcurl's timeouts: rounded up so that a positive duration never becomes 0
/// (libcurl's "no limit"); kInfinite and longer is 0, at most 0x7fffffff.
[[nodiscard]] long to_curl_ms(Duration d) noexcept;

/// keel's reading of a libcurl error, with the OS errno libcurl saw (0: none).
[[nodiscard]] NetError net_error_of(CURLcode rc, long os_errno) noexcept;

/// Throws std::invalid_argument "TYPE: FIELD must be REQUIREMENT (got VALUE)" when a Requires
/// line of the fields both clients use is broken (transport.connect_timeout,
/// limits.max_header_bytes, limits.max_response_bytes). `type` names the options as the caller
/// knows them.
void check_options(const ClientOptions& options, std::string_view type);

/// The circuit breakers and the retry budget of a client, from its options: the caller's
/// (shared), the client's own, or none when switched off. Safe for concurrent use.
class OperationGuards {
 public:
  explicit OperationGuards(const ClientOptions& options);

  /// The registry of per-host adaptive timeouts; nullptr when brakes.adaptive_timeouts is false.
  [[nodiscard]] AdaptiveTimeoutRegistry* timeouts() const noexcept { return timeouts_; }
  /// The registry of per-host breakers; nullptr when brakes.circuit_breakers is false.
  [[nodiscard]] BreakerRegistry* breakers() const noexcept { return breakers_; }
  /// The retry budget; nullptr when brakes.retry_budget is false.
  [[nodiscard]] RetryBudget* budget() const noexcept { return budget_; }

  /// The engine's per-call inputs for one operation of `request` (clock, deadline, whether it is
  /// safe to repeat, budget, prior attempts, the host's breaker). `breaker` receives the host's
  /// breaker, which the caller holds for the whole operation. rng and context are left unset.
  [[nodiscard]] CallOptions call_options(const Request& request, const RequestTraits& traits,
                                         Clock& clock,
                                         std::shared_ptr<CircuitBreaker>& breaker) const;

  /// The adaptive timeout of `request`'s host, which the caller holds for the whole operation;
  /// nullptr when brakes.adaptive_timeouts is false, the URL has no host, or the registry is full.
  [[nodiscard]] std::shared_ptr<AdaptiveTimeout> adaptive_timeout(const Request& request) const;
  /// The rate limit of `request`'s host; nullptr without brakes.rate_limits, a host, or room.
  [[nodiscard]] std::shared_ptr<RateLimit> rate_limit(const Request& request) const;
  /// The adaptive concurrency limit of `request`'s host; nullptr when
  /// brakes.adaptive_concurrency is false, the URL has no host, or the registry is full.
  [[nodiscard]] std::shared_ptr<AdaptiveConcurrencyLimit> concurrency_limit(
      const Request& request) const;

 private:
  std::unique_ptr<AdaptiveTimeoutRegistry> own_timeouts_;
  RateLimitRegistry* rate_limits_ = nullptr;
  std::unique_ptr<ConcurrencyLimitRegistry> own_concurrency_;
  ConcurrencyLimitRegistry* concurrency_ = nullptr;
  AdaptiveTimeoutRegistry* timeouts_ = nullptr;
  std::unique_ptr<BreakerRegistry> own_breakers_;
  std::unique_ptr<TokenBucketBudget> own_budget_;
  BreakerRegistry* breakers_ = nullptr;
  RetryBudget* budget_ = nullptr;
};

/// Checks `request` (check_request) and settles its Idempotency-Key in `result`: the caller's,
/// or one generated once for a POST or PATCH (Request::generate_idempotency_key). Returns the
/// request's traits; nullopt when the request is refused, with `result` filled (kPermanent, no
/// attempt, error saying why). Throws std::invalid_argument, naming `request_type` (the client's
/// request type), when the url or the method is empty: a program's error, not a request to refuse.
[[nodiscard]] std::optional<RequestTraits> begin_operation(const Request& request, Result& result,
                                                           std::string_view request_type);

/// Attempt `info` as the engine started it, with its timeout shortened to the host's measured
/// one (AdaptiveTimeout::attempt_timeout at `now`); unchanged when `timeout` is nullptr.
[[nodiscard]] AttemptInfo adapt_attempt(const AttemptInfo& info, const AdaptiveTimeout* timeout,
                                        TimePoint now) noexcept;

/// Calls options.observability.on_attempt, if set, with the event of one finished attempt.
void report_attempt(const ClientOptions& options, const Request& request, int attempt,
                    const Outcome& outcome, std::string_view error, Duration took,
                    const Decision& decision);

/// Writes the give-up line (keel::format_give_up) of an operation that did not succeed to
/// options.observability.log, or to stderr when it is not set. Does nothing when `result`
/// succeeded.
void log_give_up(const ClientOptions& options, const Request& request, const Result& result);

/// The limits of one operation's host (rate, pause, concurrency) before each attempt, and what
/// an attempt's end tells them. Not thread-safe: one per operation.
class LimitGate {
 public:
  LimitGate(std::shared_ptr<RateLimit> rate, std::shared_ptr<AdaptiveConcurrencyLimit> concurrency,
            Duration max_wait) noexcept
      : rate_(std::move(rate)), concurrency_(std::move(concurrency)), max_wait_(max_wait) {}
  [[nodiscard]] bool active() const noexcept { return rate_ || concurrency_; }
  /// Waits (on `clock`) for the host's slot and a concurrency permit, within max_limit_wait and
  /// `deadline`. nullopt: the attempt may start; else how long it would still have to wait (the
  /// operation stops with kLimited, nothing sent).
  [[nodiscard]] std::optional<Duration> pass(Clock& clock, const Deadline& deadline);
  /// The attempt ended with `outcome` after `took`: the permit learns it, and a 429 or 503 with
  /// Retry-After pauses the host. Returns the outcome to hand the engine: kNotAttempted with
  /// that Retry-After when the host was paused by it (not a failure of the dependency's health:
  /// it asked for the pause), else `outcome`.
  [[nodiscard]] Outcome finish(const Outcome& outcome, Duration took, TimePoint now);
  /// The last pass gave up in the rate limit's line (keel::waits_in_line): Outcome::in_line.
  [[nodiscard]] bool in_line() const noexcept { return in_line_; }
  /// The last attempt's answer paused the host.
  [[nodiscard]] bool paused() const noexcept { return paused_; }
  /// What is left of max_limit_wait.
  [[nodiscard]] Duration wait_left() const noexcept {
    return std::max(max_wait_ - waited_, Duration::zero());
  }

 private:
  std::shared_ptr<RateLimit> rate_;
  std::shared_ptr<AdaptiveConcurrencyLimit> concurrency_;
  Duration max_wait_;
  Duration waited_{};
  bool in_line_ = false;
  std::optional<RateDecision> slot_;  // the rate's slot for the next attempt, when taken
  ConcurrencyPermit permit_;
  bool paused_ = false;
};

/// What one attempt ended with.
struct AttemptResult {
  Outcome outcome;
  /// The response, when one was taken.
  std::optional<Response> response;
  /// libcurl's message for a transport failure, or why the response could not be taken.
  std::string error;
};

/// Tells the host's adaptive timeout (nullptr: none) what an attempt that ran for `took` says
/// about the host's latency: an attempt with a response (any status) is a latency; one that
/// libcurl timed out is recorded at `took`, a lower bound of its latency; any other failure
/// (refused, reset, DNS, a response that could not be taken) is not recorded.
void record_latency(AdaptiveTimeout* timeout, const AttemptResult& attempt, Duration took,
                    TimePoint now) noexcept;

/// Applies a client's duplicate-success rule (nullptr: none) to `attempt` when it got a
/// response: `previous` is the outcome of the operation's previous attempt (a default Outcome
/// before the first), as the engine was given it.
void apply_duplicate_success(const DuplicateSuccessRule* rule, const Outcome& previous,
                             AttemptResult& attempt);

/// The request options.classify.duplicate_lookup makes for an operation that ended with `result`,
/// when it succeeded as a duplicate and the hook asks for one; else nullopt.
[[nodiscard]] std::optional<Request> duplicate_lookup(const ClientOptions& options,
                                                      const Request& sent, const Result& result);

/// Makes `found`, the result of the lookup, the result of the operation that ended as a
/// duplicate with `result` (see ClientOptions::classify.duplicate_lookup).
void adopt_lookup(Result& result, Result found);

/// The hedging delay of a round: the policy's latency quantile of the host's measured latencies
/// (`timeout`'s tracker; nullptr: none) at `now`, else its fixed delay.
[[nodiscard]] Duration hedge_delay(const HedgePolicy& policy, const AdaptiveTimeout* timeout,
                                   TimePoint now) noexcept;

/// What a hedged operation knows while one attempt of a round finishes.
struct HedgedAttempt {
  int index = 0;   // its slot in the round (HedgeState)
  int number = 1;  // its number among the operation's requests (Keel-Attempt)
  Duration took{};
  TimePoint ended{};
};

/// One attempt of a hedged round finished: when it ends the round (an answer, or the last in
/// flight), its body goes to request.body_sink (restart, then write; a sink that fails makes it
/// a permanent failure); then the duplicate-success rule (`duplicate`, nullptr: none; against
/// the engine's last outcome), the host's latency (`timeout`, nullptr: none),
/// HedgeState::finish, the on_attempt hook (an attempt that does not end the round is reported
/// with will_retry and no delay: the operation goes on), and, when it ends the round, its
/// outcome, response and error moved into `result`. Returns HedgeState::finish's verdict.
[[nodiscard]] HedgeVerdict finish_hedged_attempt(HedgeState& hedge, RetryState& retry,
                                                 const HedgedAttempt& done, AttemptResult attempt,
                                                 const ClientOptions& options,
                                                 const Request& request,
                                                 const DuplicateSuccessRule* duplicate,
                                                 AdaptiveTimeout* timeout, Result& result);

/// What libcurl writes into during one attempt (the header and body callbacks' state).
struct Transfer {
  Response response;
  ResponseHeadParser head;
  const Request::BodySink* sink = nullptr;  // none: the body goes to response.body
  std::size_t max_body = 0;
  // Why the transfer was ended from a callback (the response could not be taken); else empty.
  std::string local_error;
};

/// One attempt of a request on a libcurl easy handle. Not copyable or movable: libcurl keeps
/// pointers into it until the transfer has finished.
class CurlAttempt {
 public:
  /// Sets `easy` (new, or reset with curl_easy_reset) up for attempt `info` of `request`: URL,
  /// method and body, header fields with Keel-Attempt, the Idempotency-Key `key` (empty:
  /// none) and, when options.transport.propagate_deadline and info.deadline is finite,
  /// Keel-Deadline-Ms (the time info.deadline leaves on options.clock now), User-Agent, connect and
  /// whole-attempt timeouts within info.timeout, a fresh connection for a request that is not
  /// safe to repeat, the head and body limits and the body sink of `options`/`request`.
  /// Requires: `request` and `options` outlive the attempt. Throws std::bad_alloc.
  CurlAttempt(CURL* easy, const Request& request, const RequestTraits& traits,
              const std::string& key, const AttemptInfo& info, const ClientOptions& options);
  CurlAttempt(const CurlAttempt&) = delete;
  CurlAttempt& operator=(const CurlAttempt&) = delete;

  /// Called right before the transfer: restarts the request's body sink. Returns the result to
  /// end the attempt with when the sink cannot restart (a permanent local failure), else
  /// nullopt.
  [[nodiscard]] std::optional<AttemptResult> start();

  /// Whether a callback ended the transfer because the response cannot be taken (a limit or the
  /// body sink); finish() then reports that, whatever libcurl's code.
  [[nodiscard]] bool response_refused() const noexcept { return !transfer_.local_error.empty(); }

  /// The attempt's result once libcurl finished the transfer with `rc`: a response that cannot
  /// be taken is a permanent failure; a response is classified by status, body and Retry-After
  /// (read against clock.wall_now()); a transport failure by libcurl's error and whether the
  /// request was sent (a timeout sets Outcome::timed_out).
  [[nodiscard]] AttemptResult finish(CURLcode rc, const HttpClassifier& classifier, Clock& clock);

 private:
  CURL* easy_;
  RequestTraits traits_;
  std::size_t max_header_bytes_;
  Transfer transfer_;
  char error_buffer_[CURL_ERROR_SIZE] = {};
  struct SlistFree {
    void operator()(curl_slist* list) const noexcept;
  };
  std::unique_ptr<curl_slist, SlistFree> headers_;
};

}  // namespace keel::http::detail
