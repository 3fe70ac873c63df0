// The fleet drill: real `keel jobs work --deliver` processes sharing their circuit breakers
// through PostgreSQL (keel::store::SharedBreakers, docs/fleet.md) against a loopback API that
// deduplicates by Idempotency-Key.
//
//  - 8 processes with --share-breakers against 1 without, in one test: the API down (503) for
//    longer than a job's attempts, then back. The 8 start on an empty queue and the jobs come in
//    one enqueue, so that every process discovers the outage at the same moment (the hard case).
//    The fleet sends at most twice what one process sends while the API is down, one probe per
//    break, and after the probe's success drains without a dead job or a second effect.
//  - The process holding the probe lease is SIGKILLed while its probe hangs: when the lease ends
//    another process probes, and the killed process's job is neither lost nor applied twice.
//  - The database restarts mid-outage (a PostgreSQL server of the test's own): every process
//    says once that it keeps its own breakers, says when it shares again, and nothing is lost.
//  - The breakers' database frozen (its server's processes SIGSTOPped): a call waits at most
//    round_trip_limit for its probe lease and then probes as if alone, and a worker drains its
//    jobs as soon as the API is back instead of waiting for the database.
//  - A row of keel_breakers left open without an end: the worker says so once and probes,
//    instead of deferring its jobs every millisecond.
//  - The flags refuse what cannot be shared (--exec, SQLite, a malformed URL), and `keel call
//    --share-breakers` is refused at once when the fleet's table says the host is down.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "build_kind.hpp"
#include "keel/core/breaker.hpp"
#include "keel/fleet/shared_breakers.hpp"
#include "support/jobs_process_support.hpp"
#include "support/waiting.hpp"

namespace keel::store {
namespace {

using namespace std::chrono_literals;
using test_jobs::CmdResult;
using test_jobs::Process;
using test_jobs::Receiver;
using Clock = std::chrono::steady_clock;

constexpr char kQueue[] = "fleet";
// The API's threads: one per connection a worker keeps alive, for 8 workers of 4 and the idle
// connections of the outage, which hold a thread until the server's keep-alive timeout (5 s):
// with too few, requests wait past their 1 s timeout after recovery, fail, and re-open the fleet.
constexpr int kReceiverThreads = 128;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::size_t occurrences(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// A fresh schema on the test server per test, or a database of the test's choosing.
class FleetDatabase : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto url = test::postgres_url();
    if (!url) GTEST_SKIP() << "no PostgreSQL test server (run through ctest)";
    url_ = *url;
  }
  void use_database(std::string url) { url_ = std::move(url); }
  [[nodiscard]] const std::string& url_text() const { return url_; }
  [[nodiscard]] DatabaseUrl url() const { return parse_database_url(url_).value(); }
  [[nodiscard]] const test::TempDir& dir() const { return dir_; }

