// Rate limits shared through SharedBreakers on a real PostgreSQL server: each "process" here is a
// BreakerRegistry and a RateLimitRegistry with their own SharedBreakers (own connections, own
// background thread, own name). What the fleet must do: keep one schedule (4 processes calling
// as fast as they may send at most rate + burst in any second), with at most one lease per
// chunk; spread a pause any process
// learnt to every process within a second, and to one that starts later; fall back to an equal
// share of the rate when the database is unreachable, said once; read a row outside its domain
// (a schedule in the far future, a pause until 'infinity') within its bounds.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "build_kind.hpp"
#include "keel/core/breaker.hpp"
#include "keel/core/rate_limit.hpp"
#include "keel/db/database.hpp"
#include "keel/fleet/shared_breakers.hpp"
#include "support/test_support.hpp"
#include "support/waiting.hpp"

namespace keel::store {
namespace {

using namespace std::chrono_literals;

// One process of the fleet: its breakers, its rate limits and their sharing.
struct Member {
  Member(const DatabaseUrl& url, std::string name, RateLimitOptions rate,
         SharedBreakersOptions options = {})
      : rates(rate) {
    options.process = std::move(name);
    options.rate_limits = &rates;
    options.on_notice = [this](std::string_view m) {
      std::lock_guard lock(mu);
      notices.emplace_back(m);
    };
    shared = std::make_unique<SharedBreakers>(breakers, url, std::move(options));
  }
  [[nodiscard]] std::vector<std::string> heard() {
    std::lock_guard lock(mu);
    return notices;
  }
  // Declared first: the sharing's thread says its notices until `shared` is destroyed.
  std::mutex mu;
  std::vector<std::string> notices;  // guarded by mu
  BreakerRegistry breakers;
  RateLimitRegistry rates;
  std::unique_ptr<SharedBreakers> shared;
};

// The most times in any window of `width`.
int busiest(std::vector<TimePoint> times, Duration width) {
  std::sort(times.begin(), times.end());
  int most = 0;
  for (std::size_t lo = 0, hi = 0; hi < times.size(); ++hi) {
    while (times[hi] - times[lo] >= width) ++lo;
    most = std::max(most, static_cast<int>(hi - lo + 1));
  }
  return most;
}

class SharedRateLimitsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto url = test::postgres_url();
    if (!url) GTEST_SKIP() << "no PostgreSQL test server (run through ctest)";
    // Its own application_name: a test that cuts its connections cuts only its own, not those of
    // the tests running beside it on the same server.
    static std::atomic<int> next{0};
    app_ = "keel_rates_" + std::to_string(::getpid()) + "_" + std::to_string(next.fetch_add(1));
    url_ = parse_database_url(*url + "&application_name=" + app_).value();
  }
  std::unique_ptr<Member> member(std::string name, RateLimitOptions rate = {.rate_per_s = 50}) {
    auto m = std::make_unique<Member>(url_, std::move(name), rate);
    EXPECT_TRUE(m->shared->wait_until_sharing(10s))
        << "not sharing: " << (m->heard().empty() ? "" : m->heard().front());
    return m;
  }
  void exec(const std::string& sql) { open_database(url_)->execute(sql); }
  DatabaseUrl url_;
  std::string app_;
};

TEST_F(SharedRateLimitsTest, TheFleetKeepsOneScheduleAndNoCallWaitsOnTheDatabaseWhileChunksCome) {
  std::vector<std::unique_ptr<Member>> fleet;
  for (int i = 0; i < 4; ++i) fleet.push_back(member("p" + std::to_string(i)));
  std::mutex mu;
  std::vector<TimePoint> sent;
  std::vector<std::thread> callers;
  const auto end = std::chrono::steady_clock::now() + 3s;
  for (int i = 0; i < 4; ++i) {
    for (int t = 0; t < 2; ++t) {  // two callers per process, each as fast as it may
      callers.emplace_back([&, i] {
        Rng rng(static_cast<std::uint64_t>(i * 2 + 1));
        auto limit = fleet[static_cast<std::size_t>(i)]->rates.get("api:443");
        while (std::chrono::steady_clock::now() < end) {
          const RateDecision d = limit->reserve(steady_clock().now(), 5s, rng);
          if (!d.go) {
            std::this_thread::sleep_for(d.wait);
            continue;
          }
          std::this_thread::sleep_for(d.wait);
          std::lock_guard lock(mu);
          sent.push_back(steady_clock().now());
        }
      });
    }
  }
  for (auto& c : callers) c.join();
  // 3 s at 50/s, with the callers' last waits ending after the 3 s.
  EXPECT_GE(sent.size(), 120u);
  EXPECT_LE(sent.size(), 3u * 50 + 5 + 60);
  EXPECT_LE(busiest(sent, 1s), 50 + 5 + 2);  // rate + burst, two for the callers' own timing
  std::uint64_t chunks = 0;
  std::uint64_t waited = 0;
  std::uint64_t full = 0;
  for (const auto& m : fleet) {
    chunks += m->shared->stats().chunks_leased;
    waited += m->shared->stats().leases_waited;
    full += m->shared->stats().leases_full;
  }
  EXPECT_GE(chunks, sent.size() / 5);  // chunks of at most 5 slots
  // Two callers a process spend about 12 slots a second each: chunks of a slot or two, leased
  // when needed (a chunk leased ahead by so slow a process would pass unused). A call waits at
  // most once per answer (a chunk, or the schedule's room), never in a loop; one answer may end
  // the waits of both of its process's callers, when both ran out of slots together.
  EXPECT_LE(waited, 4u + 2u * (chunks + full))
      << "a call waited on the database more than once an answer";
  std::printf(
      "shared schedule: %zu calls in 3 s from 4 processes, busiest second %d, %llu chunks "
      "leased, %llu asked by a call without a slot\n",
      sent.size(), busiest(sent, 1s), static_cast<unsigned long long>(chunks),
      static_cast<unsigned long long>(waited));
  const auto conn = open_database(url_);
  EXPECT_EQ(conn->query("SELECT leases FROM keel_rate_limits WHERE key = 'api:443'").integer(0, 0),
            static_cast<std::int64_t>(chunks));
}

