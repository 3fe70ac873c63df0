// keel::grpc::Client: unary calls of generated gRPC stubs, retried by core's engine with the
// rules keel's HTTP clients follow. Each attempt's gRPC status is classified by core
// (keel/core/grpc_status.hpp: UNAVAILABLE transient, RESOURCE_EXHAUSTED throttled, ABORTED a
// conflict, DEADLINE_EXCEEDED ambiguous or timed out, INTERNAL/UNKNOWN retried at most
// max_retries_on_internal times, the rest permanent), a grpc-retry-pushback-ms trailer is the
// server's delay (capped by retry.retry_after_cap; negative or malformed: no retry), and every
// attempt goes through the target's circuit breaker and the client's retry budget.
//
// On the wire, each attempt carries:
//   - its own deadline (grpc-timeout): min(retry.per_try_timeout, what the operation's deadline
//     leaves), so the server stops when the caller stops waiting for that attempt;
//   - keel-deadline-ms: the whole milliseconds left before the operation's deadline (only when
//     it is finite), as Keel-Deadline-Ms on HTTP (keel/core/deadline_header.hpp);
//   - grpc-previous-rpc-attempts: the attempts of this operation before it (gRFC A6), on every
//     attempt after the first;
//   - idempotency-key: for a call whose CallSpec says it is not idempotent, one key made before
//     the first attempt (or the caller's own), the same on every attempt; a receiver with keel's
//     idempotency flow answers a repeat with the first answer.
//
// One retrying layer: the client builds its channel itself, with gRPC's own retries turned off
// (grpc.enable_retries = 0, so a service config from the name resolver cannot turn them on
// either), and refuses channel arguments that ask for them (a service config with a retryPolicy
// or hedgingPolicy, or grpc.enable_retries = 1): keel's retries and gRPC's would multiply. A
// call made inside another keel retry loop makes one attempt (keel/core/retry_layers.hpp).
//
// Thread-safety: a Client is safe to use from many threads at once (gRPC channels and stubs are);
// its options are fixed when it is built.
//
// Example:
//   keel::grpc::Client client({.target = "payments.internal:50051",
//                              .retry = {.max_attempts = 4, .overall_timeout = 5s}});
//   auto stub = payments::Payments::NewStub(client.channel());
//   payments::ChargeReply reply;
//   keel::grpc::CallResult r =
//       client.call(*stub, &payments::Payments::Stub::Charge, request, &reply);
//   if (!r.ok()) std::cerr << keel::to_string(r.reason) << ": " << r.status.error_message();
#pragma once

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>
#include <grpcpp/support/status.h>

#include <array>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "keel/core/breaker.hpp"
#include "keel/core/budget.hpp"
#include "keel/core/classify.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/hedge.hpp"
#include "keel/core/random.hpp"
#include "keel/core/retry.hpp"

