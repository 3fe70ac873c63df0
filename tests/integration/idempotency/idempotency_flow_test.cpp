// IdempotentRequestFlow in process, without sockets or cpp-httplib: every outcome on a real
// SQLite file and a real PostgreSQL server, in virtual time (a ManualClock drives lock expiry).
#include "keel/idempotency/idempotency_flow.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdint>
#include <functional>
#include <future>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "build_kind.hpp"
#include "keel/core/random.hpp"
#include "keel/db/dialect.hpp"
#include "keel/idempotency/request_translation.hpp"
#include "support/test_support.hpp"

namespace keel::store {
namespace {

using namespace std::chrono_literals;

// A stand-in for another server framework's request and response types.
struct MiniRequest {
  std::string method;
  std::string target;
  std::map<std::string, std::string> headers;
  std::string body;
  std::string user;  // what the framework's authentication verified
  [[nodiscard]] std::optional<std::string_view> header(const std::string& name) const {
    const auto it = headers.find(name);
    if (it == headers.end()) return std::nullopt;
    return std::string_view(it->second);
  }
};
struct MiniResponse {
  int status = 0;
  std::multimap<std::string, std::string> headers;
  std::string body;
};

// --- README.md example ---
// One route of a server on any framework: copy its request in, copy the answer out.
MiniResponse create_charge(const IdempotentRequestFlow& flow, const MiniRequest& req) {
  const FlowResponse out = flow.run(
      {.method = req.method,
       .path = req.target,
       .idempotency_key = req.header("Idempotency-Key"),
       .content_type = req.header("Content-Type").value_or(""),
       .body = req.body,
       .principal = req.user},
      [&](Connection& tx) {
        tx.query("INSERT INTO charges (body) VALUES ($1)", {req.body});
        return StoredResponse{201, {{"Content-Type", "application/json"}}, R"({"ok":true})"};
      });
  // The exception or database text, for the log only: it is never in out.body.
  if (!out.error.empty()) std::clog << "POST /v1/charges: " << out.error << '\n';
  MiniResponse res{.status = out.status, .headers = {}, .body = out.body};
  for (const auto& [name, value] : out.headers) res.headers.emplace(name, value);
  return res;
}
// --- end of the README.md example ---

class Flow : public test::BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped()) return;
    pool_ = std::make_unique<ConnectionPool>(url(), PoolOptions{.max_connections = 4});
    auto conn = pool_->acquire();
    IdempotencyStore::migrate(*conn);
    conn->execute(std::string("CREATE TABLE charges (id ") +
                  (GetParam() == Backend::kPostgres ? "SERIAL" : "INTEGER") +
                  " PRIMARY KEY, body TEXT NOT NULL)");
    flow_ = std::make_unique<IdempotentRequestFlow>(
        FlowOptions{.store = &store_,
                    .pool = pool_.get(),
                    .scope_secret = "0123456789abcdef0123456789abcdef",
                    .clock = &clock_,
                    .on_outcome = [this](IdempotencyOutcome o) { outcomes_.push_back(o); },
                    .log =
                        [this](std::string_view m) {
                          std::lock_guard lock(log_mu_);
                          log_ += std::string(m) + "\n";
                        }});
  }

  static FlowRequest request(std::optional<std::string_view> key, std::string_view body = "{}") {
    return {.method = "POST",
            .path = "/v1/charges",
            .idempotency_key = key,
            .content_type = "application/json",
            .body = body,
            .principal = "alice"};
  }

  /// The flow with a handler that counts its runs and inserts one charge.
  FlowResponse run(const FlowRequest& req, int status = 201) {
    return flow_->run(req, [&](Connection& tx) {
      ++handled_;
      tx.query("INSERT INTO charges (body) VALUES ($1)", {std::string(req.body)});
      return StoredResponse{status,
                            {{"Location", "/v1/charges/1"}, {"Content-Type", "application/json"}},
                            R"({"id":1})"};
    });
  }

  std::int64_t rows(const std::string& table) {
    return pool_->acquire()->query("SELECT COUNT(*) FROM " + table).integer(0, 0);
  }

  /// The claim another request (another process) holds on `key`, made through the store.
  Claim claim_elsewhere(std::string_view key, std::string_view body = "{}") {
    auto conn = pool_->acquire();
    return store_.claim(*conn, flow_->scope("alice"), key,
                        request_fingerprint("POST", "/v1/charges", body));
  }

  static nlohmann::json problem(const FlowResponse& r) {
    EXPECT_EQ(r.header("Content-Type"), "application/problem+json");
    return nlohmann::json::parse(r.body);
  }

  ManualClock clock_{WallTime(std::chrono::hours(24 * 365 * 50))};
  IdempotencyStore store_{{.ttl = 24h, .lock_timeout = 30s, .clock = &clock_}};
  std::unique_ptr<ConnectionPool> pool_;
  std::unique_ptr<IdempotentRequestFlow> flow_;
  std::vector<IdempotencyOutcome> outcomes_;
  int handled_ = 0;
  std::mutex log_mu_;
  std::string log_;  // guarded by log_mu_
};

TEST_P(Flow, ExecutedStoresTheResponseWithTheWrites) {
  const FlowResponse r = run(request("k1", R"({"amount":100})"));
  EXPECT_EQ(r.outcome, FlowOutcome::kExecuted);
  EXPECT_EQ(r.status, 201);
  EXPECT_EQ(r.body, R"({"id":1})");
  EXPECT_EQ(r.header("Location"), "/v1/charges/1");
  EXPECT_EQ(r.header("Content-Type"), "application/json");
  EXPECT_FALSE(r.header("Idempotent-Replayed"));
  EXPECT_TRUE(r.error.empty());
  EXPECT_EQ(handled_, 1);
  EXPECT_EQ(rows("charges"), 1);
  EXPECT_EQ(outcomes_, std::vector{IdempotencyOutcome::kExecuted});
  EXPECT_EQ(claim_elsewhere("k1", R"({"amount":100})").status, ClaimStatus::kReplay);
}