 private:
  test::TempDir dir_;
  std::string url_;
};

using Workers = std::vector<std::unique_ptr<Process>>;

class FleetDrill : public test_jobs::JobsHarness<FleetDatabase> {
 protected:
  // The queue exists (workers may start on it) and holds no job.
  void create_empty_queue() {
    enqueue_many(kQueue, 1);
    auto conn = open_database(url());
    (void)conn->query("DELETE FROM keel_jobs WHERE queue = $1", {std::string(kQueue)});
  }
  // A worker that stays up when idle (the fleet starts before the jobs come), retries at a
  // backoff that spends a job's 25 attempts in about a second, and gets a lost lease back soon.
  std::vector<std::string> worker_args(const std::string& hook, bool share,
                                       const std::string& timeout = "1s") {
    std::vector<std::string> args = {"jobs",           "--db",  url_text(),      "work",
                                     "--queue",        kQueue,  "--deliver",     hook,
                                     "--backoff-base", "10ms",  "--backoff-cap", "50ms",
                                     "--idle-poll",    "100ms", "--concurrency", "4",
                                     "--timeout",      timeout, "--lease",       "1s"};
    if (share) args.emplace_back("--share-breakers");
    return args;
  }
  Workers start_fleet(int processes, const std::vector<std::string>& args, bool share) {
    Workers workers;
    for (int i = 0; i < processes; ++i) workers.push_back(spawn(args));
    const std::string up =
        share ? "keel jobs: breakers and pauses shared through" : "keel jobs: worker ";
    EXPECT_TRUE(every_said(workers, up, 30s)) << first_err(workers);
    return workers;
  }
  static bool every_said(const Workers& workers, const std::string& line,
                         std::chrono::milliseconds bound) {
    return test::wait_until(
        [&] {
          return std::all_of(workers.begin(), workers.end(), [&](const auto& w) {
            return w->err().find(line) != std::string::npos;
          });
        },
        bound);
  }
  static std::string first_err(const Workers& workers) {
    return workers.empty() ? std::string() : workers.front()->err();
  }
  static std::string every_err(const Workers& workers) {
    std::string all;
    for (const auto& w : workers) all += "--- worker " + std::to_string(w->pid()) + "\n" + w->err();
    return all;
  }
  // SIGTERM: each worker finishes and exits 0.
  static void stop_fleet(Workers& workers) {
    for (auto& w : workers) {
      if (!w->poll()) w->signal(SIGTERM);
    }
    for (auto& w : workers) EXPECT_EQ(w->wait(), 0) << w->err();
  }
  // One connection for the polls, which come every 5 ms (a connection each would cost the
  // server a process each, beside the workers').
  Connection& poller() {
    if (!poller_ || poller_url_ != url_text() || poller_->broken()) {
      poller_ = open_database(url());
      poller_url_ = url_text();
    }
    return *poller_;
  }
  std::int64_t done_jobs() {
    return poller().query("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'").integer(0, 0);
  }
  bool drained(int jobs, std::chrono::milliseconds bound) {
    return test::wait_until([&] { return done_jobs() == jobs; }, bound);
  }
  // No job dead, every job done and applied exactly once, never two deliveries at once.
  void expect_every_job_once(Receiver& api, int jobs) {
    EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'dead'"), 0);
    EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'"), jobs);
    std::lock_guard lock(api.mu);
    EXPECT_EQ(api.applied.size(), static_cast<std::size_t>(jobs));
    for (const auto& key : keys(kQueue)) EXPECT_EQ(api.applied.count(key), 1U) << key;
    EXPECT_EQ(api.overlaps, 0);
    EXPECT_EQ(api.missing_key, 0);
  }
  // The fleet's row for the API: probes and breaks (-1 when there is none).
  std::pair<std::int64_t, std::int64_t> probes_and_breaks() {
    auto conn = open_database(url());
    const Rows r = conn->query("SELECT probes, breaks FROM keel_breakers");
    if (r.size() != 1) return {-1, -1};
    return {r.integer(0, 0), r.integer(0, 1)};
  }

