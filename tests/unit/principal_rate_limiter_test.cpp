#include "keel/core/principal_rate_limiter.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using keel::Duration;
using namespace std::chrono_literals;

TEST(PrincipalRateLimiter, EachPrincipalGetsTheRateAndItsWaitIsTheTimeToTheNextToken) {
  keel::ManualClock clock;
  keel::PrincipalRateLimiter limiter(2.0, 100, clock);
  // A new principal is admitted through the shared bucket, then spends its own burst of 2.
  EXPECT_EQ(limiter.admit("p:a"), Duration::zero());
  EXPECT_EQ(limiter.admit("p:a"), Duration::zero());
  const Duration wait = limiter.admit("p:a");
  EXPECT_GT(wait, 400ms);
  EXPECT_LE(wait, 500ms);
  clock.advance(wait);
  EXPECT_EQ(limiter.admit("p:a"), Duration::zero()) << "a token after the wait it was told";
  EXPECT_EQ(limiter.size(), 1u);
}

TEST(PrincipalRateLimiter, RotatingCredentialsAndAnonymousCallersShareOneBucket) {
  keel::ManualClock clock;
  keel::PrincipalRateLimiter limiter(10.0, 1000, clock);
  // 100 new principals in the same instant: only the shared bucket's 10 get in.
  int admitted = 0;
  for (int i = 0; i < 100; ++i) {
    if (limiter.admit("p:" + std::to_string(i)) == Duration::zero()) ++admitted;
  }
  EXPECT_EQ(admitted, 10);
  // The anonymous caller (the empty scope) draws from that same, now empty, bucket and never
  // gets a bucket of its own.
  EXPECT_GT(limiter.admit(""), Duration::zero());
  EXPECT_EQ(limiter.size(), 10u);
}

TEST(PrincipalRateLimiter, TheTableIsBoundedAndEvictsTheLeastRecentlyUsed) {
  keel::ManualClock clock;
  keel::PrincipalRateLimiter limiter(1000.0, 3, clock);
  for (const char* p : {"p:a", "p:b", "p:c"}) ASSERT_EQ(limiter.admit(p), Duration::zero());
  ASSERT_EQ(limiter.admit("p:a"), Duration::zero());  // a is now the most recent
  ASSERT_EQ(limiter.admit("p:d"), Duration::zero());  // evicts b
  EXPECT_EQ(limiter.size(), 3u);
}

TEST(PrincipalRateLimiter, InvalidOptionsNameTheField) {
  EXPECT_THROW(keel::PrincipalRateLimiter(0.0, 1), std::invalid_argument);
  EXPECT_THROW(keel::PrincipalRateLimiter(std::numeric_limits<double>::infinity(), 1),
               std::invalid_argument);
  try {
    keel::PrincipalRateLimiter(1.0, 0);
    ADD_FAILURE();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("capacity"), std::string::npos) << e.what();
  }
}

TEST(PrincipalRateLimiter, ConcurrentCallersNeverGetMoreThanTheBucket) {
  keel::ManualClock clock;  // time stands still: exactly the burst is admitted
  keel::PrincipalRateLimiter limiter(50.0, 8, clock);
  std::atomic<int> admitted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        if (limiter.admit(i % 2 == 0 ? "p:shared" : "p:t" + std::to_string(t)) ==
            Duration::zero()) {
          admitted.fetch_add(1);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  // The shared bucket's 50 let principals in (each then has its own 49 more), never more.
  EXPECT_LE(admitted.load(), 50 + 5 * 49);
  EXPECT_LE(limiter.size(), 5u);
}

}  // namespace
