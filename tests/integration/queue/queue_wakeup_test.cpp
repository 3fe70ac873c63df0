// Wakeups of the job queue's idle workers (docs/queue.md, "Wakeups"): a producer in the same
// process wakes them at once on SQLite and PostgreSQL; on PostgreSQL a job written by another
// connection (plain SQL, so only the trigger's NOTIFY can tell) wakes them through LISTEN; a
// retry is leased when it comes due, not at the next safety-net poll; and an idle worker costs
// at most half a transaction a second.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "build_kind.hpp"
#include "keel/db/database.hpp"
#include "keel/queue/queue.hpp"
#include "keel/queue/queue_worker.hpp"
#include "support/counting_connection.hpp"
#include "support/test_support.hpp"

namespace keel::store {
namespace {

using namespace std::chrono_literals;

using keel::test::kTimingAsserted;  // build_kind.hpp

// Polled every 5 ms up to `bound`.
template <class Predicate>
bool wait_until(Predicate done, std::chrono::milliseconds bound) {
  const auto give_up = std::chrono::steady_clock::now() + bound;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= give_up) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

// A poll so slow that a job picked up within the tests' bounds was found by a wakeup.
constexpr Duration kSlowPoll = 60s;

class WakeupTest : public test::BackendTest {
 protected:
  void SetUp() override {
    test::BackendTest::SetUp();
    if (IsSkipped()) return;
    conn_ = open_database(url());
    JobQueue::migrate(*conn_);
    (void)queue_.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = "first"});
  }

  // Starts `worker` and waits until it has run the first job and all its slots are idle.
  void start(Worker& worker, int slots = 1) {
    runner_ = std::thread([&worker] { (void)worker.run(); });
    ASSERT_TRUE(wait_until(
        [&] {
          const WorkerWakeups w = worker.wakeup_counts();
          return w.idle == slots && (GetParam() == Backend::kSqlite || w.listening);
        },
        30s));
  }

  void TearDown() override {
    if (runner_.joinable()) runner_.join();
  }

  JobQueue queue_{{.seed = 5}};
  std::unique_ptr<Connection> conn_;
  std::thread runner_;
};

TEST_P(WakeupTest, AnInProcessProducerWakesAnIdleWorkerAtOnce) {
  ConnectionPool pool(url(), {.max_connections = 4});
  std::atomic<int> handled{0};
  Worker worker(pool, queue_, {.queue = "q", .poll_interval = kSlowPoll, .idle_poll = kSlowPoll},
                [&](const LeasedJob&, const std::atomic<bool>&) {
                  handled.fetch_add(1);
                  return AttemptReport::success();
                });
  start(worker);
  ASSERT_EQ(handled.load(), 1);
  const auto enqueued = std::chrono::steady_clock::now();
  // Another connection of this process, and another JobQueue: the registry is the process's.
  JobQueue producer({.seed = 9});
  auto other = open_database(url());
  ASSERT_TRUE(producer.enqueue(*other, {.queue = "q", .payload = "{}"}).ok());
  ASSERT_TRUE(wait_until([&] { return handled.load() == 2; }, 20s)) << "not woken";
  const auto took = std::chrono::steady_clock::now() - enqueued;
  worker.stop();
  runner_.join();
  const WorkerWakeups w = worker.wakeup_counts();
  EXPECT_GE(w.local, 1);
  EXPECT_EQ(w.woken_leases, 1);
  if (kTimingAsserted) {
    EXPECT_LT(took, 500ms);
  }
}

TEST_P(WakeupTest, ManyProducersAndWorkersInOneProcess) {
  // Two workers of two slots each and four producer threads: every job is picked up through the
  // in-process wakeups (the poll is a minute), subscriptions come and go while producers wake.
  ConnectionPool pool(url(), {.max_connections = 8});
  std::atomic<int> handled{0};
  const auto handler = [&](const LeasedJob&, const std::atomic<bool>&) {
    handled.fetch_add(1);
    return AttemptReport::success();
  };
  const WorkerOptions options{
      .queue = "q", .concurrency = 2, .poll_interval = kSlowPoll, .idle_poll = kSlowPoll};
  Worker a(pool, queue_, options, handler);
  Worker b(pool, queue_, options, handler);
  std::thread run_a([&] { (void)a.run(); });
  std::thread run_b([&] { (void)b.run(); });
  constexpr int kProducers = 4;
  constexpr int kJobs = 25;
  const std::string errors = test::run_at_once(kProducers, [&] {
    JobQueue producer({.seed = 3});
    auto conn = open_database(url());
    for (int i = 0; i < kJobs; ++i) {
      if (!producer.enqueue(*conn, {.queue = "q", .payload = "{}"}).ok()) {
        throw std::runtime_error("enqueue failed");
      }
      std::this_thread::sleep_for(1ms);
    }
  });
  EXPECT_EQ(errors, "");
  EXPECT_TRUE(wait_until([&] { return handled.load() == 1 + kProducers * kJobs; }, 30s))
      << handled.load();
  a.stop();
  b.stop();
  run_a.join();
  run_b.join();
  EXPECT_EQ(conn_->query("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'").integer(0, 0),
            1 + kProducers * kJobs);
}

