#include "keel/grpc/client.hpp"

#include <grpc/grpc.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>

#include "keel/core/deadline_header.hpp"
#include "keel/core/expected.hpp"
#include "keel/core/grpc_status.hpp"
#include "keel/core/hedge.hpp"
#include "keel/core/idempotency_key.hpp"
#include "keel/core/text.hpp"
#include "keel/detail/secure_random.hpp"

namespace keel::grpc {
namespace {

constexpr std::string_view kOptions = "keel::grpc::ClientOptions";

[[noreturn]] void refuse(std::string_view field, std::string problem, std::string got = {}) {
  throw_invalid({.context = std::string(kOptions),
                 .field = std::string(field),
                 .problem = std::move(problem),
                 .got = std::move(got)});
}

// gRPC's own retries would multiply keel's: refuse arguments that turn them on, then turn them
// off for whatever the name resolver's service config says.
void refuse_grpc_retries(::grpc::ChannelArguments& arguments) {
  const grpc_channel_args c = arguments.c_channel_args();
  for (std::size_t i = 0; i < c.num_args; ++i) {
    const grpc_arg& arg = c.args[i];
    const std::string_view key = arg.key;
    if (key == GRPC_ARG_ENABLE_RETRIES && arg.type == GRPC_ARG_INTEGER && arg.value.integer != 0) {
      refuse("arguments", "must not turn on gRPC's own retries (keel retries at one layer)",
             GRPC_ARG_ENABLE_RETRIES " = " + std::to_string(arg.value.integer));
    }
    if (key == GRPC_ARG_SERVICE_CONFIG && arg.type == GRPC_ARG_STRING) {
      const std::string_view config = arg.value.string;
      for (const std::string_view policy : {"retryPolicy", "hedgingPolicy"}) {
        if (config.find(policy) != std::string_view::npos) {
          refuse("arguments",
                 "must not carry a service config with a " + std::string(policy) +
                     " (keel retries at one layer: take it out, or use gRPC's policy without keel)",
                 std::string(policy));
        }
      }
    }
  }
  arguments.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
}

// The value of a trailer sent once; several different values are malformed (no retry), the
// same value sent twice is that value.
std::optional<std::string> single_trailer(const ::grpc::ClientContext& context,
                                          std::string_view key, bool& conflicting) {
  conflicting = false;
  std::optional<std::string> value;
  const auto [first, last] =
      context.GetServerTrailingMetadata().equal_range(::grpc::string_ref(key.data(), key.size()));
  for (auto it = first; it != last; ++it) {
    const std::string v(it->second.data(), it->second.size());
    if (value && *value != v) conflicting = true;
    value = v;
  }
  return value;
}

// What is wrong with the caller's metadata, if anything: a name gRPC refuses (empty, upper case,
// not [0-9a-z_.-]), a value it refuses (outside printable ASCII, unless the name ends in -bin),
// or a name keel sets itself.
std::optional<std::string> metadata_problem(
    const std::vector<std::pair<std::string, std::string>>& metadata) {
  for (const auto& [name, value] : metadata) {
    const std::string quoted = "'" + storable_text(name, 64) + "'";
    if (name.empty() ||
        !grpc_header_key_is_legal(grpc_slice_from_static_buffer(name.data(), name.size()))) {
      return "metadata name " + quoted + " is not a legal gRPC name (lower case [0-9a-z_.-])";
    }
    if (name == kIdempotencyKeyMetadata || name == kPreviousAttemptsMetadata ||
        name == kDeadlineMetadata) {
      return "metadata name " + quoted + " is set by keel (use CallSpec's fields)";
    }
    const grpc_slice v = grpc_slice_from_static_buffer(value.data(), value.size());
    if (!grpc_is_binary_header(grpc_slice_from_static_buffer(name.data(), name.size())) &&
        !grpc_header_nonbin_value_is_legal(v)) {
      return "metadata value of " + quoted +
             " is not printable ASCII (name it with -bin to send bytes)";
    }
  }
  return std::nullopt;
}

::grpc::Status not_attempted_status(StopReason reason) {
  switch (reason) {
    case StopReason::kCircuitOpen:
      return {::grpc::StatusCode::UNAVAILABLE, "keel: circuit open, nothing sent"};
    case StopReason::kDeadline:
      return {::grpc::StatusCode::DEADLINE_EXCEEDED,
              "keel: the deadline left no time for an attempt, nothing sent"};
    case StopReason::kBudgetExhausted:
      return {::grpc::StatusCode::UNAVAILABLE, "keel: retry budget exhausted, nothing sent"};
    default:
      return {::grpc::StatusCode::UNAVAILABLE,
              "keel: " + std::string(to_string(reason)) + ", nothing sent"};
  }
}

}  // namespace

std::string make_idempotency_key() { return keel::detail::random_idempotency_key("keel::grpc"); }

struct Client::Impl {
  explicit Impl(ClientOptions o) : options(std::move(o)), policy(options.retry) {
    if (options.target.empty()) refuse("target", "must not be empty");
    if (options.max_retries_on_internal < 0 || options.max_retries_on_internal > 254) {
      refuse("max_retries_on_internal", "must be within 0..254",
             std::to_string(options.max_retries_on_internal));
    }
    refuse_grpc_retries(options.arguments);
    if (!options.credentials) options.credentials = ::grpc::InsecureChannelCredentials();
    if (options.brakes.circuit_breakers) {
      if (options.brakes.breakers == nullptr) {
        own_breakers = std::make_unique<BreakerRegistry>(options.brakes.own_breakers);
      }
      breakers = options.brakes.breakers != nullptr ? options.brakes.breakers : own_breakers.get();
      breaker_key =
          options.brakes.breaker_key.empty() ? options.target : options.brakes.breaker_key;
    }
    if (options.brakes.retry_budget) {
      if (options.brakes.budget == nullptr) {
        own_budget = std::make_unique<TokenBucketBudget>(options.brakes.own_budget);
      }
      budget = options.brakes.budget != nullptr ? options.brakes.budget : own_budget.get();
    }
    if (options.hedge) hedge.emplace(*options.hedge);
    channel = ::grpc::CreateCustomChannel(options.target, options.credentials, options.arguments);
  }

