// keel's one idempotency key rule where it is applied: the job queue (JobQueue::enqueue on real
// SQLite and PostgreSQL), the HTTP clients (keel::http::check_request, which both clients run
// before any attempt) and the receiver (keel::store::parse_idempotency_key, behind keel-demo
// serve). For each case of tests/key_rule_cases.hpp the three give one verdict and one canonical
// form, so a job the queue accepts is sent and read as the key it was stored under, and two keys a
// receiver reads as one are one job.
#include <gtest/gtest.h>

#include "keel/http/message.hpp"
#include "keel/http/request.hpp"
#include "keel/idempotency/idempotency.hpp"
#include "keel/queue/queue.hpp"
#include "key_rule_cases.hpp"
#include "support/test_support.hpp"

namespace keel::store {
namespace {

class KeyRuleTest : public test::BackendTest {
 protected:
  void SetUp() override {
    test::BackendTest::SetUp();
    if (IsSkipped()) return;
    conn_ = open_database(url());
    JobQueue::migrate(*conn_);
  }

  [[nodiscard]] JobQueue make_queue() { return JobQueue({.clock = &clock_, .seed = 42}); }

  ManualClock clock_;
  std::unique_ptr<Connection> conn_;
};

TEST_P(KeyRuleTest, QueueClientsAndReceiverGiveOneAnswerPerKey) {
  const JobQueue q = make_queue();
  for (const test::KeyRuleCase& c : test::key_rule_cases()) {
    SCOPED_TRACE(c.name);
    // The clients: the key check, and the request check both clients run first.
    const Expected<std::string> client = http::check_idempotency_key(c.input);
    const Expected<std::string> request = http::check_request(
        {.method = "POST", .url = "http://127.0.0.1:9/pay", .idempotency_key = c.input});
    const Expected<std::string> header =
        http::check_request({.method = "POST",
                             .url = "http://127.0.0.1:9/pay",
                             .headers = {{"Idempotency-Key", c.input}}});
    // The receiver.
    const ParsedKey receiver = parse_idempotency_key(c.input);
    // The queue (an empty key asks the queue for a UUID, as an empty Request::idempotency_key
    // asks the client for one: absent, not invalid).
    EnqueueResult queued;
    ASSERT_NO_THROW(queued = q.enqueue(*conn_, {.queue = "keys", .payload = "{}", .key = c.input}));

    const bool valid = c.canonical.has_value();
    EXPECT_EQ(client.has_value(), valid);
    EXPECT_EQ(header.has_value(), valid);
    EXPECT_EQ(receiver.key.has_value(), valid) << receiver.detail;
    if (!c.input.empty()) {
      EXPECT_EQ(request.has_value(), valid);
      EXPECT_EQ(queued.ok(), valid) << queued.error;
    }
    if (valid) {
      EXPECT_EQ(*client, *c.canonical);
      EXPECT_EQ(*request, *c.canonical);
      EXPECT_EQ(*header, *c.canonical);
      EXPECT_EQ(*receiver.key, *c.canonical);
      EXPECT_EQ(queued.idempotency_key, *c.canonical);
      EXPECT_EQ(q.get(*conn_, queued.id)->idempotency_key, *c.canonical);
    } else if (!c.input.empty()) {
      EXPECT_EQ(queued.error.rfind("idempotency key ", 0), 0u) << queued.error;
      EXPECT_EQ(queued.id, 0);
    }
  }
}

TEST_P(KeyRuleTest, TwoFormsOfOneKeyAreOneJob) {
  const JobQueue q = make_queue();
  const EnqueueResult bare = q.enqueue(*conn_, {.queue = "pay", .payload = "{}", .key = "abc"});
  const EnqueueResult quoted =
      q.enqueue(*conn_, {.queue = "pay", .payload = "{}", .key = "\"abc\""});
  ASSERT_TRUE(bare.ok() && quoted.ok()) << bare.error << quoted.error;
  EXPECT_TRUE(bare.created);
  EXPECT_FALSE(quoted.created);
  EXPECT_EQ(quoted.id, bare.id);
  EXPECT_EQ(quoted.idempotency_key, "abc");
  // In one batch too, in either order.
  const auto batch = q.enqueue_many(*conn_, {{.queue = "pay2", .payload = "{}", .key = "\"k\""},
                                             {.queue = "pay2", .payload = "{}", .key = "k"}});
  ASSERT_TRUE(batch[0].ok() && batch[1].ok());
  EXPECT_EQ(batch[0].id, batch[1].id);
  EXPECT_EQ(batch[0].idempotency_key, "k");
  EXPECT_EQ(conn_->query("SELECT COUNT(*) FROM keel_jobs").integer(0, 0), 2);
}

TEST_P(KeyRuleTest, AnInvalidKeyIsAnErrorValueAndWritesNothing) {
  const JobQueue q = make_queue();
  for (const std::string key : {"abc\xff", "caf\xc3\xa9", " abc", "\"open"}) {
    EnqueueResult r;
    ASSERT_NO_THROW(r = q.enqueue(*conn_, {.queue = "q", .payload = "{}", .key = key}));
    EXPECT_FALSE(r.ok());
    std::vector<EnqueueResult> batch;
    ASSERT_NO_THROW(batch = q.enqueue_many(*conn_, {{.queue = "q", .payload = "{}"},
                                                    {.queue = "q", .payload = "{}", .key = key}}));
    EXPECT_FALSE(batch[0].ok());
  }
  EXPECT_EQ(conn_->query("SELECT COUNT(*) FROM keel_jobs").integer(0, 0), 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, KeyRuleTest,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

}  // namespace
}  // namespace keel::store
