// keel::store::ProcessedMessages on real SQLite files and a real PostgreSQL server: a duplicate
// skips the effect, a rolled-back effect frees its id, ids are opaque bytes of 1..255, concurrent
// deliveries of one id with real threads run one effect, retention in virtual time, and a drill
// of 1,000 messages delivered at least once from several threads.
#include "keel/consumers/processed_messages.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "keel/queue/queue.hpp"
#include "support/test_support.hpp"
#ifdef KEEL_TEST_METRICS
#include "keel/metrics/processed_messages.hpp"
#endif

namespace keel::store {
namespace {

using namespace std::chrono_literals;

class ProcessedMessagesTest : public test::BackendTest {
 protected:
  void SetUp() override {
    test::BackendTest::SetUp();
    if (IsSkipped()) return;
    conn_ = open_database(url());
    ProcessedMessages::migrate(*conn_);
    conn_->execute("CREATE TABLE effects (message TEXT NOT NULL, n BIGINT NOT NULL)");
  }

  [[nodiscard]] ProcessedMessages make_records(std::string consumer = "billing") {
    return ProcessedMessages({.consumer = std::move(consumer), .clock = &clock_});
  }

  [[nodiscard]] std::int64_t count(const std::string& sql) {
    return conn_->query(sql).integer(0, 0);
  }

  // An effect that writes one row for `message` through the transaction.
  static std::function<bool(Connection&)> write_effect(std::string message) {
    return [message = std::move(message)](Connection& tx) {
      tx.query("INSERT INTO effects (message, n) VALUES ($1, 1)", {message});
      return true;
    };
  }

