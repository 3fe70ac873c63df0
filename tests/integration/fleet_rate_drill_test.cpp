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
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "build_kind.hpp"
#include "jobs_process_support.hpp"
#include "waiting.hpp"

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
  RateLimitedApi() {
    server_.new_task_queue = [] { return new httplib::ThreadPool(128); };
    server_.Post("/hook", [this](const httplib::Request& req, httplib::Response& res) {
      const std::string key = req.get_header_value("Idempotency-Key");
      std::lock_guard lock(mu_);
      const auto now = Clock::now();
      arrivals_.push_back(now);
      while (!accepted_.empty() && accepted_.front() <= now - 1s) accepted_.pop_front();
      if (pause_next_) {
        pause_next_ = false;
        pause_at_ = now;
        pause_key_ = key;
        res.status = 429;
        res.set_header("Retry-After", "5");
        return;
      }
      if (static_cast<int>(accepted_.size()) >= kRate) {
        ++throttled_;
        res.status = 429;
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

  Workers start_fleet(const std::string& hook, bool share) {
    // The queue exists and holds no job: the fleet starts idle.
    enqueue_many(kQueue, 1);
    (void)open_database(url())->query("DELETE FROM keel_jobs WHERE queue = $1",
                                      {std::string(kQueue)});
    std::vector<std::string> args = {"jobs",           "--db",  url_text(),      "work",
                                     "--queue",        kQueue,  "--deliver",     hook,
                                     "--backoff-base", "10ms",  "--backoff-cap", "50ms",
                                     "--idle-poll",    "100ms", "--concurrency", "4",
                                     "--timeout",      "5s",    "--rate-limit",  "50/s"};
    if (share) args.emplace_back("--share-fleet");
    Workers workers;
    for (int i = 0; i < kProcesses; ++i) workers.push_back(spawn(args));
    const std::string up = share ? "rate limits and pauses shared through" : "keel jobs: worker ";
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

}  // namespace
}  // namespace keel::store
