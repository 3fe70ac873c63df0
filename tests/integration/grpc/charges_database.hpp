// The database behind the test service's Payments.Charge in the gRPC server tests
// (grpc_server_test.cpp, grpc_jobs_test.cpp): each test, on the backend of its parameter, gets a
// pool, keel's idempotency records and a `charges` table (one row per charge applied), and the
// options that run keel::grpc::IdempotentUnary's flow over them.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "keel/db/database.hpp"
#include "keel/grpc/server.hpp"
#include "keel/idempotency/idempotency.hpp"
#include "support/test_support.hpp"
#include "test_service.grpc.pb.h"

namespace keel::test {

/// Inserts the row of one applied charge, in the caller's transaction.
inline void insert_charge(store::Connection& tx, const ChargeRequest& request) {
  tx.query("INSERT INTO charges (account, cents) VALUES ($1, $2)",
           {request.account(), store::Value(std::int64_t{request.amount_cents()})});
}

class ChargesDatabaseTest : public BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped()) return;
    pool_ =
        std::make_unique<store::ConnectionPool>(url(), store::PoolOptions{.max_connections = 8});
    auto conn = pool_->acquire();
    store::IdempotencyStore::migrate(*conn);
    conn->execute(std::string("CREATE TABLE charges (id ") +
                  (GetParam() == store::Backend::kPostgres ? "SERIAL" : "INTEGER") +
                  " PRIMARY KEY, account TEXT NOT NULL, cents BIGINT NOT NULL)");
  }

  /// `options` with its flow on this database: the records, the pool, a fixed scope secret and
  /// no log lines.
  [[nodiscard]] grpc::ServerOptions with_flow(grpc::ServerOptions options = {}) {
    options.flow.store = &store_;
    options.flow.pool = pool_.get();
    options.flow.scope_secret = "0123456789abcdef0123456789abcdef";
    options.flow.log = [](std::string_view) {};
    return options;
  }

  store::IdempotencyStore store_{
      {.ttl = std::chrono::hours(24), .lock_timeout = std::chrono::seconds(30)}};
  std::unique_ptr<store::ConnectionPool> pool_;
};

}  // namespace keel::test
