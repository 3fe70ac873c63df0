// Admission control: retries are shed at max_concurrency, first attempts at max + queue_bound;
// Retry-After is full jitter from the injected generator; the attempt headers; the in-flight
// count under real threads (run under ThreadSanitizer by the tsan preset).
#include "keel/admission.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "keel/random.hpp"

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

TEST(AdmissionLimiter, AdaptiveLimitShrinksOnSlowRequestsAndGrowsBackWhenBusyAndFast) {
  keel::Rng rng(1);
  AdmissionLimiter limiter({.max_concurrency = 20,
                            .queue_bound = 2,
                            .latency_threshold = 100ms,
                            .min_concurrency = 2,
                            .backoff_ratio = 0.5});
  EXPECT_EQ(limiter.limit(), 20);
  // Slow answers halve the limit, down to min_concurrency.
  for (const std::int64_t expected : {10, 5, 2, 2}) {
    limiter.admit(1, rng).release(250ms);
    EXPECT_EQ(limiter.limit(), expected);
  }
  EXPECT_EQ(limiter.stats().limit, 2);
  // Retries are now shed at 2 in flight, first attempts at 2 + 2.
  Admission a = limiter.admit(1, rng);
  Admission b = limiter.admit(1, rng);
  EXPECT_EQ(limiter.admit(2, rng).reason(), ShedReason::kRetryOverLimit);
  Admission c = limiter.admit(1, rng);
  Admission d = limiter.admit(1, rng);
  EXPECT_TRUE(c);
  EXPECT_TRUE(d);
  EXPECT_EQ(limiter.admit(1, rng).reason(), ShedReason::kOverCapacity);
  // Fast answers while at least half the limit was in use add one each.
  a.release(10ms);  // admitted with 1 in flight: 1 * 2 >= 2
  EXPECT_EQ(limiter.limit(), 3);
  b.release(10ms);  // 2 in flight at its admission
  EXPECT_EQ(limiter.limit(), 4);
  c.release(10ms);
  d.release(10ms);
  EXPECT_EQ(limiter.limit(), 6);
  // A fast answer from an idle server does not grow the limit: nothing showed it was needed.
  limiter.admit(1, rng).release(10ms);  // 1 in flight, 1 * 2 < 6
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
