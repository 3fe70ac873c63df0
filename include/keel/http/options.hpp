// keel::http::ClientOptions: the configuration of both HTTP clients. keel::http::Client (blocking)
// and keel::asio::HttpClient (on an Asio event loop) run the same libcurl attempt with the same
// retry policy, limits, breakers and budget, so they take one options type
// (keel::asio::HttpClientOptions is this struct). The fields come in sections, one nested struct
// each: retry (the policy), classify (which answers are retried, duplicates as success), brakes
// (circuit breakers, retry budget, adaptive timeouts), fallbacks (stale answers, queued writes),
// hedge (hedged requests), observability (hooks), transport (connection and added headers),
// limits (response sizes, per-client pools), then the injected clock and rng. A few fields apply
// to one client only and say which; the other client ignores them.
//
// Thread-safety: a plain value, copied into the client when it is built.
//
// Example:
//   keel::http::ClientOptions o{.retry = {.max_attempts = 4},
//                               .brakes = {.retry_budget = false},
//                               .transport = {.connect_timeout = 500ms}};
//   o.fallbacks.stale_responses = &cache;
//   keel::http::Client blocking(o);
//   keel::asio::HttpClient async(io.get_executor(), o);
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
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
#include "keel/core/random.hpp"
#include "keel/core/rate_limit.hpp"
#include "keel/core/retry.hpp"
#include "keel/http/message.hpp"
#include "keel/http/request.hpp"

namespace keel::http {

class DeferredWrites;  // keel/http/deferred_writes.hpp
class ResponseCache;   // keel/http/response_cache.hpp

struct ClientOptions {
  /// How answers are classified: which statuses and bodies are retried, and whether an "already
  /// exists" after a lost answer is the earlier attempt's success (docs/classification.md).
  struct Classify {
    /// How statuses and bodies are classified (500 retry limit, body hook). Default: 500
    /// retried at most once, no body hook.
    HttpClassifierOptions responses = {};
    /// Whether a retry's "already exists" answer (a status of the set whose body matches) after
    /// an ambiguous failure of the same operation (a timeout or reset after sending, a 500) is
    /// the success of the earlier attempt (keel::DuplicateSuccessRule): the operation then stops
    /// with kSuccess, Result::outcome.duplicate set and the duplicate answer as
    /// Result::response. On a first attempt, or after any other failure, the response keeps its
    /// classification. Throws std::invalid_argument when the client is built with an invalid
    /// status set. See docs/classification.md. Default none.
    std::optional<DuplicateSuccessOptions> duplicate_success;
    /// With duplicate_success: the request that fetches the resource an operation found already
    /// there (for example a GET of the duplicate answer's Location), or nullopt to keep the
    /// duplicate answer. Called once, after the operation succeeded as a duplicate, on the
    /// thread (blocking Client) or executor (keel::asio::HttpClient) of the operation. The
    /// lookup runs as an operation of its own (retries, deadline, breakers) and its result
    /// becomes the result: with outcome.duplicate set when it succeeds, attempts and elapsed
    /// counting both operations, and the create's Idempotency-Key; when it fails, its failure
    /// (the create took effect, but its resource could not be read). Default none.
    std::function<std::optional<Request>(const Request& sent, const Response& duplicate)>
        duplicate_lookup;
  };