TEST_P(Flow, SameKeyAndPayloadReplaysWithoutRunningTheHandlerAgain) {
  const FlowResponse first = run(request("k1", R"({"amount":100,"currency":"EUR"})"));
  ASSERT_EQ(first.outcome, FlowOutcome::kExecuted);
  // The same JSON in another member order and spacing is the same payload.
  const FlowResponse again = run(request("k1", R"({ "currency": "EUR", "amount": 100 })"));
  EXPECT_EQ(again.outcome, FlowOutcome::kReplayed);
  EXPECT_EQ(again.status, 201);
  EXPECT_EQ(again.body, first.body);
  EXPECT_EQ(again.header("Location"), "/v1/charges/1");
  EXPECT_EQ(again.header("Content-Type"), "application/json");
  EXPECT_EQ(again.header("Idempotent-Replayed"), "true");
  EXPECT_EQ(handled_, 1);
  EXPECT_EQ(rows("charges"), 1);
  EXPECT_EQ(outcomes_, (std::vector{IdempotencyOutcome::kExecuted, IdempotencyOutcome::kReplayed}));
}

TEST_P(Flow, AKeyHeldByAnotherRequestIs409WithTheLockTimeLeft) {
  ASSERT_EQ(claim_elsewhere("k1").status, ClaimStatus::kClaimed);
  clock_.advance(10s);
  const FlowResponse r = run(request("k1"));
  EXPECT_EQ(r.outcome, FlowOutcome::kInProgress);
  EXPECT_EQ(r.status, 409);
  // The lock's 20 s left, plus 0..2 s of spread (retry_after_spread 3).
  EXPECT_GE(std::stoi(std::string(r.header("Retry-After").value_or("0"))), 20);
  EXPECT_LE(std::stoi(std::string(r.header("Retry-After").value_or("0"))), 22);
  EXPECT_EQ(problem(r)["status"], 409);
  EXPECT_EQ(problem(r)["title"], "Request in progress");
  EXPECT_EQ(handled_, 0);
  EXPECT_EQ(outcomes_, std::vector{IdempotencyOutcome::kInProgress});
}

TEST_P(Flow, TheSameKeyWithAnotherPayloadIs422) {
  ASSERT_EQ(run(request("k1", R"({"amount":100})")).outcome, FlowOutcome::kExecuted);
  const FlowResponse r = run(request("k1", R"({"amount":999})"));
  EXPECT_EQ(r.outcome, FlowOutcome::kMismatch);
  EXPECT_EQ(r.status, 422);
  EXPECT_EQ(problem(r)["title"], "Idempotency-Key reused");
  EXPECT_EQ(handled_, 1);
  EXPECT_EQ(rows("charges"), 1);
  EXPECT_EQ(outcomes_.back(), IdempotencyOutcome::kMismatch);
}

TEST_P(Flow, AMissingKeyIs400AndClaimsNothing) {
  const FlowResponse r = run(request(std::nullopt));
  EXPECT_EQ(r.outcome, FlowOutcome::kMissingKey);
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(problem(r)["title"], "Invalid Idempotency-Key");
  EXPECT_EQ(metrics_outcome(r.outcome), IdempotencyOutcome::kInvalidKey);
  EXPECT_EQ(outcomes_, std::vector{IdempotencyOutcome::kInvalidKey});
  EXPECT_EQ(handled_, 0);
  EXPECT_EQ(rows("keel_idempotency"), 0);
}

TEST_P(Flow, AnInvalidKeyIs400AndClaimsNothing) {
  const std::string too_long(kMaxKeyLength + 1, 'k');
  for (const std::string_view key : {std::string_view(""), std::string_view(too_long),
                                     std::string_view("a\x01z"), std::string_view("\"open")}) {
    const FlowResponse r = run(request(key));
    EXPECT_EQ(r.outcome, FlowOutcome::kInvalidKey) << key;
    EXPECT_EQ(r.status, 400);
    EXPECT_FALSE(problem(r)["detail"].get<std::string>().empty());
  }
  EXPECT_EQ(handled_, 0);
  EXPECT_EQ(rows("keel_idempotency"), 0);
}

TEST_P(Flow, TwoIdempotencyKeyFieldsAre400AndClaimNothing) {
  FlowRequest req = request("key-a");
  req.idempotency_key_fields = 2;
  const FlowResponse r = run(req);
  EXPECT_EQ(r.outcome, FlowOutcome::kInvalidKey);
  EXPECT_EQ(r.status, 400);
  const std::string detail = problem(r)["detail"].get<std::string>();
  EXPECT_NE(detail.find("2 Idempotency-Key header fields"), std::string::npos) << detail;
  EXPECT_EQ(outcomes_, std::vector{IdempotencyOutcome::kInvalidKey});
  EXPECT_EQ(handled_, 0);
  EXPECT_EQ(rows("keel_idempotency"), 0);
  // One field with that key runs.
  req.idempotency_key_fields = 1;
  EXPECT_EQ(run(req).outcome, FlowOutcome::kExecuted);
}

TEST_P(Flow, AJsonBodyOverTheLimitsIs400BeforeAnythingIsClaimed) {
  const FlowResponse deep = run(request("k1", std::string(100, '[') + std::string(100, ']')));
  EXPECT_EQ(deep.outcome, FlowOutcome::kInvalidBody);
  EXPECT_EQ(deep.status, 400);
  const FlowResponse dup = run(request("k2", R"({"a":1,"a":2})"));
  EXPECT_EQ(dup.outcome, FlowOutcome::kInvalidBody);
  EXPECT_EQ(problem(dup)["title"], "Duplicate JSON member");
  EXPECT_EQ(handled_, 0);
  EXPECT_EQ(rows("keel_idempotency"), 0);
}

TEST_P(Flow, AHandlerErrorIsAGeneric500AndTheRecordIsReleasedForARetry) {
  const FlowResponse r = flow_->run(request("k1"), [&](Connection& tx) -> StoredResponse {
    ++handled_;
    tx.query("INSERT INTO charges (body) VALUES ($1)", {"doomed"});
    throw std::runtime_error("secret database password in here");
  });
  EXPECT_EQ(r.outcome, FlowOutcome::kHandlerError);
  EXPECT_EQ(r.status, 500);
  EXPECT_EQ(r.body.find("secret"), std::string::npos) << r.body;
  EXPECT_EQ(problem(r)["title"], "Handler failed");
  EXPECT_NE(r.error.find("secret database password"), std::string::npos) << r.error;
  {
    std::lock_guard lock(log_mu_);
    EXPECT_NE(log_.find("secret database password"), std::string::npos) << log_;
  }
  EXPECT_EQ(outcomes_, std::vector{IdempotencyOutcome::kError});
  EXPECT_EQ(rows("charges"), 0);
  EXPECT_EQ(rows("keel_idempotency"), 0);
  // Released, not locked: the retry runs at once, without waiting for the lock to expire.
  const FlowResponse retry = run(request("k1"));
  EXPECT_EQ(retry.outcome, FlowOutcome::kExecuted);
  EXPECT_EQ(handled_, 2);
  EXPECT_EQ(rows("charges"), 1);
}

