#include "keel/core/retry.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

using namespace std::chrono_literals;
using keel::AttemptInfo;
using keel::Duration;
using keel::Outcome;
using keel::RetryOptions;
using keel::RetryPolicy;
using keel::StopReason;

namespace {

struct Harness {
  keel::ManualClock clock;
  keel::Rng rng{1234};
  keel::CallOptions call(bool safe = true, keel::Deadline deadline = keel::Deadline::infinite()) {
    keel::CallOptions c;
    c.clock = &clock;
    c.rng = &rng;
    c.safe_to_repeat = safe;
    c.deadline = deadline;
    return c;
  }
};

// A scripted dependency: returns outcomes in order, repeating the last.
struct Script {
  std::vector<Outcome> outcomes;
  std::vector<AttemptInfo> seen;
  Outcome operator()(const AttemptInfo& a) {
    seen.push_back(a);
    const std::size_t i = std::min(seen.size() - 1, outcomes.size() - 1);
    return outcomes[i];
  }
};

}  // namespace

TEST(Retry, SucceedsWithoutRetrying) {
  Harness h;
  RetryPolicy policy;
  Script s{{Outcome::success()}};
  auto r = keel::retry(policy, std::ref(s), h.call());
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r.attempts, 1);
  EXPECT_EQ(h.clock.sleeps(), 0);
}

TEST(Retry, MaxAttemptsCountsTheFirstTry) {
  Harness h;
  RetryPolicy policy({.max_attempts = 3});
  Script s{{Outcome::transient()}};
  auto r = keel::retry(policy, std::ref(s), h.call());
  EXPECT_EQ(r.reason, StopReason::kAttemptsExhausted);
  EXPECT_EQ(r.attempts, 3);
  EXPECT_EQ(s.seen.size(), 3u);
  EXPECT_EQ(h.clock.sleeps(), 2);  // a wait before each retry, none after the last attempt
  EXPECT_EQ(s.seen[0].number, 1);
  EXPECT_EQ(s.seen[2].number, 3);
  EXPECT_TRUE(s.seen[1].is_retry());
}

TEST(Retry, SucceedsOnTheThirdAttempt) {
  Harness h;
  RetryPolicy policy({.max_attempts = 5});
  Script s{{Outcome::transient(), Outcome::throttled(), Outcome::success()}};
  auto r = keel::retry(policy, std::ref(s), h.call());
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r.attempts, 3);
}

TEST(Retry, PermanentStopsAtOnce) {
  Harness h;
  RetryPolicy policy({.max_attempts = 5});
  Script s{{keel::classify_http_status(400, {})}};
  auto r = keel::retry(policy, std::ref(s), h.call());
  EXPECT_EQ(r.reason, StopReason::kPermanent);
  EXPECT_EQ(r.attempts, 1);
}

TEST(Retry, AmbiguousFailureOfUnsafeOperationIsNotRetried) {
  Harness h;
  RetryPolicy policy({.max_attempts = 5});
  Script s{{keel::classify_network(keel::NetError::kTimedOut, /*request_sent=*/true)}};
  auto r = keel::retry(policy, std::ref(s), h.call(/*safe=*/false));
  EXPECT_EQ(r.reason, StopReason::kNotSafeToRetry);
  EXPECT_EQ(r.attempts, 1);
  // The same failure with an idempotency key (safe to repeat) is retried.
  Script again{{keel::classify_network(keel::NetError::kTimedOut, true), Outcome::success()}};
  auto r2 = keel::retry(policy, std::ref(again), h.call(/*safe=*/true));
  EXPECT_TRUE(r2.ok());
  EXPECT_EQ(r2.attempts, 2);
}

TEST(Retry, TransientFailureOfUnsafeOperationIsRetried) {
  // Connection refused: nothing was sent, so even a POST without a key may be retried.
  Harness h;
  RetryPolicy policy;
  Script s{{keel::classify_network(keel::NetError::kConnectionRefused, false), Outcome::success()}};
  auto r = keel::retry(policy, std::ref(s), h.call(/*safe=*/false));
  EXPECT_TRUE(r.ok());
}

TEST(Retry, FiveHundredIsRetriedOnce) {
  Harness h;
  RetryPolicy policy({.max_attempts = 5});
  Script s{{keel::classify_http_status(500, {})}};
  auto r = keel::retry(policy, std::ref(s), h.call());
  EXPECT_EQ(r.reason, StopReason::kAttemptsExhausted);
  EXPECT_EQ(r.attempts, 2);
}

TEST(Retry, DelaysAreFullJitterUnderTheCeiling) {
  Harness h;
  std::vector<Duration> delays;
  RetryPolicy policy({.max_attempts = 6,
                      .backoff = {.base = 100ms, .cap = 1s},
                      .on_retry = [&](const keel::RetryEvent& e) { delays.push_back(e.delay); }});
  Script s{{Outcome::transient()}};
  (void)keel::retry(policy, std::ref(s), h.call());
  ASSERT_EQ(delays.size(), 5u);
  const Duration ceilings[] = {100ms, 200ms, 400ms, 800ms, 1s};
  Duration total{};
  for (std::size_t i = 0; i < delays.size(); ++i) {
    EXPECT_GE(delays[i], 0s);
    EXPECT_LT(delays[i], ceilings[i]);
    total += delays[i];
  }
  EXPECT_EQ(h.clock.slept(), total);  // the helper slept exactly the chosen delays
}