  /// The brakes that keep retries from making an outage worse: per-host circuit breakers, a
  /// client-wide retry budget and per-host adaptive timeouts. Each is a switch, a shared object
  /// to use (non-owning) and the options of the client's own when none is shared.
  struct Brakes {
    /// Whether requests go through a circuit breaker per "host:port" of their URL
    /// (breaker_key): an open breaker stops an operation before an attempt
    /// (StopReason::kCircuitOpen) and every outcome is reported to the host's breaker.
    /// Default true.
    bool circuit_breakers = true;
    /// The registry the per-host breakers come from; share one between clients (blocking or
    /// not) to share their view of each host. Non-owning; Requires: outlives the client.
    /// Default none: the client keeps a registry of its own built from own_breakers.
    BreakerRegistry* breakers = nullptr;
    /// Options of the client's own registry (when breakers is none). Default: keel's
    /// BreakerRegistryOptions (time window 30 s, at least 20 calls, trip at 50% failures, open
    /// 5 s).
    BreakerRegistryOptions own_breakers = {};
    /// Whether retries draw on a retry budget shared by every request of the client (refused:
    /// StopReason::kBudgetExhausted). Default true.
    bool retry_budget = true;
    /// The budget to draw on; share one between clients that call the same dependencies.
    /// Non-owning; Requires: outlives the client. Default none: the client keeps its own
    /// TokenBucketBudget built from own_budget.
    RetryBudget* budget = nullptr;
    /// Options of the client's own budget (when budget is none). Default: 500 tokens, a retry
    /// costs 5 (10 after a timeout), a successful first attempt refunds 1 (the AWS SDKs' quota).
    TokenBucketBudgetOptions own_budget = {};
    /// Whether each attempt's timeout comes from the measured latency of its "host:port" (the
    /// breaker_key): clamp(quantile x factor + margin, floor, ceiling) of the host's recent
    /// latencies (keel::AdaptiveTimeout), once it has min_samples of them; until then, and
    /// whenever it is longer, the engine's timeout (retry.per_try_timeout, or what the deadline
    /// leaves), which stays the upper bound. Recorded: the latency of every attempt that got a
    /// response (any status), and a timed-out attempt at the time it waited (a lower bound of
    /// its latency: dropping it would keep the timeout low after a shift above it, see
    /// keel/core/latency.hpp); not connection failures. Latencies are read on `clock` (a
    /// keel::ManualClock reads them as zero: the timeout then sits at its floor). See
    /// docs/timeouts.md. Default false.
    bool adaptive_timeouts = false;
    /// The registry the per-host timeouts come from; share one between clients to share their
    /// measurements, or keep one to read a host's timeout (get(key)->timeout(now, static)).
    /// Non-owning; Requires: outlives the client. Default none: the client keeps a registry of
    /// its own built from own_timeouts.
    AdaptiveTimeoutRegistry* timeouts = nullptr;
    /// Options of the client's own registry (when timeouts is none). Default: keel's
    /// AdaptiveTimeoutOptions (p99.9 x 1.25 + 25 ms within [10 ms, 60 s], after 1000
    /// latencies, over the last 60 s).
    AdaptiveTimeoutRegistryOptions own_timeouts = {};
    /// keel::http::Client only (keel::asio::HttpClient ignores the four fields below): the
    /// rate limits of the hosts, one keel::RateLimit per "host:port" (breaker_key; a registry
    /// may give a host its own rate with set_options). Before each attempt the call takes a
    /// slot of its host's rate, waiting for it (on `clock`) within max_limit_wait and the
    /// deadline; a longer wait stops the operation with StopReason::kLimited, nothing sent and
    /// no attempt spent (Result::outcome kNotAttempted with the wait as server_delay). A 429 or
    /// 503 with Retry-After pauses its host (RateLimit::pause, capped by its max_pause): every
    /// call to it waits or stops as above until then, and that answer is handed to the engine
    /// as kNotAttempted (no breaker failure, no budget charge; the operation stops with
    /// kLimited when it may not wait). Share the registry between clients, or attach it to
    /// keel::store::SharedBreakers to share it with a fleet. Non-owning; Requires: outlives
    /// the client. Default none: no rate limits and no pauses.
    RateLimitRegistry* rate_limits = nullptr;
    /// The longest a call waits for its host's rate, pause or concurrency limit before it stops
    /// with kLimited (the deadline bounds it too). Requires: >= 0. Default 10 s.
    Duration max_limit_wait = std::chrono::seconds(10);
    /// Whether each host's calls in flight are bounded by an adaptive concurrency limit
    /// (keel::AdaptiveConcurrencyLimit, docs/concurrency.md): an attempt over it waits for
    /// about the host's latency (jittered) and asks again, within max_limit_wait; timeouts and
    /// 429/503 answers are its drops, other answers its latencies. Default false.
    bool adaptive_concurrency = false;
    /// The registry the per-host limits come from (share one between clients). Non-owning;
    /// Requires: outlives the client. Default none: the client's own, from own_concurrency.
    ConcurrencyLimitRegistry* concurrency_limits = nullptr;
    /// Options of the client's own limits (when concurrency_limits is none). Default: keel's
    /// ConcurrencyLimitOptions (start at 20, within [1, 1000]).
    ConcurrencyLimitOptions own_concurrency = {};
  };

  /// What a failed operation may do instead of failing, when keel::choose_fallback allows it
  /// (keel/core/fallback.hpp, docs/breakers.md): answer a GET from a stale copy, queue a keyed
  /// write for later. Both off by default.
  struct Fallbacks {
    /// Stale while down: the cache every successful GET is stored in, and answered from while
    /// the host's breaker is open (Result::stale, with its age; never older than the cache's
    /// max_age), instead of failing with kCircuitOpen (keel/core/fallback.hpp). Share one between
    /// clients. Non-owning; Requires: outlives the client. See docs/breakers.md. Default none.
    ResponseCache* stale_responses = nullptr;
    /// Queue for later: where a write that carries an idempotency key goes when its dependency
    /// is down (the breaker is open, or the retries gave up on a transient failure); the call
    /// then stops with StopReason::kQueued and Result::job_id. When storing it fails, the call
    /// reports its original failure, with Result::error saying so. Non-owning; Requires:
    /// outlives the client. See docs/breakers.md. Default none.
    DeferredWrites* deferred_writes = nullptr;
  };

