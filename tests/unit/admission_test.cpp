// Admission control: retries are shed at max_concurrency, first attempts at max + queue_bound;
// Retry-After is full jitter from the injected generator; the attempt headers; the in-flight
// count under real threads (run under ThreadSanitizer by the tsan preset).
#include "keel/core/admission.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "keel/core/random.hpp"

namespace {

using namespace std::chrono_literals;
using keel::Admission;
using keel::AdmissionLimiter;
using keel::AdmissionOptions;
using keel::ShedReason;

TEST(AdmissionLimiter, ShedsRetriesAtTheLimitAndFirstAttemptsAtTheQueueBound) {
  keel::Rng rng(1);
  AdmissionLimiter limiter({.max_concurrency = 2, .queue_bound = 1});
  Admission a = limiter.admit(1, rng);
  Admission b = limiter.admit(2, rng);  // a retry below the limit is admitted
  ASSERT_TRUE(a);
  ASSERT_TRUE(b);
  EXPECT_EQ(limiter.in_flight(), 2);

  Admission retry = limiter.admit(2, rng);  // at the limit: the retry is shed
  EXPECT_FALSE(retry);
  EXPECT_EQ(retry.reason(), ShedReason::kRetryOverLimit);
  Admission first = limiter.admit(1, rng);  // a first attempt takes the queue slot
  EXPECT_TRUE(first);
  Admission second = limiter.admit(1, rng);  // the queue is full: shed too
  EXPECT_FALSE(second);
  EXPECT_EQ(second.reason(), ShedReason::kOverCapacity);
  EXPECT_EQ(limiter.in_flight(), 3);

  first.release();
  b.release();
  b.release();  // idempotent
  EXPECT_EQ(limiter.in_flight(), 1);
  EXPECT_TRUE(limiter.admit(5, rng));  // admitted, and released at once by the temporary
  EXPECT_EQ(limiter.in_flight(), 1);

  const keel::AdmissionStats s = limiter.stats();
  EXPECT_EQ(s.admitted_first, 2u);
  EXPECT_EQ(s.admitted_retry, 2u);
  EXPECT_EQ(s.shed[static_cast<int>(ShedReason::kRetryOverLimit)], 1u);
  EXPECT_EQ(s.shed[static_cast<int>(ShedReason::kOverCapacity)], 1u);
  EXPECT_EQ(s.shed[static_cast<int>(ShedReason::kNone)], 0u);
}

TEST(AdmissionLimiter, QueueBoundZeroIsOneLimitForAll) {
  keel::Rng rng(1);
  AdmissionLimiter limiter({.max_concurrency = 1, .queue_bound = 0});
  Admission a = limiter.admit(1, rng);
  ASSERT_TRUE(a);
  EXPECT_EQ(limiter.admit(1, rng).reason(), ShedReason::kOverCapacity);
  EXPECT_EQ(limiter.admit(3, rng).reason(), ShedReason::kRetryOverLimit);
}

TEST(AdmissionLimiter, AttemptsBelowOneCountAsFirstAttempts) {
  keel::Rng rng(1);
  AdmissionLimiter limiter({.max_concurrency = 1, .queue_bound = 1});
  Admission a = limiter.admit(1, rng);
  EXPECT_TRUE(limiter.admit(0, rng));
  EXPECT_TRUE(limiter.admit(-7, rng));
}

TEST(AdmissionLimiter, MovingAnAdmissionMovesItsSlot) {
  keel::Rng rng(1);
  AdmissionLimiter limiter({.max_concurrency = 4, .queue_bound = 0});
  Admission a = limiter.admit(1, rng);
  Admission b = std::move(a);
  EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
  EXPECT_TRUE(b);
  EXPECT_EQ(limiter.in_flight(), 1);
  Admission c = limiter.admit(1, rng);
  c = std::move(b);  // c's own slot is released, b's moves in
  EXPECT_EQ(limiter.in_flight(), 1);
  c.release();
  EXPECT_EQ(limiter.in_flight(), 0);
}

TEST(AdmissionLimiter, RetryAfterIsFullJitterFromTheInjectedGenerator) {
  AdmissionLimiter limiter({.max_concurrency = 1, .queue_bound = 0, .retry_after_max = 10s});
  keel::Rng hold_rng(7);
  Admission hold = limiter.admit(1, hold_rng);
  // The same seed gives the same delays: uniform01(gen) * 10 s.
  keel::Rng rng(42);
  keel::Rng replay(42);
  for (int i = 0; i < 5; ++i) {
    const Admission shed = limiter.admit(2, rng);
    ASSERT_FALSE(shed);
    const auto expected = keel::saturating_scale(keel::Duration(10s), keel::uniform01(replay));
    EXPECT_EQ(shed.retry_after(), expected);
  }
  // Statistically uniform on [0, 10 s): mean about 5 s, every decile used.
  constexpr int kDraws = 20000;
  int deciles[10] = {};
  double sum = 0;
  for (int i = 0; i < kDraws; ++i) {
    const auto d = limiter.admit(2, rng).retry_after();
    ASSERT_GE(d, keel::Duration::zero());
    ASSERT_LT(d, keel::Duration(10s));
    const double s = std::chrono::duration<double>(d).count();
    sum += s;
    ++deciles[std::min(9, static_cast<int>(s))];
  }
  EXPECT_NEAR(sum / kDraws, 5.0, 0.1);
  for (const int n : deciles) EXPECT_NEAR(n, kDraws / 10, kDraws / 10 * 0.1);
}

TEST(AdmissionLimiter, RejectsInvalidOptionsNamingTheField) {
  EXPECT_THROW(AdmissionLimiter({.max_concurrency = 0}), std::invalid_argument);
  EXPECT_THROW(AdmissionLimiter({.queue_bound = -1}), std::invalid_argument);
  EXPECT_THROW(AdmissionLimiter({.retry_after_max = 0s}), std::invalid_argument);
  try {
    AdmissionLimiter limiter({.max_concurrency = -3});
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("max_concurrency must be >= 1 (got -3)"),
              std::string::npos)
        << e.what();
  }
}

