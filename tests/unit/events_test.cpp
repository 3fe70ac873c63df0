// The event stream: what the retry engine and the breakers publish, in virtual time, and
// subscribers that come and go while other threads publish (run under the tsan preset).
#include "keel/core/events.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "keel/core/health.hpp"

using namespace std::chrono_literals;
using keel::Event;
using keel::EventKind;
using keel::Outcome;
using keel::StopReason;

namespace {

// Collects every event's log line (thread-safe).
struct Lines {
  std::mutex mu;
  std::vector<std::string> lines;
  std::vector<Event> events;  // string views not kept valid: only the plain fields are read
  void add(const Event& e) {
    const std::lock_guard lock(mu);
    lines.push_back(keel::format_event(e));
    Event copy = e;
    copy.operation = {};
    copy.key = {};
    events.push_back(copy);
  }
};

struct Harness {
  keel::ManualClock clock;
  keel::Rng rng{7};
  keel::EventStream stream;
  Lines seen;
  keel::SubscriptionId id = stream.subscribe([this](const Event& e) { seen.add(e); });
  keel::CallOptions call() {
    keel::CallOptions c;
    c.clock = &clock;
    c.rng = &rng;
    c.safe_to_repeat = true;
    return c;
  }
  keel::RetryOptions options(int attempts = 3) {
    keel::RetryOptions o;
    o.max_attempts = attempts;
    o.backoff = {.base = 100ms, .cap = 1s, .jitter = keel::Jitter::kNone};
    o.events = &stream;
    o.operation = "charge";
    return o;
  }
};

// Runs a scripted operation: outcomes in order, the last repeated.
keel::RetryResult<Outcome> run(const keel::RetryPolicy& policy, std::vector<Outcome> script,
                               const keel::CallOptions& call) {
  std::size_t i = 0;
  return keel::retry(
      policy,
      [&] {
        const Outcome o = script[std::min(i, script.size() - 1)];
        ++i;
        return o;
      },
      call);
}

TEST(EventStream, NothingIsDeliveredWithoutSubscribers) {
  keel::EventStream stream;
  EXPECT_FALSE(stream.has_subscribers());
  stream.publish(Event{});  // a load and a branch; nobody to call
  int calls = 0;
  const auto id = stream.subscribe([&](const Event&) { ++calls; });
  ASSERT_NE(id, 0U);
  EXPECT_EQ(stream.subscribers(), 1U);
  stream.publish(Event{});
  stream.unsubscribe(id);
  stream.unsubscribe(id);  // twice: no-op
  stream.unsubscribe(12345);
  stream.publish(Event{});
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(stream.has_subscribers());
}

TEST(EventStream, RetriesThenSuccessInTheWordsOfKeelCallVerbose) {
  Harness h;
  const keel::RetryPolicy policy(h.options());
  const auto r =
      run(policy, {Outcome::transient(), Outcome::throttled(), Outcome::success()}, h.call());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(
      h.seen.lines,
      (std::vector<std::string>{
          "keel: charge: attempt 1 started",
          "keel: charge: attempt 1 -> " + keel::describe(Outcome::transient()) + "; retry in 100ms",
          "keel: charge: attempt 2 started",
          "keel: charge: attempt 2 -> " + keel::describe(Outcome::throttled()) + "; retry in 200ms",
          "keel: charge: attempt 3 started",
          "keel: charge: attempt 3 -> success; stop: success",
      }));
  EXPECT_EQ(h.seen.events.back().reason, StopReason::kSuccess);
  EXPECT_FALSE(h.seen.events.back().will_retry);
  EXPECT_EQ(h.seen.events[1].delay, 100ms);
}

TEST(EventStream, GiveUpCarriesTheReasonAndTheElapsedVirtualTime) {
  Harness h;
  const keel::RetryPolicy policy(h.options(2));
  const auto r = run(policy, {Outcome::transient()}, h.call());
  EXPECT_EQ(r.reason, StopReason::kAttemptsExhausted);
  ASSERT_EQ(h.seen.events.size(), 5U);
  EXPECT_EQ(h.seen.events[3].kind, EventKind::kAttemptFinished);
  EXPECT_EQ(h.seen.events[3].reason, StopReason::kAttemptsExhausted);
  const Event& gave_up = h.seen.events[4];
  EXPECT_EQ(gave_up.kind, EventKind::kGaveUp);
  EXPECT_EQ(gave_up.reason, StopReason::kAttemptsExhausted);
  EXPECT_EQ(gave_up.attempt, 2);
  EXPECT_EQ(gave_up.elapsed, 100ms);  // the one wait, on the ManualClock
  EXPECT_EQ(h.seen.lines[3], "keel: charge: attempt 2 -> " + keel::describe(Outcome::transient()) +
                                 "; stop: attempts exhausted");
  EXPECT_EQ(h.seen.lines[4].rfind("keel: charge: gave up after 2 attempts in 100ms: attempts "
                                  "exhausted",
                                  0),
            0U);
}

TEST(EventStream, PermanentFailureGivesUpAfterOneAttempt) {
  Harness h;
  const keel::RetryPolicy policy(h.options());
  (void)run(policy, {Outcome::permanent()}, h.call());
  ASSERT_EQ(h.seen.events.size(), 3U);
  EXPECT_EQ(h.seen.events[2].kind, EventKind::kGaveUp);
  EXPECT_EQ(h.seen.events[2].reason, StopReason::kPermanent);
}

TEST(EventStream, BudgetRefusalIsPublishedBeforeTheGiveUp) {
  Harness h;
  keel::TokenBucketBudget budget({.capacity = 4, .retry_cost = 5});  // never enough for a retry
  keel::CallOptions call = h.call();
  call.budget = &budget;
  const keel::RetryPolicy policy(h.options());
  const auto r = run(policy, {Outcome::transient()}, call);
  EXPECT_EQ(r.reason, StopReason::kBudgetExhausted);
  std::vector<EventKind> kinds;
  for (const Event& e : h.seen.events) kinds.push_back(e.kind);
  EXPECT_EQ(kinds, (std::vector<EventKind>{EventKind::kAttemptStarted, EventKind::kBudgetRefused,
                                           EventKind::kAttemptFinished, EventKind::kGaveUp}));
  EXPECT_EQ(h.seen.events[2].reason, StopReason::kBudgetExhausted);
  EXPECT_EQ(h.seen.lines[1], "keel: charge: attempt 1 -> " + keel::describe(Outcome::transient()) +
                                 "; budget refused the retry");
}

TEST(EventStream, BreakerTransitionsAndACircuitOpenGiveUp) {
  Harness h;
  keel::BreakerRegistryOptions ro;
  ro.breaker.window = keel::BreakerWindow::kCount;
  ro.breaker.window_calls = 2;
  ro.breaker.minimum_calls = 2;
  ro.breaker.break_duration = 5s;
  ro.breaker.clock = &h.clock;
  keel::BreakerRegistry registry(ro);
  keel::publish_breaker_transitions(registry, h.stream);
  const auto breaker = registry.get("api.example:443");
  keel::CallOptions call = h.call();
  call.breaker = breaker.get();
  const keel::RetryPolicy policy(h.options(2));
  (void)run(policy, {Outcome::transient()}, call);  // two failures: the breaker opens
  std::vector<std::string> transitions;
  for (const auto& line : h.seen.lines) {
    if (line.starts_with("keel: breaker ")) transitions.push_back(line);
  }
  EXPECT_EQ(transitions, std::vector<std::string>{"keel: breaker api.example:443: closed -> open"});

  h.seen.lines.clear();
  h.seen.events.clear();
  const auto r = run(policy, {Outcome::success()}, call);
  EXPECT_EQ(r.reason, StopReason::kCircuitOpen);
  ASSERT_EQ(h.seen.events.size(), 1U);  // nothing started: only the give-up
  EXPECT_EQ(h.seen.events[0].kind, EventKind::kGaveUp);
  EXPECT_EQ(h.seen.events[0].reason, StopReason::kCircuitOpen);
  EXPECT_EQ(h.seen.events[0].attempt, 0);
  EXPECT_FALSE(h.seen.events[0].outcome.attempted());

  // The health snapshot agrees.
  const keel::HealthSnapshot health = keel::health_snapshot(registry);
  ASSERT_EQ(health.breakers.size(), 1U);
  EXPECT_EQ(health.breakers[0].key, "api.example:443");
  EXPECT_EQ(health.breakers[0].state, keel::BreakerState::kOpen);
  EXPECT_FALSE(health.all_closed());

  h.clock.advance(5s);  // the break ends: the next attempt is a half-open trial, which succeeds
  h.seen.lines.clear();
  EXPECT_TRUE(run(policy, {Outcome::success()}, call).ok());
  transitions.clear();
  for (const auto& line : h.seen.lines) {
    if (line.starts_with("keel: breaker ")) transitions.push_back(line);
  }
  EXPECT_EQ(transitions,
            (std::vector<std::string>{"keel: breaker api.example:443: open -> half-open",
                                      "keel: breaker api.example:443: half-open -> closed"}));
  EXPECT_TRUE(keel::health_snapshot(registry).all_closed());
}

TEST(EventStream, FormatDecisionIsTheVerboseWording) {
  EXPECT_EQ(keel::format_decision(true, 1500ms, StopReason::kSuccess), "retry in 1.5s");
  EXPECT_EQ(keel::format_decision(false, 0ms, StopReason::kDeadline), "stop: deadline");
  EXPECT_EQ(keel::to_string(EventKind::kGaveUp), "gave up");
}

TEST(EventStream, SinksGetOnlyTheKindsTheyAskedFor) {
  Harness h;  // h.seen takes every kind
  std::vector<EventKind> outcomes;
  const auto id =
      h.stream.subscribe([&](const Event& e) { outcomes.push_back(e.kind); }, keel::kOutcomeEvents);
  ASSERT_NE(id, 0U);
  EXPECT_TRUE(h.stream.wants(EventKind::kAttemptStarted));
  const keel::RetryPolicy policy(h.options());
  (void)run(policy, {Outcome::transient(), Outcome::success()}, h.call());
  EXPECT_EQ(outcomes,
            (std::vector<EventKind>{EventKind::kAttemptFinished, EventKind::kAttemptFinished}));
  EXPECT_EQ(h.seen.events.size(), 4U);

  h.stream.unsubscribe(h.id);  // only the outcome sink is left: nobody wants the starts
  EXPECT_FALSE(h.stream.wants(EventKind::kAttemptStarted));
  EXPECT_TRUE(h.stream.wants(EventKind::kGaveUp));
  h.stream.unsubscribe(id);
  EXPECT_FALSE(h.stream.wants(EventKind::kGaveUp));
  EXPECT_EQ(keel::kOutcomeEvents & keel::event_mask(EventKind::kAttemptStarted), 0U);
}

TEST(EventStream, AtMostKMaxSubscribersAndSlotsAreReused) {
  keel::EventStream stream;
  std::vector<keel::SubscriptionId> ids;
  for (std::size_t i = 0; i < keel::EventStream::kMaxSubscribers; ++i) {
    ids.push_back(stream.subscribe([](const Event&) {}));
    ASSERT_NE(ids.back(), 0U);
  }
  EXPECT_EQ(stream.subscribe([](const Event&) {}), 0U);  // full
  EXPECT_EQ(stream.subscribe(std::shared_ptr<keel::EventSink>()), 0U);
  stream.unsubscribe(ids[3]);
  const auto again = stream.subscribe([](const Event&) {});
  EXPECT_NE(again, 0U);
  EXPECT_NE(again, ids[3]);  // a new id: the old one stays dead
  stream.unsubscribe(ids[3]);
  EXPECT_EQ(stream.subscribers(), keel::EventStream::kMaxSubscribers);
}

struct CountingSink final : keel::EventSink {
  std::atomic<std::int64_t> n{0};
  void on_event(const Event&) override { n.fetch_add(1, std::memory_order_relaxed); }
};

TEST(EventStream, UnsubscribedSinksLiveUntilReclaimOrTheStreamEnds) {
  std::weak_ptr<CountingSink> weak;
  {
    keel::EventStream stream;
    auto sink = std::make_shared<CountingSink>();
    weak = sink;
    const auto id = stream.subscribe(sink);
    sink.reset();  // the stream shares ownership
    stream.publish(Event{});
    EXPECT_EQ(weak.lock()->n.load(), 1);
    stream.unsubscribe(id);
    EXPECT_FALSE(weak.expired());  // a publish on another thread might still be calling it
    stream.reclaim();
    EXPECT_TRUE(weak.expired());
    auto other = std::make_shared<CountingSink>();
    weak = other;
    (void)stream.subscribe(std::move(other));
  }
  EXPECT_TRUE(weak.expired());  // released with the stream
}

// Real threads: retry loops publish on four threads while a fifth subscribes and unsubscribes
// sinks. A sink subscribed throughout sees every event; the others see some; nothing races
// (ThreadSanitizer) and nothing is called after it was reclaimed.
TEST(EventStream, SubscribersComeAndGoWhileOthersPublish) {
  keel::EventStream stream;
  auto steady = std::make_shared<CountingSink>();
  ASSERT_NE(stream.subscribe(steady), 0U);
  constexpr int kThreads = 4;
  constexpr int kOperations = 2000;
  std::atomic<bool> go{false};
  std::atomic<int> done{0};
  std::vector<std::thread> publishers;
  keel::RetryOptions o;
  o.max_attempts = 2;
  o.backoff = {.base = 1ms, .cap = 1ms};
  o.events = &stream;
  const keel::RetryPolicy policy(o);
  for (int t = 0; t < kThreads; ++t) {
    publishers.emplace_back([&, t] {
      keel::ManualClock clock;
      keel::Rng rng(static_cast<std::uint64_t>(t) + 1);
      keel::CallOptions call;
      call.clock = &clock;
      call.rng = &rng;
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < kOperations; ++i) {
        // Fails once, then succeeds: started, finished (retry), started, finished (stop).
        int n = 0;
        (void)keel::retry(
            policy, [&] { return ++n == 1 ? Outcome::transient() : Outcome::success(); }, call);
      }
      done.fetch_add(1);
    });
  }
  std::vector<std::shared_ptr<CountingSink>> toggled;
  go.store(true);
  while (done.load() < kThreads) {
    auto sink = std::make_shared<CountingSink>();
    const auto id = stream.subscribe(sink);
    ASSERT_NE(id, 0U);
    std::this_thread::yield();
    stream.unsubscribe(id);
    toggled.push_back(std::move(sink));
  }
  for (auto& p : publishers) p.join();
  stream.reclaim();  // every publisher joined: no publish can be under way
  EXPECT_EQ(steady->n.load(), std::int64_t{kThreads} * kOperations * 4);
  std::int64_t partial = 0;
  for (const auto& s : toggled) {
    EXPECT_LE(s->n.load(), steady->n.load());
    partial += s->n.load();
  }
  const std::int64_t before = partial;
  stream.publish(Event{});  // after every unsubscribe: only the steady sink is called
  partial = 0;
  for (const auto& s : toggled) partial += s->n.load();
  EXPECT_EQ(partial, before);
  EXPECT_EQ(steady->n.load(), std::int64_t{kThreads} * kOperations * 4 + 1);
}

