// keel::store::dead_letters on real SQLite files and a real PostgreSQL server, in virtual time
// (ManualClock): filters by queue, dead reason and time of death; paced replays whose run_at
// times are spread at the rate and leased at that rate; dry runs that change nothing; discards
// by filter; and dead jobs that pruning done jobs leaves alone.
#include "keel/queue/dead_letters.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "keel/queue/queue.hpp"
#include "support/test_support.hpp"

namespace keel::store {
namespace {

using namespace std::chrono_literals;

class DlqFilterTest : public test::BackendTest {
 protected:
  void SetUp() override {
    test::BackendTest::SetUp();
    if (IsSkipped()) return;
    conn_ = open_database(url());
    JobQueue::migrate(*conn_);
  }

  [[nodiscard]] JobQueue make_queue() {
    return JobQueue({.max_attempts = 1, .clock = &clock_, .seed = 42});
  }

  // Enqueues a job on `queue` and lets it fail permanently with `error` now: dead at now_ms().
  std::int64_t kill(const JobQueue& q, const std::string& queue, const std::string& error) {
    const auto job = q.enqueue(*conn_, {.queue = queue, .payload = "{}"});
    EXPECT_TRUE(job.ok()) << job.error;
    auto leased = q.lease(*conn_, queue, "w", 1);
    EXPECT_EQ(leased.size(), 1u);
    const auto r = q.complete(*conn_, leased.at(0).id, leased.at(0).fence,
                              {.outcome = Outcome::permanent(), .error = error});
    EXPECT_EQ(r.status, CompleteStatus::kDead);
    return job.id;
  }

  [[nodiscard]] static std::vector<std::int64_t> ids(const std::vector<DeadLetter>& jobs) {
    std::vector<std::int64_t> out;
    for (const auto& j : jobs) out.push_back(j.id);
    return out;
  }

  [[nodiscard]] std::int64_t count(const std::string& sql) {
    return conn_->query(sql).integer(0, 0);
  }

  ManualClock clock_;
  std::unique_ptr<Connection> conn_;
};

TEST_P(DlqFilterTest, FiltersByQueueReasonAndTimeOfDeath) {
  const JobQueue q = make_queue();
  const std::int64_t t0 = q.now_ms();
  const std::int64_t a = kill(q, "webhooks", "HTTP 503 from hooks.example");
  clock_.advance(1h);
  const std::int64_t b = kill(q, "webhooks", "HTTP 400: bad signature");
  const std::int64_t c = kill(q, "email", "HTTP 503 from smtp relay");
  clock_.advance(1h);
  const std::int64_t d = kill(q, "webhooks", "HTTP 503 from hooks.example");
  const std::int64_t t1 = t0 + 3600 * 1000;  // b and c died exactly here

  EXPECT_EQ(ids(dead_letters::select(*conn_, {})), (std::vector<std::int64_t>{a, b, c, d}));
  EXPECT_EQ(ids(dead_letters::select(*conn_, {.queue = "webhooks"})),
            (std::vector<std::int64_t>{a, b, d}));
  EXPECT_EQ(ids(dead_letters::select(*conn_, {.reason_contains = "HTTP 503"})),
            (std::vector<std::int64_t>{a, c, d}));
  EXPECT_TRUE(dead_letters::select(*conn_, {.reason_contains = "http 503"}).empty())
      << "case-sensitive";
  EXPECT_TRUE(dead_letters::select(*conn_, {.reason_contains = "HTTP 5%"}).empty())
      << "no LIKE wildcards";
  // died-after is inclusive, died-before exclusive: the two split time cleanly.
  EXPECT_EQ(ids(dead_letters::select(*conn_, {.died_at_or_after_ms = t1})),
            (std::vector<std::int64_t>{b, c, d}));
  EXPECT_EQ(ids(dead_letters::select(*conn_, {.died_before_ms = t1})),
            (std::vector<std::int64_t>{a}));
  EXPECT_EQ(ids(dead_letters::select(*conn_, {.queue = "webhooks",
                                              .reason_contains = "503",
                                              .died_at_or_after_ms = t1,
                                              .died_before_ms = t1 + 1})),
            (std::vector<std::int64_t>{}));
  EXPECT_EQ(ids(dead_letters::select(*conn_, {.ids = {d, a, 99999}})),
            (std::vector<std::int64_t>{a, d}));
  const auto one = dead_letters::select(*conn_, {.queue = "email"});
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].died_ms, t1);
  EXPECT_EQ(one[0].dead_reason, "permanent: HTTP 503 from smtp relay");
  EXPECT_EQ(one[0].attempts, 1);
  EXPECT_EQ(dead_letters::select(*conn_, {}, 2).size(), 2u);
}

