// The idempotency store's conformance suite, run against a real SQLite file and a real
// PostgreSQL server, in virtual time (a ManualClock drives TTLs and lock expiry).
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "keel/idempotency/idempotency.hpp"
#include "support/test_support.hpp"

namespace keel::store {
namespace {

using namespace std::chrono_literals;

TEST(Fingerprint, JsonKeyOrderAndWhitespaceDoNotMatter) {
  const auto a = request_fingerprint("POST", "/v1/charges", R"({"amount":100,"currency":"EUR"})");
  const auto b =
      request_fingerprint("POST", "/v1/charges", "{ \"currency\" : \"EUR\",\n \"amount\": 100 }");
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.size(), 64u);
  EXPECT_NE(a, request_fingerprint("POST", "/v1/charges", R"({"amount":101,"currency":"EUR"})"));
  EXPECT_NE(a, request_fingerprint("POST", "/v1/refunds", R"({"amount":100,"currency":"EUR"})"));
  EXPECT_NE(a, request_fingerprint("PATCH", "/v1/charges", R"({"amount":100,"currency":"EUR"})"));
}

TEST(Fingerprint, OtherBodiesAreByteExact) {
  EXPECT_NE(request_fingerprint("POST", "/x", "a=1&b=2"),
            request_fingerprint("POST", "/x", "b=2&a=1"));
  EXPECT_EQ(request_fingerprint("POST", "/x", "a=1"), request_fingerprint("POST", "/x", "a=1"));
  // A raw body that spells the canonical JSON does not collide with the JSON one.
  EXPECT_NE(request_fingerprint("POST", "/x", "{"), request_fingerprint("POST", "/x", "{ "));
}

TEST(IdempotencyKey, BareTokenAndRfc8941StringAreAccepted) {
  EXPECT_EQ(parse_idempotency_key("abc-123").key, "abc-123");
  EXPECT_EQ(parse_idempotency_key(R"("8e03978e-40d5-43e8-bc93-6894a57f9324")").key,
            "8e03978e-40d5-43e8-bc93-6894a57f9324");
  EXPECT_EQ(parse_idempotency_key(R"("a\\b")").key, R"(a\b)");
}

TEST(IdempotencyKey, BadKeysAreRefusedWithAReason) {
  EXPECT_EQ(parse_idempotency_key(std::nullopt).error, KeyError::kMissing);
  EXPECT_EQ(parse_idempotency_key("").error, KeyError::kEmpty);
  EXPECT_EQ(parse_idempotency_key("\"\"").error, KeyError::kEmpty);
  EXPECT_EQ(parse_idempotency_key(std::string(256, 'k')).error, KeyError::kTooLong);
  EXPECT_TRUE(parse_idempotency_key(std::string(255, 'k')).key);
  EXPECT_EQ(parse_idempotency_key("a\x01"
                                  "b")
                .error,
            KeyError::kControlCharacter);
  EXPECT_EQ(parse_idempotency_key("\"a\tb\"").error, KeyError::kControlCharacter);
  EXPECT_EQ(parse_idempotency_key("\"unterminated").error, KeyError::kMalformed);
  EXPECT_EQ(parse_idempotency_key(R"("bad \n escape")").error, KeyError::kMalformed);
  EXPECT_EQ(parse_idempotency_key(R"("x" trailing)").error, KeyError::kMalformed);
  // keel's one rule (keel/core/idempotency_key.hpp): nothing is trimmed, no space, quote, comma or
  // percent sign in the key.
  EXPECT_EQ(parse_idempotency_key("  abc  ").error, KeyError::kMalformed);
  EXPECT_EQ(parse_idempotency_key(R"("a \"quoted\" key")").error, KeyError::kMalformed);
  EXPECT_EQ(parse_idempotency_key("a,b").error, KeyError::kMalformed);
  EXPECT_EQ(parse_idempotency_key("a%41").error, KeyError::kMalformed);
  EXPECT_FALSE(parse_idempotency_key("").detail.empty());
  EXPECT_EQ(parse_idempotency_key("a b").detail.find("Idempotency-Key contains a space"), 0u);
}

TEST(IdempotencyOptions, InvalidValuesAreRejectedByName) {
  try {
    IdempotencyStore bad({.ttl = Duration::zero()});
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("ttl"), std::string::npos);
  }
  EXPECT_THROW(IdempotencyStore({.lock_timeout = -1s}), std::invalid_argument);
  EXPECT_THROW(IdempotencyStore({.purge_batch = 0}), std::invalid_argument);
}

class Idempotency : public test::BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped()) return;
    conn_ = open_database(url());
    IdempotencyStore::migrate(*conn_);
    conn_->execute("CREATE TABLE charges (id TEXT PRIMARY KEY, amount BIGINT NOT NULL)");
  }

  // The middleware's step 2+3: business write and completion in one transaction.
  bool finish(const Claim& c, std::string_view scope, std::string_view key, const std::string& id,
              int status = 201) {
    conn_->begin();
    conn_->query("INSERT INTO charges (id, amount) VALUES ($1, $2)", {id, 100});
    if (!store_.complete(
            *conn_, scope, key, c.token,
            {status, {{"Location", "/v1/charges/" + id}}, "{\"id\":\"" + id + "\"}"})) {
      conn_->rollback();
      return false;
    }
    conn_->commit();
    return true;
  }

  std::int64_t charges() { return conn_->query("SELECT COUNT(*) FROM charges").integer(0, 0); }

  ManualClock clock_{WallTime(std::chrono::hours(24 * 365 * 50))};
  IdempotencyStore store_{{.ttl = 24h, .lock_timeout = 30s, .purge_batch = 2, .clock = &clock_}};
  std::unique_ptr<Connection> conn_;
  const std::string fp_ = request_fingerprint("POST", "/v1/charges", R"({"amount":100})");
  const std::string other_fp_ = request_fingerprint("POST", "/v1/charges", R"({"amount":999})");
};

