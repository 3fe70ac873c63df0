// SharedBreakers on a real PostgreSQL server: each "process" here is a BreakerRegistry with its
// own SharedBreakers (its own two connections and background thread) under its own name, so
// that the fleet's rules can be driven call by call: one opens, all open; one probe per break;
// the probe's result closes or re-opens everyone; a dead prober's lease is taken over; a process
// that starts later reads the table; an unreachable database means per-process breakers, said
// once. The drill with real processes is in fleet_drill_test.cpp.
#include "keel/store/fleet/shared_breakers.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "build_kind.hpp"
#include "keel/breaker.hpp"
#include "keel/store/db/database.hpp"
#include "test_support.hpp"
#include "waiting.hpp"

namespace keel::store {
namespace {

using namespace std::chrono_literals;

constexpr Outcome kF = Outcome::transient();
constexpr Outcome kS = Outcome::success();

BreakerRegistryOptions fleet_breaker(Duration break_for) {
  BreakerRegistryOptions o;
  o.breaker.window = BreakerWindow::kCount;
  o.breaker.window_calls = 2;
  o.breaker.minimum_calls = 2;
  o.breaker.break_duration = break_for;
  return o;
}

// One process of the fleet.
struct Member {
  Member(const DatabaseUrl& url, std::string name, Duration break_for,
         SharedBreakersOptions options = {})
      : registry(fleet_breaker(break_for)) {
    options.process = std::move(name);
    if (options.release_spread == 1s) options.release_spread = 0ms;
    options.on_notice = [this](std::string_view m) {
      std::lock_guard lock(mu);
      notices.emplace_back(m);
    };
    shared = std::make_unique<SharedBreakers>(registry, url, std::move(options));
  }
  [[nodiscard]] std::vector<std::string> heard() {
    std::lock_guard lock(mu);
    return notices;
  }
  // Two failures: the local breaker trips.
  void trip(const std::string& key) {
    auto b = registry.get(key);
    for (int i = 0; i < 2; ++i) {
      const auto p = b->try_acquire();
      ASSERT_TRUE(p);
      b->record(p, kF);
    }
    ASSERT_EQ(b->state(), BreakerState::kOpen);
  }
  [[nodiscard]] BreakerState state(const std::string& key) { return registry.get(key)->state(); }

  BreakerRegistry registry;
  std::mutex mu;
  std::vector<std::string> notices;  // guarded by mu
  std::unique_ptr<SharedBreakers> shared;
};

// Whether every member's breaker for `key` is in `state`.
bool all_in(const std::vector<std::unique_ptr<Member>>& fleet, const std::string& key,
            BreakerState state) {
  for (const auto& m : fleet) {
    if (m->registry.state(key) != state) return false;
  }
  return true;
}

class SharedBreakersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto url = test::postgres_url();
    if (!url) GTEST_SKIP() << "no PostgreSQL test server (run through ctest)";
    url_ = parse_database_url(*url).value();
  }
  [[nodiscard]] std::unique_ptr<Member> member(std::string name, Duration break_for,
                                               SharedBreakersOptions options = {}) {
    auto m = std::make_unique<Member>(url_, std::move(name), break_for, std::move(options));
    EXPECT_TRUE(m->shared->wait_until_sharing(10s)) << "not sharing";
    return m;
  }
  // The table's row of `key`: probes and breaks so far.
  [[nodiscard]] std::pair<std::int64_t, std::int64_t> row(const std::string& key) {
    auto conn = open_database(url_);
    const Value k[] = {key};
    const Rows r = conn->query("SELECT probes, breaks FROM keel_breakers WHERE key = $1", k);
    if (r.empty()) return {-1, -1};
    return {r.integer(0, 0), r.integer(0, 1)};
  }

  DatabaseUrl url_;
};

TEST_F(SharedBreakersTest, OneProcessOpensAndEveryProcessOpensWithinASecond) {
  auto a = member("a", 30s);
  auto b = member("b", 30s);
  auto c = member("c", 30s);
  (void)b->registry.get("api:443");  // b knows the key already; c learns it from the fleet
  const auto opened = std::chrono::steady_clock::now();
  a->trip("api:443");
  ASSERT_TRUE(test::wait_until(
      [&] {
        return b->registry.state("api:443") == BreakerState::kOpen &&
               c->registry.state("api:443") == BreakerState::kOpen;
      },
      10s));
  if (test::kTimingAsserted) {
    EXPECT_LT(std::chrono::steady_clock::now() - opened, 1s);
  }
  // Until the same probe time: the fleet's break, not a break of their own.
  const auto remaining = b->registry.get("api:443")->snapshot().open_remaining;
  EXPECT_GT(remaining, 25s);
  EXPECT_LE(remaining, 30s + 2ms);  // the break is sent in whole ms, and the breaker rounds up
  EXPECT_EQ(b->shared->stats().applied_opens, 1U);
  ASSERT_TRUE(a->shared->flush(10s));
  EXPECT_EQ(a->shared->stats().published, 1U);
  EXPECT_EQ(row("api:443"), std::make_pair(std::int64_t{0}, std::int64_t{1}));
  // Another dependency is untouched.
  EXPECT_EQ(b->state("db:5432"), BreakerState::kClosed);
}