TEST_P(Flow, AHandlerThatThrowsANonStandardExceptionIsStillAGeneric500) {
  const FlowResponse r = flow_->run(request("k1"), [](Connection&) -> StoredResponse { throw 42; });
  EXPECT_EQ(r.outcome, FlowOutcome::kHandlerError);
  EXPECT_EQ(r.status, 500);
  EXPECT_NE(r.error.find("not derived from std::exception"), std::string::npos) << r.error;
  EXPECT_EQ(rows("keel_idempotency"), 0);
}

TEST_P(Flow, AHandlerErrorAnswerIsSentNotStoredAndReleased) {
  const FlowResponse r = run(request("k1"), 400);
  EXPECT_EQ(r.outcome, FlowOutcome::kNotStored);
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.body, R"({"id":1})");
  EXPECT_EQ(rows("charges"), 0);
  EXPECT_EQ(rows("keel_idempotency"), 0);
  EXPECT_EQ(run(request("k1")).outcome, FlowOutcome::kExecuted);
  EXPECT_EQ(outcomes_,
            (std::vector{IdempotencyOutcome::kNotStored, IdempotencyOutcome::kExecuted}));
}

TEST_P(Flow, AClaimWhoseLockExpiredIsTakenOver) {
  const Claim dead = claim_elsewhere("k1");
  ASSERT_EQ(dead.status, ClaimStatus::kClaimed);
  EXPECT_EQ(run(request("k1")).outcome, FlowOutcome::kInProgress);
  clock_.advance(30s);  // the lock expires
  const FlowResponse r = run(request("k1"));
  EXPECT_EQ(r.outcome, FlowOutcome::kTookOver);
  EXPECT_EQ(r.status, 201);
  EXPECT_EQ(metrics_outcome(r.outcome), IdempotencyOutcome::kExecuted);
  EXPECT_EQ(outcomes_.back(), IdempotencyOutcome::kExecuted);
  EXPECT_EQ(handled_, 1);
  // The dead claim's owner wakes up: its completion is refused.
  auto conn = pool_->acquire();
  conn->begin();
  EXPECT_FALSE(store_.complete(*conn, flow_->scope("alice"), "k1", dead.token, {}));
  conn->rollback();
  EXPECT_EQ(run(request("k1")).outcome, FlowOutcome::kReplayed);
}

TEST_P(Flow, AHandlerWhoseKeyIsClaimedMeanwhileIs409AndStoresNothing) {
  const bool row_locks = pool_->dialect().row_level_locks();
  const FlowResponse r = flow_->run(request("k1"), [&](Connection& tx) {
    ++handled_;
    tx.query("INSERT INTO charges (body) VALUES ($1)", {"late"});
    // A claim made without holding the key (IdempotencyStore::claim on its own, from another
    // program) lands while this handler runs. PostgreSQL: committed from another connection.
    // SQLite: the handler's transaction holds the write lock, so it is written through it.
    if (row_locks) {
      EXPECT_EQ(claim_elsewhere("k1").status, ClaimStatus::kClaimed);
    } else {
      tx.query(
          "INSERT INTO keel_idempotency (scope, idem_key, fingerprint, status, lock_token,"
          " lock_expires_ms, created_ms) VALUES ($1, 'k1', 'x', 'in_progress', 'theirs', 0, 0)",
          {flow_->scope("alice")});
    }
    return StoredResponse{201, {}, "late"};
  });
  EXPECT_EQ(r.outcome, FlowOutcome::kClaimLost);
  EXPECT_EQ(r.status, 409);
  const std::string retry_after(r.header("Retry-After").value_or(""));
  EXPECT_TRUE(retry_after == "1" || retry_after == "2" || retry_after == "3") << retry_after;
  EXPECT_EQ(problem(r)["status"], 409);
  EXPECT_EQ(metrics_outcome(r.outcome), IdempotencyOutcome::kInProgress);
  EXPECT_EQ(rows("charges"), 0);
}

TEST_P(Flow, ScopesArePerPrincipalAndHoldNoCredential) {
  ASSERT_EQ(run(request("k1")).outcome, FlowOutcome::kExecuted);
  FlowRequest bob = request("k1");
  bob.principal = "bob";
  EXPECT_EQ(run(bob).outcome, FlowOutcome::kExecuted);  // not alice's replay
  EXPECT_EQ(flow_->scope(""), kAnonymousScope);
  EXPECT_EQ(flow_->scope("alice").rfind("p:", 0), 0u);
  EXPECT_EQ(pool_->acquire()
                ->query("SELECT COUNT(*) FROM keel_idempotency WHERE scope IN ('alice', 'bob')")
                .integer(0, 0),
            0);
}

TEST_P(Flow, AnotherFrameworkDrivesTheFlowThroughPlainValues) {
  MiniRequest req{.method = "POST",
                  .target = "/v1/charges",
                  .headers = {{"Idempotency-Key", "k1"}, {"Content-Type", "application/json"}},
                  .body = R"({"amount":100})",
                  .user = "alice"};
  const MiniResponse first = create_charge(*flow_, req);
  EXPECT_EQ(first.status, 201);
  EXPECT_EQ(first.body, R"({"ok":true})");
  const MiniResponse again = create_charge(*flow_, req);
  EXPECT_EQ(again.status, 201);
  EXPECT_EQ(again.headers.count("Idempotent-Replayed"), 1u);
  EXPECT_EQ(rows("charges"), 1);
}

// --- deadline propagation (Keel-Deadline-Ms) ---

