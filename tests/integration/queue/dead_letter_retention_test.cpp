// The dead-letter retention on real SQLite files and a real PostgreSQL server, in virtual time
// (ManualClock): without a retention nothing ever prunes a dead job; with one, jobs past it are
// pruned (in batches, with their history) and counted, jobs inside the warning window are
// reported as expiring before they go, a replayed job is not pruned, and the Worker's
// housekeeping prunes and reports what it pruned.
#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#include "keel/core/duration.hpp"
#include "keel/queue/queue.hpp"
#include "keel/queue/queue_worker.hpp"
#include "support/test_support.hpp"

namespace keel::store {
namespace {

using namespace std::chrono_literals;

constexpr Duration kWeek = 168h;

class DeadLetterRetentionTest : public test::BackendTest {
 protected:
  void SetUp() override {
    test::BackendTest::SetUp();
    if (IsSkipped()) return;
    conn_ = open_database(url());
    JobQueue::migrate(*conn_);
  }

  [[nodiscard]] JobQueue make_queue(QueueOptions o = {}) {
    o.max_attempts = 1;
    o.clock = &clock_;
    o.seed = 42;
    return JobQueue(o);
  }

  // Enqueues a job on `queue` and lets it fail permanently now: dead at now_ms().
  std::int64_t kill(const JobQueue& q, const std::string& queue = "q") {
    const auto job = q.enqueue(*conn_, {.queue = queue, .payload = "{}"});
    EXPECT_TRUE(job.ok()) << job.error;
    auto leased = q.lease(*conn_, queue, "w", 1);
    EXPECT_EQ(leased.size(), 1u);
    const auto r = q.complete(*conn_, leased.at(0).id, leased.at(0).fence,
                              {.outcome = Outcome::permanent(), .error = "HTTP 400"});
    EXPECT_EQ(r.status, CompleteStatus::kDead);
    return job.id;
  }

  [[nodiscard]] std::int64_t expiring_in_stats(const JobQueue& q, const std::string& queue) {
    for (const QueueStats& s : q.stats(*conn_)) {
      if (s.queue == queue) return s.dead_expiring;
    }
    ADD_FAILURE() << "no stats for queue " << queue;
    return -1;
  }

  [[nodiscard]] std::int64_t count(const std::string& sql) {
    return conn_->query(sql).integer(0, 0);
  }

