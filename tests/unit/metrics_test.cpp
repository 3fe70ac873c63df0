// keel::metrics: the event stream and the health snapshot as Prometheus text, through
// prometheus-cpp's registry and TextSerializer, in virtual time.
#include "keel/metrics/metrics.hpp"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

using namespace std::chrono_literals;
using keel::Outcome;

namespace {

bool has(const std::string& text, const std::string& line) {
  return text.find(line + "\n") != std::string::npos;
}

TEST(RetryMetrics, CountsRetriesGiveUpsAndAttemptsPerOperation) {
  prometheus::Registry registry;
  auto metrics = std::make_shared<keel::metrics::RetryMetrics>(registry);
  keel::EventStream events;
  ASSERT_NE(events.subscribe(metrics, keel::kOutcomeEvents), 0U);
  keel::ManualClock clock;
  keel::Rng rng(3);
  keel::CallOptions call;
  call.clock = &clock;
  call.rng = &rng;
  const keel::RetryPolicy policy({.max_attempts = 3, .events = &events, .operation = "charge"});

  // Fails once then succeeds; then fails three times.
  int n = 0;
  (void)keel::retry(
      policy, [&] { return ++n == 1 ? Outcome::transient() : Outcome::success(); }, call);
  (void)keel::retry(
      policy, [] { return Outcome::transient(); }, call);

  const std::string text = keel::metrics::serialize({&registry});
  EXPECT_TRUE(has(text, "keel_retries_total{operation=\"charge\"} 3")) << text;
  EXPECT_TRUE(has(text, "keel_attempts_total{operation=\"charge\",outcome=\"transient\"} 4"))
      << text;
  EXPECT_TRUE(has(text, "keel_attempts_total{operation=\"charge\",outcome=\"success\"} 1"));
  EXPECT_TRUE(
      has(text, "keel_give_ups_total{operation=\"charge\",reason=\"attempts_exhausted\"} 1"));
  EXPECT_TRUE(has(text, "keel_attempts_per_operation_count{operation=\"charge\"} 2"));
  EXPECT_TRUE(has(text, "keel_attempts_per_operation_sum{operation=\"charge\"} 5"));
  EXPECT_TRUE(has(text, "keel_attempts_per_operation_bucket{operation=\"charge\",le=\"2\"} 1"));
  EXPECT_TRUE(has(text, "# TYPE keel_attempts_per_operation histogram"));
}

TEST(RetryMetrics, BreakerStateAndBudgetFromTransitionsAndTheSnapshot) {
  prometheus::Registry registry;
  auto metrics = std::make_shared<keel::metrics::RetryMetrics>(registry);
  keel::EventStream events;
  ASSERT_NE(events.subscribe(metrics), 0U);
  keel::ManualClock clock;
  keel::BreakerRegistryOptions ro;
  ro.breaker.window = keel::BreakerWindow::kCount;
  ro.breaker.window_calls = 4;
  ro.breaker.minimum_calls = 4;
  ro.breaker.clock = &clock;
  keel::BreakerRegistry breakers(ro);
  keel::publish_breaker_transitions(breakers, events);
  const auto b = breakers.get("api:443");
  for (int i = 0; i < 4; ++i) b->record(b->try_acquire(), Outcome::transient());
  keel::TokenBucketBudget budget;
  metrics->observe(keel::health_snapshot(breakers, {{"payments", &budget}}));

  const std::string text = keel::metrics::serialize({&registry});
  EXPECT_TRUE(has(text, "keel_breaker_state{dependency=\"api:443\",state=\"open\"} 1")) << text;
  EXPECT_TRUE(has(text, "keel_breaker_state{dependency=\"api:443\",state=\"closed\"} 0"));
  EXPECT_TRUE(has(text, "keel_breaker_transitions_total{dependency=\"api:443\",to=\"open\"} 1"));
  EXPECT_TRUE(has(text, "keel_breaker_failure_rate{dependency=\"api:443\"} 1"));
  EXPECT_TRUE(has(text, "keel_breaker_window_calls{dependency=\"api:443\"} 4"));
  EXPECT_TRUE(
      has(text, "keel_retry_budget_available{budget=\"payments\",model=\"token_bucket\"} 100"))
      << text;
}

TEST(RetryMetrics, LabelValuesAreKeelsWordsWithUnderscores) {
  EXPECT_EQ(keel::metrics::label_value("attempts exhausted"), "attempts_exhausted");
  EXPECT_EQ(keel::metrics::label_value("half-open"), "half_open");
}

}  // namespace