  // Prepares one attempt's context: its deadline on gRPC's clock and keel's metadata.
  void prepare(::grpc::ClientContext& context, const CallSpec& spec, const std::string& key,
               const AttemptInfo& attempt, const RetryState& state, Clock& clock,
               std::chrono::system_clock::time_point& attempt_deadline) const {
    // A timeout beyond a century is none: now + it would not fit gRPC's clock.
    if (attempt.timeout < std::chrono::hours(24 * 365 * 100)) {
      attempt_deadline =
          std::chrono::system_clock::now() +
          std::chrono::duration_cast<std::chrono::system_clock::duration>(attempt.timeout);
      context.set_deadline(attempt_deadline);
    } else {
      attempt_deadline = std::chrono::system_clock::time_point::max();
    }
    if (!key.empty()) context.AddMetadata(std::string(kIdempotencyKeyMetadata), key);
    const int previous = attempt.number - 1 + spec.prior_attempts;
    if (previous > 0) {
      context.AddMetadata(std::string(kPreviousAttemptsMetadata), std::to_string(previous));
    }
    if (options.propagate_deadline && !state.deadline().is_infinite()) {
      context.AddMetadata(std::string(kDeadlineMetadata),
                          format_deadline_header(state.deadline().remaining(clock.now())));
    }
    for (const auto& [name, value] : spec.metadata) context.AddMetadata(name, value);
  }

  // The attempt's outcome in core's taxonomy, from its status and trailers.
  Outcome classify(const ::grpc::Status& status, const ::grpc::ClientContext& context,
                   std::chrono::system_clock::time_point attempt_deadline,
                   std::string& pushback) const {
    GrpcAttemptFacts facts;
    facts.max_retries_on_internal = options.max_retries_on_internal;
    facts.callers_deadline = status.error_code() == ::grpc::StatusCode::DEADLINE_EXCEEDED &&
                             std::chrono::system_clock::now() >= attempt_deadline;
    bool conflicting = false;
    const std::optional<std::string> value =
        single_trailer(context, kPushbackMetadata, conflicting);
    pushback = value.value_or("");
    // Two different pushbacks are malformed: read as "do not retry", as A6 reads garbage.
    facts.pushback = parse_grpc_pushback(conflicting ? std::optional<std::string_view>("")
                                                     : std::optional<std::string_view>(value));
    return classify_grpc_status(static_cast<int>(status.error_code()), facts);
  }