 private:
  std::unique_ptr<Connection> poller_;
  std::string poller_url_;
};

// ---------------------------------------------------------------------------------------------
// 8 processes sharing against 1 alone.

constexpr int kJobs = 60;

struct Phase {
  int requests_during_outage = 0;
  double outage_s = 0;
  int first_second = 0;  // requests in the first second after the first effect (the probe)
  double probe_s = 0;    // from the API's return to the fleet's successful probe
  double drain_s = 0;    // from the API's return to the last job done
  std::int64_t probes = -1;
  std::int64_t breaks = -1;
  std::string logs;  // every worker's, when the fleet broke more than once
};

class FleetOutage : public FleetDrill {
 protected:
  // One outage: `processes` workers idle on an empty queue, the API down, kJobs jobs at once;
  // down until every worker's breaker is open and then 3 s more (a job's 25 attempts take about
  // a second at this backoff), then back until the queue drains.
  void outage(int processes, bool share, Phase& phase) {
    Receiver api(2024, kReceiverThreads);
    api.set_outage(Receiver::kDown503);
    create_empty_queue();
    Workers workers = start_fleet(processes, worker_args(api.url("/hook"), share), share);
    ASSERT_FALSE(HasFailure());
    const auto start = Clock::now();
    enqueue_many(kQueue, kJobs);
    const bool open = every_said(workers, "keel jobs: circuit open for 127.0.0.1:", 30s) &&
                      test::wait_until(
                          [&] {
                            return count(
                                       "SELECT COUNT(*) FROM keel_job_attempts"
                                       " WHERE outcome = 'deferred'") > 0;
                          },
                          30s);
    ASSERT_TRUE(open) << "the breakers did not open and defer a job within 30 s\n"
                      << first_err(workers);
    std::this_thread::sleep_for(3s);
    phase.requests_during_outage = api.total_requests();
    phase.outage_s = seconds_since(start);

    api.set_outage(Receiver::kNone);
    const auto back = Clock::now();
    const auto applied = [&] {
      std::lock_guard lock(api.mu);
      return !api.applied.empty();
    };
    // The next probe is at most a break (5 s) away.
    ASSERT_TRUE(test::wait_until(applied, 20s)) << "no probe within 20 s\n" << first_err(workers);
    const auto recovered = Clock::now();
    phase.probe_s = std::chrono::duration<double>(recovered - back).count();
    const int at_recovery = api.total_requests();
    // Polled together: the requests of the first second, and the moment the last job is done.
    int first_second = -1;
    const bool done = test::wait_until(
        [&] {
          if (first_second < 0 && Clock::now() >= recovered + 1s) {
            first_second = api.total_requests() - at_recovery;
          }
          if (phase.drain_s == 0 && done_jobs() == kJobs) {
            phase.drain_s = seconds_since(back);
          }
          return first_second >= 0 && phase.drain_s > 0;
        },
        30s);
    ASSERT_TRUE(done) << "not drained within 30 s\n" << every_err(workers);
    phase.first_second = first_second;
    stop_fleet(workers);
    expect_every_job_once(api, kJobs);
    if (share) {
      std::tie(phase.probes, phase.breaks) = probes_and_breaks();
      if (phase.breaks != 1) phase.logs = every_err(workers);
      // Every worker opens once and closes once, after the fleet's one probe: the fleet does not
      // re-open just after recovery.
      for (const auto& w : workers) {
        const std::string log = w->err();
        EXPECT_EQ(occurrences(log, "circuit open for 127.0.0.1:"), 1U) << log;
        EXPECT_EQ(occurrences(log, "circuit closed for 127.0.0.1:"), 1U) << log;
      }
    }
  }
};

TEST_F(FleetOutage, EightSharingProcessesSendAtMostTwiceWhatOneSendsAndProbeOncePerBreak) {
  Phase alone;
  ASSERT_NO_FATAL_FAILURE(outage(1, false, alone));
  const auto fresh = test::postgres_url();
  ASSERT_TRUE(fresh);
  use_database(*fresh);
  Phase fleet;
  ASSERT_NO_FATAL_FAILURE(outage(8, true, fleet));
  std::printf(
      "fleet drill: requests during the outage: 1 process %d (%.1f s), 8 sharing %d (%.1f s); "
      "fleet probes %lld for %lld breaks; requests in the first second after the probe: 1 "
      "process %d, 8 sharing %d; drained %.1f s (1) and %.1f s (8) after the API was back, "
      "probe after %.1f s and %.1f s\n",
      alone.requests_during_outage, alone.outage_s, fleet.requests_during_outage, fleet.outage_s,
      static_cast<long long>(fleet.probes), static_cast<long long>(fleet.breaks),
      alone.first_second, fleet.first_second, alone.drain_s, fleet.drain_s, alone.probe_s,
      fleet.probe_s);
  // One process trips after its 20 calls; eight that share judge after their share of those
  // and open together, so the fleet costs the dependency at most twice as much.
  EXPECT_GE(alone.requests_during_outage, 20);
  EXPECT_LE(fleet.requests_during_outage, 2 * alone.requests_during_outage);
  // One break for the whole fleet, and one probe lease for it: a lease is granted again within a
  // break only when its holder died (the next test), and nobody died here. A second break just
  // after recovery is one process re-opening the whole fleet: the workers' logs say which.
  EXPECT_EQ(fleet.breaks, 1) << fleet.logs;
  EXPECT_EQ(fleet.probes, 1);
  // After the probe, each job is delivered once: nothing in the first second is a repeat.
  EXPECT_LE(fleet.first_second, kJobs);
  EXPECT_LE(alone.first_second, kJobs);
  if (test::kTimingAsserted) {
    // The probe comes at the end of the 5 s break; the rest drains within 3 s of it.
    EXPECT_LT(fleet.drain_s, 8.0);
    EXPECT_LT(fleet.drain_s - fleet.probe_s, 3.0);
    EXPECT_LT(alone.drain_s, 8.0);
  }
}

// ---------------------------------------------------------------------------------------------
// The prober killed while it holds the lease.

TEST_F(FleetDrill, AProberKilledHoldingTheLeaseIsReplacedAndItsJobIsDeliveredOnce) {
  constexpr int kKillJobs = 20;
  Receiver api(2024, kReceiverThreads);
  api.set_outage(Receiver::kDown503);
  create_empty_queue();
  // A 5 s timeout: the probe hangs in the API (its 3 s at most) until the test kills its sender.
  Workers workers = start_fleet(3, worker_args(api.url("/hook"), true, "5s"), true);
  ASSERT_FALSE(HasFailure());
  enqueue_many(kQueue, kKillJobs);
  const auto fleet_open = [&] {
    return poller()
               .query("SELECT COUNT(*) FROM keel_breakers WHERE state = 'open'")
               .integer(0, 0) == 1;
  };
  ASSERT_TRUE(test::wait_until(fleet_open, 30s)) << first_err(workers);
  api.set_outage(Receiver::kHang);  // from now on the API answers nothing: the probe hangs

  // The break ends (5 s) and one process takes the lease; its probe is in the API.
  std::string holder;
  std::string victim_key;
  const bool probing = test::wait_until(
      [&] {
        const Rows r = poller().query(
            "SELECT probe_holder FROM keel_breakers WHERE probe_holder IS NOT NULL"
            " AND probe_until > now()");
        if (r.empty()) return false;
        holder = r.text(0, 0);
        std::lock_guard lock(api.mu);
        for (const auto& [key, n] : api.in_flight) {
          if (n > 0) victim_key = key;
        }
        return !victim_key.empty();
      },
      20s);
  ASSERT_TRUE(probing) << "no probe in flight within 20 s\n" << first_err(workers);
  // The holder's name is host:pid:tag.
  const auto colon = holder.find(':');
  ASSERT_NE(colon, std::string::npos) << holder;
  const pid_t victim_pid = std::stoi(holder.substr(colon + 1));
  const auto victim = std::find_if(workers.begin(), workers.end(),
                                   [&](const auto& w) { return w->pid() == victim_pid; });
  ASSERT_NE(victim, workers.end()) << "the holder " << holder << " is none of the workers";
  (*victim)->signal(SIGKILL);
  EXPECT_EQ((*victim)->wait(), 128 + SIGKILL);
  workers.erase(victim);
  const auto killed = Clock::now();
  api.set_outage(Receiver::kNone);  // the hung request answers 503, applying nothing

  // The others wait out the dead prober's lease (10 s), then one of them probes and succeeds.
  ASSERT_TRUE(drained(kKillJobs, 40s)) << first_err(workers);
  const double drain_s = seconds_since(killed);
  stop_fleet(workers);
  expect_every_job_once(api, kKillJobs);
  {
    std::lock_guard lock(api.mu);
    EXPECT_EQ(api.applied.count(victim_key), 1U) << "the killed prober's job";
  }
  auto conn = open_database(url());
  const Rows row = conn->query("SELECT state, probes, breaks, updated_by FROM keel_breakers");
  ASSERT_EQ(row.size(), 1U);
  EXPECT_EQ(row.text(0, 0), "closed");
  const std::int64_t probes = row.integer(0, 1);
  const std::int64_t breaks = row.integer(0, 2);
  // The dead prober's lease, then its successor's: one probe more than breaks, no more.
  EXPECT_EQ(probes, breaks + 1);
  EXPECT_NE(row.text(0, 3), holder) << "the probe that closed the fleet was another process's";
  std::printf(
      "fleet drill, prober killed: probes %lld for %lld breaks, drained %.1f s after the kill "
      "(probe lease 10 s)\n",
      static_cast<long long>(probes), static_cast<long long>(breaks), drain_s);
  if (test::kTimingAsserted) {
    EXPECT_LT(drain_s, 14.0) << every_err(workers);
  }
}

// ---------------------------------------------------------------------------------------------
// The database restarted mid-outage.

// A PostgreSQL server of the test's own (scripts/pg-test-server.sh), paused and resumed on the
// same port; stopped and removed with the object.
class OwnServer {
 public:
  explicit OwnServer(const test::TempDir& dir) : state_((dir.path() / "pg").string()) {
    started_ = run("start");
  }
  ~OwnServer() {
    if (started_) (void)run("stop");
  }
  OwnServer(const OwnServer&) = delete;
  OwnServer& operator=(const OwnServer&) = delete;
  [[nodiscard]] bool started() const { return started_; }
  [[nodiscard]] std::string url() const {
    std::ifstream in(state_ + "/url");
    std::string url;
    in >> url;
    return url;
  }
  bool run(const std::string& action) const {
    const std::string command = std::string(KEEL_PG_TEST_SERVER) + " " + action + " '" + state_ +
                                "' >'" + state_ + "." + action + ".log' 2>&1";
    return std::system(command.c_str()) == 0;
  }
  // The server's processes: the postmaster, then its children (one per connection and the
  // server's own).
  [[nodiscard]] std::vector<pid_t> processes() const {
    std::string base;
    std::ifstream(state_ + "/datadir") >> base;
    pid_t postmaster = -1;
    std::ifstream(base + "/data/postmaster.pid") >> postmaster;
    std::vector<pid_t> out;
    if (postmaster <= 0) return out;
    out.push_back(postmaster);
    for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
      const std::string name = entry.path().filename().string();
      if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
      std::ifstream in(entry.path() / "stat");
      std::string stat;
      if (!std::getline(in, stat)) continue;
      // pid (comm) state ppid ...
      const auto end = stat.rfind(')');
      if (end == std::string::npos) continue;
      std::istringstream rest(stat.substr(end + 1));
      std::string state;
      pid_t parent = -1;
      rest >> state >> parent;
      if (parent == postmaster) out.push_back(std::stoi(name));
    }
    return out;
  }