TEST_P(Flow, ADeadlinePassedOnArrivalIsRefusedNotExecutedAndNothingIsStored) {
  FlowRequest req = request("late-1");
  req.deadline = request_deadline("0", clock_.now());  // no time left when it was sent
  const FlowResponse r = run(req);
  EXPECT_EQ(r.outcome, FlowOutcome::kDeadlineExceeded);
  EXPECT_EQ(r.status, 400) << "a status no retrying layer repeats";
  EXPECT_EQ(problem(r)["title"], "Deadline exceeded");
  EXPECT_EQ(handled_, 0);
  EXPECT_EQ(rows("charges"), 0);
  EXPECT_EQ(rows("keel_idempotency"), 0);
  EXPECT_EQ(outcomes_, std::vector{IdempotencyOutcome::kDeadlineExceeded});
  // The key is free: the same request with time left runs.
  const FlowResponse again = run(request("late-1"));
  EXPECT_EQ(again.outcome, FlowOutcome::kExecuted);
  EXPECT_EQ(handled_, 1);
}

TEST_P(Flow, ADeadlineThatPassedInTransitIsRefused) {
  FlowRequest req = request("late-2");
  req.deadline = request_deadline("500", clock_.now());
  clock_.advance(501ms);  // queued somewhere before the flow started
  EXPECT_EQ(run(req).outcome, FlowOutcome::kDeadlineExceeded);
  EXPECT_EQ(handled_, 0);
}

// Counts each exchange a connection has with its database by kind: a statement, BEGIN, COMMIT,
// and the ones sent together (a statement then BEGIN, a statement then COMMIT, BEGIN then
// statements); `on_statement` sees each statement's SQL before it runs.
class ExchangeCountingConnection final : public Connection {
 public:
  struct Counts {
    std::atomic<int> query{0}, begin{0}, commit{0}, query_then_begin{0}, query_then_commit{0},
        begin_then_query{0};
    std::function<void(std::string_view sql)> on_statement = [](std::string_view) {};
  };
  ExchangeCountingConnection(std::unique_ptr<Connection> inner, Counts& counts)
      : inner_(std::move(inner)), counts_(counts) {}
  [[nodiscard]] Backend backend() const noexcept override { return inner_->backend(); }
  void execute(std::string_view sql) override { inner_->execute(sql); }
  Rows query(std::string_view sql, std::span<const Value> params) override {
    ++counts_.query;
    counts_.on_statement(sql);
    return inner_->query(sql, params);
  }
  void begin(Isolation isolation) override {
    ++counts_.begin;
    inner_->begin(isolation);
  }
  void commit() override {
    ++counts_.commit;
    inner_->commit();
  }
  Rows query_then_begin(std::string_view sql, std::span<const Value> params,
                        Isolation isolation) override {
    ++counts_.query_then_begin;
    counts_.on_statement(sql);
    return inner_->query_then_begin(sql, params, isolation);
  }
  Rows query_then_commit(std::string_view sql, std::span<const Value> params) override {
    ++counts_.query_then_commit;
    counts_.on_statement(sql);
    return inner_->query_then_commit(sql, params);
  }
  std::vector<Rows> begin_then_query(Isolation isolation,
                                     std::span<const Statement> statements) override {
    ++counts_.begin_then_query;
    for (const Statement& statement : statements) counts_.on_statement(statement.sql);
    return inner_->begin_then_query(isolation, statements);
  }
  void rollback() noexcept override { inner_->rollback(); }
  [[nodiscard]] bool in_transaction() const noexcept override { return inner_->in_transaction(); }
  [[nodiscard]] bool broken() const noexcept override { return inner_->broken(); }

 private:
  std::unique_ptr<Connection> inner_;
  Counts& counts_;
};

// A flow over a pool of one connection whose exchanges `counts` counts.
struct CountedFlow {
  CountedFlow(const DatabaseUrl& url, const IdempotencyStore& store, Clock& clock,
              ExchangeCountingConnection::Counts& counts)
      : pool(url, {.max_connections = 1,
                   .open =
                       [&counts](const DatabaseUrl& u, const ConnectOptions& o) {
                         return std::make_unique<ExchangeCountingConnection>(open_database(u, o),
                                                                             counts);
                       }}),
        flow({.store = &store,
              .pool = &pool,
              .scope_secret = "0123456789abcdef0123456789abcdef",
              .clock = &clock,
              .log = [](std::string_view) {}}) {}
  ConnectionPool pool;
  IdempotentRequestFlow flow;
};

TEST_P(Flow, ADeadlineThatPassesWhileClaimingReleasesTheClaimAndRunsNothing) {
  // Reading the key's record takes 2 s of the request's 1 s.
  ExchangeCountingConnection::Counts counts;
  counts.on_statement = [&](std::string_view sql) {
    if (sql.starts_with("SELECT fingerprint")) clock_.advance(2s);
  };
  const CountedFlow counted(url(), store_, clock_, counts);
  const IdempotentRequestFlow& flow = counted.flow;
  FlowRequest req = request("late-3");
  req.deadline = request_deadline("1000", clock_.now());
  int handled = 0;
  const FlowResponse r = flow.run(req, [&](Connection&) {
    ++handled;
    return StoredResponse{201, {}, "{}"};
  });
  EXPECT_EQ(r.outcome, FlowOutcome::kDeadlineExceeded);
  EXPECT_NE(problem(r)["detail"].get<std::string>().find("claimed"), std::string::npos)
      << problem(r)["detail"];
  EXPECT_EQ(handled, 0);
  EXPECT_EQ(rows("keel_idempotency"), 0) << "the claim was released";
  EXPECT_EQ(claim_elsewhere("late-3").status, ClaimStatus::kClaimed);
}

TEST_P(Flow, ADeadlineThatPassesWhileTheTransactionIsRetriedStopsTheRetries) {
  FlowRequest req = request("late-4");
  req.deadline = request_deadline("500", clock_.now());
  DatabaseError::Details lost{.backend = GetParam()};
  if (GetParam() == Backend::kPostgres) {
    lost.sqlstate = "40001";  // serialization_failure: with_transaction_retry retries it
  } else {
    lost.sqlite_code = 5;  // SQLITE_BUSY
  }
  int handled = 0;
  // Each run of the handler takes 300 ms and loses a race; the policy would allow 5 runs.
  const FlowResponse r = flow_->run(req, [&](Connection&) -> StoredResponse {
    ++handled;
    clock_.advance(300ms);
    throw DatabaseError("lost a race", lost);
  });
  EXPECT_EQ(handled, 2);
  EXPECT_EQ(r.outcome, FlowOutcome::kDeadlineExceeded);
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(problem(r)["detail"].get<std::string>().find("transaction"), std::string::npos);
  EXPECT_EQ(rows("keel_idempotency"), 0) << "the claim was released";
  EXPECT_EQ(claim_elsewhere("late-4").status, ClaimStatus::kClaimed);
}