TEST(Retry, ExactDelaysForASeed) {
  auto run = [](std::uint64_t seed) {
    keel::ManualClock clock;
    keel::Rng rng(seed);
    std::vector<Duration> delays;
    RetryPolicy policy({.max_attempts = 4,
                        .on_retry = [&](const keel::RetryEvent& e) { delays.push_back(e.delay); }});
    keel::CallOptions call;
    call.clock = &clock;
    call.rng = &rng;
    (void)keel::retry(
        policy, [] { return Outcome::transient(); }, call);
    return delays;
  };
  EXPECT_EQ(run(99), run(99));
  EXPECT_NE(run(99), run(100));
}

TEST(Retry, RetryAfterReplacesBackoffAndIsCapped) {
  Harness h;
  std::vector<keel::RetryEvent> events;
  RetryPolicy policy({.max_attempts = 3,
                      .backoff = {.base = 10ms, .cap = 20ms},
                      .retry_after_cap = 60s,
                      .on_retry = [&](const keel::RetryEvent& e) { events.push_back(e); }});
  Script s{{Outcome::throttled(5s), Outcome::throttled(std::chrono::hours(24 * 365 * 10)),
            Outcome::success()}};
  auto r = keel::retry(policy, std::ref(s), h.call());
  EXPECT_TRUE(r.ok());
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].delay, 5s);  // the server's delay, not the 10 ms backoff
  EXPECT_TRUE(events[0].server_delay_used);
  EXPECT_EQ(events[1].delay, 60s);  // ten years capped at 60 s
  EXPECT_EQ(h.clock.slept(), 65s);
}

TEST(Retry, RetryAfterThatDoesNotFitTheDeadlineStopsEarly) {
  Harness h;
  RetryPolicy policy({.max_attempts = 5, .overall_timeout = 10s});
  Script s{{Outcome::throttled(30s)}};
  auto r = keel::retry(policy, std::ref(s), h.call());
  EXPECT_EQ(r.reason, StopReason::kDeadline);
  EXPECT_EQ(r.attempts, 1);
  EXPECT_EQ(h.clock.slept(), 0s);  // it did not sleep at all
}

TEST(Retry, DeadlineWinsOverAttemptCountAndIsNeverSleptPast) {
  Harness h;
  RetryPolicy policy({.max_attempts = 100,
                      .overall_timeout = 3s,
                      .backoff = {.base = 400ms, .cap = 400ms, .jitter = keel::Jitter::kNone}});
  Script s{{Outcome::transient()}};
  const auto t0 = h.clock.now();
  auto r = keel::retry(policy, std::ref(s), h.call());
  EXPECT_EQ(r.reason, StopReason::kDeadline);
  EXPECT_LE(h.clock.now() - t0, 3s);
  // 400 ms waits: attempts start at 0, 0.4, ..., 2.4 s; the 8th wait would end at 2.8 s + ...
  EXPECT_EQ(r.attempts, 8);
}

TEST(Retry, CallerDeadlineCombinesWithPolicyTimeout) {
  Harness h;
  RetryPolicy policy({.max_attempts = 10,
                      .overall_timeout = 60s,
                      .backoff = {.base = 1s, .cap = 1s, .jitter = keel::Jitter::kNone}});
  Script s{{Outcome::transient()}};
  auto r = keel::retry(policy, std::ref(s), h.call(true, keel::Deadline::after(h.clock, 2500ms)));
  EXPECT_EQ(r.reason, StopReason::kDeadline);
  EXPECT_EQ(r.attempts, 3);  // at 0, 1, 2 s; a wait to 3 s would pass 2.5 s
}

TEST(Retry, PerAttemptTimeoutIsTheSmallerOfPerTryAndRemaining) {
  Harness h;
  RetryPolicy policy({.max_attempts = 5,
                      .per_try_timeout = 2s,
                      .overall_timeout = 5s,
                      .backoff = {.base = 1s, .cap = 1s, .jitter = keel::Jitter::kNone}});
  Script s{{Outcome::transient()}};
  std::vector<Duration> timeouts;
  auto r = keel::retry(
      policy,
      [&](const AttemptInfo& a) {
        timeouts.push_back(a.timeout);
        h.clock.sleep_for(a.timeout);  // each attempt hangs until its timeout
        return keel::classify_network(keel::NetError::kTimedOut, false);
      },
      h.call());
  EXPECT_EQ(r.reason, StopReason::kDeadline);
  // t=0: 2 s (ends 2), wait 1 -> t=3: min(2, 2) = 2 s (ends 5): no time left for another.
  ASSERT_EQ(timeouts.size(), 2u);
  EXPECT_EQ(timeouts[0], 2s);
  EXPECT_EQ(timeouts[1], 2s);
}