TEST(AdmissionLimiter, NeverAdmitsMoreThanTheLimitsUnderRealThreads) {
  // Threads hammer admit/release; each checks the in-flight count it sees while it holds a slot.
  AdmissionLimiter limiter({.max_concurrency = 3, .queue_bound = 2});
  std::atomic<int> held_first{0};
  std::atomic<int> held_retry{0};
  std::atomic<bool> over{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      keel::Rng rng(static_cast<std::uint64_t>(t) + 1);
      for (int i = 0; i < 20000; ++i) {
        const bool retry = (i + t) % 2 == 0;
        Admission a = limiter.admit(retry ? 2 : 1, rng);
        if (!a) continue;
        auto& held = retry ? held_retry : held_first;
        const int total = held.fetch_add(1) + 1 + (retry ? held_first : held_retry).load();
        if (total > 5) over = true;
        held.fetch_sub(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_FALSE(over.load());
  EXPECT_EQ(limiter.in_flight(), 0);
  const keel::AdmissionStats s = limiter.stats();
  EXPECT_EQ(s.admitted_first + s.admitted_retry + s.shed[1] + s.shed[2], 8u * 20000u);
}

TEST(AdmissionLimiter, RetriesAreNeverAdmittedPastTheLimitUnderRealThreads) {
  // Four threads hold first-attempt slots up to the limit; retries racing them never get in
  // while max_concurrency slots are taken.
  AdmissionLimiter limiter({.max_concurrency = 4, .queue_bound = 4});
  keel::Rng rng(3);
  std::vector<Admission> held;
  for (int i = 0; i < 4; ++i) held.push_back(limiter.admit(1, rng));
  std::atomic<int> admitted_retries{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      keel::Rng r(static_cast<std::uint64_t>(t) + 10);
      for (int i = 0; i < 5000; ++i) {
        if (limiter.admit(2, r)) ++admitted_retries;
        Admission first = limiter.admit(1, r);  // first attempts may take the queue slots
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(admitted_retries.load(), 0);
  EXPECT_EQ(limiter.in_flight(), 4);
}

TEST(AdmissionLimiter, TheFirstAttemptsQueueShrinksWithAnAdaptiveLimit) {
  // At every limit an AIMD limiter of max 64 and a queue of 16 may be cut to, first attempts are
  // admitted up to the limit + 16 x limit / 64 (at least 1), retries up to the limit.
  keel::Rng rng(3);
  AdmissionLimiter limiter({.max_concurrency = 64,
                            .queue_bound = 16,
                            .latency_threshold = 100ms,
                            .min_concurrency = 1,
                            .backoff_ratio = 0.5});
  for (const std::int64_t limit : {64, 32, 16, 8, 4, 2, 1}) {
    ASSERT_EQ(limiter.limit(), limit);
    const std::int64_t queue = std::max<std::int64_t>(1, 16 * limit / 64);
    std::vector<Admission> held;
    for (std::int64_t i = 0; i < limit; ++i) held.push_back(limiter.admit(2, rng));
    EXPECT_TRUE(held.back()) << limit;
    EXPECT_EQ(limiter.admit(2, rng).reason(), ShedReason::kRetryOverLimit) << limit;
    for (std::int64_t i = 0; i < queue; ++i) held.push_back(limiter.admit(1, rng));
    EXPECT_TRUE(held.back()) << limit;
    EXPECT_EQ(limiter.admit(1, rng).reason(), ShedReason::kOverCapacity) << limit;
    // The last one admitted found the limit full: its slow answer halves the limit.
    held.back().release(300ms);
    for (auto& h : held) h.release();
  }
  // A fixed limit keeps its whole queue.
  AdmissionLimiter fixed({.max_concurrency = 4, .queue_bound = 16});
  std::vector<Admission> held;
  for (int i = 0; i < 20; ++i) held.push_back(fixed.admit(1, rng));
  EXPECT_TRUE(held.back());
  EXPECT_EQ(fixed.admit(1, rng).reason(), ShedReason::kOverCapacity);
}

TEST(AdmissionLimiter, SlowAnswersBelowTheLimitNeverCutIt) {
  // A dependency that is slow but keeps up (every answer over the threshold, never the limit in
  // flight): the limit stays where it is at every load below it, and nothing is shed.
  for (const std::int64_t in_flight : {1, 2, 5, 10, 15}) {
    keel::Rng rng(static_cast<std::uint64_t>(in_flight));
    AdmissionLimiter limiter({.max_concurrency = 16,
                              .queue_bound = 4,
                              .latency_threshold = 100ms,
                              .min_concurrency = 1,
                              .backoff_ratio = 0.5});
    std::vector<Admission> held;
    for (std::int64_t i = 1; i < in_flight; ++i) held.push_back(limiter.admit(1, rng));
    for (int i = 0; i < 1000; ++i) {
      Admission a = limiter.admit(i % 3 == 0 ? 2 : 1, rng);
      ASSERT_TRUE(a) << "shed at " << in_flight << " in flight";
      a.release(300ms);
    }
    EXPECT_EQ(limiter.limit(), 16) << in_flight << " in flight";
    // The same slow answer of the request that fills the limit is a queue: it cuts.
    while (limiter.in_flight() + 1 < limiter.limit()) held.push_back(limiter.admit(1, rng));
    limiter.admit(1, rng).release(300ms);
    EXPECT_EQ(limiter.limit(), 8) << in_flight << " in flight";
  }
}

TEST(AdmissionLimiter, AdaptiveLimitShrinksOnSlowRequestsAndGrowsBackWhenBusyAndFast) {
  keel::Rng rng(1);
  AdmissionLimiter limiter({.max_concurrency = 20,
                            .queue_bound = 2,
                            .latency_threshold = 100ms,
                            .min_concurrency = 2,
                            .backoff_ratio = 0.5});
  EXPECT_EQ(limiter.limit(), 20);
  // Slow answers of requests that found the limit full halve it, down to min_concurrency.
  for (const std::int64_t expected : {10, 5, 2, 2}) {
    std::vector<Admission> held;
    while (limiter.in_flight() + 1 < limiter.limit()) held.push_back(limiter.admit(1, rng));
    limiter.admit(1, rng).release(250ms);  // admitted as the limit-th in flight
    EXPECT_EQ(limiter.limit(), expected);
    for (auto& h : held) h.release();
  }
  EXPECT_EQ(limiter.stats().limit, 2);
  // Retries are now shed at 2 in flight, first attempts at 2 + 1: the queue of 2 at the limit's
  // highest (20) shrinks with it (2 x 2 / 20, at least 1).
  Admission a = limiter.admit(1, rng);
  Admission b = limiter.admit(1, rng);
  EXPECT_EQ(limiter.admit(2, rng).reason(), ShedReason::kRetryOverLimit);
  Admission c = limiter.admit(1, rng);
  EXPECT_TRUE(c);
  EXPECT_EQ(limiter.admit(1, rng).reason(), ShedReason::kOverCapacity);
  // A limit's worth of fast answers, each while at least half the limit was in use, adds one.
  a.release(10ms);  // admitted with 1 in flight: 1 * 2 >= 2, a credit of 1
  EXPECT_EQ(limiter.limit(), 2);
  b.release(10ms);  // 2 in flight at its admission: 2 credits, the limit's worth
  EXPECT_EQ(limiter.limit(), 3);
  c.release(10ms);  // 3 in flight at its admission: 1 credit of the 3 the next one needs
  EXPECT_EQ(limiter.limit(), 3);
  for (const std::int64_t limit : {3, 4, 5}) {
    std::vector<Admission> busy;  // each answer below is admitted as the limit-th in flight
    for (std::int64_t i = 1; i < limit; ++i) busy.push_back(limiter.admit(1, rng));
    int answers = 0;
    while (limiter.limit() == limit && answers < 100) {
      limiter.admit(1, rng).release(10ms);
      ++answers;
    }
    EXPECT_EQ(limiter.limit(), limit + 1);
    EXPECT_EQ(answers, limit == 3 ? 2 : limit);  // c's credit counted at 3
    for (auto& h : busy) h.release();
  }
  // Fast answers from an idle server do not grow the limit: nothing showed it was needed.
  for (int i = 0; i < 100; ++i) limiter.admit(1, rng).release(10ms);  // 1 * 2 < 6
  EXPECT_EQ(limiter.limit(), 6);
  // Only the first release counts; a plain release() reports nothing.
  Admission e = limiter.admit(1, rng);
  e.release();
  e.release(1s);
  EXPECT_EQ(limiter.limit(), 6);
}

TEST(AdmissionLimiter, AdaptiveLimitNeverLeavesItsBoundsUnderRealThreads) {
  AdmissionLimiter limiter({.max_concurrency = 16,
                            .queue_bound = 0,
                            .latency_threshold = 100ms,
                            .min_concurrency = 2,
                            .backoff_ratio = 0.9});
  std::atomic<bool> out_of_bounds{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      keel::Rng rng(static_cast<std::uint64_t>(t) + 1);
      for (int i = 0; i < 20000; ++i) {
        Admission a = limiter.admit(1, rng);
        const std::int64_t l = limiter.limit();
        if (l < 2 || l > 16) out_of_bounds = true;
        if (a) a.release((i + t) % 3 == 0 ? 200ms : 10ms);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_FALSE(out_of_bounds.load());
  EXPECT_EQ(limiter.in_flight(), 0);
}

TEST(AdmissionLimiter, AFixedLimitIgnoresLatencies) {
  keel::Rng rng(1);
  AdmissionLimiter limiter({.max_concurrency = 8});
  limiter.admit(1, rng).release(1h);
  EXPECT_EQ(limiter.limit(), 8);
  EXPECT_THROW(AdmissionLimiter({.max_concurrency = 4, .min_concurrency = 5}),
               std::invalid_argument);
  EXPECT_THROW(AdmissionLimiter({.backoff_ratio = 1.0}), std::invalid_argument);
  EXPECT_THROW(AdmissionLimiter({.latency_threshold = -1ms}), std::invalid_argument);
}

TEST(AdmissionLimiter, AdaptiveSettingsWithoutALatencyThresholdAreRefused) {
  for (const AdmissionOptions& options :
       {AdmissionOptions{.min_concurrency = 2}, AdmissionOptions{.backoff_ratio = 0.5}}) {
    try {
      AdmissionLimiter limiter(options);
      ADD_FAILURE() << "accepted";
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(options.min_concurrency != 1 ? "min_concurrency" : "backoff_ratio"),
                std::string::npos)
          << what;
      EXPECT_NE(what.find("latency_threshold"), std::string::npos) << what;
    }
  }
  // With the threshold they are the adaptive limit's settings.
  EXPECT_NO_THROW(
      AdmissionLimiter({.latency_threshold = 100ms, .min_concurrency = 2, .backoff_ratio = 0.5}));
}

TEST(AttemptNumber, ReadsEachHeader) {
  EXPECT_EQ(keel::attempt_number({}), 1);
  EXPECT_EQ(keel::attempt_number({.keel_attempt = "3"}), 3);
  EXPECT_EQ(keel::attempt_number({.envoy_attempt_count = " 2 "}), 2);
  EXPECT_EQ(keel::attempt_number({.grpc_previous_rpc_attempts = "0"}), 1);
  EXPECT_EQ(keel::attempt_number({.grpc_previous_rpc_attempts = "2"}), 3);
}

TEST(AttemptNumber, TakesTheLargestValidValue) {
  EXPECT_EQ(keel::attempt_number({.keel_attempt = "1", .envoy_attempt_count = "4"}), 4);
  EXPECT_EQ(keel::attempt_number({.keel_attempt = "2", .grpc_previous_rpc_attempts = "4"}), 5);
  EXPECT_EQ(keel::attempt_number({.keel_attempt = "junk", .envoy_attempt_count = "2"}), 2);
}

TEST(AttemptNumber, IgnoresInvalidValuesAndClampsHugeOnes) {
  for (const char* bad : {"", " ", "-2", "+2", "2x", "0x10", "1.5", "two"}) {
    EXPECT_EQ(keel::attempt_number({.keel_attempt = bad}), 1) << bad;
  }
  EXPECT_EQ(keel::attempt_number({.keel_attempt = "0"}), 1);
  EXPECT_EQ(keel::attempt_number({.keel_attempt = "99999999999999999999999"}), 1000000);
  EXPECT_EQ(keel::attempt_number({.grpc_previous_rpc_attempts = "999999999999"}), 1000000);
}

}  // namespace
