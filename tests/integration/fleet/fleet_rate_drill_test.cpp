// The rate-limit drill: 8 real `keel jobs work --deliver --rate-limit 50/s` processes on one
// PostgreSQL against a loopback API that answers 429 to a request when it accepted 50 in the
// last second (docs/rate-limits.md quotes the figures this prints):
//  - Sharing (--share-fleet): the fleet keeps one schedule. No 1-second window holds more than
//    55 requests, 429s are at most 1% of the requests, and the queue drains at 45 jobs/s or more.
//  - Without sharing: each process keeps its own 50/s, and the fleet sends several times the
//    limit (the per-process rate, shown and asserted above 55 in a second).
//  - One process gets a 429 with Retry-After: 5: the fleet's requests stop within 1 s and resume
//    after 5 s (and within its release spread after that); no job loses an attempt to the pause
//    and none is dead.
// Timing bounds are asserted in the release build only (tests/build_kind.hpp); the sanitizer
// builds run the sharing and the pause with fewer jobs and check their outcomes, and skip the
// run without sharing, which shows only a rate.
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "build_kind.hpp"
#include "support/jobs_process_support.hpp"
#include "support/waiting.hpp"

namespace keel::store {
namespace {

using namespace std::chrono_literals;
using test_jobs::Process;
using Clock = std::chrono::steady_clock;

constexpr char kQueue[] = "rated";
constexpr int kRate = 50;
constexpr int kProcesses = 8;

// The API: 429 (without Retry-After) to a request that arrives when it accepted kRate in the
// last second; 200 otherwise, applying the job's effect once per Idempotency-Key. On demand, the
// next request gets a 429 with Retry-After: 5 instead.
class RateLimitedApi {
 public:
  // `limit` requests in any sliding `window`; `retry_after`: the header of every 429 over the
  // limit (empty: none); `always_429`: every request is refused.
  explicit RateLimitedApi(int limit = kRate, Clock::duration window = 1s,
                          std::string retry_after = {}, bool always_429 = false)
      : limit_(limit),
        window_(window),
        retry_after_(std::move(retry_after)),
        always_429_(always_429) {
    server_.new_task_queue = [] { return new httplib::ThreadPool(128); };
    server_.Post("/hook", [this](const httplib::Request& req, httplib::Response& res) {
      const std::string key = req.get_header_value("Idempotency-Key");
      std::lock_guard lock(mu_);
      const auto now = Clock::now();
      arrivals_.push_back(now);
      while (!accepted_.empty() && accepted_.front() <= now - window_) accepted_.pop_front();
      if (pause_next_) {
        pause_next_ = false;
        pause_at_ = now;
        pause_key_ = key;
        res.status = 429;
        res.set_header("Retry-After", "5");
        return;
      }
      if (always_429_ || static_cast<int>(accepted_.size()) >= limit_) {
        ++throttled_;
        res.status = 429;
        if (!retry_after_.empty()) res.set_header("Retry-After", retry_after_);
        return;
      }
      accepted_.push_back(now);
      ++applied_[key];
      res.status = 200;
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(1ms);
  }
  ~RateLimitedApi() {
    server_.stop();
    thread_.join();
  }
  [[nodiscard]] std::string url() const {
    return "http://127.0.0.1:" + std::to_string(port_) + "/hook";
  }
  void pause_next() {
    std::lock_guard lock(mu_);
    pause_next_ = true;
  }
  [[nodiscard]] std::vector<Clock::time_point> arrivals() {
    std::lock_guard lock(mu_);
    return arrivals_;
  }
  [[nodiscard]] int throttled() {
    std::lock_guard lock(mu_);
    return throttled_;
  }
  [[nodiscard]] std::map<std::string, int> applied() {
    std::lock_guard lock(mu_);
    return applied_;
  }
  [[nodiscard]] std::pair<Clock::time_point, std::string> pause() {
    std::lock_guard lock(mu_);
    return {pause_at_, pause_key_};
  }

 private:
  int limit_;
  Clock::duration window_;
  std::string retry_after_;
  bool always_429_;
  httplib::Server server_;
  std::thread thread_;
  int port_ = 0;
  std::mutex mu_;
  std::vector<Clock::time_point> arrivals_;  // guarded by mu_
  std::deque<Clock::time_point> accepted_;   // guarded by mu_: in the last second
  std::map<std::string, int> applied_;       // guarded by mu_
  int throttled_ = 0;                        // guarded by mu_
  bool pause_next_ = false;                  // guarded by mu_
  Clock::time_point pause_at_{};             // guarded by mu_
  std::string pause_key_;                    // guarded by mu_
};

// The most arrivals in any window of `width`.
int busiest(std::vector<Clock::time_point> t, Clock::duration width) {
  std::sort(t.begin(), t.end());
  int most = 0;
  for (std::size_t lo = 0, hi = 0; hi < t.size(); ++hi) {
    while (t[hi] - t[lo] >= width) ++lo;
    most = std::max(most, static_cast<int>(hi - lo + 1));
  }
  return most;
}

// Arrivals per whole second from the first, as "51 50 50 ...".
std::string per_second(std::vector<Clock::time_point> t) {
  if (t.empty()) return "";
  std::sort(t.begin(), t.end());
  std::vector<int> counts;
  for (const auto& at : t) {
    const auto s = static_cast<std::size_t>((at - t.front()) / 1s);
    if (counts.size() <= s) counts.resize(s + 1);
    ++counts[s];
  }
  std::string out;
  for (const int c : counts) out += (out.empty() ? "" : " ") + std::to_string(c);
  return out;
}

// A fresh schema on the test server per test.
class RateDatabase : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto url = test::postgres_url();
    if (!url) GTEST_SKIP() << "no PostgreSQL test server (run through ctest)";
    url_ = *url;
  }
  [[nodiscard]] const std::string& url_text() const { return url_; }
  [[nodiscard]] DatabaseUrl url() const { return parse_database_url(url_).value(); }
  [[nodiscard]] const test::TempDir& dir() const { return dir_; }

