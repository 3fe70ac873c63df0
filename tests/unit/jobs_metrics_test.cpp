// `keel jobs work`'s metrics and breaker log (tools/keel/jobs_metrics.cpp), checked in process:
// each dead-letter reason counted in its own bucket, by the reason's kind, and the probes of an
// outage counted as sent.
#include "jobs_metrics.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "keel/core/breaker.hpp"
#include "keel/core/clock.hpp"
#include "keel/queue/queue.hpp"

namespace keel::cli::jobs_cli {
namespace {

using store::DeadReason;

// The outage's closing line counts the probes this process sent: the moments a fleet's trial gate
// held the breaker open for another process's probe are not among them.
TEST(BreakerLogTest, TheClosingLineCountsProbesSentNotMomentsHeldForTheFleet) {
  using namespace std::chrono_literals;
  ManualClock clock;
  BreakerRegistry breakers({.breaker = {.window = BreakerWindow::kCount,
                                        .window_calls = 1,
                                        .minimum_calls = 1,
                                        .break_duration = 5s,
                                        .clock = &clock}});
  BreakerLog log(breakers);
  breakers.add_listener([&](std::string_view key, BreakerState from, BreakerState to) {
    log.on_change(key, from, to);
  });
  std::vector<Duration> answers = {1s, 1s, 1s, 0s};  // three holds, then this process probes
  std::size_t asked = 0;
  breakers.set_trial_gate([&](std::string_view) { return answers.at(asked++); });
  const auto b = breakers.get("api:443");
  testing::internal::CaptureStderr();
  auto permit = b->try_acquire();
  ASSERT_TRUE(permit);
  b->record(permit, Outcome::transient());  // open
  for (int held = 0; held < 3; ++held) {
    clock.advance(5s);
    EXPECT_FALSE(b->try_acquire());
  }
  clock.advance(1s);
  permit = b->try_acquire();
  ASSERT_TRUE(permit.trial);
  b->record(permit, Outcome::success());
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(asked, 4U);
  EXPECT_NE(err.find("circuit open for api:443: 1 of 1 calls failed (100%)"), std::string::npos)
      << err;
  EXPECT_NE(err.find("(1 probes)"), std::string::npos) << err;
}

TEST(JobsMetricsTest, EachDeadReasonHasItsBucketFromTheStart) {
  const Metrics metrics("x");
  const std::string text = metrics.render({});
  for (const char* reason : {"permanent", "attempts_exhausted", "max_age"}) {
    EXPECT_NE(text.find(std::string("keel_queue_dead_lettered_total{queue=\"x\",reason=\"") +
                        reason + "\"} 0"),
              std::string::npos)
        << reason << "\n"
        << text;
  }
}

TEST(JobsMetricsTest, DeadLettersAreCountedByTheirKind) {
  Metrics metrics("x");
  metrics.dead_lettered(DeadReason::kPermanent);
  metrics.dead_lettered(DeadReason::kAttemptsExhausted);
  metrics.dead_lettered(DeadReason::kAttemptsExhausted);
  metrics.dead_lettered(DeadReason::kMaxAge);
  metrics.dead_lettered(DeadReason::kMaxAge);
  metrics.dead_lettered(DeadReason::kMaxAge);
  const std::string text = metrics.render({});
  EXPECT_NE(text.find("keel_queue_dead_lettered_total{queue=\"x\",reason=\"permanent\"} 1"),
            std::string::npos)
      << text;
  EXPECT_NE(
      text.find("keel_queue_dead_lettered_total{queue=\"x\",reason=\"attempts_exhausted\"} 2"),
      std::string::npos)
      << text;
  EXPECT_NE(text.find("keel_queue_dead_lettered_total{queue=\"x\",reason=\"max_age\"} 3"),
            std::string::npos)
      << text;
}

}  // namespace
TEST(JobsMetricsTest, DeadlocksTheQueueSawAreACounter) {
  const Metrics metrics("x");
  EXPECT_NE(metrics.render({}).find("keel_queue_deadlocks_total{queue=\"x\"} 0"),
            std::string::npos);
  const std::string text = metrics.render({}, 2);
  EXPECT_NE(text.find("# TYPE keel_queue_deadlocks_total counter"), std::string::npos) << text;
  EXPECT_NE(text.find("keel_queue_deadlocks_total{queue=\"x\"} 2"), std::string::npos) << text;
}

TEST(JobsMetricsTest, JobsReturnedAfterACrashAreACounter) {
  const Metrics metrics("x");
  EXPECT_NE(metrics.render({}).find("keel_queue_returned_after_crash_total{queue=\"x\"} 0"),
            std::string::npos);
  const std::string text = metrics.render({}, 0, 7);
  EXPECT_NE(text.find("# TYPE keel_queue_returned_after_crash_total counter"), std::string::npos)
      << text;
  EXPECT_NE(text.find("keel_queue_returned_after_crash_total{queue=\"x\"} 7"), std::string::npos)
      << text;
}

namespace {

// The rate limits' series: slots, refusals, pauses by cause, cuts and the share's fallbacks per
// dependency, with at most kMaxRateLabels dependencies named (the rest summed as "other").
TEST(JobsMetricsTest, RateLimitsArePerDependencyWithBoundedLabels) {
  using namespace std::chrono_literals;
  Metrics metrics("x");
  RateLimitRegistry rates({.rate_per_s = 1000});
  keel::Rng rng(1);
  const TimePoint now{};
  for (std::size_t i = 0; i < Metrics::kMaxRateLabels + 10; ++i) {
    (void)rates.get("host" + std::to_string(i) + ":443")->reserve(now, 1s, rng);
  }
  const auto api = rates.get("host0:443");
  (void)api->pause(now, 120s);                     // its own Retry-After, cut to 60 s
  (void)api->pause(now, 70s, /*announce=*/false);  // the fleet's: longer than the first's cut
  (void)api->reserve(now, 1s, rng);                // refused: paused
  metrics.watch_rates(&rates, nullptr);
  const std::string text = metrics.render({});
  EXPECT_NE(
      text.find(R"(keel_rate_limit_pauses_total{cause="retry_after",dependency="host0:443"} 1)"),
      std::string::npos)
      << text;
  EXPECT_NE(text.find(R"(keel_rate_limit_pauses_cut_total{dependency="host0:443"} 1)"),
            std::string::npos);
  EXPECT_NE(text.find(R"(keel_rate_limit_refusals_total{dependency="host0:443"} 1)"),
            std::string::npos);
  EXPECT_NE(text.find(R"(keel_rate_limit_slots_total{dependency="other",wait="none"} 10)"),
            std::string::npos)
      << text;
  std::size_t named = 0;
  for (std::size_t at = 0;
       (at = text.find("keel_rate_limit_refusals_total{", at)) != std::string::npos; ++at) {
    ++named;
  }
  EXPECT_EQ(named, Metrics::kMaxRateLabels + 1);  // and "other"
}

}  // namespace

}  // namespace keel::cli::jobs_cli