// A database error no retry can fix, raised in the handler's transaction, is a 500 without
// Retry-After (clients stop), runs the handler once, stores nothing and releases the key: a CHECK
// constraint (23514; SQLITE_CONSTRAINT_CHECK) and a trigger's abort (P0001; RAISE(ABORT)).
TEST_P(Flow, APermanentDatabaseErrorInTheHandlerIs500WithoutRetryAfter) {
  const bool pg = GetParam() == Backend::kPostgres;
  {
    auto conn = pool_->acquire();
    conn->execute("CREATE TABLE amounts (cents INTEGER NOT NULL CHECK (cents > 0))");
    conn->execute("CREATE TABLE refused (note TEXT)");
    if (pg) {
      conn->execute(
          "CREATE FUNCTION refuse_all() RETURNS trigger LANGUAGE plpgsql AS "
          "$$ BEGIN RAISE EXCEPTION 'refused by a trigger'; END $$;"
          "CREATE TRIGGER refuse BEFORE INSERT ON refused FOR EACH ROW EXECUTE FUNCTION "
          "refuse_all()");
    } else {
      conn->execute(
          "CREATE TRIGGER refuse BEFORE INSERT ON refused BEGIN "
          "SELECT RAISE(ABORT, 'refused by a trigger'); END");
    }
  }
  const struct {
    const char* key;
    const char* sql;
  } cases[] = {{"check-1", "INSERT INTO amounts (cents) VALUES (-5)"},
               {"trigger-1", "INSERT INTO refused (note) VALUES ('x')"}};
  for (const auto& c : cases) {
    int handled = 0;
    const FlowResponse r = flow_->run(request(c.key), [&](Connection& tx) {
      ++handled;
      tx.query("INSERT INTO charges (body) VALUES ('{}')");
      tx.query(c.sql);
      return StoredResponse{201, {}, "{}"};
    });
    EXPECT_EQ(r.outcome, FlowOutcome::kDatabaseError) << c.key;
    EXPECT_EQ(r.status, 500) << c.key;
    EXPECT_FALSE(r.header("Retry-After").has_value()) << c.key << ": clients must not retry it";
    EXPECT_EQ(problem(r)["status"], 500);
    EXPECT_EQ(r.body.find("refused by a trigger"), std::string::npos) << "no database text";
    EXPECT_EQ(r.body.find("amounts"), std::string::npos) << "no database text";
    EXPECT_FALSE(r.error.empty());
    EXPECT_EQ(handled, 1) << c.key << ": a permanent error is not retried";
    EXPECT_EQ(claim_elsewhere(c.key).status, ClaimStatus::kClaimed) << "the key was released";
  }
  EXPECT_EQ(rows("charges"), 0);
  EXPECT_EQ(rows("keel_idempotency"), 2) << "only the two claims made here by claim_elsewhere";
}

// A lock another transaction holds is waited for at most until the request's deadline (400
// deadline exceeded) or, without one, the flow's max_wait (503 + Retry-After); the handler's
// writes are rolled back and nothing is answered after that. PostgreSQL: LOCK TABLE held by
// another session; SQLite: another connection's BEGIN IMMEDIATE.
TEST_P(Flow, ALockHeldElsewhereIsWaitedForOnlyUntilTheDeadlineOrMaxWait) {
  const bool pg = GetParam() == Backend::kPostgres;
  auto holder = open_database(url());
  holder->begin();
  if (pg) {
    holder->query("LOCK TABLE charges IN EXCLUSIVE MODE");
  } else {
    holder->query("INSERT INTO charges (body) VALUES ('held')");  // holds the write lock
  }
  const IdempotentRequestFlow flow({.store = &store_,
                                    .pool = pool_.get(),
                                    .scope_secret = "0123456789abcdef0123456789abcdef",
                                    .max_wait = 1500ms,
                                    .log = [](std::string_view) {}});
  const auto timed = [&](FlowRequest req) {
    const auto start = std::chrono::steady_clock::now();
    const FlowResponse r = flow.run(req, [&](Connection& tx) {
      tx.query("INSERT INTO charges (body) VALUES ('{}')");
      return StoredResponse{201, {}, "{}"};
    });
    return std::make_pair(r, std::chrono::steady_clock::now() - start);
  };
  FlowRequest with_deadline = request("locked-1");
  with_deadline.deadline = request_deadline("500", steady_clock().now());
  const auto [refused, took] = timed(with_deadline);
  EXPECT_EQ(refused.outcome, FlowOutcome::kDeadlineExceeded) << refused.error;
  EXPECT_EQ(refused.status, 400);
  const auto [busy, busy_took] = timed(request("locked-2"));
  EXPECT_EQ(busy.outcome, FlowOutcome::kDatabaseUnavailable) << busy.error;
  EXPECT_EQ(busy.status, 503);
  EXPECT_TRUE(busy.header("Retry-After").has_value());
  if (test::kTimingAsserted) {
    EXPECT_LT(took, 1000ms) << "the 500 ms deadline bounds the wait";
    EXPECT_GE(busy_took, 1400ms);
    EXPECT_LT(busy_took, 2500ms) << "max_wait (1.5 s) bounds the wait";
  }
  holder->rollback();
  EXPECT_EQ(rows("charges"), 0) << "nothing committed behind the lock";
  // The lock gone, the same keys run as new requests.
  EXPECT_EQ(timed(request("locked-1")).first.outcome, FlowOutcome::kExecuted);
  EXPECT_EQ(timed(request("locked-2")).first.outcome, FlowOutcome::kExecuted);
}

// Set by a server whose client went away (or whose drain ran out): nothing is committed after
// it, even when the handler's work is done.
TEST_P(Flow, AnAbandonedRequestCommitsNothing) {
  std::atomic<bool> abandoned{false};
  FlowRequest req = request("gone-1");
  req.abandoned = &abandoned;
  const FlowResponse r = flow_->run(req, [&](Connection& tx) {
    tx.query("INSERT INTO charges (body) VALUES ('{}')");
    abandoned.store(true);  // the client disconnected while the handler ran
    return StoredResponse{201, {}, "{}"};
  });
  EXPECT_EQ(r.outcome, FlowOutcome::kDeadlineExceeded);
  EXPECT_EQ(rows("charges"), 0);
  EXPECT_EQ(claim_elsewhere("gone-1").status, ClaimStatus::kClaimed) << "nothing was stored";
}