 private:
  std::string state_;
  bool started_ = false;
};

// The server's processes stopped (SIGSTOP) until thaw() or the end of the scope: a database that
// accepts bytes and answers nothing, not even a timeout of its own.
class Frozen {
 public:
  explicit Frozen(std::vector<pid_t> processes) : processes_(std::move(processes)) {
    for (const pid_t pid : processes_) ::kill(pid, SIGSTOP);
  }
  ~Frozen() { thaw(); }
  Frozen(const Frozen&) = delete;
  Frozen& operator=(const Frozen&) = delete;
  void thaw() {
    for (const pid_t pid : processes_) ::kill(pid, SIGCONT);
    processes_.clear();
  }

 private:
  std::vector<pid_t> processes_;
};

TEST_F(FleetDrill, TheDatabaseRestartedMidOutageMeansOwnBreakersThenSharingAgain) {
  constexpr int kRestartJobs = 20;
  OwnServer server(dir());
  ASSERT_TRUE(server.started()) << "scripts/pg-test-server.sh start failed";
  use_database(server.url());
  Receiver api(2024, kReceiverThreads);
  api.set_outage(Receiver::kDown503);
  create_empty_queue();
  Workers workers = start_fleet(3, worker_args(api.url("/hook"), true), true);
  ASSERT_FALSE(HasFailure());
  enqueue_many(kQueue, kRestartJobs);
  ASSERT_TRUE(every_said(workers, "keel jobs: circuit open for 127.0.0.1:", 30s))
      << first_err(workers);

  ASSERT_TRUE(server.run("pause"));
  const std::string fallback = "shared breakers: the database is unreachable";
  EXPECT_TRUE(every_said(workers, fallback, 10s)) << first_err(workers);
  std::this_thread::sleep_for(1s);  // several reconnections fail meanwhile
  ASSERT_TRUE(server.run("resume"));
  const std::string again = "shared breakers: sharing again";
  EXPECT_TRUE(every_said(workers, again, 30s)) << first_err(workers);

  api.set_outage(Receiver::kNone);
  const auto back = Clock::now();
  ASSERT_TRUE(drained(kRestartJobs, 30s)) << first_err(workers);
  const double drain_s = seconds_since(back);
  stop_fleet(workers);
  expect_every_job_once(api, kRestartJobs);
  for (const auto& w : workers) {
    const std::string log = w->err();
    EXPECT_EQ(occurrences(log, fallback), 1U) << "said once\n" << log;
    EXPECT_EQ(occurrences(log, "each process keeps its own breakers"), 1U) << log;
    EXPECT_EQ(occurrences(log, again), 1U) << log;
  }
  std::printf("fleet drill, database restarted: drained %.1f s after the API was back\n", drain_s);
  if (test::kTimingAsserted) {
    EXPECT_LT(drain_s, 15.0) << every_err(workers);
  }
}