INSTANTIATE_TEST_SUITE_P(Backends, WakeupTest,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

class PostgresWakeupTest : public WakeupTest {};

TEST_P(PostgresWakeupTest, AJobWrittenByAnotherSessionWakesAnIdleWorkerThroughNotify) {
  ConnectionPool pool(url(), {.max_connections = 4});
  std::atomic<int> handled{0};
  Worker worker(pool, queue_, {.queue = "q", .poll_interval = kSlowPoll, .idle_poll = kSlowPoll},
                [&](const LeasedJob&, const std::atomic<bool>&) {
                  handled.fetch_add(1);
                  return AttemptReport::success();
                });
  start(worker);
  const auto enqueued = std::chrono::steady_clock::now();
  // Plain SQL on a connection of its own: no keel producer, so only the trigger can tell.
  auto other = open_database(url());
  other->query(
      "INSERT INTO keel_jobs (queue, payload, idem_key, state, attempts, max_attempts, run_at_ms,"
      " fence, replays, created_ms, updated_ms) VALUES ('q', '{}', 'by-sql', 'ready', 0, 3, $1,"
      " 0, 0, $1, $1)",
      {queue_.now_ms()});
  // A job of another queue is not this worker's business.
  (void)queue_.enqueue(*other, {.queue = "other", .payload = "{}"});
  ASSERT_TRUE(wait_until([&] { return handled.load() == 2; }, 20s)) << "not woken";
  const auto took = std::chrono::steady_clock::now() - enqueued;
  worker.stop();
  runner_.join();
  const WorkerWakeups w = worker.wakeup_counts();
  EXPECT_EQ(w.listener_statements, 2);
  EXPECT_EQ(w.notifications, 1);  // the other queue's job sent one too, and was skipped
  EXPECT_EQ(w.local, 0);
  EXPECT_EQ(w.woken_leases, 1);
  if (kTimingAsserted) {
    EXPECT_LT(took, 500ms);
  }
}

// Schema version 7: a job notifies only when no other job of its queue is due and waiting. A
// job that finds one waiting wakes nobody (the workers lease it when they record the one before),
// so a busy queue costs no notifications: each would make every listening backend run a
// transaction to read it and every idle worker lease for nothing.
TEST_P(PostgresWakeupTest, AJobThatFindsAnotherWaitingInItsQueueNotifiesNobody) {
  ConnectionPool pool(url(), {.max_connections = 4});
  std::atomic<int> handled{0};
  std::atomic<bool> holding{false};
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  Worker worker(pool, queue_, {.queue = "q", .poll_interval = kSlowPoll, .idle_poll = kSlowPoll},
                [&](const LeasedJob& job, const std::atomic<bool>&) {
                  if (job.idempotency_key == "hold") {
                    holding.store(true);
                    std::unique_lock lock(mu);
                    cv.wait(lock, [&] { return release; });
                  }
                  handled.fetch_add(1);
                  return AttemptReport::success();
                });
  start(worker);
  // Plain SQL, each job in a transaction of its own: only the trigger can wake the worker.
  auto other = open_database(url());
  const auto insert = [&](const std::string& key) {
    other->query(
        "INSERT INTO keel_jobs (queue, payload, idem_key, state, attempts, max_attempts,"
        " run_at_ms, fence, replays, created_ms, updated_ms) VALUES ('q', '{}', $1, 'ready', 0,"
        " 3, $2, 0, 0, $2, $2)",
        {key, queue_.now_ms()});
  };
  insert("hold");  // the queue was idle: a notification, and the worker runs it
  ASSERT_TRUE(wait_until([&] { return holding.load(); }, 20s));  // leased: no longer waiting
  insert("a");  // nothing waiting (hold is running): a notification
  insert("b");  // a is waiting: none
  insert("c");  // none
  ASSERT_TRUE(wait_until([&] { return worker.wakeup_counts().notifications >= 2; }, 20s));
  {
    std::lock_guard lock(mu);
    release = true;
  }
  cv.notify_all();
  ASSERT_TRUE(wait_until([&] { return handled.load() == 5; }, 20s)) << handled.load();
  // A notification is delivered within milliseconds of its commit; give a late one the time.
  std::this_thread::sleep_for(300ms);
  worker.stop();
  runner_.join();
  EXPECT_EQ(worker.wakeup_counts().notifications, 2);
}

TEST_P(PostgresWakeupTest, ARetryIsLeasedWhenItComesDueNotAtTheNextPoll) {
  ConnectionPool pool(url(), {.max_connections = 4});
  JobQueue queue({.backoff = {.base = 300ms, .cap = 300ms, .jitter = Jitter::kNone}, .seed = 2});
  std::atomic<int> calls{0};
  std::mutex mu;
  std::vector<std::chrono::steady_clock::time_point> at;
  Worker worker(pool, queue, {.queue = "q", .poll_interval = kSlowPoll, .idle_poll = kSlowPoll},
                [&](const LeasedJob& job, const std::atomic<bool>&) {
                  if (job.idempotency_key == "first") return AttemptReport::success();
                  {
                    std::lock_guard lock(mu);
                    at.push_back(std::chrono::steady_clock::now());
                  }
                  return calls.fetch_add(1) == 0
                             ? AttemptReport{.outcome = Outcome::transient(), .error = "flaky"}
                             : AttemptReport::success();
                });
  start(worker);
  ASSERT_TRUE(queue.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = "retried"}).ok());
  ASSERT_TRUE(wait_until([&] { return calls.load() == 2; }, 20s)) << "the retry was not leased";
  worker.stop();
  runner_.join();
  std::lock_guard lock(mu);
  ASSERT_EQ(at.size(), 2u);
  // Due 300 ms after the failure: the idle worker slept until then, not for the poll.
  EXPECT_GE(at[1] - at[0], 290ms);
  if (kTimingAsserted) {
    EXPECT_LT(at[1] - at[0], 1500ms);
  }
  EXPECT_GE(worker.wakeup_counts().due_checks, 1);
}

