// Hedged requests: when an attempt of a safe-to-repeat operation is still in flight after the
// hedging delay, a second one is sent; the first good answer wins and the others are cancelled.
// Hedging cuts the tail a slow replica or a lost packet adds, at the price of extra load; keel
// charges every hedge to the same keel::RetryBudget as the retries, as gRPC (A6) and Finagle's
// backup requests do, so that hedges cannot become a load storm (see docs/hedging.md).
//
// The decision is here, pure and in virtual time; the HTTP clients drive it. A HedgeState sits
// beside a RetryState: each attempt the retry engine starts opens a round, in which HedgeState
// says when the next hedge is due and whether it may go, and which result ends the round. The
// round's ending outcome is what RetryState::next decides on, so a round whose attempts all
// failed is retried (after the backoff) as one failed attempt would be.
//
// Rules (each tested in tests/unit/hedge_test.cpp):
//  - Only a safe-to-repeat operation hedges (CallOptions::safe_to_repeat: an idempotent method,
//    or a write that carries its idempotency key). A POST without a key is never hedged.
//  - One retrying layer: an operation nested in another keel retry loop (RetryState::nested)
//    makes a single attempt and does not hedge either.
//  - A hedge is due `delay` after the round's latest attempt started; at most max_hedges hedges
//    per round, so at most 1 + max_hedges attempts are in flight at once.
//  - Before a hedge is sent: the time left before the operation's deadline must be at least the
//    policy's min_attempt_time (and the hedge's timeout is min(the round's timeout, time left));
//    the circuit breaker must admit it; the retry budget must grant it (as for a retry). A
//    refusal sends nothing and ends hedging for the round: the call waits for the attempts in
//    flight.
//  - A success or a permanent failure ends the round at once (it is the answer; the others
//    would get the same): it wins, the attempts still in flight are cancelled.
//  - Any other failure ends the round only when nothing else is in flight; otherwise it is
//    recorded and the round waits for the others. A throttled failure, or one that carries a
//    server delay (Retry-After), ends hedging for the round: the server asked for less load.
//  - The breaker is told the outcome of every attempt that finished (a cancelled one is
//    released uncounted, as RetryState::cancel does); the budget is told every finished hedge's
//    outcome with its permit (a token bucket refunds a successful one, as a successful retry),
//    and a cancelled hedge keeps its charge: it was sent.
//  - The retry engine's max_attempts counts rounds; AttemptInfo::number (Keel-Attempt) numbers
//    every request sent, hedges included, so a receiver sheds hedges as it sheds retries.
//
// Thread-safety: a HedgePolicy is immutable and safe to share between threads. A HedgeState
// belongs to one operation (with its RetryState) and is not thread-safe.
//
// Example (one round; see src/http/client.cpp for a driver):
//   keel::RetryState retry(policy, call);
//   keel::HedgeState hedge(&hedge_policy, policy, call, retry);
//   auto start = retry.start_attempt();
//   send(0, hedge.begin_round(start.attempt, hedge_policy.delay(nullptr, now)));
//   // when hedge.next_hedge_at() passes: if (auto h = hedge.start_hedge(); h.proceed) send(...)
//   // when attempt i finishes: auto v = hedge.finish(i, outcome);
//   // if (v.done) { cancel the others (hedge.cancel(j)); act on v.decision as on next() }
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string_view>

#include "keel/core/breaker.hpp"
#include "keel/core/budget.hpp"
#include "keel/core/classify.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/latency.hpp"
#include "keel/core/retry.hpp"

namespace keel {

struct HedgeOptions {
  /// Wait after the round's latest attempt started before the next hedge. Requires: >= 0.
  /// Default 100 ms.
  Duration delay = std::chrono::milliseconds(100);
  /// Hedges per round: attempts in flight at once beyond the first. Requires: in [1, 10].
  /// Default 1.
  int max_hedges = 1;
  /// When set, the delay is this quantile of the dependency's recent latencies (its
  /// keel::LatencyTracker: the HTTP clients use the per-host adaptive timeout's when
  /// brakes.adaptive_timeouts is on), once it holds min_samples of them; until then `delay`.
  /// Requires: in (0, 1). Default none (the fixed delay).
  std::optional<double> latency_quantile;
  /// Latencies the tracker must hold before latency_quantile is used. Requires: >= 1.
  /// Default 100.
  std::int64_t min_samples = 100;
};

/// Validated, immutable hedging configuration, shared by many operations.
class HedgePolicy {
 public:
  /// The most hedges a round may have (HedgeOptions::max_hedges).
  static constexpr int kMaxHedges = 10;

  /// Throws std::invalid_argument naming the field and value when a Requires line is broken.
  explicit HedgePolicy(HedgeOptions options = {});

  [[nodiscard]] const HedgeOptions& options() const noexcept { return options_; }

  /// The hedging delay now: latency_quantile of `latencies` at `now` when configured and the
  /// tracker holds min_samples latencies, else options().delay. `latencies` may be nullptr.
  [[nodiscard]] Duration delay(const LatencyTracker* latencies, TimePoint now) const noexcept;