TEST_F(SharedBreakersTest, TheFleetSendsOneProbePerBreakAndItsSuccessClosesEveryone) {
  std::vector<std::unique_ptr<Member>> fleet;
  for (int i = 0; i < 4; ++i) fleet.push_back(member("p" + std::to_string(i), 300ms));
  fleet[0]->trip("api:443");
  ASSERT_TRUE(test::wait_until([&] { return all_in(fleet, "api:443", BreakerState::kOpen); }, 10s));
  // The break ends for everyone at once; every process asks for a trial, from 2 threads each.
  ASSERT_TRUE(
      test::wait_until([&] { return fleet[0]->state("api:443") == BreakerState::kHalfOpen; }, 10s));
  std::this_thread::sleep_for(50ms);  // the others' breaks (applied a little later) are over too
  std::atomic<int> trials{0};
  std::mutex mu;
  std::vector<std::pair<std::shared_ptr<CircuitBreaker>, BreakerPermit>> probes;
  std::vector<std::thread> threads;
  for (auto& m : fleet) {
    for (int t = 0; t < 2; ++t) {
      threads.emplace_back([&, breaker = m->registry.get("api:443")] {
        const auto p = breaker->try_acquire();
        if (p) {
          trials.fetch_add(1);
          std::lock_guard lock(mu);
          probes.emplace_back(breaker, p);
        }
      });
    }
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ(trials.load(), 1) << "one probe for the fleet";
  EXPECT_EQ(row("api:443").first, 1);
  // The probe succeeds: every process closes.
  probes[0].first->record(probes[0].second, kS);
  EXPECT_TRUE(
      test::wait_until([&] { return all_in(fleet, "api:443", BreakerState::kClosed); }, 10s));
}

TEST_F(SharedBreakersTest, AfterTheFleetsProbeSucceedsTheOthersCloseSpreadOverTheReleaseSpread) {
  SharedBreakersOptions spread;
  spread.release_spread = 600ms;
  spread.heartbeat = 50ms;  // a joining process is counted at once anyway
  std::vector<std::unique_ptr<Member>> fleet;
  for (int i = 0; i < 5; ++i) fleet.push_back(member("p" + std::to_string(i), 200ms, spread));
  fleet[0]->trip("api:443");
  ASSERT_TRUE(test::wait_until([&] { return all_in(fleet, "api:443", BreakerState::kOpen); }, 10s));
  // Every process asks for a trial as soon as its break allows; exactly one probes.
  std::mutex mu;
  std::vector<std::chrono::steady_clock::time_point> closed(fleet.size());
  std::atomic<int> trials{0};
  std::vector<std::thread> threads;
  const auto give_up = std::chrono::steady_clock::now() + 20s;
  for (std::size_t i = 0; i < fleet.size(); ++i) {
    threads.emplace_back([&, i, b = fleet[i]->registry.get("api:443")] {
      while (std::chrono::steady_clock::now() < give_up) {
        if (b->state() == BreakerState::kClosed) break;
        const auto p = b->try_acquire();
        if (p.trial) {
          trials.fetch_add(1);
          b->record(p, kS);
        } else if (p) {
          b->release(p);
        }
        std::this_thread::sleep_for(2ms);
      }
      std::lock_guard lock(mu);
      closed[i] = std::chrono::steady_clock::now();
    });
  }
  for (auto& t : threads) t.join();
  for (auto& m : fleet) EXPECT_EQ(m->state("api:443"), BreakerState::kClosed);
  EXPECT_EQ(trials.load(), 1) << "one probe; the others close at their release times";
  if (test::kTimingAsserted) {
    const auto [first, last] = std::minmax_element(closed.begin(), closed.end());
    EXPECT_GE(*last - *first, 30ms) << "the fleet came back at once";
  }
}

TEST_F(SharedBreakersTest, AFailedProbeReopensEveryProcessForTheNextBreak) {
  auto a = member("a", 200ms);
  auto b = member("b", 200ms);
  a->trip("api:443");
  ASSERT_TRUE(test::wait_until([&] { return b->registry.state("api:443").has_value(); }, 10s));
  ASSERT_TRUE(
      test::wait_until([&] { return a->state("api:443") == BreakerState::kHalfOpen; }, 10s));
  const auto breaker = a->registry.get("api:443");
  BreakerPermit probe;
  ASSERT_TRUE(test::wait_until([&] { return (probe = breaker->try_acquire()).allowed; }, 10s));
  ASSERT_TRUE(probe.trial);
  breaker->record(probe, kF);  // the fleet's probe failed: a new break for everyone
  ASSERT_EQ(breaker->state(), BreakerState::kOpen);
  ASSERT_TRUE(a->shared->flush(10s));
  EXPECT_EQ(row("api:443"), std::make_pair(std::int64_t{1}, std::int64_t{2}));
  // b was held open while a probed, and now opens for the fleet's second break.
  EXPECT_TRUE(test::wait_until([&] { return b->shared->stats().applied_opens >= 2; }, 10s));
  EXPECT_EQ(b->state("api:443"), BreakerState::kOpen);
}

TEST_F(SharedBreakersTest, AProberThatDiesIsReplacedWhenItsLeaseEnds) {
  SharedBreakersOptions lease;
  lease.probe_lease = 300ms;
  auto a = member("a", 100ms, lease);
  auto b = member("b", 100ms, lease);
  a->trip("api:443");
  ASSERT_TRUE(test::wait_until([&] { return b->registry.state("api:443").has_value(); }, 10s));
  ASSERT_TRUE(
      test::wait_until([&] { return a->state("api:443") == BreakerState::kHalfOpen; }, 10s));
  // a's own break may end a little before the fleet's (it tripped before it published): it is
  // held open until the fleet's probe time, then takes the probe.
  const auto ab = a->registry.get("api:443");
  BreakerPermit probe;
  ASSERT_TRUE(test::wait_until([&] { return (probe = ab->try_acquire()).allowed; }, 10s));
  ASSERT_TRUE(probe.trial);  // a holds the probe ...
  a.reset();                 // ... and dies before it reports
  const auto bb = b->registry.get("api:443");
  ASSERT_TRUE(test::wait_until([&] { return bb->state() == BreakerState::kHalfOpen; }, 10s));
  EXPECT_FALSE(bb->try_acquire()) << "a's lease is still live";
  EXPECT_EQ(b->shared->stats().probes_held, 1U);
  // When the lease ends, b's next trial is the fleet's probe.
  std::optional<BreakerPermit> taken;
  ASSERT_TRUE(test::wait_until(
      [&] {
        const auto p = bb->try_acquire();
        if (p) taken = p;
        return p.allowed;
      },
      10s));
  EXPECT_TRUE(taken->trial);
  EXPECT_EQ(row("api:443").first, 2);
  EXPECT_EQ(b->shared->stats().probes_taken, 1U);
  bb->record(*taken, kS);
}

TEST_F(SharedBreakersTest, AProcessHeldForAnotherProcesssProbeAsksAgainWithinProbeWait) {
  SharedBreakersOptions o;
  o.probe_lease = 30s;
  o.probe_wait = 200ms;
  auto a = member("a", 100ms, o);
  auto b = member("b", 100ms, o);
  a->trip("api:443");
  ASSERT_TRUE(test::wait_until([&] { return b->registry.state("api:443").has_value(); }, 10s));
  const auto ab = a->registry.get("api:443");
  BreakerPermit probe;
  ASSERT_TRUE(test::wait_until([&] { return (probe = ab->try_acquire()).allowed; }, 10s));
  ASSERT_TRUE(probe.trial);  // a probes, with a lease of 30 s
  const auto bb = b->registry.get("api:443");
  ASSERT_TRUE(test::wait_until([&] { return bb->state() == BreakerState::kHalfOpen; }, 10s));
  EXPECT_FALSE(bb->try_acquire()) << "a holds the probe";
  EXPECT_EQ(b->shared->stats().probes_held, 1U);
  // Held open for probe_wait, not for a's whole lease: a queue defers its jobs by retry_in.
  EXPECT_LE(bb->retry_in(), 201ms);  // the breaker's millisecond ticks round up
  EXPECT_GT(bb->retry_in(), 0ms);
  // b asks again, is held again while a's probe is out, and closes when it succeeds.
  ASSERT_TRUE(test::wait_until([&] { return bb->state() == BreakerState::kHalfOpen; }, 10s));
  EXPECT_FALSE(bb->try_acquire());
  EXPECT_EQ(b->shared->stats().probes_held, 2U);
  ab->record(probe, kS);
  EXPECT_TRUE(test::wait_until([&] { return bb->state() == BreakerState::kClosed; }, 10s));
  EXPECT_EQ(row("api:443").first, 1) << "one probe";
}

TEST_F(SharedBreakersTest, AProcessThatStartsLaterReadsTheFleetsState) {
  auto a = member("a", 30s);
  a->trip("api:443");
  ASSERT_TRUE(a->shared->flush(10s));
  auto late = member("late", 30s);  // sharing means the table was read
  EXPECT_EQ(late->registry.state("api:443"), BreakerState::kOpen);
  EXPECT_GT(late->registry.get("api:443")->snapshot().open_remaining, 25s);
}

TEST_F(SharedBreakersTest, NotificationsOfAnotherSchemaAreNotThisFleets) {
  auto a = member("a", 30s);
  const auto other = test::postgres_url();
  ASSERT_TRUE(other);
  Member elsewhere(parse_database_url(*other).value(), "elsewhere", 30s);
  ASSERT_TRUE(elsewhere.shared->wait_until_sharing(10s));
  (void)a->registry.get("api:443");
  elsewhere.trip("api:443");
  ASSERT_TRUE(elsewhere.shared->flush(10s));
  auto b = member("b", 30s);  // a change of this fleet, seen by a, after the other one's
  b->trip("db:5432");
  ASSERT_TRUE(test::wait_until([&] { return a->state("db:5432") == BreakerState::kOpen; }, 10s));
  EXPECT_EQ(a->state("api:443"), BreakerState::kClosed);
}

TEST_F(SharedBreakersTest, EachProcessJudgesAfterItsShareOfTheFleetsMinimumCalls) {
  SharedBreakersOptions fast;
  fast.heartbeat = 50ms;
  std::vector<std::unique_ptr<Member>> fleet;
  for (int i = 0; i < 4; ++i) fleet.push_back(member("p" + std::to_string(i), 30s, fast));
  const auto sized = [&](int n) {
    return test::wait_until(
        [&] {
          for (auto& m : fleet) {
            if (m->shared->stats().fleet_size != n) return false;
          }
          return true;
        },
        10s);
  };
  ASSERT_TRUE(sized(4));
  // minimum_calls 2 stays 2 (a minimum below 3 is kept); a registry of 20 would judge after 5.
  EXPECT_EQ(fleet[0]->registry.get("api:443")->minimum_calls(), 2);
  fleet.pop_back();  // leaves the table as it stops
  EXPECT_TRUE(sized(3));
}

TEST_F(SharedBreakersTest, AnUnreachableDatabaseMeansPerProcessBreakersSaidOnce) {
  // A port nothing listens on.
  const auto url =
      parse_database_url("postgresql://postgres@127.0.0.1:1/keel_test?connect_timeout=1").value();
  SharedBreakersOptions o;
  o.reconnect.base = 10ms;
  o.reconnect.cap = 20ms;
  Member alone(url, "alone", 50ms, o);
  ASSERT_TRUE(test::wait_until([&] { return !alone.heard().empty(); }, 10s));
  std::this_thread::sleep_for(200ms);  // several reconnection attempts
  EXPECT_EQ(alone.heard().size(), 1U) << "said once";
  EXPECT_NE(alone.heard()[0].find("own breakers"), std::string::npos) << alone.heard()[0];
  EXPECT_FALSE(alone.shared->stats().sharing);
  // The local breaker works as without sharing: it trips, and probes for itself.
  alone.trip("api:443");
  ASSERT_TRUE(
      test::wait_until([&] { return alone.state("api:443") == BreakerState::kHalfOpen; }, 10s));
  const auto b = alone.registry.get("api:443");
  const auto probe = b->try_acquire();
  ASSERT_TRUE(probe.trial);
  b->record(probe, kS);
  EXPECT_EQ(b->state(), BreakerState::kClosed);
  EXPECT_EQ(alone.shared->stats().fallbacks, 1U);
}

TEST(SharedBreakers, RefusesSqliteAndInvalidOptionsNamingTheProblem) {
  test::TempDir dir;
  BreakerRegistry registry;
  const auto sqlite = parse_database_url("sqlite:" + (dir.path() / "k.db").string()).value();
  try {
    SharedBreakers shared(registry, sqlite);
    FAIL() << "SQLite accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("PostgreSQL only"), std::string::npos) << e.what();
  }
  const auto pg = parse_database_url("postgresql://postgres@127.0.0.1:1/x").value();
  SharedBreakersOptions bad;
  bad.probe_lease = 1ms;
  EXPECT_THROW(SharedBreakers(registry, pg, bad), std::invalid_argument);
  bad = {};
  bad.probe_wait = 0ms;
  EXPECT_THROW(SharedBreakers(registry, pg, bad), std::invalid_argument);
  bad = {};
  bad.process = "two words";
  EXPECT_THROW(SharedBreakers(registry, pg, bad), std::invalid_argument);
}

}  // namespace
}  // namespace keel::store