// Ten dead jobs replayed at 4 per second: due at +0, 250, 500, ... 2250 ms, oldest death first,
// in one transaction; the queue hands them out at that rate as virtual time passes.
TEST_P(DlqFilterTest, PacedReplaySpreadsRunAtAtTheRate) {
  const JobQueue q = make_queue();
  std::vector<std::int64_t> dead;
  for (int i = 0; i < 10; ++i) {
    dead.push_back(kill(q, "webhooks", "HTTP 503"));
    clock_.advance(1s);
  }
  (void)kill(q, "other", "HTTP 503");  // not selected
  const std::int64_t now = q.now_ms();

  const auto plan =
      dead_letters::plan_replay(*conn_, {.queue = "webhooks"}, {.per_second = 4}, clock_);
  EXPECT_EQ(q.dead_depth(*conn_, "webhooks"), 10) << "a dry run changes nothing";
  const auto moved = dead_letters::replay(*conn_, {.queue = "webhooks"}, {.per_second = 4}, clock_);
  ASSERT_EQ(moved.size(), 10u);
  EXPECT_EQ(ids(moved), dead);
  EXPECT_EQ(ids(plan), dead);
  for (std::size_t i = 0; i < moved.size(); ++i) {
    EXPECT_EQ(moved[i].run_at_ms, now + static_cast<std::int64_t>(i) * 250) << i;
    EXPECT_EQ(plan[i].run_at_ms, moved[i].run_at_ms) << i;
    EXPECT_EQ(q.get(*conn_, moved[i].id)->run_at_ms, moved[i].run_at_ms) << i;
  }
  EXPECT_EQ(q.dead_depth(*conn_, "webhooks"), 0);
  EXPECT_EQ(q.dead_depth(*conn_, "other"), 1);

  // The queue releases them at the rate: one now, then one per 250 ms.
  std::vector<std::int64_t> leased;
  for (int step = 0; step < 10; ++step) {
    auto got = q.lease(*conn_, "webhooks", "w", 100);
    ASSERT_EQ(got.size(), 1u) << "step " << step;
    leased.push_back(got[0].id);
    EXPECT_EQ(got[0].attempt, 1);
    clock_.advance(250ms);
  }
  EXPECT_EQ(leased, dead);
}

// A replay here is JobQueue::replay's: every column it resets, reset the same way.
TEST_P(DlqFilterTest, ReplayResetsTheSameColumnsAsJobQueueReplay) {
  const JobQueue q = make_queue();
  const std::int64_t a = kill(q, "q", "boom");
  const std::int64_t b = kill(q, "q", "boom");
  conn_->query(
      "UPDATE keel_jobs SET limited_retries = 1, prev_delay_ms = 7, deferred_reason = 'x',"
      " deferrals = 2");
  const std::string columns =
      "SELECT state, attempts, fence, replays, run_at_ms, dead_reason, finished_ms,"
      " limited_retries, prev_delay_ms, deferred_reason, deferrals, updated_ms FROM keel_jobs"
      " WHERE id = $1";
  EXPECT_EQ(q.replay(*conn_, {a}), std::vector<std::int64_t>{a});
  ASSERT_EQ(dead_letters::replay(*conn_, {.ids = {b}}, {}, clock_).size(), 1u);
  const Rows ra = conn_->query(columns, {a});
  const Rows rb = conn_->query(columns, {b});
  for (std::size_t col = 0; col < ra.columns(); ++col) {
    EXPECT_EQ(ra.cell(0, col), rb.cell(0, col)) << ra.column_names()[col];
  }
  EXPECT_EQ(ra.text(0, 0), "ready");
  EXPECT_EQ(ra.integer(0, 3), 1);
  EXPECT_FALSE(ra.cell(0, 5).has_value());
  // Replaying again finds nothing: they are not dead any more.
  EXPECT_TRUE(dead_letters::replay(*conn_, {.ids = {a, b}}, {}, clock_).empty());
}