TEST_F(SharedRateLimitsTest, APauseAnyProcessLearntHoldsEveryProcessWithinASecond) {
  auto a = member("a");
  auto b = member("b");
  auto c = member("c");
  (void)b->rates.get("api:443");  // b knows the key; c learns it from the fleet
  const auto paused = std::chrono::steady_clock::now();
  ASSERT_TRUE(a->rates.get("api:443")->pause(steady_clock().now(), 5s));
  ASSERT_TRUE(test::wait_until(
      [&] {
        const auto bl = b->rates.find("api:443");
        const auto cl = c->rates.find("api:443");
        return bl && cl && bl->paused_until() > steady_clock().now() &&
               cl->paused_until() > steady_clock().now();
      },
      10s));
  if (test::kTimingAsserted) {
    EXPECT_LT(std::chrono::steady_clock::now() - paused, 1s);
  }
  const TimePoint until = c->rates.find("api:443")->paused_until();
  EXPECT_GT(until - steady_clock().now(), 3s);
  EXPECT_LE(until - steady_clock().now(), 5s);
  Rng rng(1);
  EXPECT_FALSE(c->rates.get("api:443")->reserve(steady_clock().now(), 1s, rng).go);
  // A process that starts during the pause reads it.
  auto late = member("late");
  EXPECT_GT(late->rates.get("api:443")->paused_until(), steady_clock().now() + 2s);
  EXPECT_EQ(a->shared->stats().pauses_published, 1u);
  EXPECT_GE(c->shared->stats().pauses_applied, 1u);
}

TEST_F(SharedRateLimitsTest, WithoutTheDatabaseEachProcessKeepsAnEqualShareAndSaysSoOnce) {
  std::atomic<bool> refuse{false};
  SharedBreakersOptions options;
  options.open = [&](const DatabaseUrl& url, const ConnectOptions& connect) {
    if (refuse.load()) throw std::runtime_error("refused by the test");
    return open_database(url, connect);
  };
  auto p0 = std::make_unique<Member>(url_, "p0", RateLimitOptions{.rate_per_s = 50}, options);
  ASSERT_TRUE(p0->shared->wait_until_sharing(10s));
  std::vector<std::unique_ptr<Member>> others;
  for (int i = 1; i < 4; ++i) others.push_back(member("p" + std::to_string(i)));
  ASSERT_TRUE(test::wait_until([&] { return p0->shared->stats().fleet_size == 4; }, 10s));
  // p0 loses its connections and cannot open one again.
  refuse = true;
  exec(
      "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
      " WHERE application_name = '" +
      app_ + "' AND pid <> pg_backend_pid()");
  ASSERT_TRUE(test::wait_until([&] { return !p0->shared->stats().sharing; }, 10s));
  std::this_thread::sleep_for(500ms);  // a few reconnections, refused
  const auto heard = p0->heard();
  const auto unreachable = std::count_if(heard.begin(), heard.end(), [](const std::string& n) {
    return n.find("unreachable") != std::string::npos;
  });
  EXPECT_EQ(unreachable, 1);
  const auto said = std::find_if(heard.begin(), heard.end(), [](const std::string& n) {
    return n.find("unreachable") != std::string::npos;
  });
  ASSERT_NE(said, heard.end());
  EXPECT_NE(said->find("1/4 of each shared rate limit"), std::string::npos) << *said;
  // A quarter of 50/s: after the burst, one slot every 80 ms.
  Rng rng(1);
  auto limit = p0->rates.get("api:443");
  const TimePoint now = steady_clock().now();
  Duration last{};
  for (int i = 0; i < 20; ++i) {
    const RateDecision d = limit->reserve(now, 10s, rng);
    ASSERT_TRUE(d.go);
    last = d.wait;
  }
  EXPECT_GE(last, 1300ms);  // 18 slots after the burst of 2, 80 ms apart
  EXPECT_LE(last, 1600ms);  // not 1/8 or less
  EXPECT_EQ(limit->stats().chunks, 0u);
}

