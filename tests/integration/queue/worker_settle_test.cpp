// A job whose outcome is known is never run again because recording it failed. The database
// connection is lost while the Worker records an outcome (before the write, or after it committed
// and before the answer came back: a commit in doubt, as at a failover): the Worker settles it on
// a new connection with the job's fencing token, recording it or finding it recorded, and the job
// runs once, is not dead with max_attempts 1, and is not charged for the lost connection. Also:
// a worker whose jobs all succeed never says it lost a lease. On a real SQLite file and a real
// PostgreSQL server, with the connection loss injected by a connection wrapper.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "keel/db/database.hpp"
#include "keel/queue/queue.hpp"
#include "keel/queue/queue_worker.hpp"
#include "support/test_support.hpp"
#include "support/waiting.hpp"

namespace keel::store {
namespace {

using namespace std::chrono_literals;

// When `armed`, the next write that records a job's outcome (a statement or transaction that sets
// a state other than 'running') fails as a lost connection: after it committed (`after_commit`:
// the commit is in doubt) or before anything reached the database. Each failure disarms.
struct Fault {
  std::atomic<bool> armed{false};
  // When set, the next statement that leases jobs fails as a lost connection before it is sent.
  std::atomic<bool> lease_armed{false};
  bool after_commit = true;
  std::atomic<int> injected{0};
};

class LosingConnection final : public Connection {
 public:
  LosingConnection(std::unique_ptr<Connection> inner, Fault& fault)
      : inner_(std::move(inner)), fault_(fault) {}
  [[nodiscard]] Backend backend() const noexcept override { return inner_->backend(); }
  void execute(std::string_view sql) override { inner_->execute(sql); }
  Rows query(std::string_view sql, std::span<const Value> params) override {
    if (sql.find("state IN ('ready', 'retry_scheduled') AND run_at_ms <=") !=
        std::string_view::npos) {
      bool expected = true;
      if (fault_.lease_armed.compare_exchange_strong(expected, false)) {
        fault_.injected.fetch_add(1);
        lose(false);
      }
    }
    const bool records = records_outcome(sql);
    if (inner_->in_transaction()) {
      if (records) tx_records_ = true;
      return inner_->query(sql, params);
    }
    if (records && take()) {
      if (fault_.after_commit) (void)inner_->query(sql, params);  // applied, answer lost
      lose(false);
    }
    return inner_->query(sql, params);
  }
  void begin(Isolation isolation) override {
    tx_records_ = false;
    inner_->begin(isolation);
  }
  void commit() override {
    const bool records = std::exchange(tx_records_, false);
    if (records && take()) {
      if (fault_.after_commit) {
        inner_->commit();
      } else {
        inner_->rollback();
      }
      lose(true);
    }
    inner_->commit();
  }
  void rollback() noexcept override {
    tx_records_ = false;
    inner_->rollback();
  }
  [[nodiscard]] bool in_transaction() const noexcept override {
    return !lost_ && inner_->in_transaction();
  }
  [[nodiscard]] bool broken() const noexcept override { return lost_ || inner_->broken(); }
  [[nodiscard]] std::string database_identity() const override {
    return inner_->database_identity();
  }

 private:
  static bool records_outcome(std::string_view sql) {
    return sql.find("UPDATE keel_jobs") != std::string_view::npos &&
           (sql.find("'done'") != std::string_view::npos ||
            sql.find("'retry_scheduled'") != std::string_view::npos ||
            sql.find("'dead'") != std::string_view::npos);
  }
  bool take() {
    bool expected = true;
    if (!fault_.armed.compare_exchange_strong(expected, false)) return false;
    fault_.injected.fetch_add(1);
    return true;
  }
  [[noreturn]] void lose(bool during_commit) {
    if (inner_->in_transaction()) inner_->rollback();
    lost_ = true;
    DatabaseError::Details details{
        .backend = inner_->backend(), .during_commit = during_commit, .connection_lost = true};
    if (details.backend == Backend::kPostgres) details.sqlstate = "08006";
    throw DatabaseError("connection lost (injected)", details);
  }

  std::unique_ptr<Connection> inner_;
  Fault& fault_;
  bool tx_records_ = false;
  bool lost_ = false;
};

class WorkerSettle : public test::BackendTest {
 protected:
  void SetUp() override {
    test::BackendTest::SetUp();
    if (IsSkipped()) return;
    conn_ = open_database(url());
    JobQueue::migrate(*conn_);
  }