TEST(Health, BudgetLevelsAndBreakerRates) {
  keel::ManualClock clock;
  keel::BreakerRegistryOptions ro;
  ro.breaker.clock = &clock;
  ro.breaker.minimum_calls = 100;
  keel::BreakerRegistry registry(ro);
  const auto b = registry.get("b:80");
  const auto a = registry.get("a:80");
  for (int i = 0; i < 4; ++i) {
    const auto permit = a->try_acquire();
    a->record(permit, i == 0 ? Outcome::transient() : Outcome::success());
  }
  keel::TokenBucketBudget tokens;
  keel::ThrottleBudget throttle;
  const keel::HealthSnapshot h =
      keel::health_snapshot(registry, {{"payments", &tokens}, {"none", nullptr}, {"t", &throttle}});
  ASSERT_EQ(h.breakers.size(), 2U);
  EXPECT_EQ(h.breakers[0].key, "a:80");  // sorted
  EXPECT_EQ(h.breakers[0].calls, 4);
  EXPECT_EQ(h.breakers[0].failures, 1);
  EXPECT_DOUBLE_EQ(h.breakers[0].failure_rate, 0.25);
  EXPECT_EQ(h.breakers[1].calls, 0);
  EXPECT_DOUBLE_EQ(h.breakers[1].failure_rate, 0.0);
  EXPECT_TRUE(h.all_closed());
  ASSERT_EQ(h.budgets.size(), 2U);
  EXPECT_EQ(h.budgets[0].name, "payments");
  EXPECT_EQ(h.budgets[0].model, "token bucket");
  EXPECT_DOUBLE_EQ(h.budgets[0].available, tokens.available());
  EXPECT_EQ(h.budgets[1].model, "throttle");
  EXPECT_DOUBLE_EQ(h.budgets[1].available, 10.0);
}

}  // namespace
