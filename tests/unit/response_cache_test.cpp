// keel::http::ResponseCache in virtual time (keel::ManualClock): what is stored, the age limit,
// the entry and byte bounds with least-recently-used eviction, the key, and concurrent use.
// Also keel call's head for a stale answer (tools/keel/call_fallback.hpp), in process: one
// keel call process cannot open a breaker, so the print path is checked here.
#include "keel/http/response_cache.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "call_fallback.hpp"
#include "keel/core/clock.hpp"

using namespace std::chrono_literals;
using keel::ManualClock;
using keel::http::Request;
using keel::http::Response;
using keel::http::ResponseCache;

namespace {

Request get(const std::string& url) { return Request{.url = url}; }

Response ok(std::string body, keel::http::Headers headers = {}) {
  return Response{.status = 200,
                  .status_line = "HTTP/1.1 200 OK",
                  .headers = std::move(headers),
                  .body = std::move(body)};
}

TEST(ResponseCache, ServesAStoredAnswerWithItsAgeUpToMaxAgeAndNeverOlder) {
  ManualClock clock;
  ResponseCache cache({.max_age = 10s});
  ASSERT_TRUE(cache.store(get("http://a/x"), ok("v1"), clock.now()));
  clock.advance(4s);
  auto hit = cache.lookup(get("http://a/x"), clock.now());
  ASSERT_TRUE(hit);
  EXPECT_EQ(hit->response.body, "v1");
  EXPECT_EQ(hit->age, 4s);
  clock.advance(6s);
  ASSERT_TRUE(cache.lookup(get("http://a/x"), clock.now())) << "exactly max_age old is served";
  clock.advance(1ns);
  EXPECT_FALSE(cache.lookup(get("http://a/x"), clock.now())) << "older than max_age: never";
  EXPECT_EQ(cache.size(), 0u) << "the expired entry is dropped";
  EXPECT_EQ(cache.bytes(), 0u);
}

TEST(ResponseCache, ANewerAnswerReplacesTheOlderAndRestartsItsAge) {
  ManualClock clock;
  ResponseCache cache({.max_age = 10s});
  ASSERT_TRUE(cache.store(get("http://a/x"), ok("v1"), clock.now()));
  clock.advance(8s);
  ASSERT_TRUE(cache.store(get("http://a/x"), ok("v2"), clock.now()));
  clock.advance(5s);
  auto hit = cache.lookup(get("http://a/x"), clock.now());
  ASSERT_TRUE(hit);
  EXPECT_EQ(hit->response.body, "v2");
  EXPECT_EQ(hit->age, 5s);
  EXPECT_EQ(cache.size(), 1u);
}

TEST(ResponseCache, StoresOnlyCacheableAnswersToGets) {
  ManualClock clock;
  ResponseCache cache;
  EXPECT_FALSE(cache.store(Request{.method = "POST", .url = "http://a/x"}, ok("v"), clock.now()));
  Response not_found = ok("no");
  not_found.status = 404;
  EXPECT_FALSE(cache.store(get("http://a/x"), not_found, clock.now()));
  EXPECT_FALSE(cache.store(get("http://a/x"), ok("v", {{"cache-control", "private, No-Store"}}),
                           clock.now()));
  EXPECT_FALSE(cache.store(get("http://a/x"), ok("v", {{"Vary", "*"}}), clock.now()));
  EXPECT_TRUE(
      cache.store(get("http://a/x"), ok("v", {{"Cache-Control", "max-age=0"}}), clock.now()))
      << "freshness headers are not read: the cache answers only while the host is down";
  EXPECT_FALSE(cache.lookup(Request{.method = "HEAD", .url = "http://a/x"}, clock.now()));
}

TEST(ResponseCache, TheKeyHoldsTheUrlAcceptAndAuthorization) {
  ManualClock clock;
  ResponseCache cache;
  Request alice = get("http://a/me");
  alice.headers = {{"Authorization", "Bearer alice"}};
  Request bob = get("http://a/me");
  bob.headers = {{"authorization", "Bearer bob"}};
  ASSERT_TRUE(cache.store(alice, ok("alice's"), clock.now()));
  EXPECT_FALSE(cache.lookup(bob, clock.now())) << "other credentials never share an answer";
  EXPECT_FALSE(cache.lookup(get("http://a/me"), clock.now()));
  Request json = alice;
  json.headers.emplace_back("Accept", "application/json");
  EXPECT_FALSE(cache.lookup(json, clock.now()));
  Request alice_again = get("http://a/me");
  alice_again.headers = {{"X-Trace", "1"}, {"AUTHORIZATION", "Bearer alice"}};
  ASSERT_TRUE(cache.lookup(alice_again, clock.now())) << "other header fields are not in the key";
  EXPECT_FALSE(cache.lookup(get("http://a/me?x=1"), clock.now()));
}

TEST(ResponseCache, TheEntryBoundEvictsTheLeastRecentlyUsed) {
  ManualClock clock;
  ResponseCache cache({.max_entries = 2});
  ASSERT_TRUE(cache.store(get("http://a/1"), ok("1"), clock.now()));
  ASSERT_TRUE(cache.store(get("http://a/2"), ok("2"), clock.now()));
  ASSERT_TRUE(cache.lookup(get("http://a/1"), clock.now()));  // 2 is now the least recent
  ASSERT_TRUE(cache.store(get("http://a/3"), ok("3"), clock.now()));
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_TRUE(cache.lookup(get("http://a/1"), clock.now()));
  EXPECT_FALSE(cache.lookup(get("http://a/2"), clock.now()));
  EXPECT_TRUE(cache.lookup(get("http://a/3"), clock.now()));
}

TEST(ResponseCache, TheByteBoundEvictsAndRefusesWhatCanNeverFit) {
  ManualClock clock;
  const std::size_t one = std::string("http://a/1").size() + 2 + 15 + 100;  // key, status, body
  ResponseCache cache({.max_bytes = 2 * one + 10});
  ASSERT_TRUE(cache.store(get("http://a/1"), ok(std::string(100, 'x')), clock.now()));
  ASSERT_TRUE(cache.store(get("http://a/2"), ok(std::string(100, 'y')), clock.now()));
  EXPECT_EQ(cache.bytes(), 2 * one);
  ASSERT_TRUE(cache.store(get("http://a/3"), ok(std::string(100, 'z')), clock.now()));
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_LE(cache.bytes(), cache.options().max_bytes);
  EXPECT_FALSE(cache.lookup(get("http://a/1"), clock.now())) << "the least recent went first";
  EXPECT_FALSE(cache.store(get("http://a/big"), ok(std::string(3 * one, 'b')), clock.now()));
  EXPECT_EQ(cache.size(), 2u) << "a response too large for the cache evicts nothing";
}

TEST(ResponseCache, RejectsInvalidOptionsNamingTheField) {
  EXPECT_THROW(ResponseCache({.max_entries = 0}), std::invalid_argument);
  EXPECT_THROW(ResponseCache({.max_bytes = 0}), std::invalid_argument);
  try {
    ResponseCache cache({.max_age = 0s});
    FAIL() << "max_age 0 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("max_age"), std::string::npos) << e.what();
  }
}

TEST(ResponseCache, ConcurrentStoresAndLookupsStayWithinTheBounds) {
  ManualClock clock;
  ResponseCache cache({.max_entries = 16, .max_bytes = 4096});
  std::atomic<int> hits{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        const std::string url = "http://a/" + std::to_string((i * 7 + t) % 40);
        if (i % 3 == 0) {
          (void)cache.store(get(url), ok(std::string(50, 'a')), clock.now());
        } else if (cache.lookup(get(url), clock.now())) {
          ++hits;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_LE(cache.size(), 16u);
  EXPECT_LE(cache.bytes(), 4096u);
  EXPECT_GT(hits.load(), 0);
}

TEST(KeelCallHead, AStaleAnswerCarriesAKeelStaleLineAfterItsHeaders) {
  keel::http::Result r;
  r.response = ok("body", {{"Content-Type", "text/plain"}});
  EXPECT_EQ(keel::cli::response_head(r), "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n");
  r.stale = true;
  r.stale_age = 1500ms;
  EXPECT_EQ(keel::cli::response_head(r),
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nKeel-Stale: age=1.5s\r\n\r\n");
  EXPECT_NE(keel::cli::stale_note(r).find("1.5s old"), std::string::npos);
  EXPECT_EQ(keel::cli::response_head(keel::http::Result{}), "");
}

}  // namespace