 private:
  std::string url_;
  test::TempDir dir_;
};

class FleetRateDrill : public test_jobs::JobsHarness<RateDatabase> {
 protected:
  using Workers = std::vector<std::unique_ptr<Process>>;

  struct FleetArgs {
    std::string rate = "50/s";
    int concurrency = 4;
    int processes = kProcesses;
    std::vector<std::string> extra;
  };
  Workers start_fleet(const std::string& hook, bool share) {
    return start_fleet(hook, share, FleetArgs{});
  }
  Workers start_fleet(const std::string& hook, bool share, const FleetArgs& f) {
    // The queue exists and holds no job: the fleet starts idle.
    enqueue_many(kQueue, 1);
    (void)open_database(url())->query("DELETE FROM keel_jobs WHERE queue = $1",
                                      {std::string(kQueue)});
    std::vector<std::string> args = {
        "jobs",           "--db",  url_text(),      "work",
        "--queue",        kQueue,  "--deliver",     hook,
        "--backoff-base", "10ms",  "--backoff-cap", "50ms",
        "--idle-poll",    "100ms", "--concurrency", std::to_string(f.concurrency),
        "--timeout",      "5s"};
    if (!f.rate.empty()) args.insert(args.end(), {"--rate-limit", f.rate});
    if (share) args.emplace_back("--share-fleet");
    args.insert(args.end(), f.extra.begin(), f.extra.end());
    Workers workers;
    for (int i = 0; i < f.processes; ++i) workers.push_back(spawn(args));
    const std::string up = share ? (f.rate.empty() ? "breakers and pauses shared through"
                                                   : "rate limits and pauses shared through")
                                 : "keel jobs: worker ";
    EXPECT_TRUE(test::wait_until(
        [&] {
          return std::all_of(workers.begin(), workers.end(),
                             [&](const auto& w) { return w->err().find(up) != std::string::npos; });
        },
        30s))
        << (workers.empty() ? "" : workers.front()->err());
    return workers;
  }
  static void stop_fleet(Workers& workers) {
    for (auto& w : workers) {
      if (!w->poll()) w->signal(SIGTERM);
    }
    for (auto& w : workers) EXPECT_EQ(w->wait(), 0) << w->err();
  }
  std::int64_t done() { return count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'"); }
  // Waits until `jobs` are done; returns the seconds from `from`, or a negative value.
  double drain(int jobs, Clock::time_point from, std::chrono::seconds bound) {
    double at = -1;
    (void)test::wait_until(
        [&] {
          if (done() < jobs) return false;
          at = std::chrono::duration<double>(Clock::now() - from).count();
          return true;
        },
        bound);
    return at;
  }
  void expect_every_job_once(RateLimitedApi& api, int jobs) {
    EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'dead'"), 0);
    EXPECT_EQ(done(), jobs);
    const auto applied = api.applied();
    EXPECT_EQ(applied.size(), static_cast<std::size_t>(jobs));
    for (const auto& [key, n] : applied) EXPECT_EQ(n, 1) << key;
  }
};

TEST_F(FleetRateDrill, EightSharingProcessesKeepOneRate) {
  const int jobs = test::kTimingAsserted ? 600 : 100;
  RateLimitedApi api;
  Workers workers = start_fleet(api.url(), /*share=*/true);
  ASSERT_FALSE(HasFailure());
  const auto start = Clock::now();
  enqueue_many(kQueue, jobs);
  const double drained = drain(jobs, start, 60s);
  ASSERT_GT(drained, 0) << "not drained within 60 s\n" << workers.front()->err();
  stop_fleet(workers);
  expect_every_job_once(api, jobs);
  const auto arrivals = api.arrivals();
  const int most = busiest(arrivals, 1s);
  const double share_429 = 100.0 * api.throttled() / static_cast<double>(arrivals.size());
  std::printf(
      "rate drill, 8 processes sharing --rate-limit 50/s: %d jobs in %.1f s (%.1f jobs/s), "
      "%zu requests, %d 429s (%.2f%%), busiest second %d; per second: %s\n",
      jobs, drained, jobs / drained, arrivals.size(), api.throttled(), share_429, most,
      per_second(arrivals).c_str());
  if (test::kTimingAsserted) {
    EXPECT_LE(most, 55);
    EXPECT_LE(share_429, 1.0);
    EXPECT_GE(jobs / drained, 45.0);
  }
}

TEST_F(FleetRateDrill, EightProcessesWithoutSharingSendThePerProcessRate) {
  if (!test::kTimingAsserted) GTEST_SKIP() << "a rate: shown in the release build only";
  const int jobs = 100;
  RateLimitedApi api;
  Workers workers = start_fleet(api.url(), /*share=*/false);
  ASSERT_FALSE(HasFailure());
  const auto start = Clock::now();
  enqueue_many(kQueue, jobs);
  const double drained = drain(jobs, start, 60s);
  ASSERT_GT(drained, 0) << "not drained within 60 s\n" << workers.front()->err();
  stop_fleet(workers);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'dead'"), 0);
  const auto arrivals = api.arrivals();
  const int most = busiest(arrivals, 1s);
  std::printf(
      "rate drill, 8 processes with their own --rate-limit 50/s: %d jobs in %.1f s, %zu "
      "requests, %d 429s (%.1f%%), busiest second %d; per second: %s\n",
      jobs, drained, arrivals.size(), api.throttled(),
      100.0 * api.throttled() / static_cast<double>(arrivals.size()), most,
      per_second(arrivals).c_str());
  EXPECT_GT(most, 55);
  EXPECT_GT(api.throttled(), 0);
}

TEST_F(FleetRateDrill, A429WithRetryAfterPausesTheFleetWithoutCostingAnAttempt) {
  const int jobs = test::kTimingAsserted ? 500 : 150;
  RateLimitedApi api;
  Workers workers = start_fleet(api.url(), /*share=*/true);
  ASSERT_FALSE(HasFailure());
  enqueue_many(kQueue, jobs);
  ASSERT_TRUE(test::wait_until([&] { return done() >= jobs / 5; }, 30s));
  api.pause_next();
  ASSERT_TRUE(test::wait_until([&] { return !api.pause().second.empty(); }, 10s));
  const auto [paused_at, paused_key] = api.pause();
  ASSERT_GT(drain(jobs, paused_at, 90s), 0) << "not drained\n" << workers.front()->err();
  stop_fleet(workers);
  expect_every_job_once(api, jobs);
  // The job that got the 429 was deferred, not charged.
  auto conn = open_database(url());
  const Rows paused_job =
      conn->query("SELECT attempts FROM keel_jobs WHERE idem_key = $1", {paused_key});
  ASSERT_EQ(paused_job.size(), 1u);
  EXPECT_EQ(paused_job.integer(0, 0), 1);
  // Jobs charged more than one attempt: only by a 429 without Retry-After (the API's rate), if
  // any; none by the pause.
  EXPECT_LE(count("SELECT COUNT(*) FROM keel_jobs WHERE attempts > 1"), api.throttled());
  // The requests after the pause's 429: none from 1 s after it until 5 s after it.
  int held = 0;
  Clock::time_point resumed{};
  for (const auto& at : api.arrivals()) {
    if (at <= paused_at) continue;
    if (at >= paused_at + 1s && at < paused_at + 5s) ++held;
    if (at >= paused_at + 1s && (resumed == Clock::time_point{} || at < resumed)) resumed = at;
  }
  const double resumed_s = std::chrono::duration<double>(resumed - paused_at).count();
  std::printf(
      "pause drill: after the 429 with Retry-After: 5, %d requests from 1 s to 5 s, the "
      "first again %.2f s after it\n",
      held, resumed_s);
  if (test::kTimingAsserted) {
    EXPECT_EQ(held, 0);
    EXPECT_GE(resumed_s, 5.0);
    EXPECT_LE(resumed_s, 8.0);  // within the release spread (1 s) and a worker's poll
  }
}

// Other operating points than 50/s x 4 jobs: low rates with few and many jobs per process, high
// rates with few and many, a per-minute quota with one job a process and with four (most of
// which wait longer than a job waits for a slot and are deferred). Each: no window over the
// rate + 10%, 429s at most 1% (one at the smallest counts), the queue drained at 85% of the rate
// or more without its tail (the first 90% of the requests), nothing dead, every job's effect
// once. Release build only: rates.
struct DrillPoint {
  std::string rate;
  int per_window;  // the API's limit in its window
  Clock::duration window;
  int concurrency;
  int jobs;
};

class FleetRatePoints : public FleetRateDrill {
 protected:
  void run_point(const DrillPoint& p) {
    if (!test::kTimingAsserted) GTEST_SKIP() << "rates: measured in the release build only";
    const std::string queue = std::string(kQueue) + "_points";
    RateLimitedApi api(p.per_window, p.window);
    enqueue_many(queue, 1);
    (void)open_database(url())->query("DELETE FROM keel_jobs WHERE queue = $1", {queue});
    std::vector<std::string> args = {
        "jobs",           "--db",  url_text(),      "work",
        "--queue",        queue,   "--deliver",     api.url(),
        "--backoff-base", "10ms",  "--backoff-cap", "50ms",
        "--idle-poll",    "100ms", "--concurrency", std::to_string(p.concurrency),
        "--timeout",      "5s",    "--rate-limit",  p.rate,
        "--share-fleet"};
    Workers workers;
    for (int i = 0; i < kProcesses; ++i) workers.push_back(spawn(args));
    ASSERT_TRUE(test::wait_until(
        [&] {
          return std::all_of(workers.begin(), workers.end(), [](const auto& w) {
            return w->err().find("rate limits and pauses shared through") != std::string::npos;
          });
        },
        30s));
    enqueue_many(queue, p.jobs);
    const auto done_here = [&] {
      return count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done' AND queue = '" + queue +
                   "'");
    };
    ASSERT_TRUE(test::wait_until([&] { return done_here() >= p.jobs; }, 90s))
        << p.rate << ": not drained\n"
        << workers.front()->err();
    stop_fleet(workers);
    EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'dead'"), 0) << p.rate;
    auto arrivals = api.arrivals();
    std::sort(arrivals.begin(), arrivals.end());
    ASSERT_FALSE(arrivals.empty());
    const int most = busiest(arrivals, p.window);
    const double share_429 = 100.0 * api.throttled() / static_cast<double>(arrivals.size());
    const double seconds =
        std::chrono::duration<double>(arrivals.back() - arrivals.front()).count();
    const double per_s = p.per_window / std::chrono::duration<double>(p.window).count();
    const double drained = (static_cast<double>(arrivals.size()) - 1) / std::max(seconds, 1e-3);
    // The drain without the tail: the first 90% of the requests. As the backlog runs out, the
    // last jobs wait for slots their processes do not hold, or come back from a deferral later
    // than their slot (docs/rate-limits.md, "The tail").
    const std::size_t body = std::max<std::size_t>(2, (arrivals.size() * 9 + 9) / 10);
    const double body_seconds =
        std::chrono::duration<double>(arrivals[body - 1] - arrivals.front()).count();
    const double drained_body = (static_cast<double>(body) - 1) / std::max(body_seconds, 1e-3);
    std::printf(
        "rate drill, 8 processes x %d jobs sharing --rate-limit %s: %d jobs, %zu requests in "
        "%.1f s (%.2f/s; %.2f/s without the tail), %d 429s (%.2f%%), busiest window %d of %d\n",
        p.concurrency, p.rate.c_str(), p.jobs, arrivals.size(), seconds, drained, drained_body,
        api.throttled(), share_429, most, p.per_window);
    // The bounds are 1% and 90% on a quiet machine (docs/rate-limits.md has the
    // figures); ctest runs these drills with nothing beside them (RUN_SERIAL: beside another test,
    // the 5/s points saw 2 429s and a busiest second of 6, slots sent tens of milliseconds late),
    // and the assertion still leaves room for the machine's timers: one 429 at the smallest
    // counts, and 85% of the rate. The bugs these
    // points caught were 4-17% 429s and 28-60% of the rate. At hundreds a second the drain is
    // bound by the machine as much as by the schedule (32 workers' requests on two cores: 307/s
    // of 500 beside a compile), so there it must show only that the bug (28%) is gone: half the
    // rate. The schedule's own drain is asserted in virtual time (rate_schedule_grid_test.cpp).
    EXPECT_LE(most, std::max(p.per_window + 1, static_cast<int>(p.per_window * 1.1))) << p.rate;
    EXPECT_LE(api.throttled(), std::max(1, static_cast<int>(arrivals.size() / 100))) << p.rate;
    EXPECT_GE(drained_body, (per_s >= 200 ? 0.5 : 0.85) * per_s) << p.rate;
    EXPECT_EQ(api.applied().size(), static_cast<std::size_t>(p.jobs)) << p.rate;
  }
};

TEST_F(FleetRatePoints, FivePerSecondWith4JobsAProcess) { run_point({"5/s", 5, 1s, 4, 60}); }
TEST_F(FleetRatePoints, FivePerSecondWith16JobsAProcess) { run_point({"5/s", 5, 1s, 16, 60}); }
TEST_F(FleetRatePoints, TwentyPerSecondWith4JobsAProcess) { run_point({"20/s", 20, 1s, 4, 160}); }
TEST_F(FleetRatePoints, TwentyPerSecondWith32JobsAProcess) { run_point({"20/s", 20, 1s, 32, 160}); }
TEST_F(FleetRatePoints, FiveHundredPerSecondWith4JobsAProcess) {
  run_point({"500/s", 500, 1s, 4, 2500});
}
TEST_F(FleetRatePoints, FivePerSecondWith32JobsAProcess) { run_point({"5/s", 5, 1s, 32, 60}); }
TEST_F(FleetRatePoints, FiveHundredPerSecondWith32JobsAProcess) {
  run_point({"500/s", 500, 1s, 32, 2500});
}
TEST_F(FleetRatePoints, SixtyPerMinuteWithAJobAProcess) { run_point({"60/m", 60, 60s, 1, 24}); }
TEST_F(FleetRatePoints, SixtyPerMinuteWith4JobsAProcess) { run_point({"60/m", 60, 60s, 4, 24}); }

// An hourly quota shared: 8 processes at 120/h (one call every 30 s) send one request in their
// first 25 s, not the 6 in 0.2 s a chunk read as garbage let through.
TEST_F(FleetRateDrill, AnHourlyQuotaSharedSendsOneCallPerItsInterval) {
  if (!test::kTimingAsserted) GTEST_SKIP() << "a rate: measured in the release build only";
  RateLimitedApi api(2, 60s);
  Workers workers = start_fleet(api.url(), /*share=*/true, {.rate = "120/h"});
  ASSERT_FALSE(HasFailure());
  enqueue_many(kQueue, 10);
  std::this_thread::sleep_for(25s);  // a window of the quota's own, in real time
  stop_fleet(workers);
  const auto arrivals = api.arrivals();
  std::printf("hourly drill, 8 processes sharing --rate-limit 120/h: %zu requests in 25 s\n",
              arrivals.size());
  EXPECT_EQ(arrivals.size(), 1u);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'dead'"), 0);
}

// An API that answers 429 with Retry-After: 0 to every request: each job's attempts are charged
// and backed off, and the job ends dead as throttled after its attempts, in a bounded number of
// requests (it was an endless loop of uncharged requests with a rate limit or --share-fleet on).
TEST_F(FleetRateDrill, RetryAfterZeroOnEveryRequestChargesTheJobsAndEndsThem) {
  RateLimitedApi api(kRate, 1s, "0", /*always_429=*/true);
  const int jobs = 6;
  Workers workers =
      start_fleet(api.url(), /*share=*/true, {.rate = "", .concurrency = 2, .processes = 2});
  ASSERT_FALSE(HasFailure());
  auto conn = open_database(url());
  JobQueue q;
  for (int i = 0; i < jobs; ++i) {
    ASSERT_TRUE(q.enqueue(*conn, {.queue = kQueue, .payload = "{}", .max_attempts = 3}).ok());
  }
  ASSERT_TRUE(test::wait_until(
      [&] { return count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'dead'") >= jobs; }, 60s))
      << workers.front()->err();
  stop_fleet(workers);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'dead' AND attempts = 3"), jobs);
  std::printf("Retry-After 0 drill: %d jobs of 3 attempts each, %zu requests, all dead\n", jobs,
              api.arrivals().size());
  // Each attempt may send up to the HTTP client's own attempts (one layer: the worker's client
  // makes one per job attempt): bounded, not a loop.
  EXPECT_LE(api.arrivals().size(), static_cast<std::size_t>(jobs * 3 * 3));
}

}  // namespace
}  // namespace keel::store
