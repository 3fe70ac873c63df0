// keel::asio::retry: the engine's rules through an Asio event loop, compared scenario by
// scenario with the blocking keel::retry; per-attempt timeouts through cancellation slots;
// cancellation of the outer operation mid-wait and mid-attempt; many calls on one thread.
#include <gtest/gtest.h>

#include <asio/bind_cancellation_slot.hpp>
#include <asio/cancellation_signal.hpp>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/redirect_error.hpp>
#include <asio/steady_timer.hpp>
#include <chrono>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "keel/asio/retry.hpp"
#include "keel/core/breaker.hpp"
#include "keel/core/budget.hpp"
#include "keel/core/random.hpp"

namespace {

using namespace std::chrono_literals;
using keel::AttemptInfo;
using keel::Outcome;
using keel::StopReason;

template <class T>
struct Captured {
  std::optional<T> value;
  std::exception_ptr error;
  bool done = false;
};

// Runs `aw` on `io` to completion (or until `limit` of real time passes) and returns its result.
template <class T>
Captured<T> run(::asio::io_context& io, ::asio::awaitable<T> aw, std::chrono::seconds limit = 20s) {
  Captured<T> out;
  ::asio::co_spawn(io, std::move(aw), [&](std::exception_ptr e, T v) {
    out.error = e;
    if (!e) out.value = std::move(v);
    out.done = true;
  });
  io.run_for(limit);
  return out;
}

// A scripted dependency: attempt n returns script[n-1] (the last entry repeats), optionally
// advancing the manual clock by `cost` to model the attempt's duration.
struct Script {
  std::vector<Outcome> outcomes;
  keel::Duration cost{};
  Outcome at(int n) const {
    const auto i = static_cast<std::size_t>(n - 1);
    return i < outcomes.size() ? outcomes[i] : outcomes.back();
  }
};

struct Trace {
  std::vector<int> numbers;
  std::vector<keel::Duration> timeouts;
  std::vector<keel::Duration> delays;
  std::vector<StopReason> give_ups;
};

keel::RetryOptions traced(keel::RetryOptions o, Trace& t) {
  o.on_retry = [&t](const keel::RetryEvent& e) { t.delays.push_back(e.delay); };
  o.on_give_up = [&t](const keel::GiveUpEvent& e) { t.give_ups.push_back(e.reason); };
  return o;
}

struct Scenario {
  std::string name;
  keel::RetryOptions options;
  Script script;
  bool safe_to_repeat = false;
  keel::Duration caller_deadline = keel::kInfinite;
};

void PrintTo(const Scenario& s, std::ostream* os) { *os << s.name; }

class SameRulesAsBlocking : public ::testing::TestWithParam<Scenario> {};

// The same scenario through the blocking helper and the async one, each with its own manual
// clock and an identically seeded generator: same attempts, timeouts, delays, reason, time.
TEST_P(SameRulesAsBlocking, AttemptsDelaysReasonAndTimeMatch) {
  const Scenario& s = GetParam();

  keel::ManualClock blocking_clock;
  keel::Rng blocking_rng(42);
  Trace blocking;
  const keel::RetryPolicy blocking_policy(traced(s.options, blocking));
  keel::CallOptions blocking_call{
      .clock = &blocking_clock,
      .deadline = keel::Deadline::after(blocking_clock, s.caller_deadline),
      .safe_to_repeat = s.safe_to_repeat,
      .rng = &blocking_rng};
  const auto b = keel::retry(
      blocking_policy,
      [&](const AttemptInfo& a) {
        blocking.numbers.push_back(a.number);
        blocking.timeouts.push_back(a.timeout);
        blocking_clock.advance(s.script.cost);
        return s.script.at(a.number);
      },
      blocking_call);

  keel::ManualClock async_clock;
  keel::Rng async_rng(42);
  Trace async;
  const keel::RetryPolicy async_policy(traced(s.options, async));
  keel::CallOptions async_call{.clock = &async_clock,
                               .deadline = keel::Deadline::after(async_clock, s.caller_deadline),
                               .safe_to_repeat = s.safe_to_repeat,
                               .rng = &async_rng};
  ::asio::io_context io;
  auto op = [&](const AttemptInfo& a) -> ::asio::awaitable<Outcome> {
    async.numbers.push_back(a.number);
    async.timeouts.push_back(a.timeout);
    async_clock.advance(s.script.cost);
    co_return s.script.at(a.number);
  };
  auto got = run(io, keel::asio::retry(io.get_executor(), async_policy, op, async_call));
  ASSERT_TRUE(got.done);
  ASSERT_FALSE(got.error);
  const auto& a = *got.value;

  EXPECT_EQ(a.reason, b.reason) << keel::to_string(a.reason) << " vs " << keel::to_string(b.reason);
  EXPECT_EQ(a.attempts, b.attempts);
  EXPECT_EQ(a.elapsed, b.elapsed);
  EXPECT_EQ(a.outcome.kind, b.outcome.kind);
  EXPECT_EQ(async.numbers, blocking.numbers);
  EXPECT_EQ(async.timeouts, blocking.timeouts);
  EXPECT_EQ(async.delays, blocking.delays);
  EXPECT_EQ(async.give_ups, blocking.give_ups);
  EXPECT_EQ(async_clock.slept(), blocking_clock.slept());
}

const Outcome kTransient = Outcome::transient();

INSTANTIATE_TEST_SUITE_P(
    Rules, SameRulesAsBlocking,
    ::testing::Values(Scenario{"success_first_try", {}, {{Outcome::success()}}},
                      Scenario{"transient_then_success",
                               {.max_attempts = 4},
                               {{kTransient, kTransient, Outcome::success()}}},
                      Scenario{"attempts_exhausted", {.max_attempts = 3}, {{kTransient}}},
                      Scenario{
                          "permanent_stops_at_once", {.max_attempts = 5}, {{Outcome::permanent()}}},
                      Scenario{"ambiguous_not_safe", {.max_attempts = 5}, {{Outcome::ambiguous()}}},
                      Scenario{"ambiguous_safe_retried",
                               {.max_attempts = 3},
                               {{Outcome::ambiguous(), Outcome::success()}},
                               true},
                      Scenario{"retry_after_replaces_backoff",
                               {.max_attempts = 3, .overall_timeout = 120s},
                               {{Outcome::throttled(30s), Outcome::success()}}},
                      Scenario{"retry_after_capped",
                               {.max_attempts = 2, .retry_after_cap = 5s},
                               {{Outcome::throttled(3600s)}}},
                      Scenario{"retry_after_past_deadline_stops",
                               {.max_attempts = 3, .overall_timeout = 10s},
                               {{Outcome::throttled(20s)}}},
                      Scenario{"overall_deadline_caps_attempt_timeout",
                               {.max_attempts = 10,
                                .per_try_timeout = 4s,
                                .overall_timeout = 10s,
                                .backoff = {.base = 500ms, .cap = 1s}},
                               {{kTransient}, 3s}},
                      Scenario{"caller_deadline_wins",
                               {.max_attempts = 10, .backoff = {.base = 1s, .cap = 2s}},
                               {{kTransient}, 1s},
                               false,
                               5s},
                      Scenario{"retry_limit_of_500",
                               {.max_attempts = 5},
                               {{keel::classify_http_status(500, {keel::Method::kGet})}},
                               true}));

TEST(AsioRetry, ValueAndClassifierOverloadReturnsTheLastValue) {
  ::asio::io_context io;
  keel::ManualClock clock;
  const keel::RetryPolicy policy({.max_attempts = 5});
  auto op = [](const AttemptInfo& a) -> ::asio::awaitable<int> { co_return a.number * 10; };
  auto classify = [](const int& v) { return v < 30 ? Outcome::transient() : Outcome::success(); };
  auto got = run(io, keel::asio::retry(io.get_executor(), policy, op, classify, {.clock = &clock}));
  ASSERT_TRUE(got.done);
  ASSERT_TRUE(got.value->ok());
  EXPECT_EQ(got.value->attempts, 3);
  EXPECT_EQ(got.value->value, 30);
}

TEST(AsioRetry, ExceptionsFromTheOpPropagate) {
  ::asio::io_context io;
  const keel::RetryPolicy policy({.max_attempts = 3});
  auto op = [](const AttemptInfo&) -> ::asio::awaitable<Outcome> {
    throw std::logic_error("broken op");
    co_return Outcome::success();
  };
  auto got = run(io, keel::asio::retry(io.get_executor(), policy, op));
  ASSERT_TRUE(got.done);
  ASSERT_TRUE(got.error);
  EXPECT_THROW(std::rethrow_exception(got.error), std::logic_error);
}

// An attempt that awaits a long timer; records how its wait ended.
struct SlowOp {
  std::vector<std::error_code>* endings;
  std::chrono::steady_clock::duration takes;
  ::asio::awaitable<Outcome> operator()(const AttemptInfo&) const {
    ::asio::steady_timer t(co_await ::asio::this_coro::executor, takes);
    std::error_code ec;
    co_await t.async_wait(::asio::redirect_error(::asio::use_awaitable, ec));
    endings->push_back(ec);
    co_return ec ? Outcome::transient() : Outcome::success();
  }
};

TEST(AsioRetry, PerAttemptTimeoutCancelsTheAttemptThroughItsSlot) {
  ::asio::io_context io;
  std::vector<std::error_code> endings;
  const keel::RetryPolicy policy(
      {.max_attempts = 2, .per_try_timeout = 20ms, .backoff = {.base = 1ms, .cap = 1ms}});
  auto got = run(io, keel::asio::retry(io.get_executor(), policy, SlowOp{&endings, 1h},
                                       {.safe_to_repeat = true}));
  ASSERT_TRUE(got.done) << "the attempts were not cancelled";
  ASSERT_FALSE(got.error);
  EXPECT_EQ(got.value->reason, StopReason::kAttemptsExhausted);
  EXPECT_EQ(got.value->attempts, 2);
  EXPECT_TRUE(got.value->outcome.timed_out);
  EXPECT_EQ(got.value->outcome.kind, keel::OutcomeKind::kAmbiguous);
  EXPECT_FALSE(got.value->value.has_value());
  ASSERT_EQ(endings.size(), 2U);
  EXPECT_EQ(endings[0], ::asio::error::operation_aborted);
  EXPECT_EQ(endings[1], ::asio::error::operation_aborted);
}

TEST(AsioRetry, TimedOutAttemptOfAnOperationNotSafeToRepeatIsNotRetried) {
  ::asio::io_context io;
  std::vector<std::error_code> endings;
  const keel::RetryPolicy policy({.max_attempts = 3, .per_try_timeout = 10ms});
  auto got = run(io, keel::asio::retry(io.get_executor(), policy, SlowOp{&endings, 1h}));
  ASSERT_TRUE(got.done);
  EXPECT_EQ(got.value->reason, StopReason::kNotSafeToRetry);
  EXPECT_EQ(got.value->attempts, 1);
}

TEST(AsioRetry, AttemptFasterThanItsTimeoutKeepsItsResult) {
  ::asio::io_context io;
  std::vector<std::error_code> endings;
  const keel::RetryPolicy policy({.max_attempts = 3, .per_try_timeout = 10s});
  auto got = run(io, keel::asio::retry(io.get_executor(), policy, SlowOp{&endings, 1ms}));
  ASSERT_TRUE(got.done);
  EXPECT_TRUE(got.value->ok());
  ASSERT_EQ(endings.size(), 1U);
  EXPECT_FALSE(endings[0]);
}

// Spawns the retry with a cancellation signal bound to its completion, emits the signal after
// `after` of real time, and reports the result.
template <class Op>
Captured<keel::RetryResult<Outcome>> run_and_cancel(const keel::RetryPolicy& policy, Op op,
                                                    std::chrono::milliseconds after) {
  ::asio::io_context io;
  ::asio::cancellation_signal signal;
  Captured<keel::RetryResult<Outcome>> out;
  ::asio::co_spawn(io, keel::asio::retry(io.get_executor(), policy, op, {.safe_to_repeat = true}),
                   ::asio::bind_cancellation_slot(
                       signal.slot(), [&](std::exception_ptr e, keel::RetryResult<Outcome> r) {
                         out.error = e;
                         if (!e) out.value = std::move(r);
                         out.done = true;
                       }));
  ::asio::steady_timer trigger(io, after);
  trigger.async_wait([&](std::error_code) { signal.emit(::asio::cancellation_type::terminal); });
  io.run_for(20s);
  return out;
}

TEST(AsioRetry, CancellationDuringTheWaitStopsAtOnceWithCancelled) {
  std::vector<StopReason> give_ups;
  int attempts_run = 0;
  // The first attempt fails at once; the wait before the second is an hour.
  const keel::RetryPolicy policy(
      {.max_attempts = 3,
       .backoff = {.base = 1h, .cap = 1h, .jitter = keel::Jitter::kNone},
       .on_give_up = [&](const keel::GiveUpEvent& e) { give_ups.push_back(e.reason); }});
  auto op = [&](const AttemptInfo&) -> ::asio::awaitable<Outcome> {
    ++attempts_run;
    co_return Outcome::transient();
  };
  auto got = run_and_cancel(policy, op, 20ms);
  ASSERT_TRUE(got.done) << "the wait was not cancelled";
  ASSERT_FALSE(got.error);
  EXPECT_EQ(got.value->reason, StopReason::kCancelled);
  EXPECT_EQ(got.value->attempts, 1);
  EXPECT_EQ(attempts_run, 1);
  EXPECT_EQ(got.value->outcome.kind, keel::OutcomeKind::kTransient);
  EXPECT_LT(got.value->elapsed, 1h);
  EXPECT_EQ(give_ups, std::vector<StopReason>{StopReason::kCancelled});
}

TEST(AsioRetry, CancellationDuringAnAttemptStopsItWithCancelled) {
  std::vector<std::error_code> endings;
  const keel::RetryPolicy policy({.max_attempts = 3, .per_try_timeout = 2h});
  auto got = run_and_cancel(policy, SlowOp{&endings, 1h}, 20ms);
  ASSERT_TRUE(got.done) << "the attempt was not cancelled";
  ASSERT_FALSE(got.error);
  EXPECT_EQ(got.value->reason, StopReason::kCancelled);
  EXPECT_EQ(got.value->attempts, 1);
  ASSERT_EQ(endings.size(), 1U);
  EXPECT_EQ(endings[0], ::asio::error::operation_aborted);
}

TEST(AsioRetry, CancellationDuringAnAttemptWithoutTimeoutStopsIt) {
  std::vector<std::error_code> endings;
  const keel::RetryPolicy policy({.max_attempts = 3});  // no per-try timeout: no race
  auto got = run_and_cancel(policy, SlowOp{&endings, 1h}, 20ms);
  ASSERT_TRUE(got.done);
  EXPECT_EQ(got.value->reason, StopReason::kCancelled);
  ASSERT_EQ(endings.size(), 1U);
  EXPECT_EQ(endings[0], ::asio::error::operation_aborted);
}

// Ten operations in a row against a dependency that always fails, sharing one token bucket:
// the async path spends and refuses retries exactly as the blocking one.
TEST(AsioRetry, BudgetRefusesRetriesAsTheBlockingHelperDoes) {
  const keel::RetryPolicy policy({.max_attempts = 3});
  auto reasons_of = [&](bool async) {
    keel::ManualClock clock;
    keel::Rng rng(7);
    keel::TokenBucketBudget budget({.capacity = 20, .retry_cost = 5, .success_refund = 1});
    keel::CallOptions call{.clock = &clock, .rng = &rng, .budget = &budget};
    std::vector<std::pair<StopReason, int>> out;
    for (int i = 0; i < 10; ++i) {
      if (async) {
        ::asio::io_context io;
        auto op = [](const AttemptInfo&) -> ::asio::awaitable<Outcome> {
          co_return Outcome::transient();
        };
        auto got = run(io, keel::asio::retry(io.get_executor(), policy, op, call));
        out.emplace_back(got.value->reason, got.value->attempts);
      } else {
        auto r = keel::retry(
            policy, [](const AttemptInfo&) { return Outcome::transient(); }, call);
        out.emplace_back(r.reason, r.attempts);
      }
    }
    return out;
  };
  const auto blocking = reasons_of(false);
  const auto async = reasons_of(true);
  EXPECT_EQ(async, blocking);
  ASSERT_EQ(async.back().first, StopReason::kBudgetExhausted);
  EXPECT_EQ(async.back().second, 1);
}

// A breaker that trips after 4 failed calls: later operations stop before running anything.
TEST(AsioRetry, OpenBreakerStopsBeforeTheAttempt) {
  keel::ManualClock clock;
  keel::CircuitBreaker breaker({.window = keel::BreakerWindow::kCount,
                                .window_calls = 4,
                                .minimum_calls = 4,
                                .break_duration = std::chrono::seconds(30),
                                .clock = &clock});
  const keel::RetryPolicy policy({.max_attempts = 2});
  int ran = 0;
  auto op = [&](const AttemptInfo&) -> ::asio::awaitable<Outcome> {
    ++ran;
    co_return Outcome::transient();
  };
  std::vector<StopReason> reasons;
  for (int i = 0; i < 3; ++i) {
    ::asio::io_context io;
    auto got = run(io, keel::asio::retry(io.get_executor(), policy, op,
                                         {.clock = &clock, .breaker = &breaker}));
    reasons.push_back(got.value->reason);
  }
  EXPECT_EQ(ran, 4);
  EXPECT_EQ(reasons,
            (std::vector<StopReason>{StopReason::kAttemptsExhausted, StopReason::kAttemptsExhausted,
                                     StopReason::kCircuitOpen}));
  EXPECT_EQ(breaker.state(), keel::BreakerState::kOpen);
}

// Three layers of async retries, 3 attempts each, sharing one RetryContext: the bottom is
// reached 3 times, not 27; with NestedRetries::kRetry the layers multiply.
::asio::awaitable<Outcome> layer(const keel::RetryPolicy& policy, keel::RetryContext* context,
                                 keel::NestedRetries nested, int depth, int& bottom_calls) {
  if (depth == 0) {
    ++bottom_calls;
    co_return Outcome::transient();
  }
  auto ex = co_await ::asio::this_coro::executor;
  auto op = [&, depth](const AttemptInfo&) {
    return layer(policy, context, nested, depth - 1, bottom_calls);
  };
  auto r = co_await keel::asio::retry(
      ex, policy, op, {.safe_to_repeat = true, .context = context, .nested = nested});
  co_return r.outcome;
}

TEST(AsioRetry, OneRetryingLayerThroughAnExplicitContext) {
  const keel::RetryPolicy policy({.max_attempts = 3, .backoff = {.base = 1ms, .cap = 1ms}});
  keel::RetryContext context;
  int bottom = 0;
  {
    ::asio::io_context io;
    auto got = run(io, layer(policy, &context, keel::NestedRetries::kSingleAttempt, 3, bottom));
    ASSERT_TRUE(got.done);
  }
  EXPECT_EQ(bottom, 3);
  EXPECT_EQ(context.depth(), 0);
  bottom = 0;
  {
    ::asio::io_context io;
    auto got = run(io, layer(policy, &context, keel::NestedRetries::kRetry, 3, bottom));
    ASSERT_TRUE(got.done);
  }
  EXPECT_EQ(bottom, 27);
}

// Without a context, operations interleaved on one thread do not count as nested in each other.
TEST(AsioRetry, ConcurrentOperationsWithoutContextAreIndependent) {
  const keel::RetryPolicy policy({.max_attempts = 3, .backoff = {.base = 1ms, .cap = 2ms}});
  ::asio::io_context io;
  std::vector<int> attempts;
  for (int i = 0; i < 20; ++i) {
    auto op = [](const AttemptInfo&) -> ::asio::awaitable<Outcome> {
      ::asio::steady_timer t(co_await ::asio::this_coro::executor, 1ms);
      co_await t.async_wait(::asio::use_awaitable);
      co_return Outcome::transient();
    };
    ::asio::co_spawn(
        io, keel::asio::retry(io.get_executor(), policy, op),
        [&](std::exception_ptr, keel::RetryResult<Outcome> r) { attempts.push_back(r.attempts); });
  }
  io.run_for(20s);
  EXPECT_EQ(attempts, std::vector<int>(20, 3));
}

// 1,000 operations on one thread, against a dependency that fails each operation's first
// `i % 3` attempts; with 3 attempts allowed every operation succeeds, after exactly i % 3 + 1
// attempts, and no operation holds the thread while it waits.
TEST(AsioRetry, AThousandConcurrentCallsOnOneThread) {
  ::asio::io_context io(1);
  const keel::RetryPolicy policy(
      {.max_attempts = 3, .per_try_timeout = 5s, .backoff = {.base = 5ms, .cap = 20ms}});
  constexpr int kCalls = 1000;
  std::vector<int> attempts(kCalls, 0);
  int done = 0;
  for (int i = 0; i < kCalls; ++i) {
    auto op = [&, i](const AttemptInfo& a) -> ::asio::awaitable<Outcome> {
      // Each attempt takes 1 ms of reactor time.
      ::asio::steady_timer t(co_await ::asio::this_coro::executor, 1ms);
      co_await t.async_wait(::asio::use_awaitable);
      co_return a.number <= i % 3 ? Outcome::transient() : Outcome::success();
    };
    ::asio::co_spawn(io, keel::asio::retry(io.get_executor(), policy, op),
                     [&, i](std::exception_ptr e, keel::RetryResult<Outcome> r) {
                       ASSERT_FALSE(e);
                       EXPECT_TRUE(r.ok()) << i;
                       attempts[static_cast<std::size_t>(i)] = r.attempts;
                       ++done;
                     });
  }
  io.run_for(30s);
  EXPECT_EQ(done, kCalls);
  for (int i = 0; i < kCalls; ++i) EXPECT_EQ(attempts[static_cast<std::size_t>(i)], i % 3 + 1) << i;
}

}  // namespace