TEST_P(Idempotency, CompletedKeyIsReplayedWithStatusHeadersAndBody) {
  const Claim first = store_.claim(*conn_, "alice", "k1", fp_);
  ASSERT_EQ(first.status, ClaimStatus::kClaimed);
  EXPECT_FALSE(first.took_over);
  ASSERT_TRUE(finish(first, "alice", "k1", "ch_1"));
  const Claim again = store_.claim(*conn_, "alice", "k1", fp_);
  ASSERT_EQ(again.status, ClaimStatus::kReplay);
  EXPECT_EQ(again.response.status, 201);
  EXPECT_EQ(again.response.body, R"({"id":"ch_1"})");
  ASSERT_EQ(again.response.headers.size(), 1u);
  EXPECT_EQ(again.response.headers[0].first, "Location");
  EXPECT_EQ(again.response.headers[0].second, "/v1/charges/ch_1");
  EXPECT_EQ(charges(), 1);
}

TEST_P(Idempotency, DifferentFingerprintIsAMismatchInProgressOrCompleted) {
  const Claim first = store_.claim(*conn_, "alice", "k1", fp_);
  ASSERT_EQ(first.status, ClaimStatus::kClaimed);
  EXPECT_EQ(store_.claim(*conn_, "alice", "k1", other_fp_).status, ClaimStatus::kMismatch);
  ASSERT_TRUE(finish(first, "alice", "k1", "ch_1"));
  EXPECT_EQ(store_.claim(*conn_, "alice", "k1", other_fp_).status, ClaimStatus::kMismatch);
}

TEST_P(Idempotency, InProgressAnswersWithTheLockTimeLeft) {
  ASSERT_EQ(store_.claim(*conn_, "alice", "k1", fp_).status, ClaimStatus::kClaimed);
  clock_.advance(10s);
  const Claim busy = store_.claim(*conn_, "alice", "k1", fp_);
  EXPECT_EQ(busy.status, ClaimStatus::kInProgress);
  EXPECT_EQ(busy.retry_after, 20s);
  clock_.advance(19s + 500ms);
  EXPECT_EQ(store_.claim(*conn_, "alice", "k1", fp_).retry_after, 1s);  // never below 1 s
}

TEST_P(Idempotency, ExpiredLockIsTakenOverAndTheDeadClaimCannotComplete) {
  const Claim dead = store_.claim(*conn_, "alice", "k1", fp_);
  ASSERT_EQ(dead.status, ClaimStatus::kClaimed);
  clock_.advance(31s);
  const Claim heir = store_.claim(*conn_, "alice", "k1", fp_);
  ASSERT_EQ(heir.status, ClaimStatus::kClaimed);
  EXPECT_TRUE(heir.took_over);
  EXPECT_NE(heir.token, dead.token);
  // The first handler wakes up late: its completion is refused and its writes rolled back.
  EXPECT_FALSE(finish(dead, "alice", "k1", "ch_dead"));
  EXPECT_EQ(charges(), 0);
  ASSERT_TRUE(finish(heir, "alice", "k1", "ch_heir"));
  EXPECT_EQ(charges(), 1);
  EXPECT_EQ(store_.claim(*conn_, "alice", "k1", fp_).response.body, R"({"id":"ch_heir"})");
}

TEST_P(Idempotency, ReleasedClaimLetsARetryRunAfresh) {
  const Claim first = store_.claim(*conn_, "alice", "k1", fp_);
  conn_->begin();
  conn_->query("INSERT INTO charges (id, amount) VALUES ($1, $2)", {"ch_failed", 1});
  conn_->rollback();  // the handler failed
  store_.release(*conn_, "alice", "k1", first.token);
  EXPECT_EQ(charges(), 0);
  const Claim retry = store_.claim(*conn_, "alice", "k1", other_fp_);  // nothing was stored
  EXPECT_EQ(retry.status, ClaimStatus::kClaimed);
  EXPECT_FALSE(retry.took_over);
}