// ---------------------------------------------------------------------------------------------
// The breakers' database frozen: sharing never holds a call longer than round_trip_limit.

TEST_F(FleetDrill, TheBreakersDatabaseFrozenHoldsACallNoLongerThanTheRoundTripLimit) {
  OwnServer server(dir());
  ASSERT_TRUE(server.started()) << "scripts/pg-test-server.sh start failed";
  BreakerRegistryOptions breakers;
  breakers.breaker.window = BreakerWindow::kCount;
  breakers.breaker.window_calls = 2;
  breakers.breaker.minimum_calls = 2;
  breakers.breaker.break_duration = 200ms;
  BreakerRegistry registry(breakers);
  constexpr Duration kLimit = 100ms;
  SharedBreakersOptions options;
  options.round_trip_limit = kLimit;
  options.process = "frozen";
  options.on_notice = [](std::string_view) {};
  SharedBreakers shared(registry, parse_database_url(server.url()).value(), options);
  ASSERT_TRUE(shared.wait_until_sharing(10s));
  const auto api = registry.get("api:443");
  const auto db = registry.get("db:5432");
  for (const auto& b : {api, db}) {
    for (int i = 0; i < 2; ++i) b->record(b->try_acquire(), Outcome::transient());
    ASSERT_EQ(b->state(), BreakerState::kOpen);
  }
  ASSERT_TRUE(shared.flush(10s));
  ASSERT_TRUE(test::wait_until(
      [&] {
        return api->state() == BreakerState::kHalfOpen && db->state() == BreakerState::kHalfOpen;
      },
      10s));

  Frozen frozen(server.processes());
  // Each trial asks the fleet for the probe; the database answers nothing, and each call goes on
  // as if alone within the limit (the second at once: the database is known not to answer).
  BreakerPermit first;
  BreakerPermit second;
  Duration first_waited{};
  Duration second_waited{};
  std::atomic<bool> returned{false};
  std::thread caller([&] {
    auto asked = Clock::now();
    first = api->try_acquire();
    first_waited = Clock::now() - asked;
    asked = Clock::now();
    second = db->try_acquire();
    second_waited = Clock::now() - asked;
    returned.store(true);
  });
  const bool in_time = test::wait_until([&] { return returned.load(); }, 5s);
  frozen.thaw();  // a call still waiting returns now
  caller.join();
  ASSERT_TRUE(in_time) << "a call waited for the frozen database";
  EXPECT_TRUE(first.trial);
  EXPECT_TRUE(second.trial);
  EXPECT_GE(shared.stats().fallbacks, 2U);
  std::printf(
      "fleet drill, breakers' database frozen: the calls waited %.0f ms and %.0f ms "
      "(round_trip_limit %.0f ms)\n",
      std::chrono::duration<double, std::milli>(first_waited).count(),
      std::chrono::duration<double, std::milli>(second_waited).count(),
      std::chrono::duration<double, std::milli>(kLimit).count());
  if (test::kTimingAsserted) {
    EXPECT_LT(first_waited, kLimit + 50ms);
    EXPECT_LT(second_waited, kLimit + 50ms);
  }
  // Thawed, the probes' results are shared.
  api->record(first, Outcome::success());
  db->record(second, Outcome::success());
  ASSERT_TRUE(shared.flush(10s));
  auto conn = open_database(parse_database_url(server.url()).value());
  EXPECT_EQ(conn->query("SELECT count(*) FROM keel_breakers WHERE state = 'closed'").integer(0, 0),
            2);
}

