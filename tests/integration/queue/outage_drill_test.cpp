// The seeds' outage, end to end: `keel jobs work --deliver` (real processes) against a loopback
// API that deduplicates by Idempotency-Key, on real SQLite files and a real PostgreSQL server.
//
//  - The API is down (503; connection refused; hanging past the per-try timeout) for longer than
//    all of a job's attempts would last at the configured backoff, then back: no job is
//    dead-lettered, each has exactly one effect, the requests sent during the outage are bounded
//    by the breaker (its trip plus its probes, far under jobs x attempts), and every job is done
//    soon after the API is back.
//  - 30% random 503s with workers SIGKILLed and restarted, over many seeds: none dead, none lost,
//    none applied twice.
#include <gtest/gtest.h>

#include <chrono>
#include <random>
#include <string>
#include <thread>
#include <tuple>

#include "support/jobs_process_support.hpp"

namespace keel::store {
namespace {

using namespace std::chrono_literals;
using test_jobs::CmdResult;
using test_jobs::Process;
using test_jobs::Receiver;

constexpr int kJobs = 60;
constexpr int kMaxAttempts = 25;  // the queue's default
// How the API is down.
enum class Down { k503, kRefused, kHang };

std::string name_of(Down d) {
  switch (d) {
    case Down::k503:
      return "Http503";
    case Down::kRefused:
      return "ConnectionRefused";
    case Down::kHang:
      return "HangPastTimeout";
  }
  return "unknown";
}

class OutageDrill
    : public test_jobs::JobsHarness<test::BackendParamTest<std::tuple<Backend, Down>>> {};

TEST_P(OutageDrill, JobsWaitOutAnOutageLongerThanTheirRetriesAndDrainAfterIt) {
  const Down down = std::get<1>(GetParam());
  Receiver api;
  if (down == Down::k503) api.set_outage(Receiver::kDown503);
  if (down == Down::kHang) api.set_outage(Receiver::kHang);
  const std::string hook = api.url("/hook");
  if (down == Down::kRefused) api.stop_listening();
  enqueue_many("payments", kJobs);

  // At this backoff, all 25 attempts of a job would be spent in about a second. The time the
  // worker takes to start, fail its first calls and trip its breaker varies with the machine (and
  // a hung call waits out its 1 s timeout: a third of the receiver's 3 s hang, and room for the
  // deliveries after recovery on a slow machine). So the outage lasts until the breaker is seen
  // open and deferring jobs, then 3 s more: real processes, real time.
  auto args = work_args("payments", hook);
  *(std::find(args.begin(), args.end(), "--backoff-cap") + 1) = "50ms";
  args.insert(args.end(), {"--concurrency", "4", "--timeout", "1s"});
  const auto outage_start = std::chrono::steady_clock::now();
  auto worker = spawn(args);
  const auto tripped = [&] {
    return worker->err().find("circuit open for 127.0.0.1:") != std::string::npos &&
           count("SELECT COUNT(*) FROM keel_job_attempts WHERE outcome = 'deferred'") > 0;
  };
  for (const auto until = outage_start + 30s;
       !tripped() && !worker->poll() && std::chrono::steady_clock::now() < until;) {
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_TRUE(tripped()) << "the breaker did not open and defer a job within 30 s\n"
                         << worker->err();
  std::this_thread::sleep_for(3s);
  const std::int64_t attempts_during_outage =
      count("SELECT COUNT(*) FROM keel_job_attempts WHERE outcome <> 'deferred'");
  const std::int64_t deferrals_during_outage =
      count("SELECT COUNT(*) FROM keel_job_attempts WHERE outcome = 'deferred'");
  const int requests_during_outage = api.total_requests();

  // Back.
  if (down == Down::kRefused) api.listen_again();
  api.set_outage(Receiver::kNone);
  const auto back = std::chrono::steady_clock::now();
  const double outage_s = std::chrono::duration<double>(back - outage_start).count();
  // Bounded: the breaker's next probe is at most its 5 s break away, then the queue drains.
  for (int i = 0; i < 600 && !worker->poll(); ++i) std::this_thread::sleep_for(50ms);
  ASSERT_TRUE(worker->poll()) << "the queue did not drain within 30 s of recovery\n"
                              << worker->err();
  const double drain_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - back).count();
  EXPECT_EQ(worker->wait(), 0) << worker->err();

  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'dead'"), 0) << worker->err();
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'"), kJobs);
  {
    std::lock_guard lock(api.mu);
    EXPECT_EQ(api.applied.size(), static_cast<std::size_t>(kJobs));
    for (const auto& key : keys("payments")) EXPECT_EQ(api.applied.count(key), 1u) << key;
    EXPECT_EQ(api.overlaps, 0);
  }
  // The breaker trips after its 20 calls; then only probes go out. Jobs x attempts would be 1500.
  EXPECT_LE(attempts_during_outage, 40) << worker->err();
  EXPECT_LE(requests_during_outage, 40);
  EXPECT_GE(deferrals_during_outage, 1) << "the open breaker should have deferred jobs";
  // A deferral is recorded as such, with the breaker's next probe, never as a failed attempt.
  auto conn = open_database(url());
  const Rows deferred = conn->query(
      "SELECT error FROM keel_job_attempts WHERE outcome = 'deferred' ORDER BY id LIMIT 1");
  ASSERT_FALSE(deferred.empty());
  EXPECT_NE(deferred.text(0, 0).find("circuit open for 127.0.0.1:"), std::string::npos)
      << deferred.text(0, 0);
  EXPECT_LE(count("SELECT MAX(attempts) FROM keel_jobs"), 5);
  // What the worker said about it: one line when the circuit opened, one when it closed.
  const std::string log = worker->err();
  EXPECT_NE(log.find("circuit open for 127.0.0.1:"), std::string::npos) << log;
  EXPECT_NE(log.find("circuit closed for 127.0.0.1:"), std::string::npos) << log;
  std::printf(
      "drill %s: %d requests and %lld attempts during the %.1f s outage, %lld deferrals, "
      "drained %.1f s after recovery\n",
      name_of(down).c_str(), requests_during_outage, static_cast<long long>(attempts_during_outage),
      outage_s, static_cast<long long>(deferrals_during_outage), drain_s);
  EXPECT_LT(attempts_during_outage, kJobs * kMaxAttempts / 10);
}

INSTANTIATE_TEST_SUITE_P(
    Drill, OutageDrill,
    ::testing::Combine(::testing::Values(Backend::kSqlite, Backend::kPostgres),
                       ::testing::Values(Down::k503, Down::kRefused, Down::kHang)),
    [](const ::testing::TestParamInfo<std::tuple<Backend, Down>>& p) {
      return std::string(std::get<0>(p.param) == Backend::kSqlite ? "Sqlite" : "Postgres") +
             name_of(std::get<1>(p.param));
    });

// ---------------------------------------------------------------------------------------------
// 30% 503s with SIGKILLed workers, over many seeds.

class CrashDrill : public test_jobs::JobsHarness<test::BackendParamTest<std::tuple<Backend, int>>> {
};

TEST_P(CrashDrill, ThirtyPercent503sAndKilledWorkersLoseNothingAndKillNothing) {
  const int seed = std::get<1>(GetParam());
  Receiver api(static_cast<std::uint64_t>(seed));
  api.fail_rate = 0.3;
  constexpr int kCrashJobs = 150;
  enqueue_many("fleet", kCrashJobs);
  auto args = work_args("fleet", api.url("/hook"));
  args.insert(args.end(), {"--concurrency", "2", "--lease", "1s"});
  std::mt19937 rng(static_cast<std::mt19937::result_type>(seed));
  std::vector<std::unique_ptr<Process>> workers;
  workers.push_back(spawn(args));
  workers.push_back(spawn(args));
  for (int kills = 0; kills < 3; ++kills) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100 + rng() % 300));
    auto& victim = workers[rng() % workers.size()];
    if (victim->poll()) break;  // drained already
    victim->signal(SIGKILL);
    const int status = victim->wait();
    if (status == 0) break;  // it drained the queue and exited before the kill landed
    EXPECT_EQ(status, 128 + SIGKILL) << victim->err();
    victim = spawn(args);
  }
  for (auto& w : workers) EXPECT_EQ(w->wait(), 0) << w->err();
  const CmdResult again = keel(args);  // in case both exited while a lease was being reaped
  ASSERT_EQ(again.status, 0) << again.err;
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'dead'"), 0) << "seed " << seed;
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'"), kCrashJobs)
      << "seed " << seed;
  std::lock_guard lock(api.mu);
  EXPECT_EQ(api.applied.size(), static_cast<std::size_t>(kCrashJobs)) << "seed " << seed;
  EXPECT_EQ(api.overlaps, 0) << "seed " << seed;
  EXPECT_EQ(api.missing_key, 0);
}

INSTANTIATE_TEST_SUITE_P(Seeds, CrashDrill,
                         ::testing::Combine(::testing::Values(Backend::kSqlite, Backend::kPostgres),
                                            ::testing::Range(1, 21)),
                         [](const ::testing::TestParamInfo<std::tuple<Backend, int>>& p) {
                           return std::string(std::get<0>(p.param) == Backend::kSqlite
                                                  ? "Sqlite"
                                                  : "Postgres") +
                                  "Seed" + std::to_string(std::get<1>(p.param));
                         });

}  // namespace
}  // namespace keel::store