  /// Hooks that see what the client does. Both are called synchronously: keep them short.
  struct Observability {
    /// Called after every attempt: from any thread using a blocking Client (so it must be safe
    /// for that), on the client's executor for keel::asio::HttpClient. Default none.
    std::function<void(const AttemptEvent&)> on_attempt;
    /// Receives the one line logged when an operation gives up (keel::format_give_up). Must be
    /// safe to call from any thread using a blocking Client. Default: the line is written to
    /// stderr.
    std::function<void(std::string_view)> log;
  };

  /// How each attempt goes on the wire: connection setup and the headers keel adds.
  struct Transport {
    /// Time allowed to establish a connection, within an attempt's timeout. Requires: > 0.
    /// Default 2 s.
    Duration connect_timeout = std::chrono::seconds(2);
    /// Whether every attempt of an operation with a finite deadline carries Keel-Deadline-Ms:
    /// the whole milliseconds left before the operation's deadline when the attempt is set up
    /// (keel/core/deadline_header.hpp), so the receiver can refuse work nobody will wait for and
    /// bound its own retries by it. Never sent for an operation without a deadline. See
    /// docs/deadlines.md. Default true.
    bool propagate_deadline = true;
    /// Sent as User-Agent unless the request sets one. Default "keel/0.1".
    std::string user_agent = "keel/0.1";
  };

  /// Sizes: what a response may weigh, and the per-client pools and queues. The last three
  /// apply to one client only and say which; the other client ignores them.
  struct Limits {
    /// Largest response head (status line and header fields) accepted, in bytes; a larger one
    /// ends the attempt as a permanent failure (a local error: the response is not taken).
    /// Requires: >= 1. Default 64 KiB.
    std::size_t max_header_bytes = kDefaultMaxHeaderBytes;
    /// Largest response body collected in memory (Response::body), in bytes; a larger one ends
    /// the attempt as a permanent failure. Not applied to a Request::body_sink. Requires: >= 1.
    /// Default 256 MiB.
    std::size_t max_response_bytes = kDefaultMaxResponseBytes;
    /// keel::http::Client only: idle easy handles kept for reuse. Requires: >= 1. Default 16.
    /// (keel::asio::HttpClient keeps up to 64.)
    int max_idle_handles = 16;
    /// keel::asio::HttpClient only: connections open at once to one host; further transfers
    /// queue inside libcurl. Requires: >= 0. Default 0 (no limit).
    long max_host_connections = 0;
    /// keel::asio::HttpClient only: transfers handed to libcurl at once; the others wait, in
    /// order, inside the client, and the wait counts against the attempt's timeout. Set it for
    /// large fan-outs: libcurl's own queue (behind max_host_connections) re-examines every
    /// waiting transfer each time a connection frees, which is quadratic in the number waiting.
    /// Requires: >= 0. Default 0 (no limit).
    long max_transfers = 0;
  };

  /// Retry policy for every request. Defaults: keel::client_retry_options() (3 attempts, per-try
  /// timeout 10 s, overall deadline 30 s, full jitter base 100 ms cap 10 s, Retry-After cap
  /// 60 s). Its on_retry and on_give_up hooks are called as the engine documents.
  RetryOptions retry = client_retry_options();
  /// How answers are classified (see Classify).
  Classify classify;
  /// Circuit breakers, retry budget, adaptive timeouts (see Brakes).
  Brakes brakes;
  /// Stale answers and queued writes (see Fallbacks).
  Fallbacks fallbacks;
  /// Hedged requests (keel/core/hedge.hpp, docs/hedging.md): when an attempt of a safe-to-repeat
  /// request (an idempotent method, or a write with its Idempotency-Key; never a POST without
  /// one) is still in flight after hedge->delay, another is sent with the same key, up to
  /// max_hedges at once; the first good answer wins and the others are cancelled. Every hedge
  /// draws on the retry budget (refused: not sent, the call waits for the attempt in flight),
  /// the breaker sees every attempt's outcome, and an operation one retrying layer down does
  /// not hedge. With latency_quantile and brakes.adaptive_timeouts, the delay is that quantile
  /// of the host's measured latencies. A hedged operation collects each attempt's body in
  /// memory (up to limits.max_response_bytes) and hands the winner's to a Request::body_sink
  /// when it wins. Throws std::invalid_argument when the client is built with invalid options.
  /// Default none.
  std::optional<HedgeOptions> hedge;
  /// Attempt and give-up hooks (see Observability).
  Observability observability;
  /// Connection setup and added headers (see Transport).
  Transport transport;
  /// Response sizes and per-client pools (see Limits).
  Limits limits;
  /// Time source for deadlines and the waits between attempts (a blocking Client sleeps on it;
  /// with keel::asio a keel::ManualClock makes the waits virtual, see keel/asio/retry.hpp).
  /// Default keel::steady_clock().
  Clock* clock = nullptr;
  /// keel::asio::HttpClient only: randomness for the backoff jitter. Default keel::thread_rng().
  Rng* rng = nullptr;
};

}  // namespace keel::http
