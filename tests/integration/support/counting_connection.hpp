// A connection that counts the transactions it runs, for tests that measure what a worker costs
// the database at the client (the server's own counts come late and are shared by the tests
// running beside).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "keel/db/database.hpp"

namespace keel::test {

using store::Backend;
using store::Connection;
using store::Isolation;
using store::Rows;
using store::Value;

// Counts the transactions a connection runs: each statement outside a transaction is one, and a
// BEGIN ... COMMIT is one.
class CountingConnection final : public Connection {
 public:
  CountingConnection(std::unique_ptr<Connection> inner, std::atomic<std::int64_t>& count)
      : inner_(std::move(inner)), count_(count) {}
  [[nodiscard]] Backend backend() const noexcept override { return inner_->backend(); }
  void execute(std::string_view sql) override {
    if (!inner_->in_transaction()) count_.fetch_add(1);
    inner_->execute(sql);
  }
  Rows query(std::string_view sql, std::span<const Value> params) override {
    if (!inner_->in_transaction()) count_.fetch_add(1);
    return inner_->query(sql, params);
  }
  void begin(Isolation isolation) override {
    count_.fetch_add(1);
    inner_->begin(isolation);
  }
  void commit() override { inner_->commit(); }
  void rollback() noexcept override { inner_->rollback(); }
  [[nodiscard]] bool in_transaction() const noexcept override { return inner_->in_transaction(); }
  [[nodiscard]] bool broken() const noexcept override { return inner_->broken(); }
  [[nodiscard]] std::string database_identity() const override {
    return inner_->database_identity();
  }

 private:
  std::unique_ptr<Connection> inner_;
  std::atomic<std::int64_t>& count_;
};

}  // namespace keel::test