TEST_F(FleetDrill, TheBreakersDatabaseFrozenDelaysNoJob) {
  if (!test::kTimingAsserted) {
    GTEST_SKIP() << "a drill of times; the test above checks the calls' bound in every build";
  }
  constexpr int kFrozenJobs = 10;
  OwnServer breakers_db(dir());
  ASSERT_TRUE(breakers_db.started()) << "scripts/pg-test-server.sh start failed";
  Receiver api(2024, kReceiverThreads);
  api.set_outage(Receiver::kDown503);
  create_empty_queue();
  std::vector<std::string> args = worker_args(api.url("/hook"), false);
  args.push_back("--share-breakers=" + breakers_db.url());
  Workers workers = start_fleet(1, args, true);
  ASSERT_FALSE(HasFailure());
  enqueue_many(kQueue, kFrozenJobs);
  std::int64_t probe_in_ms = 0;  // the end of the fleet's break
  {
    auto conn = open_database(parse_database_url(breakers_db.url()).value());
    ASSERT_TRUE(test::wait_until(
        [&] {
          const Rows r = conn->query(
              "SELECT ceil(extract(epoch FROM open_until - now()) * 1000)::bigint"
              " FROM keel_breakers WHERE state = 'open'");
          if (r.size() == 1) probe_in_ms = r.integer(0, 0);
          return r.size() == 1;
        },
        30s))
        << first_err(workers);
  }
  api.set_outage(Receiver::kNone);
  const auto back = Clock::now();
  // Frozen just before the probe is due: the sharing's own thread is then most likely idle, and
  // the probe's call is the first to ask the database.
  std::this_thread::sleep_for(
      std::chrono::milliseconds(std::max<std::int64_t>(0, probe_in_ms - 300)));
  double drain_s = 0;
  {
    Frozen frozen(breakers_db.processes());
    // The probe is at most a break (5 s) away; a call that waited for the database would wait
    // until the thaw.
    const bool done = drained(kFrozenJobs, 15s);
    drain_s = seconds_since(back);
    frozen.thaw();
    ASSERT_TRUE(done) << "not drained while the breakers' database was frozen\n"
                      << first_err(workers);
  }
  stop_fleet(workers);
  expect_every_job_once(api, kFrozenJobs);
  std::printf("fleet drill, breakers' database frozen: drained %.1f s after the API was back\n",
              drain_s);
  EXPECT_LT(drain_s, 9.0) << first_err(workers);
}