TEST_P(Flow, AFutureDeadlineRunsAsUsualAndTheHandlerSeesIt) {
  FlowRequest req = request("soon-1");
  req.deadline = request_deadline("30000", clock_.now());
  std::optional<Deadline> seen;
  const FlowResponse r = flow_->run(req, [&](Connection& tx) {
    seen = current_request_deadline();
    tx.query("INSERT INTO charges (body) VALUES ($1)", {std::string(req.body)});
    return StoredResponse{201, {}, "{}"};
  });
  EXPECT_EQ(r.outcome, FlowOutcome::kExecuted);
  ASSERT_TRUE(seen.has_value());
  EXPECT_EQ(seen->when(), clock_.now() + 30s);
  EXPECT_TRUE(current_request_deadline().is_infinite()) << "only while the handler runs";
  EXPECT_EQ(rows("charges"), 1);
}

TEST_P(Flow, AMalformedOrAbsentDeadlineIsIgnored) {
  for (const std::string_view bad : {"-1", "soon", "1.5", "100, 200", "99999999999999"}) {
    EXPECT_TRUE(request_deadline(bad, clock_.now()).is_infinite()) << bad;
  }
  EXPECT_TRUE(request_deadline(std::nullopt, clock_.now()).is_infinite());
  FlowRequest req = request("odd-1");
  req.deadline = request_deadline("-1", clock_.now());
  EXPECT_EQ(run(req).outcome, FlowOutcome::kExecuted);
  EXPECT_EQ(handled_, 1);
}

TEST(FlowOutcomes, DeadlineExceededHasItsOwnNameAndCounter) {
  EXPECT_EQ(to_string(FlowOutcome::kDeadlineExceeded), "deadline_exceeded");
  EXPECT_EQ(metrics_outcome(FlowOutcome::kDeadlineExceeded), IdempotencyOutcome::kDeadlineExceeded);
  EXPECT_EQ(to_string(IdempotencyOutcome::kDeadlineExceeded), "deadline_exceeded");
  EXPECT_EQ(static_cast<int>(IdempotencyOutcome::kDeadlineExceeded), kIdempotencyOutcomes - 1);
}

// --- what a request costs the database ---

// At SERIALIZABLE the handler's snapshot would predate a lock taken in its transaction, so on
// PostgreSQL the claim commits on its own first (sent with BEGIN), and is released when the
// handler stores nothing; on SQLite every transaction holds the write lock, so nothing changes.
TEST_P(Flow, AtSerializableTheClaimCommitsFirstWhereRowsAreLockedAndTheGuaranteesHold) {
  ExchangeCountingConnection::Counts counts;
  CountedFlow counted(url(), store_, clock_, counts);
  const IdempotentRequestFlow flow({.store = &store_,
                                    .pool = &counted.pool,
                                    .scope_secret = "0123456789abcdef0123456789abcdef",
                                    .isolation = Isolation::kSerializable,
                                    .clock = &clock_,
                                    .log = [](std::string_view) {}});
  int handled = 0;
  const auto charge = [&](Connection& tx) {
    ++handled;
    tx.query("INSERT INTO charges (body) VALUES ($1)", {"{}"});
    return StoredResponse{201, {}, "{}"};
  };
  EXPECT_EQ(flow.run(request("ser-1"), charge).outcome, FlowOutcome::kExecuted);
  EXPECT_EQ(flow.run(request("ser-1"), charge).outcome, FlowOutcome::kReplayed);
  const FlowResponse declined = flow.run(request("ser-2"), [&](Connection& tx) {
    tx.query("INSERT INTO charges (body) VALUES ($1)", {"declined"});
    return StoredResponse{402, {}, "{}"};
  });
  EXPECT_EQ(declined.outcome, FlowOutcome::kNotStored);
  EXPECT_EQ(handled, 1);
  EXPECT_EQ(rows("charges"), 1);
  EXPECT_EQ(rows("keel_idempotency"), 1) << "the declined request's claim was released";
  if (counted.pool.dialect().row_level_locks()) {
    EXPECT_EQ(counts.query_then_begin, 3);  // each request's claim, sent with BEGIN
    EXPECT_EQ(counts.begin_then_query, 0);
  } else {
    EXPECT_EQ(counts.query_then_begin + counts.begin_then_query, 0);
  }
}

TEST_P(Flow, ANewKeyCostsTheHandlersStatementsPlusTwoSentWithBeginAndCommit) {
  ExchangeCountingConnection::Counts counts;
  const CountedFlow counted(url(), store_, clock_, counts);
  const IdempotentRequestFlow& flow = counted.flow;
  const FlowResponse r = flow.run(request("cost-1"), [](Connection& tx) {
    tx.query("INSERT INTO charges (body) VALUES ($1)", {"{}"});
    return StoredResponse{201, {}, "{}"};
  });
  ASSERT_EQ(r.outcome, FlowOutcome::kExecuted);
  if (counted.pool.dialect().row_level_locks()) {
    // BEGIN, the key's lock and the record's read go together; the record is written with
    // COMMIT: the handler's one INSERT plus two round trips, as many as BEGIN and COMMIT alone,
    // and one transaction.
    EXPECT_EQ(counts.begin_then_query, 1);
    EXPECT_EQ(counts.query, 1);
    EXPECT_EQ(counts.query_then_commit, 1);
    EXPECT_EQ(counts.begin + counts.commit + counts.query_then_begin, 0);
  } else {
    // One transaction: the record's read, the handler's INSERT and the record's one write.
    EXPECT_EQ(counts.begin, 1);
    EXPECT_EQ(counts.query, 3);
    EXPECT_EQ(counts.commit, 1);
    EXPECT_EQ(counts.query_then_begin + counts.query_then_commit + counts.begin_then_query, 0);
  }
  EXPECT_EQ(rows("charges"), 1);
  EXPECT_EQ(run(request("cost-1")).outcome, FlowOutcome::kReplayed);
}