namespace keel::grpc {

/// The metadata keys keel sends and reads (lower case, as gRPC requires).
inline constexpr std::string_view kIdempotencyKeyMetadata = "idempotency-key";
inline constexpr std::string_view kPreviousAttemptsMetadata = "grpc-previous-rpc-attempts";
inline constexpr std::string_view kPushbackMetadata = "grpc-retry-pushback-ms";
inline constexpr std::string_view kDeadlineMetadata = "keel-deadline-ms";

struct ClientOptions {
  /// The server, in gRPC's target syntax ("localhost:50051", "dns:///payments:443",
  /// "unix:/run/payments.sock"). Requires: not empty.
  std::string target;
  /// Default: insecure credentials (plain text), for loopback and a mesh that encrypts.
  std::shared_ptr<::grpc::ChannelCredentials> credentials;
  /// Further channel arguments. Refused (std::invalid_argument) when they turn gRPC's own retries
  /// on: grpc.enable_retries = 1, or a service config naming a retryPolicy or hedgingPolicy.
  /// keel sets grpc.enable_retries = 0 in the channel it builds.
  ::grpc::ChannelArguments arguments;
  /// Retry policy for every call. Defaults: keel::client_retry_options(), as keel's HTTP clients
  /// (3 attempts, per-try timeout 10 s, overall deadline 30 s, full jitter base 100 ms cap 10 s,
  /// pushback cap 60 s).
  RetryOptions retry = client_retry_options();
  /// How many retries an INTERNAL, UNKNOWN or unlisted status may cause in one call.
  /// Requires: 0..254. Default 1 (as HTTP 500).
  int max_retries_on_internal = 1;
  /// Circuit breaker and retry budget, as keel::http::ClientOptions::Brakes says for HTTP.
  struct Brakes {
    /// Whether calls go through the target's circuit breaker (key: breaker_key). Default true.
    bool circuit_breakers = true;
    /// The registry the breaker comes from; share one with keel's HTTP clients (and with
    /// keel::store::SharedBreakers for a fleet) to share their view of the dependency.
    /// Non-owning; Requires: outlives the client. Default none: a registry of the client's own.
    BreakerRegistry* breakers = nullptr;
    /// Options of the client's own registry (when breakers is none).
    BreakerRegistryOptions own_breakers = {};
    /// The breaker's key in the registry. Default: the target as given.
    std::string breaker_key;
    /// Whether retries draw on a retry budget shared by every call of the client (refused:
    /// StopReason::kBudgetExhausted). Default true.
    bool retry_budget = true;
    /// The budget to draw on (share one with other clients of the same dependency).
    /// Non-owning; Requires: outlives the client. Default none: the client's own.
    RetryBudget* budget = nullptr;
    /// Options of the client's own budget (when budget is none).
    TokenBucketBudgetOptions own_budget = {};
  };
  Brakes brakes;
  /// Whether every attempt of a call with a finite deadline carries keel-deadline-ms.
  /// Default true.
  bool propagate_deadline = true;
  /// Hedged calls (keel/core/hedge.hpp, docs/hedging.md), for calls made through a stub's callback
  /// method (the call() overload taking &Service::Stub::async::Method): when an attempt of a call
  /// that is safe to repeat (idempotent, or carrying its key) is still in flight after
  /// hedge->delay, another is sent with the same key, up to max_hedges at once; the first answer
  /// that ends the round wins and the others are cancelled (TryCancel). Every hedge draws on the
  /// retry budget and passes the breaker. Throws std::invalid_argument when invalid. Default
  /// none.
  std::optional<HedgeOptions> hedge;
  /// Receives the one line logged when a call gives up (keel::format_give_up). Must be safe to
  /// call from any thread. Default: the line is written to stderr.
  std::function<void(std::string_view)> log;
  /// Time source for the operation's deadline and the waits between attempts (a ManualClock
  /// makes the waits virtual). Each attempt's gRPC deadline is on the system clock, since gRPC
  /// keeps its own time. Default keel::steady_clock().
  Clock* clock = nullptr;
  /// Randomness for the backoff jitter. Default keel::thread_rng().
  Rng* rng = nullptr;
};

/// What one call says about itself beyond its request message.
struct CallSpec {
  /// The method may run twice with no harm (a read, a set to a value). Default false: the call
  /// then carries an idempotency key (below), which is what makes its ambiguous failures (a
  /// DEADLINE_EXCEEDED after sending, a connection lost mid-call) safe to retry.
  bool idempotent = false;
  /// For a call that is not idempotent: its key, the same for every attempt. Empty: keel makes
  /// one (a random UUID) before the first attempt. Requires: a valid key
  /// (keel::check_idempotency_key); an invalid one ends the call before any attempt
  /// (kPermanent, status INVALID_ARGUMENT, nothing sent).
  std::string idempotency_key;
  /// false: send no key; a call that is not idempotent then has its ambiguous failures not
  /// retried (StopReason::kNotSafeToRetry). Default true.
  bool send_idempotency_key = true;
  /// The caller's deadline for the whole call (the earlier of it and retry.overall_timeout
  /// wins). Default infinite.
  Deadline deadline = Deadline::infinite();
  /// An upper bound handed down from the caller's own caller (an incoming request's deadline).
  Deadline ceiling = Deadline::infinite();
  /// Attempts a durable layer (a job queue) already made of this operation. Requires: >= 0.
  int prior_attempts = 0;
  /// Metadata added to every attempt. Keys must be valid gRPC metadata keys (lower case).
  std::vector<std::pair<std::string, std::string>> metadata;
};

/// The result of a call: the last attempt's status and how the operation ended.
struct CallResult {
  /// The last attempt's status (UNAVAILABLE "circuit open" / "retry budget exhausted" style
  /// text when no attempt ran: see reason).
  ::grpc::Status status;
  /// Its classification; kNotAttempted when no attempt ran.
  Outcome outcome;
  StopReason reason = StopReason::kSuccess;
  int attempts = 0;
  Duration elapsed{};
  /// The key every attempt carried (empty for an idempotent call).
  std::string idempotency_key;
  /// The last attempt's grpc-retry-pushback-ms, as sent (empty when none).
  std::string pushback;
  [[nodiscard]] bool ok() const noexcept { return reason == StopReason::kSuccess; }
};

/// One attempt: fill in the response and return the status, with the context keel prepared
/// (deadline and metadata set). Called once per attempt on the calling thread.
using Attempt = std::function<::grpc::Status(::grpc::ClientContext& context)>;

class Client {
 public:
  /// Builds the channel. Throws std::invalid_argument (naming the field) when the options are
  /// invalid or turn on gRPC's own retries.
  explicit Client(ClientOptions options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  /// The channel to make stubs on. gRPC's own retries are off on it.
  [[nodiscard]] const std::shared_ptr<::grpc::Channel>& channel() const noexcept;
  [[nodiscard]] const ClientOptions& options() const noexcept;

  /// Calls a stub's synchronous unary method (&Service::Stub::Method) until it succeeds or a
  /// rule says stop. Blocks the calling thread, sleeping on the options' clock between
  /// attempts. `response` holds the last attempt's answer.
  template <class Stub, class Request, class Response>
  CallResult call(Stub& stub,
                  ::grpc::Status (Stub::*method)(::grpc::ClientContext*, const Request&, Response*),
                  const Request& request, Response* response, const CallSpec& spec = {}) {
    return run(spec, [&stub, method, &request, response](::grpc::ClientContext& context) {
      return (stub.*method)(&context, request, response);
    });
  }

  /// The same over a stub's callback method (&Service::Stub::async::Method, on
  /// *stub->async()): still blocking the calling thread, but its attempts run on gRPC's
  /// threads, so a call hedges when options().hedge is set. `response` holds the winning
  /// attempt's answer.
  template <class Async, class Request, class Response>
  CallResult call(Async& async,
                  void (Async::*method)(::grpc::ClientContext*, const Request*, Response*,
                                        std::function<void(::grpc::Status)>),
                  const Request& request, Response* response, const CallSpec& spec = {}) {
    std::array<Response, HedgePolicy::kMaxHedges + 1> replies;
    int winner = -1;
    CallResult result = run_concurrent(
        spec,
        [&](int slot, ::grpc::ClientContext& context, std::function<void(::grpc::Status)> done) {
          Response& reply = replies[static_cast<std::size_t>(slot)];
          reply.Clear();
          (async.*method)(&context, &request, &reply, std::move(done));
        },
        winner);
    if (winner >= 0) *response = std::move(replies[static_cast<std::size_t>(winner)]);
    return result;
  }

  /// The same loop over any unary attempt (a generic stub, a hand-written call).
  CallResult run(const CallSpec& spec, const Attempt& attempt);

  /// Starts attempt `slot` (0 to HedgePolicy::kMaxHedges) on `context` without waiting; gRPC
  /// calls `done` with its status once, from any thread.
  using StartAttempt = std::function<void(int slot, ::grpc::ClientContext& context,
                                          std::function<void(::grpc::Status)> done)>;
  /// The loop over attempts that run on gRPC's threads, hedged when options().hedge is set;
  /// `winner` is the slot whose answer is the result (-1 when none).
  CallResult run_concurrent(const CallSpec& spec, const StartAttempt& start, int& winner);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// A new idempotency key (a random UUID from the CSPRNG), as keel::http::make_idempotency_key.
[[nodiscard]] std::string make_idempotency_key();

}  // namespace keel::grpc