TEST_P(DlqFilterTest, DiscardByFilterDeletesOnlyTheSelectedJobsAndTheirHistory) {
  const JobQueue q = make_queue();
  const std::int64_t a = kill(q, "q", "HTTP 400: bad field");
  const std::int64_t b = kill(q, "q", "HTTP 503");
  const auto ready = q.enqueue(*conn_, {.queue = "q", .payload = "{}"});
  EXPECT_EQ(dead_letters::discard(*conn_, {.reason_contains = "HTTP 400"}),
            std::vector<std::int64_t>{a});
  EXPECT_FALSE(q.get(*conn_, a).has_value());
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_job_attempts WHERE job_id = " + std::to_string(a)), 0);
  EXPECT_TRUE(q.get(*conn_, b).has_value());
  EXPECT_TRUE(dead_letters::discard(*conn_, {.ids = {ready.id}}).empty()) << "not dead";
  EXPECT_TRUE(q.get(*conn_, ready.id).has_value());
}

// Without a dead-letter retention nothing prunes dead jobs: pruning done jobs never touches them.
TEST_P(DlqFilterTest, NothingPrunesDeadJobs) {
  const JobQueue q = make_queue();
  (void)kill(q, "q", "boom");
  clock_.advance(24h * 365);
  EXPECT_EQ(q.prune_done(*conn_, "q", Duration::zero()), 0);
  EXPECT_EQ(q.dead_depth(*conn_, "q"), 1);
}

TEST_P(DlqFilterTest, ABadPaceIsRefused) {
  EXPECT_THROW((void)dead_letters::replay(*conn_, {}, {.per_second = -1}, clock_),
               std::invalid_argument);
  EXPECT_THROW((void)dead_letters::plan_replay(*conn_, {}, {.per_second = 1.0 / 0.0}, clock_),
               std::invalid_argument);
}

INSTANTIATE_TEST_SUITE_P(Backends, DlqFilterTest,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

TEST(DlqTimeBound, ParsesRfc3339AndDurationsAgo) {
  const std::int64_t now = 1'764'583'200'000;  // 2025-12-01T10:00:00Z
  EXPECT_EQ(dead_letters::parse_time_bound("2025-12-01T10:00:00Z", 0), now);
  EXPECT_EQ(dead_letters::parse_time_bound("2025-12-01T11:00:00+01:00", 0), now);
  EXPECT_EQ(dead_letters::parse_time_bound("2025-12-01T09:30:00-00:30", 0), now);
  EXPECT_EQ(dead_letters::parse_time_bound("2025-12-01t10:00:00.250z", 0), now + 250);
  EXPECT_EQ(dead_letters::parse_time_bound("2024-02-29T00:00:00Z", 0), 1'709'164'800'000);
  EXPECT_EQ(dead_letters::parse_time_bound("1h", now), now - 3'600'000);
  EXPECT_EQ(dead_letters::parse_time_bound("90m", now), now - 5'400'000);
  for (const char* bad :
       {"", "yesterday", "-1h", "1h ", "nan", "inf", "2025-12-01", "2025-12-01T10:00:00",
        "2025-13-01T10:00:00Z", "2025-02-29T10:00:00Z", "2025-12-01T24:00:00Z",
        "2025-12-01T10:00:00Zjunk", "2025-12-01T10:00:00.Z", "2025-12-01T10:00:00+1:00"}) {
    const auto t = dead_letters::parse_time_bound(bad, now);
    ASSERT_FALSE(t.has_value()) << bad;
    EXPECT_EQ(t.error().field, "time") << bad;
    EXPECT_NE(t.error().message().find("RFC 3339"), std::string::npos) << bad;
  }
}

TEST(DlqTimeBound, ReplayOffsetsAreTheRateSpread) {
  EXPECT_EQ(dead_letters::replay_offset_ms(0, 4), 0);
  EXPECT_EQ(dead_letters::replay_offset_ms(3, 4), 750);
  EXPECT_EQ(dead_letters::replay_offset_ms(10, 3), 3333);
  EXPECT_EQ(dead_letters::replay_offset_ms(5, 0.5), 10000);
  EXPECT_EQ(dead_letters::replay_offset_ms(99, 0), 0);
}

}  // namespace
}  // namespace keel::store