// Two requests with one key at once, on real threads, the second arriving while the first's
// handler runs. Where the claim commits on its own (row locks: PostgreSQL), the second sees it
// and is answered 409 at once, while the first still runs; where the claim is made in the
// handler's transaction (one write lock: SQLite), the second waits for that lock, as its claim
// always did while a handler ran, and then replays the first's answer. The handler runs once.
TEST_P(Flow, AConcurrentDuplicateIs409OrWaitsAndReplaysButNeverRunsTwice) {
  const IdempotentRequestFlow flow({.store = &store_,
                                    .pool = pool_.get(),
                                    .scope_secret = "0123456789abcdef0123456789abcdef",
                                    .clock = &clock_,
                                    .log = [](std::string_view) {}});
  const bool claim_commits_alone = pool_->dialect().row_level_locks();
  std::atomic<int> handled{0};
  std::promise<void> first_in_handler;
  std::promise<void> second_went;  // PostgreSQL: answered; SQLite: about to claim
  std::future<void> second_gone = second_went.get_future();
  const auto handler = [&](Connection& tx) {
    ++handled;
    tx.query("INSERT INTO charges (body) VALUES ($1)", {"{}"});
    if (handled == 1) {
      first_in_handler.set_value();
      // Bounded, so that a second request that waits for this one cannot hang the test.
      EXPECT_EQ(second_gone.wait_for(5s), std::future_status::ready);
      // Give the second request time to reach the write lock (its answer is the same without).
      if (!claim_commits_alone) std::this_thread::sleep_for(50ms);
    }
    return StoredResponse{201, {{"Content-Type", "application/json"}}, R"({"id":"first"})"};
  };
  FlowResponse first_answer;
  std::thread first([&] { first_answer = flow.run(request("together"), handler); });
  first_in_handler.get_future().wait();
  FlowResponse second_answer;
  std::thread second([&] {
    if (!claim_commits_alone) second_went.set_value();
    second_answer = flow.run(request("together"), handler);
    if (claim_commits_alone) second_went.set_value();
  });
  second.join();
  first.join();
  EXPECT_EQ(first_answer.outcome, FlowOutcome::kExecuted);
  if (claim_commits_alone) {
    EXPECT_EQ(second_answer.outcome, FlowOutcome::kInProgress);
    EXPECT_EQ(second_answer.status, 409);
    EXPECT_TRUE(second_answer.header("Retry-After").has_value());
  } else {
    EXPECT_EQ(second_answer.outcome, FlowOutcome::kReplayed);
    EXPECT_EQ(second_answer.status, 201);
    EXPECT_EQ(second_answer.body, R"({"id":"first"})");
  }
  EXPECT_EQ(handled, 1);
  EXPECT_EQ(rows("charges"), 1);
  EXPECT_EQ(run(request("together")).outcome, FlowOutcome::kReplayed);
}

INSTANTIATE_TEST_SUITE_P(Backends, Flow, ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

TEST(FlowDatabase, AnUnreachableStoreIs503WithRetryAfterAndNoDatabaseText) {
  test::TempDir dir;
  ConnectionPool pool(
      parse_database_url("sqlite:" + (dir.path() / "missing" / "db.sqlite").string()).value());
  const IdempotencyStore store;
  std::string logged;
  const IdempotentRequestFlow flow(
      {.store = &store, .pool = &pool, .log = [&](std::string_view m) { logged += m; }});
  bool ran = false;
  const FlowResponse r =
      flow.run({.method = "POST", .path = "/v1/charges", .idempotency_key = "k1", .body = "x"},
               [&](Connection&) {
                 ran = true;
                 return StoredResponse{};
               });
  EXPECT_EQ(r.outcome, FlowOutcome::kDatabaseUnavailable);
  EXPECT_EQ(r.status, 503);
  const std::string retry_after(r.header("Retry-After").value_or(""));
  EXPECT_TRUE(retry_after == "1" || retry_after == "2" || retry_after == "3") << retry_after;
  EXPECT_EQ(r.body.find("missing"), std::string::npos) << r.body;
  EXPECT_FALSE(r.error.empty());
  EXPECT_EQ(logged, r.error);
  EXPECT_FALSE(ran);
}

// The clients refused together are not told to come back together: N refusals of a database
// that is down carry Retry-After values spread over 1..retry_after_spread, from the injected
// generator (the same seed, the same values).
TEST(FlowDatabase, RefusedRequestsAreToldToComeBackAtSpreadTimes) {
  test::TempDir dir;
  ConnectionPool pool(
      parse_database_url("sqlite:" + (dir.path() / "missing" / "db.sqlite").string()).value());
  const IdempotencyStore store;
  const auto answers = [&](int spread, std::uint64_t seed) {
    keel::Rng rng(seed);
    std::mutex mu;
    const IdempotentRequestFlow flow({.store = &store,
                                      .pool = &pool,
                                      .retry_after_spread = spread,
                                      .random =
                                          [&] {
                                            std::lock_guard lock(mu);
                                            return rng();
                                          },
                                      .log = [](std::string_view) {}});
    std::map<std::string, int> seen;
    std::vector<std::string> in_order;
    for (int i = 0; i < 60; ++i) {
      const FlowResponse r =
          flow.run({.method = "POST", .path = "/v1/charges", .idempotency_key = "k1", .body = "x"},
                   [](Connection&) { return StoredResponse{}; });
      EXPECT_EQ(r.outcome, FlowOutcome::kDatabaseUnavailable);
      const std::string value(r.header("Retry-After").value_or(""));
      ++seen[value];
      in_order.push_back(value);
    }
    return std::pair{seen, in_order};
  };
  const auto [seen, in_order] = answers(3, 42);
  EXPECT_EQ(seen.size(), 3u) << "1, 2 and 3 all told";
  for (const auto& [value, n] : seen) {
    EXPECT_TRUE(value == "1" || value == "2" || value == "3") << value;
    EXPECT_GE(n, 8) << value << ": roughly a third of 60 each";
  }
  EXPECT_EQ(answers(3, 42).second, in_order) << "one seed, one sequence";
  const auto wide = answers(10, 7).first;
  EXPECT_GE(wide.size(), 8u);
  const auto one = answers(1, 7).first;
  EXPECT_EQ(one.size(), 1u);
  EXPECT_EQ(one.begin()->first, "1") << "a spread of 1 is the old fixed answer";
}

TEST(FlowOptionsCheck, InvalidOptionsAreRefusedByName) {
  const IdempotencyStore store;
  try {
    const IdempotentRequestFlow flow({.store = &store});
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("pool"), std::string::npos);
  }
  test::TempDir dir;
  ConnectionPool pool(parse_database_url("sqlite:" + (dir.path() / "db").string()).value());
  EXPECT_THROW(IdempotentRequestFlow({.store = &store, .pool = &pool, .scope_secret = "short"}),
               std::invalid_argument);
  EXPECT_THROW(IdempotentRequestFlow({.store = &store, .pool = &pool, .max_key_bytes = 0}),
               std::invalid_argument);
  for (const int spread : {0, -1, 3601}) {
    try {
      const IdempotentRequestFlow flow(
          {.store = &store, .pool = &pool, .retry_after_spread = spread});
      FAIL() << spread;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("retry_after_spread"), std::string::npos) << e.what();
    }
  }
}