TEST_P(PostgresWakeupTest, AnIdleWorkerCostsAtMostHalfATransactionPerSecond) {
  // Counted at the client: every transaction the worker's pooled connections run, and the
  // statements of its listener.
  // The server's count (xact_commit + xact_rollback in pg_stat_database) is not usable here:
  // the tests running beside this one share the database (each has a schema of its own), and a
  // backend reports its counts up to 10 s late (PostgreSQL 15 flushes an idle backend's
  // statistics at most every second and otherwise after 10 s idle). scripts and docs measure
  // the server's count on a server of their own (docs/queue.md, "Wakeups").
  std::atomic<std::int64_t> transactions{0};
  ConnectionPool pool(
      url(), {.max_connections = 4, .open = [&](const DatabaseUrl& u, const ConnectOptions& o) {
                return std::make_unique<test::CountingConnection>(open_database(u, o),
                                                                  transactions);
              }});
  Worker worker(
      pool, queue_, {.queue = "q"},  // the defaults, as `keel jobs work` runs
      [](const LeasedJob&, const std::atomic<bool>&) { return AttemptReport::success(); });
  start(worker);
  const std::int64_t before = transactions.load() + worker.wakeup_counts().listener_statements;
  constexpr auto kWindow = 8s;
  std::this_thread::sleep_for(kWindow);  // the cost of real time idling is what is measured
  const std::int64_t after = transactions.load() + worker.wakeup_counts().listener_statements;
  worker.stop();
  runner_.join();
  const double per_second =
      static_cast<double>(after - before) / std::chrono::duration<double>(kWindow).count();
  EXPECT_LE(per_second, 0.5) << (after - before) << " transactions in 8 s";
  // Without wakeups, the same worker polled every 100 ms: 10 transactions a second.
}

TEST(WorkerWakeupOptions, AnIdlePollOfZeroIsRefusedNamingTheField) {
  test::TempDir dir;
  ConnectionPool pool(parse_database_url("sqlite:" + (dir.path() / "q.db").string()).value());
  JobQueue q;
  const auto ok = [](const LeasedJob&, const std::atomic<bool>&) {
    return AttemptReport::success();
  };
  try {
    Worker w(pool, q, {.queue = "q", .idle_poll = Duration::zero()}, ok);
    ADD_FAILURE() << "accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "keel::store::WorkerOptions: idle_poll must be > 0 (got 0s)");
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, PostgresWakeupTest, ::testing::Values(Backend::kPostgres),
                         test::backend_name);

}  // namespace
}  // namespace keel::store