 private:
  HedgeOptions options_;
};

/// Why a hedge was not sent.
enum class HedgeRefusal : unsigned char {
  kNone,             // sent
  kNotHedged,        // no policy, not safe to repeat, or nested in another retry loop
  kLimit,            // max_hedges sent this round, or hedging ended for the round
  kNothingInFlight,  // the round has no attempt in flight to hedge
  kNotDue,           // next_hedge_at() has not come
  kDeadline,         // less than min_attempt_time left before the deadline
  kCircuitOpen,      // the breaker refused it
  kBudgetExhausted,  // the retry budget refused it
};

/// "sent", "not hedged", "limit", "nothing in flight", "not due", "deadline", "circuit open",
/// "budget exhausted".
[[nodiscard]] std::string_view to_string(HedgeRefusal refusal) noexcept;

/// What start_hedge answered.
struct HedgeStart {
  bool proceed = false;
  /// The attempt's slot in the round (1 to max_hedges; 0 is the round's first attempt).
  int index = 0;
  /// Its number among the operation's requests, its timeout and the deadline.
  AttemptInfo attempt;
  HedgeRefusal refusal = HedgeRefusal::kNone;  // when !proceed
};

/// What finish answered.
struct HedgeVerdict {
  /// The round is over: cancel every attempt still in flight (cancel(index) for each), then act
  /// on `decision` as on RetryState::next's.
  bool done = false;
  /// When done: the attempt whose outcome ended the round (its result is the operation's).
  int winner = -1;
  /// When done: the retry engine's decision on the winner's outcome.
  Decision decision;
};

/// The hedges of one operation, round by round. Requires: the policies, the call's budget and
/// breaker, and `retry` outlive the state; `retry` is the operation's engine, driven only
/// through this state while a round is open.
class HedgeState {
 public:
  /// `hedge` nullptr: no hedging (every round is its one attempt).
  HedgeState(const HedgePolicy* hedge, const RetryPolicy& policy, const CallOptions& call,
             RetryState& retry) noexcept;

  /// Whether this operation hedges at all (a policy, safe to repeat, not nested).
  [[nodiscard]] bool enabled() const noexcept { return enabled_; }

  /// Opens a round for `primary`, the attempt retry.start_attempt() just started, with hedges
  /// `delay` apart. Returns the attempt to send as slot 0: `primary` numbered among all the
  /// operation's requests.
  [[nodiscard]] AttemptInfo begin_round(const AttemptInfo& primary, Duration delay);

  /// When the next hedge is due; nullopt when this round will send no more (not enabled, the
  /// limit, hedging ended for the round, nothing in flight).
  [[nodiscard]] std::optional<TimePoint> next_hedge_at() const noexcept;

  /// Asks, at the clock's now, whether the next hedge may be sent: due, the deadline, the
  /// breaker, then the budget. A refusal other than kNotDue ends hedging for the round.
  [[nodiscard]] HedgeStart start_hedge();

  /// Attempt `index` of the round finished with `outcome` (see the rules above).
  /// Requires: `index` is in flight.
  [[nodiscard]] HedgeVerdict finish(int index, const Outcome& outcome);

  /// Attempt `index` was stopped before it finished (it lost, or the round ended): released
  /// from the breaker uncounted; a hedge keeps its budget charge. No-op when not in flight.
  void cancel(int index) noexcept;

  /// The caller cancelled the operation: the round's attempts are released and the engine
  /// stops with kCancelled (RetryState::cancel).
  void cancel_operation() noexcept;

  /// Attempts of the round in flight.
  [[nodiscard]] int in_flight() const noexcept { return in_flight_; }
  /// Requests sent by the operation so far (rounds' first attempts and hedges).
  [[nodiscard]] int sent() const noexcept { return sent_; }
  /// Hedges sent by the operation so far.
  [[nodiscard]] int hedges() const noexcept { return hedges_; }

 private:
  struct Permits {
    BreakerPermit breaker;
    RetryPermit budget;
  };
  void release(const Permits& permits) noexcept;

  const HedgePolicy* hedge_;
  const RetryPolicy* policy_;
  RetryState* retry_;
  RetryBudget* budget_;
  CircuitBreaker* breaker_;
  bool enabled_ = false;
  // The round.
  AttemptInfo primary_;
  Duration delay_{};
  TimePoint last_start_{};
  std::array<bool, HedgePolicy::kMaxHedges + 1> flying_{};
  // The brakes' permits of the round's hedges. RetryState holds the first attempt's; a finished
  // attempt that does not end the round is recorded on one of these, so that the one that ends
  // it is recorded on RetryState's (RetryState::next) and what is left belongs to the attempts
  // still in flight.
  std::array<Permits, HedgePolicy::kMaxHedges> pool_{};
  int pooled_ = 0;
  int in_flight_ = 0;
  int round_hedges_ = 0;
  bool hedging_ = false;  // more hedges may go this round
  int sent_ = 0;
  int hedges_ = 0;
};

}  // namespace keel