  ManualClock clock_;
  std::unique_ptr<Connection> conn_;
};

TEST_P(DeadLetterRetentionTest, WithoutARetentionNothingIsEverPruned) {
  const JobQueue q = make_queue();
  const std::int64_t id = kill(q);
  clock_.advance(24h * 365 * 10);
  EXPECT_EQ(q.prune_dead(*conn_, "q"), 0);
  EXPECT_EQ(q.prune_dead(*conn_), 0);
  EXPECT_EQ(q.dead_expiring(*conn_, "q", 24h * 365), 0);
  EXPECT_EQ(expiring_in_stats(q, "q"), 0);
  EXPECT_EQ(q.dead_depth(*conn_, "q"), 1);
  EXPECT_TRUE(q.get(*conn_, id).has_value());
}

TEST_P(DeadLetterRetentionTest, JobsInsideTheWarningWindowAreExpiringBeforeTheyArePruned) {
  const JobQueue q = make_queue({.dead_letter_retention = kWeek, .dead_letter_warning = 24h});
  const std::int64_t a = kill(q);
  clock_.advance(72h);
  const std::int64_t b = kill(q);
  EXPECT_EQ(expiring_in_stats(q, "q"), 0) << "both have days left";

  // a is pruned in 23 h: expiring; b still has four days.
  clock_.advance(73h);
  EXPECT_EQ(expiring_in_stats(q, "q"), 1);
  EXPECT_EQ(q.dead_expiring(*conn_, "q", 24h), 1);
  EXPECT_EQ(q.dead_expiring(*conn_, "q", 22h), 0);
  EXPECT_EQ(q.dead_expiring(*conn_, "q", 24h * 5), 2);
  EXPECT_EQ(q.dead_expiring(*conn_, {}, 24h), 1);
  EXPECT_EQ(q.prune_dead(*conn_, "q"), 0) << "nothing is past the retention yet";
  EXPECT_EQ(q.dead_depth(*conn_, "q"), 2);

  // Past a's retention: still counted as expiring until pruned, then gone with its history.
  clock_.advance(23h + 1ms);
  EXPECT_EQ(expiring_in_stats(q, "q"), 1);
  EXPECT_EQ(q.prune_dead(*conn_, "q"), 1);
  EXPECT_FALSE(q.get(*conn_, a).has_value());
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_job_attempts WHERE job_id = " + std::to_string(a)), 0);
  ASSERT_TRUE(q.get(*conn_, b).has_value());
  EXPECT_EQ(q.get(*conn_, b)->history.size(), 1u);
  EXPECT_EQ(expiring_in_stats(q, "q"), 0);
  EXPECT_EQ(q.prune_dead(*conn_, "q"), 0);

  clock_.advance(72h);
  EXPECT_EQ(q.prune_dead(*conn_, "q"), 1);
  EXPECT_EQ(q.dead_depth(*conn_), 0);
}

TEST_P(DeadLetterRetentionTest, PrunesInBatchesOldestFirst) {
  const JobQueue q = make_queue({.dead_letter_retention = 1h});
  std::vector<std::int64_t> ids;
  for (int i = 0; i < 5; ++i) {
    ids.push_back(kill(q));
    clock_.advance(1s);
  }
  clock_.advance(1h);
  EXPECT_EQ(q.prune_dead(*conn_, "q", 2), 2);
  EXPECT_FALSE(q.get(*conn_, ids[0]).has_value());
  EXPECT_FALSE(q.get(*conn_, ids[1]).has_value());
  EXPECT_TRUE(q.get(*conn_, ids[2]).has_value());
  EXPECT_EQ(q.prune_dead(*conn_, "q", 2), 2);
  EXPECT_EQ(q.prune_dead(*conn_, "q", 2), 1);
  EXPECT_EQ(q.prune_dead(*conn_, "q", 2), 0);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_job_attempts"), 0);
  EXPECT_THROW((void)q.prune_dead(*conn_, "q", 0), std::invalid_argument);
}

TEST_P(DeadLetterRetentionTest, AReplayedJobIsNotPrunedAndDyingAgainRestartsItsRetention) {
  const JobQueue q = make_queue({.dead_letter_retention = kWeek, .dead_letter_warning = 24h});
  const std::int64_t id = kill(q);
  clock_.advance(kWeek - 1h);
  EXPECT_EQ(expiring_in_stats(q, "q"), 1);
  // The operator answers the alert: replay.
  ASSERT_EQ(q.replay(*conn_, {id}), std::vector<std::int64_t>{id});
  EXPECT_EQ(expiring_in_stats(q, "q"), 0);
  clock_.advance(kWeek * 4);
  EXPECT_EQ(q.prune_dead(*conn_, "q"), 0);
  ASSERT_TRUE(q.get(*conn_, id).has_value());
  EXPECT_EQ(q.get(*conn_, id)->state, JobState::kReady);

  // It fails again: a new week starts from this death, and the history of both rounds is kept.
  auto leased = q.lease(*conn_, "q", "w", 1);
  ASSERT_EQ(leased.size(), 1u);
  ASSERT_EQ(q.complete(*conn_, id, leased[0].fence, {.outcome = Outcome::permanent()}).status,
            CompleteStatus::kDead);
  EXPECT_EQ(expiring_in_stats(q, "q"), 0);
  clock_.advance(kWeek - 1h);
  EXPECT_EQ(q.prune_dead(*conn_, "q"), 0);
  EXPECT_EQ(q.get(*conn_, id)->history.size(), 2u);
  clock_.advance(1h);
  EXPECT_EQ(q.prune_dead(*conn_, "q"), 1);
  EXPECT_FALSE(q.get(*conn_, id).has_value());
}

TEST_P(DeadLetterRetentionTest, PruningOneQueueLeavesTheOthersAndLiveJobs) {
  const JobQueue q = make_queue({.dead_letter_retention = 1h});
  (void)kill(q, "q");
  const std::int64_t other = kill(q, "other");
  const auto ready = q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  (void)q.enqueue(*conn_, {.queue = "done", .payload = "{}"});
  auto l = q.lease(*conn_, "done", "w", 1);
  ASSERT_EQ(l.size(), 1u);
  (void)q.complete(*conn_, l[0].id, l[0].fence, AttemptReport::success());
  clock_.advance(2h);
  EXPECT_EQ(expiring_in_stats(q, "other"), 1);
  EXPECT_EQ(q.prune_dead(*conn_, "q"), 1);
  EXPECT_TRUE(q.get(*conn_, other).has_value());
  EXPECT_TRUE(q.get(*conn_, ready.id).has_value());
  EXPECT_EQ(q.prune_dead(*conn_), 1) << "an empty queue name: every queue";
  EXPECT_FALSE(q.get(*conn_, other).has_value());
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs"), 2) << "ready and done jobs stay";
}

TEST_P(DeadLetterRetentionTest, InvalidRetentionsAreRefusedWhenTheQueueIsBuilt) {
  EXPECT_THROW(JobQueue({.dead_letter_retention = Duration::zero()}), std::invalid_argument);
  EXPECT_THROW(JobQueue({.dead_letter_retention = -1s}), std::invalid_argument);
  EXPECT_THROW(JobQueue({.dead_letter_warning = -1s}), std::invalid_argument);
  const JobQueue q = make_queue({.dead_letter_retention = 1h, .dead_letter_warning = 0s});
  EXPECT_THROW((void)q.dead_expiring(*conn_, "q", -1s), std::invalid_argument);
}

TEST_P(DeadLetterRetentionTest, AWarningWindowAsLongAsTheRetentionIsRefusedNamingBoth) {
  for (const auto& [retention, warning] :
       {std::pair<Duration, Duration>{1ms, 24h}, {1h, 1h}, {kWeek, kWeek + 2h}}) {
    try {
      const JobQueue q({.dead_letter_retention = retention, .dead_letter_warning = warning});
      ADD_FAILURE() << format_duration(retention) << " / " << format_duration(warning);
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("dead_letter_warning"), std::string::npos) << what;
      EXPECT_NE(what.find("dead_letter_retention (" + format_duration(retention) + ")"),
                std::string::npos)
          << what;
      EXPECT_NE(what.find("(got " + format_duration(warning) + ")"), std::string::npos) << what;
    }
  }
  // Shorter is fine; without a retention any window is (nothing is pruned).
  EXPECT_NO_THROW(JobQueue({.dead_letter_retention = 1h, .dead_letter_warning = 59min}));
  EXPECT_NO_THROW(JobQueue({.dead_letter_warning = kWeek}));
}

TEST_P(DeadLetterRetentionTest, TheDefaultWarningWindowIsADayOrHalfTheRetention) {
  EXPECT_EQ(JobQueue().options().dead_letter_warning, 24h);
  EXPECT_EQ(JobQueue({.dead_letter_retention = kWeek}).options().dead_letter_warning, 24h);
  EXPECT_EQ(JobQueue({.dead_letter_retention = 48h}).options().dead_letter_warning, 24h);
  EXPECT_EQ(JobQueue({.dead_letter_retention = 2h}).options().dead_letter_warning, 1h);
  EXPECT_EQ(JobQueue({.dead_letter_retention = 1ms}).options().dead_letter_warning, 500us);
  EXPECT_EQ(JobQueue({.dead_letter_retention = 2h, .dead_letter_warning = 90min})
                .options()
                .dead_letter_warning,
            90min)
      << "an explicit window is kept";
  // With a 2 h retention, a job dead for 61 min is within the default 1 h window: counted before
  // it goes.
  const JobQueue q = make_queue({.dead_letter_retention = 2h});
  (void)kill(q);
  clock_.advance(59min);
  EXPECT_EQ(expiring_in_stats(q, "q"), 0);
  clock_.advance(2min);
  EXPECT_EQ(expiring_in_stats(q, "q"), 1);
  EXPECT_EQ(q.prune_dead(*conn_, "q"), 0) << "counted, not yet pruned";
}

TEST_P(DeadLetterRetentionTest, TheWorkerPrunesPastTheRetentionAndReportsIt) {
  // A short lease: heartbeats (and with them the housekeeping) every 10 ms of real time.
  const JobQueue q = make_queue({.lease = 30ms, .dead_letter_retention = kWeek});
  const std::int64_t old_job = kill(q);
  clock_.advance(kWeek - 1h);
  const std::int64_t young = kill(q);
  clock_.advance(2h);
  ConnectionPool pool(url(), {.max_connections = 3});
  std::mutex mu;
  std::condition_variable cv;
  std::int64_t pruned = 0;
  std::vector<std::string> lines;
  WorkerOptions options{.queue = "q", .poll_interval = 5ms, .grace = 50ms};
  options.on_dead_letters_pruned = [&](std::int64_t n) {
    std::lock_guard lock(mu);
    pruned += n;
    cv.notify_all();
  };
  options.log = [&](std::string_view line) {
    std::lock_guard lock(mu);
    lines.emplace_back(line);
  };
  Worker worker(pool, q, options, [](const LeasedJob&, const std::atomic<bool>&) {
    return AttemptReport::success();
  });
  std::thread runner([&] { (void)worker.run(); });
  {
    std::unique_lock lock(mu);
    EXPECT_TRUE(cv.wait_for(lock, 30s, [&] { return pruned > 0; }));
  }
  worker.stop();
  runner.join();
  EXPECT_EQ(pruned, 1);
  EXPECT_FALSE(q.get(*conn_, old_job).has_value());
  EXPECT_TRUE(q.get(*conn_, young).has_value());
  bool logged = false;
  for (const std::string& line : lines) {
    logged = logged || line.find("pruned 1 dead job(s) of queue 'q'") != std::string::npos;
  }
  EXPECT_TRUE(logged) << "a prune is never silent";
}

INSTANTIATE_TEST_SUITE_P(Backends, DeadLetterRetentionTest,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

}  // namespace
}  // namespace keel::store