TEST(FlowOutcomeNames, EveryOutcomeHasANameAndAMetricsOutcome) {
  EXPECT_EQ(to_string(FlowOutcome::kTookOver), "took_over");
  EXPECT_EQ(to_string(FlowOutcome::kClaimLost), "claim_lost");
  EXPECT_EQ(to_string(FlowOutcome::kHandlerError), "handler_error");
  EXPECT_EQ(metrics_outcome(FlowOutcome::kCommitInDoubt), IdempotencyOutcome::kError);
  EXPECT_EQ(metrics_outcome(FlowOutcome::kDatabaseUnavailable), IdempotencyOutcome::kError);
  EXPECT_EQ(to_string(metrics_outcome(FlowOutcome::kMissingKey)), "invalid_key");
}

TEST(PrincipalFromAuthorization, BearerTokensAndEverythingElse) {
  EXPECT_EQ(principal_from_authorization(std::nullopt), "");
  EXPECT_EQ(principal_from_authorization("Bearer alice"), "alice");
  EXPECT_EQ(principal_from_authorization("bearer  alice "), "alice");
  EXPECT_EQ(principal_from_authorization("Basic YWxpY2U6"), "Authorization: Basic YWxpY2U6");
  EXPECT_EQ(principal_from_authorization("Bearer "), "Authorization: Bearer ");
}

// A request's header fields as a framework hands them over: names without regard to case, a
// field may come more than once.
class Fields final : public HeaderLookup {
 public:
  Fields(std::initializer_list<std::pair<std::string, std::string>> fields) : fields_(fields) {}
  [[nodiscard]] std::optional<std::string_view> first(std::string_view name) const override {
    for (const auto& [n, v] : fields_) {
      if (same(n, name)) return std::string_view(v);
    }
    return std::nullopt;
  }
  [[nodiscard]] std::size_t count(std::string_view name) const override {
    std::size_t n = 0;
    for (const auto& field : fields_) n += same(field.first, name) ? 1 : 0;
    return n;
  }

 private:
  static bool same(std::string_view a, std::string_view b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
             return std::tolower(static_cast<unsigned char>(x)) ==
                    std::tolower(static_cast<unsigned char>(y));
           });
  }
  std::vector<std::pair<std::string, std::string>> fields_;
};

// The one translation both server adapters use: each attempt header, in any case.
TEST(RequestTranslation, TheAttemptComesFromAnyOfItsThreeHeaders) {
  EXPECT_EQ(request_attempt(Fields{}), 1);
  EXPECT_EQ(request_attempt(Fields{{"keel-attempt", "3"}}), 3);
  EXPECT_EQ(request_attempt(Fields{{"X-Envoy-Attempt-Count", "2"}}), 2);
  EXPECT_EQ(request_attempt(Fields{{"grpc-previous-rpc-attempts", "4"}}), 5);
}

TEST(RequestTranslation, ADeadlineSentTwiceIsIgnored) {
  const TimePoint arrival{std::chrono::seconds(100)};
  EXPECT_EQ(request_deadline(Fields{{"Keel-Deadline-Ms", "250"}}, arrival).when(),
            arrival + std::chrono::milliseconds(250));
  EXPECT_TRUE(
      request_deadline(Fields{{"Keel-Deadline-Ms", "250"}, {"keel-deadline-ms", "250"}}, arrival)
          .is_infinite());
  EXPECT_TRUE(request_deadline(Fields{}, arrival).is_infinite());
}

TEST(RequestTranslation, TheFlowRequestCountsIdempotencyKeyFieldsAndReadsTheFirst) {
  const Fields fields{{"Idempotency-Key", "a"},
                      {"idempotency-key", "b"},
                      {"Content-Type", "application/json"},
                      {"Authorization", "Bearer alice"}};
  const FlowRequest r =
      flow_request(fields, "POST", "/charges", "{}", "alice", Deadline::infinite());
  EXPECT_EQ(r.method, "POST");
  EXPECT_EQ(r.path, "/charges");
  EXPECT_EQ(r.idempotency_key, "a");
  EXPECT_EQ(r.idempotency_key_fields, 2U);
  EXPECT_EQ(r.content_type, "application/json");
  EXPECT_EQ(r.body, "{}");
  EXPECT_EQ(principal_from_headers(fields), "alice");
  EXPECT_EQ(principal_from_headers(Fields{}), "");
  EXPECT_FALSE(flow_request(Fields{}, "POST", "/", "", "", Deadline::infinite()).idempotency_key);
}

TEST(RequestTranslation, AShedRequestGets503ProblemWithItsRetryAfter) {
  AdmissionLimiter limiter({.max_concurrency = 1, .queue_bound = 0});
  Admission held = limiter.admit(1, thread_rng());
  ASSERT_TRUE(held);
  Admission shed = limiter.admit(2, thread_rng());
  ASSERT_FALSE(shed);
  const FlowResponse answer = shed_response(shed);
  EXPECT_EQ(answer.status, 503);
  EXPECT_EQ(answer.header("Content-Type"), "application/problem+json");
  ASSERT_TRUE(answer.header("Retry-After"));
  EXPECT_FALSE(answer.header("Retry-After")->empty());
  EXPECT_NE(answer.body.find("\"status\":503"), std::string::npos) << answer.body;
  EXPECT_NE(answer.body.find("Overloaded"), std::string::npos) << answer.body;
}

}  // namespace
}  // namespace keel::store