  ConnectionPool make_pool() {
    return ConnectionPool(
        url(),
        {.max_connections = 6, .open = [this](const DatabaseUrl& u, const ConnectOptions& o) {
           return std::make_unique<LosingConnection>(open_database(u, o), fault_);
         }});
  }

  std::vector<std::string> run_until_idle(Worker& worker) {
    (void)worker.run();
    std::lock_guard lock(mu_);
    return lines_;
  }

  WorkerOptions options() {
    return {.queue = "q",
            .poll_interval = 10ms,
            .exit_when_idle = true,
            .log = [this](std::string_view line) {
              std::lock_guard lock(mu_);
              lines_.emplace_back(line);
            }};
  }

  static std::string joined(const std::vector<std::string>& lines) {
    std::string out;
    for (const auto& l : lines) out += l + "\n";
    return out;
  }

  Fault fault_;
  JobQueue queue_{{.lease = 2s, .seed = 3}};
  std::unique_ptr<Connection> conn_;
  std::mutex mu_;
  std::vector<std::string> lines_;
};

// A success recorded while the connection is lost, applied (in doubt) or not: settled, run once,
// done, not dead with one attempt allowed.
TEST_P(WorkerSettle, ASuccessWhoseRecordingLostItsConnectionIsSettledNotRunAgain) {
  for (const bool after_commit : {true, false}) {
    SCOPED_TRACE(after_commit ? "lost after the commit" : "lost before the write");
    fault_.after_commit = after_commit;
    const std::string key = after_commit ? "a" : "b";
    const std::int64_t id =
        queue_.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = key, .max_attempts = 1}).id;
    ConnectionPool pool = make_pool();
    std::atomic<int> runs{0};
    Worker worker(pool, queue_, options(), [&](const LeasedJob&, const std::atomic<bool>&) {
      runs.fetch_add(1);
      fault_.armed = true;  // the success's recording is the next outcome written
      return AttemptReport::success();
    });
    const std::string log = joined(run_until_idle(worker));
    EXPECT_EQ(runs.load(), 1) << log;
    const auto job = queue_.get(*conn_, id);
    ASSERT_TRUE(job);
    EXPECT_EQ(job->state, JobState::kDone) << log;
    EXPECT_EQ(job->attempts, 1);
    EXPECT_NE(log.find("settling it on a new connection"), std::string::npos) << log;
    EXPECT_EQ(log.find("lease lost"), std::string::npos) << log;
  }
  EXPECT_EQ(fault_.injected.load(), 2);
}

// A failure's outcome (here permanent) recorded while the connection is lost: the job is
// dead once, with its own reason, never run again.
TEST_P(WorkerSettle, AFailureWhoseRecordingLostItsConnectionKeepsItsOwnReason) {
  fault_.after_commit = false;
  const std::int64_t id =
      queue_.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = "c", .max_attempts = 3}).id;
  ConnectionPool pool = make_pool();
  std::atomic<int> runs{0};
  Worker worker(pool, queue_, options(), [&](const LeasedJob&, const std::atomic<bool>&) {
    runs.fetch_add(1);
    fault_.armed = true;
    return AttemptReport{.outcome = Outcome::permanent(), .error = "HTTP 400: refused"};
  });
  const std::string log = joined(run_until_idle(worker));
  EXPECT_EQ(runs.load(), 1) << log;
  const auto job = queue_.get(*conn_, id);
  ASSERT_TRUE(job);
  EXPECT_EQ(job->state, JobState::kDead) << log;
  EXPECT_NE(job->dead_reason.find("permanent: HTTP 400: refused"), std::string::npos)
      << job->dead_reason;
}