  // The wait between attempts, as core decided it. On a steady clock (real time and real sleeps:
  // Clock::is_steady_clock) it is spent watching the channel: a synchronous gRPC client polls its
  // connections only inside a call (or every 5 s from gRPC's backup poller), so a reconnection to
  // a server that came back would otherwise not finish between attempts that fail fast, and
  // every retry would fail as the first did.
  void wait_between_attempts(Clock& clock, Duration delay) const {
    if (!clock.is_steady_clock() || delay <= Duration::zero()) {
      // wait: core: the retry engine's decision
      clock.sleep_for(delay);
      return;
    }
    const auto until = std::chrono::system_clock::now() +
                       std::chrono::duration_cast<std::chrono::system_clock::duration>(delay);
    grpc_connectivity_state state = channel->GetState(/*try_to_connect=*/true);
    while (state != GRPC_CHANNEL_READY && state != GRPC_CHANNEL_SHUTDOWN) {
      // wait: core: the retry engine's decision (ends early when the channel's state changes)
      if (!channel->WaitForStateChange(state, until)) return;  // the delay is over
      state = channel->GetState(/*try_to_connect=*/true);
    }
    const auto left = until - std::chrono::system_clock::now();
    // wait: core: the rest of the retry engine's decision, once the channel is ready
    if (left > left.zero()) clock.sleep_for(std::chrono::duration_cast<Duration>(left));
  }

  bool begin(const CallSpec& spec, CallResult& result);
  CallOptions call_options(const CallSpec& spec, const CallResult& result, Clock& clock,
                           std::shared_ptr<CircuitBreaker>& breaker) const;
  void end(const RetryState& state, int sent, bool attempted, CallResult& result) const;