// ---------------------------------------------------------------------------------------------
// A row of keel_breakers edited by hand.

TEST_F(FleetDrill, ARowOpenWithoutAnEndDefersNoJobEveryMillisecond) {
  constexpr int kRowJobs = 10;
  Receiver api(2024, kReceiverThreads);
  const std::string hook = api.url("/hook");
  create_empty_queue();
  {
    // The tables exist (a process shared through them), and the API's row was left open without
    // an end.
    BreakerRegistry registry;
    SharedBreakers first(registry, url());
    ASSERT_TRUE(first.wait_until_sharing(10s));
  }
  const auto host = hook.find("//") + 2;
  const std::string key = hook.substr(host, hook.find('/', host) - host);
  {
    auto conn = open_database(url());
    (void)conn->query(
        "INSERT INTO keel_breakers (key, state, open_until, breaks, updated_by)"
        " VALUES ($1, 'open', NULL, 1, 'hand')",
        {key});
  }
  Workers workers = start_fleet(1, worker_args(hook, true), true);
  ASSERT_FALSE(HasFailure());
  enqueue_many(kQueue, kRowJobs);
  const bool done = drained(kRowJobs, 10s);
  const std::int64_t deferrals =
      count("SELECT COUNT(*) FROM keel_job_attempts WHERE outcome = 'deferred'");
  stop_fleet(workers);
  ASSERT_TRUE(done) << deferrals << " deferrals\n" << first_err(workers);
  expect_every_job_once(api, kRowJobs);
  std::printf("fleet drill, a row open without an end: %lld deferrals\n",
              static_cast<long long>(deferrals));
  EXPECT_LE(deferrals, kRowJobs);
  const std::string log = first_err(workers);
  EXPECT_EQ(occurrences(log, "keel_breakers row"), 1U) << log;
}