TEST(Retry, AnAttemptIsNotStartedWithoutTimeToFinish) {
  Harness h;
  RetryPolicy policy({.max_attempts = 5, .min_attempt_time = 100ms});
  keel::RetryState st(policy, h.call(true, keel::Deadline::after(h.clock, 1s)));
  auto first = st.start_attempt();
  ASSERT_TRUE(first.proceed);
  EXPECT_EQ(first.attempt.timeout, 1s);
  h.clock.sleep_for(950ms);  // the attempt took 950 ms
  auto d = st.next(Outcome::transient());
  EXPECT_FALSE(d.retry);  // any wait plus 100 ms does not fit in the 50 ms left
  EXPECT_EQ(d.reason, StopReason::kDeadline);
  EXPECT_FALSE(st.start_attempt().proceed);
}

TEST(Retry, ExpiredDeadlineStopsBeforeTheFirstAttempt) {
  Harness h;
  RetryPolicy policy;
  auto deadline = keel::Deadline::after(h.clock, 1s);
  h.clock.sleep_for(2s);
  int calls = 0;
  auto r = keel::retry(
      policy,
      [&] {
        ++calls;
        return Outcome::success();
      },
      h.call(true, deadline));
  EXPECT_EQ(r.reason, StopReason::kDeadline);
  EXPECT_EQ(calls, 0);
  EXPECT_FALSE(r.value.has_value());
  EXPECT_EQ(r.outcome.kind, keel::OutcomeKind::kNotAttempted);  // nothing tried: not a success
}

TEST(Retry, GiveUpHookGetsOneEventWithTheReason) {
  Harness h;
  std::vector<keel::GiveUpEvent> events;
  RetryPolicy policy({.max_attempts = 2,
                      .backoff = {.base = 1s, .cap = 1s, .jitter = keel::Jitter::kNone},
                      .on_give_up = [&](const keel::GiveUpEvent& e) { events.push_back(e); }});
  auto r = keel::retry(
      policy, [] { return keel::classify_http_status(503, {}); }, h.call());
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].reason, StopReason::kAttemptsExhausted);
  EXPECT_EQ(events[0].attempts, 2);
  EXPECT_EQ(events[0].elapsed, 1s);
  EXPECT_EQ(keel::format_give_up(events[0], "GET /v1/balance"),
            "keel: GET /v1/balance: gave up after 2 attempts in 1s: attempts exhausted (last: "
            "HTTP 503 (throttled))");
  // No give-up event on success.
  events.clear();
  (void)keel::retry(
      policy, [] { return Outcome::success(); }, h.call());
  EXPECT_TRUE(events.empty());
  EXPECT_EQ(r.outcome.code, 503);
}

TEST(Retry, ClassifierOverloadKeepsTheLastValue) {
  Harness h;
  RetryPolicy policy({.max_attempts = 3});
  int n = 0;
  auto r = keel::retry(
      policy, [&] { return ++n == 3 ? 200 : 503; },
      [](const int& status) { return keel::classify_http_status(status, {}); }, h.call());
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r.value, 200);
  EXPECT_EQ(r.attempts, 3);
}

TEST(Retry, ExceptionsPropagate) {
  Harness h;
  RetryPolicy policy;
  EXPECT_THROW((void)keel::retry(
                   policy, []() -> Outcome { throw std::runtime_error("boom"); }, h.call()),
               std::runtime_error);
}

TEST(RetryPolicy, InvalidConfigurationNamesTheField) {
  auto message = [](RetryOptions o) {
    try {
      RetryPolicy p(std::move(o));
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message({.max_attempts = 0}).find("max_attempts must be >= 1 (got 0)"),
            std::string::npos);
  EXPECT_NE(message({.per_try_timeout = 0s}).find("per_try_timeout"), std::string::npos);
  EXPECT_NE(message({.overall_timeout = -1s}).find("overall_timeout"), std::string::npos);
  EXPECT_NE(message({.backoff = {.base = 0s}}).find("base"), std::string::npos);
  EXPECT_NE(message({.retry_after_cap = -1s}).find("retry_after_cap"), std::string::npos);
}

TEST(RetryState, NextAfterStopKeepsTheReason) {
  Harness h;
  RetryPolicy policy;
  keel::RetryState st(policy, h.call());
  ASSERT_TRUE(st.start_attempt().proceed);
  EXPECT_FALSE(st.next(Outcome::permanent()).retry);
  EXPECT_EQ(st.next(Outcome::transient()).reason, StopReason::kPermanent);
  EXPECT_EQ(st.start_attempt().reason, StopReason::kPermanent);
  EXPECT_TRUE(st.stopped());
}

TEST(StopReason, EveryReasonHasADistinctName) {
  std::vector<std::string> names;
  for (int i = 0; i <= static_cast<int>(StopReason::kCancelled); ++i) {
    names.emplace_back(keel::to_string(static_cast<StopReason>(i)));
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(std::unique(names.begin(), names.end()), names.end());
}