TEST_P(Idempotency, AClaimsAsynchronousCommitReachesNoOtherTransaction) {
  // PostgreSQL: a claim outside a transaction commits with synchronous_commit off for itself
  // alone; the session's setting, and a caller's transaction that claims, keep theirs.
  const bool pg = GetParam() == Backend::kPostgres;
  if (pg) conn_->execute("SET synchronous_commit = on");
  const auto setting = [&]() -> std::string {  // SQLite has no such setting
    return pg ? conn_->query("SELECT current_setting('synchronous_commit')").text(0, 0) : "on";
  };
  const Claim first = store_.claim(*conn_, "alice", "k1", fp_);
  ASSERT_EQ(first.status, ClaimStatus::kClaimed);
  EXPECT_EQ(setting(), "on");
  // Visible to another connection at once: a concurrent duplicate is told it is in progress.
  const auto other = open_database(url());
  EXPECT_EQ(store_.claim(*other, "alice", "k1", fp_).status, ClaimStatus::kInProgress);
  ASSERT_TRUE(finish(first, "alice", "k1", "ch_1"));
  EXPECT_EQ(store_.claim(*other, "alice", "k1", fp_).status, ClaimStatus::kReplay);

  conn_->begin();
  const Claim inside = store_.claim(*conn_, "alice", "k2", fp_);
  EXPECT_EQ(inside.status, ClaimStatus::kClaimed);
  EXPECT_EQ(setting(), "on") << "the caller's commit stays synchronous";
  conn_->commit();
  EXPECT_EQ(setting(), "on");
  EXPECT_EQ(store_.claim(*other, "alice", "k2", fp_).status, ClaimStatus::kInProgress);
}

TEST_P(Idempotency, KeysAreScopedPerPrincipal) {
  const Claim alice = store_.claim(*conn_, "alice", "k1", fp_);
  ASSERT_TRUE(finish(alice, "alice", "k1", "ch_a"));
  const Claim bob = store_.claim(*conn_, "bob", "k1", fp_);
  ASSERT_EQ(bob.status, ClaimStatus::kClaimed);  // not alice's replay
  ASSERT_TRUE(finish(bob, "bob", "k1", "ch_b"));
  EXPECT_EQ(store_.claim(*conn_, "bob", "k1", fp_).response.body, R"({"id":"ch_b"})");
  EXPECT_EQ(store_.claim(*conn_, "alice", "k1", fp_).response.body, R"({"id":"ch_a"})");
  EXPECT_EQ(charges(), 2);
}

TEST_P(Idempotency, KeyReusedAfterTtlStartsANewOperation) {
  ASSERT_TRUE(finish(store_.claim(*conn_, "alice", "k1", fp_), "alice", "k1", "ch_1"));
  clock_.advance(24h - 1s);
  EXPECT_EQ(store_.claim(*conn_, "alice", "k1", fp_).status, ClaimStatus::kReplay);
  clock_.advance(1s);
  const Claim fresh = store_.claim(*conn_, "alice", "k1", other_fp_);
  ASSERT_EQ(fresh.status, ClaimStatus::kClaimed);
  ASSERT_TRUE(finish(fresh, "alice", "k1", "ch_2"));
  EXPECT_EQ(charges(), 2);
}

TEST_P(Idempotency, PurgeDeletesOnlyExpiredRecordsInBoundedBatches) {
  for (int i = 0; i < 5; ++i) {
    const std::string key = "old" + std::to_string(i);
    ASSERT_TRUE(finish(store_.claim(*conn_, "alice", key, fp_), "alice", key, "ch_" + key));
  }
  clock_.advance(25h);
  ASSERT_EQ(store_.claim(*conn_, "alice", "live", fp_).status, ClaimStatus::kClaimed);
  EXPECT_EQ(store_.purge_expired(*conn_), 2);  // purge_batch
  EXPECT_EQ(store_.purge_expired(*conn_), 2);
  EXPECT_EQ(store_.purge_expired(*conn_), 1);
  EXPECT_EQ(store_.purge_expired(*conn_), 0);
  EXPECT_EQ(conn_->query("SELECT COUNT(*) FROM keel_idempotency").integer(0, 0), 1);
  EXPECT_EQ(store_.claim(*conn_, "alice", "live", fp_).status, ClaimStatus::kInProgress);
}

TEST_P(Idempotency, ConcurrentClaimsOfOneKeyHaveExactlyOneWinner) {
  constexpr int kThreads = 8;
  std::atomic<int> claimed{0};
  std::atomic<int> in_progress{0};
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&] {
      try {
        auto conn = open_database(url());
        const Claim c = store_.claim(*conn, "alice", "race", fp_);
        if (c.status == ClaimStatus::kClaimed) ++claimed;
        if (c.status == ClaimStatus::kInProgress) ++in_progress;
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
        ++errors;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(claimed.load(), 1);
  EXPECT_EQ(in_progress.load(), kThreads - 1);
}

INSTANTIATE_TEST_SUITE_P(Backends, Idempotency,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

}  // namespace
}  // namespace keel::store
