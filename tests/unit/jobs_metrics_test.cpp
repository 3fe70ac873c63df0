// `keel jobs work`'s metrics (tools/keel/jobs_metrics.cpp), checked in process: each dead-letter
// reason counted in its own bucket, by the reason's kind.
#include "jobs_metrics.hpp"

#include <gtest/gtest.h>

#include <string>

#include "keel/store/queue/queue.hpp"

namespace keel::cli::jobs_cli {
namespace {

using store::DeadReason;

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
}  // namespace keel::cli::jobs_cli