  ManualClock clock_;
  std::unique_ptr<Connection> conn_;
};

TEST_P(ProcessedMessagesTest, ADuplicateSkipsTheEffect) {
  ProcessedMessages records = make_records();
  const auto first = records.process(*conn_, "evt-1", write_effect("evt-1"));
  ASSERT_TRUE(first);
  EXPECT_EQ(first->status, ProcessStatus::kProcessed);
  EXPECT_TRUE(first->transaction.committed());
  EXPECT_TRUE(first->done());
  bool ran = false;
  const auto again = records.process(*conn_, "evt-1", [&](Connection&) { return ran = true; });
  ASSERT_TRUE(again);
  EXPECT_EQ(again->status, ProcessStatus::kDuplicate);
  EXPECT_EQ(to_string(again->status), "duplicate");
  EXPECT_TRUE(again->done());
  EXPECT_FALSE(ran);
  EXPECT_EQ(count("SELECT COUNT(*) FROM effects"), 1);
  EXPECT_TRUE(records.contains(*conn_, "evt-1").value());
  // Ids are per consumer: another consumer of the same stream applies the message too.
  ProcessedMessages audit = make_records("audit");
  EXPECT_EQ(audit.process(*conn_, "evt-1", write_effect("evt-1"))->status,
            ProcessStatus::kProcessed);
  EXPECT_EQ(count("SELECT COUNT(*) FROM effects"), 2);
  const ProcessedCounts c = records.counts();
  EXPECT_EQ(c.processed, 1);
  EXPECT_EQ(c.duplicates, 1);
  EXPECT_EQ(c.failed, 0);
  // The primary key itself refuses a second record, whatever the code path.
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_processed_messages"), 2);
  EXPECT_EQ(schema_version(*conn_, "processed"), 1);
}

TEST_P(ProcessedMessagesTest, AnEffectThatRollsBackOrFailsFreesItsId) {
  ProcessedMessages records = make_records();
  // The effect chooses to roll back: its writes and the record go together.
  const auto declined = records.process(*conn_, "evt-1", [](Connection& tx) {
    tx.query("INSERT INTO effects (message, n) VALUES ('evt-1', 1)");
    return false;
  });
  ASSERT_TRUE(declined);
  EXPECT_EQ(declined->status, ProcessStatus::kRolledBack);
  EXPECT_FALSE(declined->done());
  EXPECT_FALSE(records.contains(*conn_, "evt-1").value());
  EXPECT_EQ(count("SELECT COUNT(*) FROM effects"), 0);
  // A database error in the effect: failed, nothing recorded.
  const auto failed = records.process(*conn_, "evt-1", [](Connection& tx) {
    tx.query("INSERT INTO no_such_table VALUES (1)");
    return true;
  });
  ASSERT_TRUE(failed);
  EXPECT_EQ(failed->status, ProcessStatus::kFailed);
  EXPECT_FALSE(failed->transaction.error.empty());
  EXPECT_FALSE(records.contains(*conn_, "evt-1").value());
  // Another exception propagates, and the transaction is rolled back.
  EXPECT_THROW((void)records.process(*conn_, "evt-1",
                                     [](Connection& tx) -> bool {
                                       tx.query("INSERT INTO effects (message, n) VALUES ('x', 1)");
                                       throw std::runtime_error("handler bug");
                                     }),
               std::runtime_error);
  EXPECT_FALSE(conn_->in_transaction());
  EXPECT_FALSE(records.contains(*conn_, "evt-1").value());
  EXPECT_EQ(count("SELECT COUNT(*) FROM effects"), 0);
  // The next delivery runs the effect.
  EXPECT_EQ(records.process(*conn_, "evt-1", write_effect("evt-1"))->status,
            ProcessStatus::kProcessed);
  EXPECT_EQ(count("SELECT COUNT(*) FROM effects"), 1);
  const ProcessedCounts c = records.counts();
  EXPECT_EQ(c.rolled_back, 1);
  EXPECT_EQ(c.failed, 1);
  EXPECT_EQ(c.processed, 1);
}

TEST_P(ProcessedMessagesTest, IdsAreOpaqueBytesOfOneTo255) {
  ProcessedMessages records = make_records();
  const auto empty = records.process(*conn_, "", write_effect("empty"));
  ASSERT_FALSE(empty);
  EXPECT_EQ(empty.error().message(), "message id must not be empty");
  const std::string longest(255, '\xff');
  EXPECT_EQ(records.process(*conn_, longest, write_effect("255"))->status,
            ProcessStatus::kProcessed);
  const auto too_long = records.process(*conn_, std::string(256, 'a'), write_effect("256"));
  ASSERT_FALSE(too_long);
  EXPECT_NE(too_long.error().message().find("at most 255 bytes; it has 256"), std::string::npos)
      << too_long.error().message();
  EXPECT_FALSE(records.contains(*conn_, std::string(256, 'a')));
  EXPECT_FALSE(records.claim(*conn_, ""));
  // NUL and every other byte value are part of the id; case matters.
  const std::string with_nul("a\0b", 3);
  std::string every_byte;
  for (int b = 0; b < 255; ++b) every_byte += static_cast<char>(b);
  for (const std::string& id : {with_nul, std::string("a"), std::string(1, '\0'), std::string("A"),
                                every_byte, std::string("\xc3\x28")}) {
    EXPECT_EQ(records.process(*conn_, id, write_effect("x"))->status, ProcessStatus::kProcessed)
        << quote_value(id);
  }
  for (const std::string& id : {with_nul, std::string("a"), std::string(1, '\0'), every_byte}) {
    EXPECT_EQ(records.process(*conn_, id, write_effect("x"))->status, ProcessStatus::kDuplicate)
        << quote_value(id);
  }
  EXPECT_FALSE(records.contains(*conn_, std::string("a\0c", 3)).value());
  EXPECT_EQ(count("SELECT COUNT(*) FROM effects"), 7);
  EXPECT_EQ(count("SELECT COUNT(*) FROM effects WHERE message IN ('empty', '256')"), 0);
}

TEST_P(ProcessedMessagesTest, ClaimRunsInsideTheCallersTransaction) {
  ProcessedMessages records = make_records();
  const auto outside = records.claim(*conn_, "evt-1");
  ASSERT_FALSE(outside);
  EXPECT_NE(outside.error().message().find("no transaction open"), std::string::npos);
  conn_->begin();
  EXPECT_TRUE(records.claim(*conn_, "evt-1").value());
  EXPECT_FALSE(records.claim(*conn_, "evt-1").value());  // the same transaction sees its claim
  conn_->rollback();
  EXPECT_FALSE(records.contains(*conn_, "evt-1").value());
  conn_->begin();
  EXPECT_TRUE(records.claim(*conn_, "evt-1").value());
  conn_->commit();
  EXPECT_TRUE(records.contains(*conn_, "evt-1").value());
  EXPECT_EQ(records.process(*conn_, "evt-1", write_effect("evt-1"))->status,
            ProcessStatus::kDuplicate);
}

// process() needs a transaction of its own: inside the caller's it refuses, before it sends
// anything, so the caller's rollback rolls back everything the caller wrote (keel never commits
// or ends a transaction it did not open). claim() is the call for the caller's transaction.
TEST_P(ProcessedMessagesTest, ProcessInsideTheCallersTransactionRefusesAndTheCallersRollbackHolds) {
  ProcessedMessages records = make_records();
  conn_->begin();
  conn_->query("INSERT INTO effects (message, n) VALUES ('callers', 1)");
  try {
    (void)records.process(*conn_, "evt-9", write_effect("evt-9"));
    ADD_FAILURE() << "process() ran inside the caller's transaction";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("already open"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(conn_->in_transaction()) << "the caller's transaction is still open";
  EXPECT_EQ(count("SELECT COUNT(*) FROM effects"), 1) << "and still holds the caller's row";
  conn_->rollback();
  EXPECT_EQ(count("SELECT COUNT(*) FROM effects"), 0) << "the caller's rollback rolled it back";
  EXPECT_FALSE(records.contains(*conn_, "evt-9").value());
  // The same through prune(), which also runs in a transaction of its own.
  conn_->begin();
  conn_->query("INSERT INTO effects (message, n) VALUES ('callers', 2)");
  EXPECT_THROW((void)records.prune(*conn_, std::chrono::hours(1)), std::logic_error);
  conn_->rollback();
  EXPECT_EQ(count("SELECT COUNT(*) FROM effects"), 0);
}

// The outbox inside a consumer: the job enqueued by the effect commits with the record, once.
TEST_P(ProcessedMessagesTest, AJobEnqueuedByTheEffectCommitsWithTheRecord) {
  ProcessedMessages records = make_records();
  JobQueue::migrate(*conn_);
  JobQueue queue({.clock = &clock_, .seed = 3});
  const auto effect = [&](bool commit) {
    return [&, commit](Connection& tx) {
      tx.query("INSERT INTO effects (message, n) VALUES ('evt-1', 1)");
      const auto job =
          queue.enqueue_in(tx, {.queue = "receipts", .payload = "{}", .key = "receipt-evt-1"});
      return job.ok() && commit;
    };
  };
  EXPECT_EQ(records.process(*conn_, "evt-1", effect(false))->status, ProcessStatus::kRolledBack);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs"), 0);
  EXPECT_EQ(records.process(*conn_, "evt-1", effect(true))->status, ProcessStatus::kProcessed);
  EXPECT_EQ(records.process(*conn_, "evt-1", effect(true))->status, ProcessStatus::kDuplicate);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs"), 1);
  EXPECT_EQ(count("SELECT COUNT(*) FROM effects"), 1);
}

TEST_P(ProcessedMessagesTest, ConcurrentDeliveriesOfOneIdRunOneEffect) {
  ProcessedMessages records = make_records();
  constexpr int kThreads = 8;
  std::atomic<int> processed{0};
  std::atomic<int> duplicates{0};
  std::atomic<int> effects_run{0};
  const std::string errors = test::run_at_once(kThreads, [&] {
    auto conn = open_database(url());
    const auto r = records.process(*conn, "evt-1", [&](Connection& tx) {
      effects_run.fetch_add(1);
      tx.query("INSERT INTO effects (message, n) VALUES ('evt-1', 1)");
      // Hold the claim while the other deliveries arrive.
      std::this_thread::sleep_for(50ms);
      return true;
    });
    if (!r) throw std::runtime_error(r.error().message());
    if (r->status == ProcessStatus::kProcessed) processed.fetch_add(1);
    if (r->status == ProcessStatus::kDuplicate) duplicates.fetch_add(1);
    if (!r->done()) throw std::runtime_error(r->transaction.error);
  });
  EXPECT_EQ(errors, "");
  EXPECT_EQ(processed.load(), 1);
  EXPECT_EQ(duplicates.load(), kThreads - 1);
  EXPECT_EQ(effects_run.load(), 1);
  EXPECT_EQ(count("SELECT COUNT(*) FROM effects"), 1);
  EXPECT_EQ(records.counts().processed, 1);
  EXPECT_EQ(records.counts().duplicates, kThreads - 1);
}

TEST_P(ProcessedMessagesTest, ADeliveryWaitingOnARolledBackClaimRunsTheEffect) {
  ProcessedMessages records = make_records();
  std::promise<void> claimed;
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  auto first = std::async(std::launch::async, [&] {
    auto conn = open_database(url());
    return records.process(*conn, "evt-1", [&](Connection& tx) {
      tx.query("INSERT INTO effects (message, n) VALUES ('first', 1)");
      claimed.set_value();
      released.wait();
      return false;  // roll back: the id is free for the waiting delivery
    });
  });
  claimed.get_future().wait();
  auto second = std::async(std::launch::async, [&] {
    auto conn = open_database(url());
    return records.process(*conn, "evt-1", write_effect("second"));
  });
  // The second delivery waits on the first's claim (PostgreSQL: the unique index; SQLite: the
  // write lock) rather than deciding anything.
  EXPECT_EQ(second.wait_for(200ms), std::future_status::timeout);
  release.set_value();
  EXPECT_EQ(first.get()->status, ProcessStatus::kRolledBack);
  EXPECT_EQ(second.get()->status, ProcessStatus::kProcessed);
  EXPECT_EQ(count("SELECT COUNT(*) FROM effects WHERE message = 'second'"), 1);
  EXPECT_EQ(count("SELECT COUNT(*) FROM effects WHERE message = 'first'"), 0);
}

TEST_P(ProcessedMessagesTest, PruneDeletesOldRecordsInBatches) {
  ProcessedMessages records = make_records();
  ProcessedMessages other = make_records("audit");
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(records.process(*conn_, "old-" + std::to_string(i), write_effect("o"))->done());
  }
  ASSERT_TRUE(other.process(*conn_, "old-0", write_effect("o"))->done());
  clock_.advance(1h);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(records.process(*conn_, "new-" + std::to_string(i), write_effect("n"))->done());
  }
  EXPECT_EQ(records.prune(*conn_, 30min, 2), 2);
  EXPECT_EQ(records.prune(*conn_, 30min, 2), 2);
  EXPECT_EQ(records.prune(*conn_, 30min, 2), 1);
  EXPECT_EQ(records.prune(*conn_, 30min, 2), 0);
  EXPECT_EQ(records.counts().pruned, 5);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_processed_messages WHERE consumer = 'billing'"), 3);
  // Another consumer's records have their own retention.
  EXPECT_TRUE(other.contains(*conn_, "old-0").value());
  // A redelivery after its record was pruned runs the effect again: the retention bounds the
  // deduplication window.
  EXPECT_EQ(records.process(*conn_, "old-0", write_effect("o"))->status, ProcessStatus::kProcessed);
  EXPECT_EQ(records.process(*conn_, "new-0", write_effect("n"))->status, ProcessStatus::kDuplicate);
  EXPECT_THROW((void)records.prune(*conn_, -1s), std::invalid_argument);
  EXPECT_THROW((void)records.prune(*conn_, 1s, 0), std::invalid_argument);
}

TEST_P(ProcessedMessagesTest, InvalidConsumerIsRefusedAtConstruction) {
  EXPECT_THROW(ProcessedMessages({.consumer = ""}), std::invalid_argument);
  try {
    ProcessedMessages records({.consumer = "bill ing"});
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("keel::store::ProcessedMessagesOptions: consumer"),
              std::string::npos)
        << e.what();
  }
}

// 1,000 messages, each delivered 1 to 3 times in a shuffled order from 4 threads, each thread
// with its own connection: every effect exactly once.
TEST_P(ProcessedMessagesTest, DrillEveryMessageOfAnAtLeastOnceStreamAppliedOnce) {
  ProcessedMessages records = make_records();
  conn_->execute("CREATE TABLE balances (account TEXT PRIMARY KEY, cents BIGINT NOT NULL)");
  conn_->execute("INSERT INTO balances (account, cents) VALUES ('acct', 0)");
  constexpr int kMessages = 1000;
  constexpr int kThreads = 4;
  std::mt19937 rng(2024);
  std::vector<int> deliveries;
  for (int m = 0; m < kMessages; ++m) {
    const int times = 1 + static_cast<int>(rng() % 3);
    for (int t = 0; t < times; ++t) deliveries.push_back(m);
  }
  std::shuffle(deliveries.begin(), deliveries.end(), rng);
  std::atomic<std::size_t> next{0};
  std::atomic<int> failed{0};
  const auto started = std::chrono::steady_clock::now();
  const std::string errors = test::run_at_once(kThreads, [&] {
    auto conn = open_database(url());
    for (std::size_t i = next.fetch_add(1); i < deliveries.size(); i = next.fetch_add(1)) {
      const int m = deliveries[i];
      const auto r = records.process(*conn, "msg-" + std::to_string(m), [&](Connection& tx) {
        tx.query("INSERT INTO effects (message, n) VALUES ($1, $2)",
                 {"msg-" + std::to_string(m), m});
        tx.query("UPDATE balances SET cents = cents + $1 WHERE account = 'acct'", {m});
        return true;
      });
      if (!r || !r->done()) failed.fetch_add(1);
    }
  });
  const auto elapsed = std::chrono::steady_clock::now() - started;
  EXPECT_EQ(errors, "");
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(count("SELECT COUNT(*) FROM effects"), kMessages);
  EXPECT_EQ(count("SELECT COUNT(DISTINCT message) FROM effects"), kMessages);
  EXPECT_EQ(count("SELECT cents FROM balances"), std::int64_t{kMessages} * (kMessages - 1) / 2);
  const ProcessedCounts c = records.counts();
  EXPECT_EQ(c.processed, kMessages);
  EXPECT_EQ(c.duplicates, static_cast<std::int64_t>(deliveries.size()) - kMessages);
  std::printf(
      "drill (%s): %d messages, %zu deliveries, %lld duplicates skipped, %d threads, %.0f ms\n",
      std::string(to_string(GetParam())).c_str(), kMessages, deliveries.size(),
      static_cast<long long>(c.duplicates), kThreads,
      std::chrono::duration<double, std::milli>(elapsed).count());
}

#ifdef KEEL_TEST_METRICS
TEST_P(ProcessedMessagesTest, CountsAreExportedThroughKeelMetrics) {
  ProcessedMessages records = make_records();
  ASSERT_TRUE(records.process(*conn_, "evt-1", write_effect("evt-1"))->done());
  ASSERT_TRUE(records.process(*conn_, "evt-1", write_effect("evt-1"))->done());
  metrics::Scrape scrape;
  metrics::add_processed_messages(scrape, records);
  const std::string text = scrape.text();
  for (const char* line :
       {"keel_consumer_messages_total{consumer=\"billing\",result=\"processed\"} 1",
        "keel_consumer_messages_total{consumer=\"billing\",result=\"duplicate\"} 1",
        "keel_consumer_messages_total{consumer=\"billing\",result=\"failed\"} 0",
        "keel_consumer_records_pruned_total{consumer=\"billing\"} 0"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << "\n" << text;
  }
}
#endif

INSTANTIATE_TEST_SUITE_P(Backends, ProcessedMessagesTest,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

}  // namespace
}  // namespace keel::store
