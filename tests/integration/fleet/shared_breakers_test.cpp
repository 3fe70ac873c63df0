// SharedBreakers on a real PostgreSQL server: each "process" here is a BreakerRegistry with its
// own SharedBreakers (its own two connections and background thread) under its own name, so
// that the fleet's rules can be driven call by call: one opens, all open; one probe per break;
// the probe's result closes or re-opens everyone; a dead prober's lease is taken over; a process
// that starts later reads the table; an unreachable database means per-process breakers, said
// once. And what it must never do: obey a row outside its domain (hand-edited rows, one kind
// each), retry a schema newer than its own, or leave a setting on a server session after its
// transaction (through a PgBouncer of one connection when one is installed). The drill with
// real processes (and the frozen database) is in fleet_drill_test.cpp.
#include "keel/fleet/shared_breakers.hpp"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <pwd.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "build_kind.hpp"
#include "keel/core/breaker.hpp"
#include "keel/db/database.hpp"
#include "support/test_support.hpp"
#include "support/waiting.hpp"

namespace keel::store {
namespace {

using namespace std::chrono_literals;

constexpr Outcome kF = Outcome::transient();
constexpr Outcome kS = Outcome::success();

BreakerRegistryOptions fleet_breaker(Duration break_for, Duration max_break = 60s) {
  BreakerRegistryOptions o;
  o.breaker.window = BreakerWindow::kCount;
  o.breaker.window_calls = 2;
  o.breaker.minimum_calls = 2;
  o.breaker.break_duration = break_for;
  o.breaker.max_break_duration = max_break;
  return o;
}

// One process of the fleet.
struct Member {
  Member(const DatabaseUrl& url, std::string name, Duration break_for,
         SharedBreakersOptions options = {}, Duration max_break = 60s)
      : registry(fleet_breaker(break_for, max_break)) {
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
  // The notices that name `what`.
  [[nodiscard]] std::vector<std::string> heard_of(const std::string& what) {
    std::vector<std::string> out;
    for (const auto& n : heard()) {
      if (n.find(what) != std::string::npos) out.push_back(n);
    }
    return out;
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
                                               SharedBreakersOptions options = {},
                                               Duration max_break = 60s) {
    auto m =
        std::make_unique<Member>(url_, std::move(name), break_for, std::move(options), max_break);
    EXPECT_TRUE(m->shared->wait_until_sharing(10s))
        << "not sharing: " << (m->heard().empty() ? "" : m->heard().front());
    return m;
  }
  // The tables exist (a process has shared once and left).
  void create_tables() {
    Member first(url_, "first", 30s);
    ASSERT_TRUE(first.shared->wait_until_sharing(10s));
  }
  void exec(const std::string& sql) {
    auto conn = open_database(url_);
    conn->execute(sql);
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
  // Killed, not stopped: its heartbeat row stays until it expires (a process that stops leaves
  // the table, and its lease with it: the next test).
  exec("INSERT INTO keel_breaker_members (process, seen_at) VALUES ('a', now())");
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

TEST_F(SharedBreakersTest, AProberThatStopsBeforeItReportsFreesTheProbeAtOnce) {
  SharedBreakersOptions lease;
  lease.probe_lease = 30s;
  auto a = member("a", 100ms, lease);
  auto b = member("b", 100ms, lease);
  a->trip("api:443");
  ASSERT_TRUE(test::wait_until([&] { return b->registry.state("api:443").has_value(); }, 10s));
  const auto ab = a->registry.get("api:443");
  BreakerPermit probe;
  ASSERT_TRUE(test::wait_until([&] { return (probe = ab->try_acquire()).allowed; }, 10s));
  ASSERT_TRUE(probe.trial);
  a.reset();  // stops (its probe never reports) and leaves the fleet
  // a's lease of 30 s is a lease of a process that is not in the fleet: b probes now.
  const auto bb = b->registry.get("api:443");
  BreakerPermit taken;
  ASSERT_TRUE(test::wait_until([&] { return (taken = bb->try_acquire()).allowed; }, 10s));
  EXPECT_TRUE(taken.trial);
  bb->record(taken, kS);
  EXPECT_EQ(row("api:443").first, 2);
  EXPECT_EQ(b->heard_of("api:443").size(), 1U) << "a's lease, said ignored once";
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

// ---------------------------------------------------------------------------------------------
// Rows outside their domain: a hand edit, a bug elsewhere, a restore gone wrong. Each is repaired
// or ignored with one line, never obeyed; the other keys are shared as before.

// A row of keel_breakers for api:443 as it was left: its columns after the key.
struct BadRow {
  const char* name;
  const char* columns;  // state, open_until, breaks, probes, probe_holder, probe_until
  std::size_t lines;    // lines said about the row: one per kind out of its domain
  const char* said;     // a word each line says
};

std::string row_name(const ::testing::TestParamInfo<BadRow>& info) { return info.param.name; }
void PrintTo(const BadRow& row, std::ostream* os) { *os << row.name; }

class BadBreakerRow : public SharedBreakersTest, public ::testing::WithParamInterface<BadRow> {};

TEST_P(BadBreakerRow, IsRepairedOrIgnoredSaidOnceAndNeverObeyed) {
  const BadRow& bad = GetParam();
  ASSERT_NO_FATAL_FAILURE(create_tables());
  exec(std::string("INSERT INTO keel_breakers (key, state, open_until, breaks, probes,"
                   " probe_holder, probe_until, updated_by) VALUES ('api:443', ") +
       bad.columns + ", 'hand')");
  SharedBreakersOptions o;
  o.probe_lease = 300ms;
  o.probe_wait = 50ms;
  constexpr Duration kMaxBreak = 400ms;
  auto m = member("m", 50ms, o, kMaxBreak);  // has read the row when it shares
  const auto started = std::chrono::steady_clock::now();
  auto other = member("other", 30s, o);
  const auto b = m->registry.get("api:443");
  // Never held open longer than the breaker's longest break.
  EXPECT_LE(b->retry_in(), kMaxBreak + 2ms);
  // A call runs within the longest break and a probe_wait: the fleet's probe, or a call of the
  // breaker deciding alone.
  BreakerPermit permit;
  int refused = 0;
  ASSERT_TRUE(test::wait_until(
      [&] {
        permit = b->try_acquire();
        if (!permit) ++refused;
        return permit.allowed;
      },
      5s))
      << "held by the row; refused " << refused << " times";
  const auto waited = std::chrono::steady_clock::now() - started;
  if (test::kTimingAsserted) {
    EXPECT_LT(waited, kMaxBreak + 600ms);
  }
  b->record(permit, kS);
  EXPECT_EQ(b->state(), BreakerState::kClosed);
  const auto lines = m->heard_of("api:443");
  EXPECT_EQ(lines.size(), bad.lines) << (lines.empty() ? "" : lines.front());
  for (const auto& line : lines) EXPECT_NE(line.find(bad.said), std::string::npos) << line;
  EXPECT_EQ(m->shared->stats().rows_out_of_domain, bad.lines);
  // Sharing goes on for every other key.
  other->trip("db:5432");
  EXPECT_TRUE(test::wait_until([&] { return m->state("db:5432") == BreakerState::kOpen; }, 10s));
  EXPECT_TRUE(m->shared->stats().sharing);
  if (permit.trial) {
    // The probe's success closed the row, whatever it held before.
    ASSERT_TRUE(m->shared->flush(10s));
    auto conn = open_database(url_);
    const Rows r = conn->query(
        "SELECT state, open_until IS NULL, probe_holder IS NULL, breaks BETWEEN 0 AND 100,"
        " probes BETWEEN 0 AND 100 FROM keel_breakers WHERE key = 'api:443'");
    ASSERT_EQ(r.size(), 1U);
    EXPECT_EQ(r.text(0, 0), "closed");
    for (std::size_t c = 1; c < 5; ++c) EXPECT_EQ(r.text(0, c), "t") << "column " << c;
  }
  // Read again by a process that starts later: said by it once too, and the row does not hold it.
  auto late = member("late", 50ms, o, kMaxBreak);
  EXPECT_LE(late->registry.get("api:443")->retry_in(), kMaxBreak + 2ms);
  EXPECT_LE(m->heard_of("api:443").size(), bad.lines) << "said once per process";
}

INSTANTIATE_TEST_SUITE_P(
    HandEdited, BadBreakerRow,
    ::testing::Values(
        BadRow{"OpenWithoutAnEnd", "'open', NULL, 1, 0, NULL, NULL", 1, "open_until"},
        BadRow{"OpenUntilInfinity", "'open', 'infinity', 1, 0, NULL, NULL", 1, "open_until"},
        BadRow{"OpenUntilMinusInfinity", "'open', '-infinity', 1, 0, NULL, NULL", 1, "open_until"},
        BadRow{"OpenForACentury", "'open', now() + interval '100 years', 1, 0, NULL, NULL", 1,
               "open_until"},
        BadRow{"OpenSinceLongAgo", "'open', '1970-01-01', 1, 0, NULL, NULL", 0, ""},
        BadRow{"AGhostHoldsTheProbeForACentury",
               "'open', now() - interval '1 second', 1, 1, 'ghost',"
               " now() + interval '100 years'",
               2, "probe"},
        BadRow{"AGhostHoldsTheProbeForever",
               "'open', now() - interval '1 second', 1, 1, 'ghost', 'infinity'", 2, "probe"},
        BadRow{"AHolderWithoutALease", "'open', now() - interval '1 second', 1, 1, 'x', NULL", 1,
               "probe"},
        BadRow{"AStateNeitherOpenNorClosed",
               "'half-open', now() + interval '1 hour', 1, 0, NULL, NULL", 1, "state"},
        BadRow{"CountsOutOfRange",
               "'open', now() - interval '1 second', -5, 9223372036854775807, NULL, NULL", 1,
               "breaks"}),
    row_name);

TEST_F(SharedBreakersTest, ALeaseLongerThanProbeLeaseIsCutToItEvenForALiveHolder) {
  SharedBreakersOptions o;
  o.probe_lease = 300ms;
  o.probe_wait = 50ms;
  auto a = member("a", 50ms, o);
  auto holder = member("holder", 30s, o);  // a live process of the fleet
  a->trip("api:443");
  ASSERT_TRUE(a->shared->flush(10s));
  exec(
      "UPDATE keel_breakers SET open_until = now() - interval '1 second', probe_holder = 'holder',"
      " probe_until = now() + interval '100 years' WHERE key = 'api:443'");
  const auto edited = std::chrono::steady_clock::now();
  const auto b = a->registry.get("api:443");
  BreakerPermit probe;
  ASSERT_TRUE(test::wait_until([&] { return (probe = b->try_acquire()).allowed; }, 5s))
      << "held by a lease of a century";
  EXPECT_TRUE(probe.trial);
  if (test::kTimingAsserted) {
    // The lease as this process's probe_lease allows it, and a probe_wait.
    EXPECT_LT(std::chrono::steady_clock::now() - edited, 300ms + 50ms + 300ms);
  }
  b->record(probe, kS);
  EXPECT_EQ(a->heard_of("api:443").size(), 1U);
  EXPECT_EQ(row("api:443").first, 1) << "a's lease (the edit took none)";
}

TEST_F(SharedBreakersTest, AStateNeitherOpenNorClosedAtTheTrialLetsTheBreakerDecideAlone) {
  SharedBreakersOptions o;
  o.probe_wait = 50ms;
  auto m = member("m", 300ms, o);
  m->trip("api:443");
  ASSERT_TRUE(m->shared->flush(10s));
  exec("UPDATE keel_breakers SET state = 'HALF_OPEN' WHERE key = 'api:443'");
  const auto b = m->registry.get("api:443");
  // Each trial asks the fleet again (a trial given back unattempted leaves the breaker
  // half-open): the row is read five times and said once.
  int trials = 0;
  BreakerPermit last;
  ASSERT_TRUE(test::wait_until(
      [&] {
        const auto p = b->try_acquire();
        if (p.trial && ++trials < 5) b->release(p);
        if (p.trial) last = p;
        return trials == 5;
      },
      10s))
      << "the row was obeyed: " << trials << " trials, state " << to_string(b->state());
  b->record(last, kS);
  const auto lines = m->heard_of("api:443");
  ASSERT_EQ(lines.size(), 1U);
  EXPECT_NE(lines[0].find("HALF_OPEN"), std::string::npos) << lines[0];
  // The probe's result is published over it.
  EXPECT_TRUE(test::wait_until(
      [&] {
        auto conn = open_database(url_);
        return conn->query("SELECT state FROM keel_breakers WHERE key = 'api:443'").text(0, 0) ==
               "closed";
      },
      10s));
}

TEST_F(SharedBreakersTest, MemberRowsOutOfTheirDomainDoNotMakeTheFleetsSize) {
  ASSERT_NO_FATAL_FAILURE(create_tables());
  exec(
      "INSERT INTO keel_breaker_members (process, seen_at)"
      " SELECT 'ghost' || i, 'infinity' FROM generate_series(1, 40) i;"
      "INSERT INTO keel_breaker_members (process, seen_at)"
      " SELECT 'ahead' || i, now() + interval '1 day' FROM generate_series(1, 3) i");
  SharedBreakersOptions fast;
  fast.heartbeat = 50ms;
  auto a = member("a", 30s, fast);
  auto b = member("b", 30s, fast);
  const auto sized = [&](int n) {
    return a->shared->stats().fleet_size == n && b->shared->stats().fleet_size == n;
  };
  ASSERT_TRUE(test::wait_until([&] { return sized(2); }, 10s))
      << a->shared->stats().fleet_size << " and " << b->shared->stats().fleet_size;
  {
    auto conn = open_database(url_);
    EXPECT_EQ(conn->query("SELECT count(*) FROM keel_breaker_members").integer(0, 0), 2)
        << "the rows seen in the future are removed";
  }
  // Said once, not per heartbeat, and bounded: not one line per row of a flood.
  const auto said =
      a->heard_of("keel_breaker_members").size() + b->heard_of("keel_breaker_members").size();
  EXPECT_GE(said, 1U);
  EXPECT_LE(said, 12U);
  // A crowd of rows that look alive (for the 0.65 s until they expire): more processes than a
  // fleet on one database can be. The size stays the one known.
  exec(
      "INSERT INTO keel_breaker_members (process, seen_at)"
      " SELECT 'crowd' || i, now() + interval '500 milliseconds'"
      " FROM generate_series(1, 20000) i");
  const auto crowd_said = [&] {
    for (const auto& line : a->heard_of("keel_breaker_members")) {
      if (line.find("20002") != std::string::npos || line.find("20001") != std::string::npos) {
        return true;
      }
    }
    return false;
  };
  int largest = 0;
  ASSERT_TRUE(test::wait_until(
      [&] {
        largest = std::max(largest, a->shared->stats().fleet_size);
        return crowd_said();
      },
      10s))
      << "fleet size " << a->shared->stats().fleet_size;
  EXPECT_EQ(largest, 2);
  EXPECT_EQ(a->shared->stats().fleet_size, 2);
}

TEST_F(SharedBreakersTest, ASchemaNewerThanThisProgramIsRefusedOnceByNameAndNotRetried) {
  {
    // A later keel migrated the tables to version 2.
    auto conn = open_database(url_);
    (void)migrate(*conn, "breakers",
                  {{"CREATE TABLE keel_breakers (key TEXT PRIMARY KEY)"}, {"SELECT 1"}});
  }
  SharedBreakersOptions o;
  o.reconnect.base = 10ms;
  o.reconnect.cap = 20ms;
  std::atomic<int> opened{0};
  o.open = [&](const DatabaseUrl& url, const ConnectOptions& connect) {
    opened.fetch_add(1);
    return open_database(url, connect);
  };
  Member m(url_, "old", 50ms, o);
  const auto asked = std::chrono::steady_clock::now();
  EXPECT_FALSE(m.shared->wait_until_sharing(10s));
  EXPECT_LT(std::chrono::steady_clock::now() - asked, 9s) << "waited for a schema to change";
  ASSERT_TRUE(test::wait_until([&] { return !m.heard().empty(); }, 10s));
  std::this_thread::sleep_for(300ms);  // a retry would have come within 20 ms
  const auto heard = m.heard();
  ASSERT_EQ(heard.size(), 1U) << heard.back();
  EXPECT_NE(heard[0].find("'breakers'"), std::string::npos) << heard[0];
  EXPECT_NE(heard[0].find("version 2"), std::string::npos) << heard[0];
  EXPECT_NE(heard[0].find("this program's 1"), std::string::npos) << heard[0];
  EXPECT_EQ(heard[0].find("unreachable"), std::string::npos) << heard[0];
  EXPECT_EQ(opened.load(), 1) << "tried again";
  const auto stats = m.shared->stats();
  EXPECT_FALSE(stats.sharing);
  EXPECT_TRUE(stats.refused);
  EXPECT_EQ(stats.reconnects, 0U);
  // The breakers work as a single process's.
  m.trip("api:443");
  ASSERT_TRUE(test::wait_until([&] { return m.state("api:443") == BreakerState::kHalfOpen; }, 10s));
  const auto b = m.registry.get("api:443");
  const auto probe = b->try_acquire();
  ASSERT_TRUE(probe.trial);
  b->record(probe, kS);
  EXPECT_EQ(b->state(), BreakerState::kClosed);
}

// ---------------------------------------------------------------------------------------------
// Nothing it sets on a connection outlives the transaction that needed it.

// A connection that forwards to one the test keeps, as a pool hands its server connection to its
// next client; it notes every statement sent.
class Forwarding final : public Connection {
 public:
  Forwarding(std::shared_ptr<Connection> inner, std::function<void(std::string_view)> note)
      : inner_(std::move(inner)), note_(std::move(note)) {}
  [[nodiscard]] Backend backend() const noexcept override { return inner_->backend(); }
  void execute(std::string_view sql) override {
    note_(sql);
    inner_->execute(sql);
  }
  Rows query(std::string_view sql, std::span<const Value> params) override {
    note_(sql);
    return inner_->query(sql, params);
  }
  void begin(Isolation isolation) override {
    note_("BEGIN");
    inner_->begin(isolation);
  }
  void commit() override {
    note_("COMMIT");
    inner_->commit();
  }
  void rollback() noexcept override { inner_->rollback(); }
  [[nodiscard]] bool in_transaction() const noexcept override { return inner_->in_transaction(); }
  Rows query_then_begin(std::string_view sql, std::span<const Value> params,
                        Isolation isolation) override {
    note_(sql);
    return inner_->query_then_begin(sql, params, isolation);
  }
  Rows query_then_commit(std::string_view sql, std::span<const Value> params) override {
    note_(sql);
    return inner_->query_then_commit(sql, params);
  }
  std::vector<Rows> begin_then_query(Isolation isolation,
                                     std::span<const Statement> statements) override {
    for (const Statement& s : statements) note_(s.sql);
    return inner_->begin_then_query(isolation, statements);
  }
  [[nodiscard]] bool broken() const noexcept override { return inner_->broken(); }
  [[nodiscard]] std::string database_identity() const override {
    return inner_->database_identity();
  }

 private:
  std::shared_ptr<Connection> inner_;
  std::function<void(std::string_view)> note_;
};

std::string lower(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

TEST_F(SharedBreakersTest, NothingItSetsOnItsConnectionOutlivesATransaction) {
  std::mutex mu;
  std::vector<std::string> sent;                      // guarded by mu
  std::vector<std::shared_ptr<Connection>> sessions;  // guarded by mu
  SharedBreakersOptions o;
  o.heartbeat = 20ms;
  o.probe_wait = 50ms;
  o.open = [&](const DatabaseUrl& url, const ConnectOptions& connect) {
    std::shared_ptr<Connection> session = open_database(url, connect);
    std::lock_guard lock(mu);
    sessions.push_back(session);
    return std::make_unique<Forwarding>(session, [&](std::string_view sql) {
      std::lock_guard note(mu);
      sent.emplace_back(sql);
    });
  };
  {
    auto a = member("a", 100ms, o);
    auto b = member("b", 100ms);
    // Every kind of statement: publications, heartbeats, a probe lease taken and one refused.
    a->trip("api:443");
    ASSERT_TRUE(a->shared->flush(10s));
    ASSERT_TRUE(test::wait_until([&] { return b->state("api:443") == BreakerState::kOpen; }, 10s));
    const auto bb = b->registry.get("api:443");
    BreakerPermit probe;
    ASSERT_TRUE(test::wait_until([&] { return (probe = bb->try_acquire()).allowed; }, 10s));
    const auto ab = a->registry.get("api:443");
    ASSERT_TRUE(test::wait_until([&] { return ab->state() == BreakerState::kHalfOpen; }, 10s));
    (void)ab->try_acquire();  // b holds the probe
    bb->record(probe, kS);
    ASSERT_TRUE(b->shared->flush(10s));
    ASSERT_TRUE(test::wait_until([&] { return ab->state() == BreakerState::kClosed; }, 10s));
    std::this_thread::sleep_for(100ms);  // heartbeats
  }
  std::lock_guard lock(mu);
  ASSERT_FALSE(sessions.empty());
  for (const auto& sql : sent) {
    const std::string s = lower(sql);
    EXPECT_NE(s.rfind("set ", 0), 0U) << "a session setting: " << sql;
    if (s.find("set_config(") != std::string::npos) {
      EXPECT_NE(s.find("true)"), std::string::npos) << "set_config for the session: " << sql;
    }
    EXPECT_EQ(s.find("pg_advisory_lock"), std::string::npos) << sql;
    EXPECT_EQ(s.find("temp"), std::string::npos) << sql;
  }
  // The next client of each of its server connections finds the server's defaults.
  auto fresh = open_database(url_);
  for (const std::string setting :
       {"statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout",
        "default_transaction_read_only", "search_path"}) {
    const std::string expected = fresh->query("SELECT current_setting($1)", {setting}).text(0, 0);
    for (const auto& session : sessions) {
      EXPECT_EQ(session->query("SELECT current_setting($1)", {setting}).text(0, 0), expected)
          << setting;
    }
  }
  for (const auto& session : sessions) {
    EXPECT_FALSE(session->in_transaction());
    EXPECT_EQ(session
                  ->query("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                          " AND pid = pg_backend_pid()")
                  .integer(0, 0),
              0);
    EXPECT_EQ(session->query("SELECT pg_my_temp_schema()::int").integer(0, 0), 0)
        << "a temporary table was made";
  }
}

// A PgBouncer of the test's own in front of a database of its own on the test server:
// transaction pooling, one server connection, so that every client's transactions run on the
// same server session, one after another. Stopped, and the database dropped, with the object.
class PgBouncer {
 public:
  static constexpr const char* kBinary = "/usr/sbin/pgbouncer";

  explicit PgBouncer(const std::string& base_url) {
    // postgresql://postgres@127.0.0.1:PORT/keel_test
    const auto at = base_url.rfind('@');
    const auto colon = base_url.find(':', at);
    const auto slash = base_url.find('/', colon);
    if (at == std::string::npos || colon == std::string::npos || slash == std::string::npos) {
      return;
    }
    const std::string host = base_url.substr(at + 1, colon - at - 1);
    const std::string port = base_url.substr(colon + 1, slash - colon - 1);
    database_ = "keel_pool_" + std::to_string(::getpid()) + "_" +
                std::to_string(std::random_device{}() % 100000);
    admin_ = open_database(parse_database_url(base_url).value());
    admin_->execute("CREATE DATABASE " + database_);
    listen_port_ = free_port();
    const std::string dir = dir_.path().string();
    std::ofstream(dir + "/pgbouncer.ini")
        << "[databases]\nkeel_pool = host=" << host << " port=" << port << " dbname=" << database_
        << " user=postgres pool_size=1\n"
        << "[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = " << listen_port_
        << "\nauth_type = any\npool_mode = transaction\ndefault_pool_size = 1\n"
        << "max_client_conn = 50\nunix_socket_dir =\nserver_reset_query =\n"
        << "ignore_startup_parameters = extra_float_digits,options\n"
        << "logfile = " << dir << "/pgbouncer.log\npidfile = " << dir << "/pgbouncer.pid\n";
    std::string command = std::string(kBinary) + " -d " + dir + "/pgbouncer.ini";
    if (::geteuid() == 0) {
      // PgBouncer refuses to run as root; the test server's user runs it.
      const passwd* pg = ::getpwnam("postgres");
      if (pg == nullptr) return;
      for (const char* file : {"", "/pgbouncer.ini"}) {
        if (::chown((dir + file).c_str(), pg->pw_uid, pg->pw_gid) != 0) return;
      }
      command = "runuser -u postgres -- " + command;
    }
    if (std::system((command + " >" + dir + "/start.log 2>&1").c_str()) != 0) return;
    started_ = test::wait_until(
        [&] {
          std::ifstream in(dir + "/pgbouncer.pid");
          return static_cast<bool>(in >> pid_) && pid_ > 0;
        },
        10s);
  }
  ~PgBouncer() {
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      (void)test::wait_until([&] { return test::process_gone(pid_); }, 10s);
    }
    if (admin_) {
      try {
        admin_->execute("DROP DATABASE IF EXISTS " + database_ + " WITH (FORCE)");
      } catch (const std::exception&) {
        // The server goes with the fixture.
      }
    }
  }
  PgBouncer(const PgBouncer&) = delete;
  PgBouncer& operator=(const PgBouncer&) = delete;

  [[nodiscard]] bool started() const { return started_; }
  [[nodiscard]] std::string url() const {
    return "postgresql://postgres@127.0.0.1:" + std::to_string(listen_port_) + "/keel_pool";
  }
  [[nodiscard]] std::string log() const {
    std::ifstream in(dir_.path() / "pgbouncer.log");
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }
  // Another application's statement through the pool (psql: the simple protocol, no prepared
  // statements), its output or "ERROR: ..." on failure.
  [[nodiscard]] std::string psql(const std::string& sql) const {
    const std::string out = (dir_.path() / "psql.out").string();
    const std::string command = "/usr/lib/postgresql/15/bin/psql -X -A -t -h 127.0.0.1 -p " +
                                std::to_string(listen_port_) + " -U postgres -d keel_pool -c \"" +
                                sql + "\" >" + out + " 2>&1";
    const int status = std::system(command.c_str());
    std::ifstream in(out);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    while (!text.empty() && text.back() == '\n') text.pop_back();
    return status == 0 ? text : "ERROR: " + text;
  }

 private:
  static int free_port() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    int port = 0;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      port = ntohs(addr.sin_port);
    }
    ::close(fd);
    return port;
  }

  test::TempDir dir_;
  std::unique_ptr<Connection> admin_;
  std::string database_;
  int listen_port_ = 0;
  pid_t pid_ = -1;
  bool started_ = false;
};

TEST_F(SharedBreakersTest, BehindAPoolOfOneConnectionTheNextClientFindsTheServersDefaults) {
  if (::access(PgBouncer::kBinary, X_OK) != 0) GTEST_SKIP() << "no PgBouncer";
  const auto base = test::postgres_base_url();
  ASSERT_TRUE(base);
  PgBouncer pool(*base);
  ASSERT_TRUE(pool.started()) << pool.log();
  const std::string defaults = pool.psql("SHOW statement_timeout") + " " +
                               pool.psql("SHOW lock_timeout") + " " +
                               pool.psql("SHOW idle_in_transaction_session_timeout");
  ASSERT_EQ(defaults, "0 0 0") << pool.log();
  {
    Member a(parse_database_url(pool.url()).value(), "a", 100ms);
    ASSERT_TRUE(a.shared->wait_until_sharing(10s)) << pool.log();
    a.trip("api:443");
    ASSERT_TRUE(a.shared->flush(10s));
    // Another application, on the same server session, while the sharing runs.
    EXPECT_EQ(pool.psql("SHOW statement_timeout") + " " + pool.psql("SHOW lock_timeout") + " " +
                  pool.psql("SHOW idle_in_transaction_session_timeout"),
              defaults);
    EXPECT_EQ(pool.psql("SELECT 1 FROM pg_sleep(0.5)"), "1") << "its statement was cancelled";
  }
  EXPECT_EQ(pool.psql("SHOW statement_timeout"), "0");
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