  void log_give_up(const CallResult& result) const {
    if (result.reason == StopReason::kSuccess) return;
    const std::string line = format_give_up({.attempts = result.attempts,
                                             .elapsed = result.elapsed,
                                             .reason = result.reason,
                                             .last = result.outcome},
                                            "gRPC " + options.target);
    if (options.log) {
      options.log(line);
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
  }

  ClientOptions options;
  RetryPolicy policy;
  std::unique_ptr<BreakerRegistry> own_breakers;
  BreakerRegistry* breakers = nullptr;
  std::string breaker_key;
  std::unique_ptr<TokenBucketBudget> own_budget;
  RetryBudget* budget = nullptr;
  std::shared_ptr<::grpc::Channel> channel;
  std::optional<HedgePolicy> hedge;  // from options.hedge
};

Client::Client(ClientOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
Client::~Client() = default;

const std::shared_ptr<::grpc::Channel>& Client::channel() const noexcept { return impl_->channel; }
const ClientOptions& Client::options() const noexcept { return impl_->options; }

// The call's key, made once before the first attempt (or the caller's, checked): false when the
// caller's key is refused, `result` then saying so (nothing is sent).
bool Client::Impl::begin(const CallSpec& spec, CallResult& result) {
  if (spec.prior_attempts < 0) {
    throw_invalid({.context = "keel::grpc::CallSpec",
                   .field = "prior_attempts",
                   .problem = "must be >= 0",
                   .got = std::to_string(spec.prior_attempts)});
  }
  if (const std::optional<std::string> problem = metadata_problem(spec.metadata)) {
    // Refused before any attempt: gRPC would abort the process over it (an API misuse).
    result.outcome = Outcome::permanent();
    result.reason = StopReason::kPermanent;
    result.status = {::grpc::StatusCode::INVALID_ARGUMENT, "keel::grpc::CallSpec: " + *problem};
    return false;
  }
  if (spec.idempotent || !spec.send_idempotency_key) return true;
  if (spec.idempotency_key.empty()) {
    result.idempotency_key = make_idempotency_key();  // once, before the first attempt
    return true;
  }
  IdempotencyKeyCheck check = check_idempotency_key(spec.idempotency_key);
  if (!check.ok()) {
    // Refused before any attempt: nothing was sent, and sending it again would not help.
    result.outcome = Outcome::permanent();
    result.reason = StopReason::kPermanent;
    result.status = {::grpc::StatusCode::INVALID_ARGUMENT,
                     "keel::grpc::CallSpec: " + check.error.in("idempotency_key").message()};
    return false;
  }
  result.idempotency_key = std::move(check.key);
  return true;
}

CallOptions Client::Impl::call_options(const CallSpec& spec, const CallResult& result, Clock& clock,
                                       std::shared_ptr<CircuitBreaker>& breaker) const {
  if (breakers != nullptr) breaker = breakers->get(breaker_key);
  CallOptions call;
  call.clock = &clock;
  call.rng = options.rng;
  call.deadline = spec.deadline;
  call.ceiling = spec.ceiling;
  call.safe_to_repeat = spec.idempotent || !result.idempotency_key.empty();
  call.budget = budget;
  call.breaker = breaker.get();
  call.prior_attempts = spec.prior_attempts;
  return call;
}

void Client::Impl::end(const RetryState& state, int sent, bool attempted,
                       CallResult& result) const {
  result.attempts = sent;
  result.elapsed = state.elapsed();
  result.reason = state.stop_reason();
  if (!attempted) {
    result.outcome = state.last_outcome();  // kNotAttempted, with the breaker's retry_in
    result.status = not_attempted_status(result.reason);
  }
  log_give_up(result);
}

CallResult Client::run(const CallSpec& spec, const Attempt& attempt) {
  Impl& impl = *impl_;
  Clock& clock = impl.options.clock != nullptr ? *impl.options.clock : steady_clock();
  CallResult result;
  if (!impl.begin(spec, result)) return result;
  std::shared_ptr<CircuitBreaker> breaker;  // held for the whole call
  const CallOptions call = impl.call_options(spec, result, clock, breaker);
  RetryState state(impl.policy, call);
  bool attempted = false;
  {
    RetryScope scope;  // a keel call made inside the attempt is one layer down
    for (AttemptStart start = state.start_attempt(); start.proceed; start = state.start_attempt()) {
      ::grpc::ClientContext context;
      std::chrono::system_clock::time_point attempt_deadline;
      impl.prepare(context, spec, result.idempotency_key, start.attempt, state, clock,
                   attempt_deadline);
      result.status = attempt(context);
      attempted = true;
      result.outcome = impl.classify(result.status, context, attempt_deadline, result.pushback);
      const Decision decision = state.next(result.outcome);
      if (!decision.retry) break;
      impl.wait_between_attempts(clock, decision.delay);
    }
  }
  impl.end(state, state.attempts(), attempted, result);
  return result;
}

namespace {

// The attempts of one call in flight at once (a round and its hedges), answered on gRPC's
// threads: their contexts, and the answers the calling thread has not taken yet.
class Round {
 public:
  static constexpr int kSlots = HedgePolicy::kMaxHedges + 1;

  ::grpc::ClientContext& fresh(int slot) {
    contexts_[static_cast<std::size_t>(slot)] = std::make_unique<::grpc::ClientContext>();
    return *contexts_[static_cast<std::size_t>(slot)];
  }
  ::grpc::ClientContext& context(int slot) { return *contexts_[static_cast<std::size_t>(slot)]; }
  std::chrono::system_clock::time_point& deadline(int slot) {
    return deadlines_[static_cast<std::size_t>(slot)];
  }

  /// The completion gRPC calls for `slot` (on one of its threads).
  std::function<void(::grpc::Status)> done(int slot) {
    {
      const std::lock_guard lock(state_->mu);
      ++state_->outstanding;
      flying_[static_cast<std::size_t>(slot)] = true;
    }
    return [state = state_, slot](::grpc::Status status) {
      const std::lock_guard lock(state->mu);
      state->answers.emplace_back(slot, std::move(status));
      state->cv.notify_all();
    };
  }

  /// The next answer, or nullopt when `until` (on `clock`) came first; with no `until`, waits
  /// for one (every attempt has its deadline).
  std::optional<std::pair<int, ::grpc::Status>> next(Clock& clock, std::optional<TimePoint> until) {
    std::unique_lock lock(state_->mu);
    const auto ready = [&] { return !state_->answers.empty(); };
    if (until) {
      const Duration left = std::max(*until - clock.now(), Duration::zero());
      // wait: core: until the hedge HedgeState scheduled, or an attempt's answer
      state_->cv.wait_for(lock, left, ready);
    } else {
      // wait: bound: an attempt's answer (each attempt ends by its own deadline)
      state_->cv.wait(lock, ready);
    }
    if (!ready()) return std::nullopt;
    auto answer = std::move(state_->answers.front());
    state_->answers.pop_front();
    --state_->outstanding;
    flying_[static_cast<std::size_t>(answer.first)] = false;
    return answer;
  }

  /// Cancels the attempts still in flight (each told to `hedge`) and waits for gRPC to finish
  /// them: their contexts and replies must outlive the calls.
  void cancel_rest(HedgeState& hedge) {
    for (int slot = 0; slot < kSlots; ++slot) {
      if (!flying_[static_cast<std::size_t>(slot)]) continue;
      contexts_[static_cast<std::size_t>(slot)]->TryCancel();
      hedge.cancel(slot);
      flying_[static_cast<std::size_t>(slot)] = false;
    }
    std::unique_lock lock(state_->mu);
    // wait: bound: the cancelled attempts' completions (gRPC ends a cancelled call at once)
    state_->cv.wait(lock, [&] { return state_->answers.size() >= state_->outstanding; });
    state_->answers.clear();
    state_->outstanding = 0;
  }

 private:
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::pair<int, ::grpc::Status>> answers;
    std::size_t outstanding = 0;
  };
  std::shared_ptr<Shared> state_ = std::make_shared<Shared>();
  std::array<std::unique_ptr<::grpc::ClientContext>, kSlots> contexts_;
  std::array<std::chrono::system_clock::time_point, kSlots> deadlines_{};
  std::array<bool, kSlots> flying_{};
};

}  // namespace

CallResult Client::run_concurrent(const CallSpec& spec, const StartAttempt& start_attempt,
                                  int& winner) {
  Impl& impl = *impl_;
  Clock& clock = impl.options.clock != nullptr ? *impl.options.clock : steady_clock();
  CallResult result;
  winner = -1;
  if (!impl.begin(spec, result)) return result;
  std::shared_ptr<CircuitBreaker> breaker;  // held for the whole call
  const CallOptions call = impl.call_options(spec, result, clock, breaker);
  RetryState state(impl.policy, call);
  HedgeState hedge(impl.hedge ? &*impl.hedge : nullptr, impl.policy, call, state);
  Round round;
  bool attempted = false;
  {
    RetryScope scope;
    const auto launch = [&](int slot, const AttemptInfo& info) {
      ::grpc::ClientContext& context = round.fresh(slot);
      impl.prepare(context, spec, result.idempotency_key, info, state, clock, round.deadline(slot));
      start_attempt(slot, context, round.done(slot));
      attempted = true;
    };
    for (AttemptStart start = state.start_attempt(); start.proceed; start = state.start_attempt()) {
      const Duration delay =
          impl.hedge ? impl.hedge->delay(nullptr, clock.now()) : Duration::zero();
      launch(0, hedge.begin_round(start.attempt, delay));
      std::optional<HedgeVerdict> verdict;
      while (!verdict) {
        const std::optional<TimePoint> due = hedge.next_hedge_at();
        if (due && clock.now() >= *due) {
          const HedgeStart h = hedge.start_hedge();
          if (h.proceed) launch(h.index, h.attempt);
          continue;
        }
        auto answer = round.next(clock, due);
        if (!answer) continue;  // a hedge is due
        std::string pushback;
        const Outcome outcome = impl.classify(answer->second, round.context(answer->first),
                                              round.deadline(answer->first), pushback);
        const HedgeVerdict v = hedge.finish(answer->first, outcome);
        if (!v.done) continue;  // another attempt of the round is still in flight
        verdict = v;
        winner = answer->first;
        result.status = std::move(answer->second);
        result.outcome = outcome;
        result.pushback = std::move(pushback);
      }
      round.cancel_rest(hedge);  // the attempts still in flight lost
      if (!verdict->decision.retry) break;
      winner = -1;
      impl.wait_between_attempts(clock, verdict->decision.delay);
    }
  }
  impl.end(state, hedge.sent(), attempted, result);
  return result;
}

}  // namespace keel::grpc