// ---------------------------------------------------------------------------------------------
// What the flags refuse.

TEST_F(FleetDrill, TheFlagsRefuseWhatCannotBeSharedNamingTheFlag) {
  create_empty_queue();
  const std::vector<std::string> work = {"jobs", "--db", url_text(), "work", "--queue", kQueue};
  const auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = work;
    args.insert(args.end(), extra.begin(), extra.end());
    return keel(args);
  };
  const std::string sqlite = "sqlite:" + (dir().path() / "breakers.db").string();
  for (const auto& extra : std::vector<std::vector<std::string>>{
           {"--exec", "true", "--share-breakers"},
           {"--deliver", "http://127.0.0.1:1/hook", "--share-breakers=" + sqlite},
           {"--deliver", "http://127.0.0.1:1/hook", "--share-breakers=postgresql://[::1"},
           {"--deliver", "http://127.0.0.1:1/hook", "--share-breakers=mysql://db/keel"}}) {
    const CmdResult r = with(extra);
    EXPECT_EQ(r.status, 2) << extra.back() << "\n" << r.err;
    EXPECT_NE(r.err.find("--share-fleet"), std::string::npos) << r.err;
  }
  // A SQLite queue shares through nothing unless told where.
  ASSERT_EQ(keel({"jobs", "--db", sqlite, "enqueue", "--queue", kQueue, "--payload", "{}"}).status,
            0);
  const CmdResult on_sqlite = keel({"jobs", "--db", sqlite, "work", "--queue", kQueue, "--deliver",
                                    "http://127.0.0.1:1/hook", "--share-breakers"});
  EXPECT_EQ(on_sqlite.status, 2) << on_sqlite.err;
  EXPECT_NE(on_sqlite.err.find("--share-fleet"), std::string::npos) << on_sqlite.err;
  EXPECT_EQ(keel({"call", "--share-breakers", sqlite, "http://127.0.0.1:1/"}).status, 2);
  EXPECT_EQ(keel({"call", "--share-breakers", "postgresql://[::1", "http://127.0.0.1:1/"}).status,
            2);
}

TEST_F(FleetDrill, CallIsRefusedAtOnceWhenTheFleetsTableSaysTheHostIsDown) {
  Receiver api(2024, kReceiverThreads);
  const std::string hook = api.url("/hook");
  // While the host is up the call goes through (and the fleet's table is created).
  const CmdResult up = keel({"call", "--share-breakers", url_text(), "-d", "{}", hook});
  ASSERT_EQ(up.status, 0) << up.err;
  ASSERT_EQ(api.total_requests(), 1);
  // The fleet found it down a moment ago.
  const std::string key =
      hook.substr(std::string("http://").size(),
                  hook.find('/', std::string("http://").size()) - std::string("http://").size());
  {
    auto conn = open_database(url());
    (void)conn->query(
        "INSERT INTO keel_breakers (key, state, open_until, breaks, updated_by)"
        " VALUES ($1, 'open', now() + interval '60 seconds', 1, 'elsewhere')",
        {key});
  }
  const auto started = Clock::now();
  const CmdResult refused = keel({"call", "--share-breakers", url_text(), "-d", "{}", hook});
  const double took = seconds_since(started);
  EXPECT_EQ(refused.status, 7) << refused.err;
  EXPECT_NE(refused.err.find("circuit"), std::string::npos) << refused.err;
  EXPECT_EQ(api.total_requests(), 1) << "no request sent";
  if (test::kTimingAsserted) {
    EXPECT_LT(took, 2.0);
  }
}

}  // namespace
}  // namespace keel::store