// Another session holds the schedule's row (what a process sees when the others lease on and its
// own round trip is slow): the calls are told to come back, never on the share at once, whose
// slots would come on top of the ones the others spend; held through several leases (a lock
// held, not contended), they go on the share and it is said; released, the chunks come back.
TEST_F(SharedRateLimitsTest, ABusyScheduleKeepsTheCallsWaitingAndOnlyARowHeldLongGoesOnTheShare) {
  auto p0 = member("p0");
  Rng rng(1);
  auto limit = p0->rates.get("api:443");
  ASSERT_TRUE(limit->reserve(steady_clock().now(), 5s, rng).go);  // the row exists
  auto holder = open_database(url_);
  holder->execute("BEGIN");
  (void)holder->query("SELECT key FROM keel_rate_limits FOR UPDATE");
  // The slots leased before the row was taken: spent.
  RateDecision d = limit->reserve(steady_clock().now(), 5s, rng);
  while (d.go) {
    std::this_thread::sleep_for(d.wait);
    d = limit->reserve(steady_clock().now(), 5s, rng);
  }
  ASSERT_EQ(limit->stats().on_share, 0u);
  const TimePoint taken = steady_clock().now();
  // Then a caller as the HTTP clients' gate is: it waits when told to, and asks again.
  while (!d.go && steady_clock().now() < taken + 20s) {
    // Never an answer to come back at once (a spin). It may be short: the end of a full
    // window set by the last busy answer, whose backoff is drawn from zero up.
    EXPECT_GT(d.wait, Duration::zero());
    std::this_thread::sleep_for(d.wait);
    d = limit->reserve(steady_clock().now(), 5s, rng);
  }
  ASSERT_TRUE(d.go) << "a row held for 20 s: still nothing on the share";
  const Duration waited = steady_clock().now() - taken;
  EXPECT_EQ(limit->stats().on_share, 1u) << "the first call that went, went on the share";
  EXPECT_GE(limit->stats().fleet_busy, 1u);
  // Four leases at least, each waiting round_trip_limit (250 ms) for the row: not the share after
  // the first.
  std::printf("a held row: the first call went on the share after %.2f s, %llu leases busy\n",
              std::chrono::duration<double>(waited).count(),
              static_cast<unsigned long long>(limit->stats().fleet_busy));
  EXPECT_GE(waited, 900ms) << "the share came after one busy lease";
  const auto said = [&](std::string_view what) {
    const auto heard = p0->heard();
    return std::count_if(heard.begin(), heard.end(),
                         [&](const std::string& n) { return n.find(what) != std::string::npos; });
  };
  EXPECT_TRUE(test::wait_until([&] { return said("cannot be leased") == 1; }, 10s));
  // Once per cause: a lock timeout (55P03) or the statement's (57014), whichever ran out first.
  EXPECT_GE(said("the fleet's schedule is busy"), 1);
  EXPECT_LE(said("the fleet's schedule is busy"), 2);
  // The row released: the calls spend the fleet's chunks again.
  holder->execute("ROLLBACK");
  const std::uint64_t chunks = limit->stats().chunks;
  EXPECT_TRUE(test::wait_until(
      [&] {
        (void)limit->reserve(steady_clock().now(), 5s, rng);
        return limit->stats().chunks > chunks;
      },
      20s));
}

TEST_F(SharedRateLimitsTest, RowsOutsideTheirDomainAreReadWithinTheirBounds) {
  { auto first = member("first"); }  // the table exists
  exec(
      "INSERT INTO keel_rate_limits (key, next_slot, paused_until) "
      "VALUES ('api:443', 'infinity', 'infinity')");
  auto m = member("m");
  const auto limit = m->rates.get("api:443");
  // The pause is obeyed as at most max_pause (60 s), not forever.
  EXPECT_LE(limit->paused_until(), steady_clock().now() + 61s);
  EXPECT_GT(limit->paused_until(), steady_clock().now() + 50s);
  // The schedule 'infinity' is read as now, and rewritten: the fleet can lease again.
  exec("UPDATE keel_rate_limits SET paused_until = NULL");
  limit->pause(steady_clock().now(), 0ms, false);
  auto other = member("other");
  auto fresh = other->rates.get("api:443");
  Rng rng(1);
  const RateDecision d = fresh->reserve(steady_clock().now(), 2s, rng);
  EXPECT_TRUE(d.go);
  EXPECT_GE(other->shared->stats().chunks_leased, 1u);
  const auto heard = other->heard();
  EXPECT_TRUE(std::any_of(heard.begin(), heard.end(), [](const std::string& n) {
    return n.find("keel_rate_limits row 'api:443': next_slot 'infinity'") != std::string::npos;
  })) << (heard.empty() ? "" : heard.front());
  const auto m_heard = m->heard();
  EXPECT_TRUE(std::any_of(m_heard.begin(), m_heard.end(), [](const std::string& n) {
    return n.find("paused_until 'infinity'") != std::string::npos;
  })) << (m_heard.empty() ? "" : m_heard.front());
}

}  // namespace
}  // namespace keel::store