// A transactional handler whose COMMIT was lost: committed (the success with the writes) is
// found done; not committed, the attempt is given back (the writes were rolled back) and the job
// runs again, once, without being charged for the connection.
TEST_P(WorkerSettle, ATransactionalHandlersCommitInDoubtIsSettledFromTheJobsRow) {
  conn_->execute("CREATE TABLE effects (job BIGINT NOT NULL)");
  for (const bool after_commit : {true, false}) {
    SCOPED_TRACE(after_commit ? "committed" : "not committed");
    fault_.after_commit = after_commit;
    const std::int64_t id = queue_
                                .enqueue(*conn_, {.queue = "q",
                                                  .payload = "{}",
                                                  .key = after_commit ? "tx-a" : "tx-b",
                                                  .max_attempts = 1})
                                .id;
    ConnectionPool pool = make_pool();
    std::atomic<int> runs{0};
    Worker worker(pool, queue_, options(),
                  TransactionalJobHandler(
                      [&](Connection& tx, const LeasedJob& job, const std::atomic<bool>&) {
                        if (runs.fetch_add(1) == 0) fault_.armed = true;
                        tx.query("INSERT INTO effects (job) VALUES ($1)", {job.id});
                        return AttemptReport::success();
                      }));
    const std::string log = joined(run_until_idle(worker));
    EXPECT_EQ(runs.load(), after_commit ? 1 : 2) << log;
    const auto job = queue_.get(*conn_, id);
    ASSERT_TRUE(job);
    EXPECT_EQ(job->state, JobState::kDone) << log;
    EXPECT_EQ(conn_->query("SELECT COUNT(*) FROM effects WHERE job = $1", {id}).integer(0, 0), 1)
        << "the effect applied exactly once";
  }
}

// The heartbeat thread holds a copy of the running jobs' leases while their slots complete them:
// a heartbeat that finds a job done by its own slot is not a lost lease.
TEST_P(WorkerSettle, AWorkerWhoseJobsAllSucceedNeverSaysItLostALease) {
  for (int i = 0; i < 300; ++i) {
    (void)queue_.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = "ok-" + std::to_string(i)});
  }
  ConnectionPool pool(url(), {.max_connections = 6});
  WorkerOptions o = options();
  o.concurrency = 4;
  o.heartbeat_interval = 1ms;  // heartbeats race every completion
  Worker worker(pool, queue_, o, [](const LeasedJob&, const std::atomic<bool>&) {
    std::this_thread::sleep_for(1ms);
    return AttemptReport::success();
  });
  const std::string log = joined(run_until_idle(worker));
  EXPECT_EQ(log.find("lease lost"), std::string::npos) << log;
  EXPECT_EQ(conn_->query("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'").integer(0, 0), 300);
}

// A failover to a standby that lagged brings back leases this worker had already settled on the
// old primary: the database says the worker holds a job that none of its slots runs. After the
// outage (here one lost lease) the worker gives it back at once, uncharged, and it runs; it is
// not left running until its lease expires (a minute here), nor charged as a crash.
TEST_P(WorkerSettle, AJobTheDatabaseSaysItHoldsAfterAnOutageIsGivenBackNotLeftToItsLease) {
  JobQueue queue({.lease = 60s, .seed = 3});
  const std::int64_t id =
      queue.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = "stale", .max_attempts = 1}).id;
  // Leased and started by "w" in a life the worker does not remember.
  const std::vector<LeasedJob> stale = queue.lease(*conn_, "q", "w", 1);
  ASSERT_EQ(stale.size(), 1u);
  ASSERT_TRUE(stale[0].started);
  ConnectionPool pool = make_pool();
  std::atomic<int> runs{0};
  WorkerOptions o = options();
  o.worker_id = "w";
  o.exit_when_idle = false;
  fault_.lease_armed = true;
  Worker worker(pool, queue, o, [&](const LeasedJob&, const std::atomic<bool>&) {
    runs.fetch_add(1);
    return AttemptReport::success();
  });
  std::thread t([&] { (void)worker.run(); });
  const bool done = test::wait_until(
      [&] {
        const auto job = queue.get(*conn_, id);
        return job && job->state == JobState::kDone;
      },
      20s);
  worker.stop();
  t.join();
  std::string log;
  {
    std::lock_guard lock(mu_);
    log = joined(lines_);
  }
  EXPECT_TRUE(done) << "the job stayed leased to the worker after the outage\n" << log;
  EXPECT_EQ(fault_.injected.load(), 1);
  EXPECT_EQ(runs.load(), 1) << log;
  const auto job = queue.get(*conn_, id);
  ASSERT_TRUE(job);
  EXPECT_EQ(job->attempts, 1) << "the given-back attempt was charged";
  EXPECT_NE(log.find("giving back 1 job(s)"), std::string::npos) << log;
}

INSTANTIATE_TEST_SUITE_P(Backends, WorkerSettle,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

}  // namespace
}  // namespace keel::store
