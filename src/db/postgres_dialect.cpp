// PostgreSQL's answers to the dialect's questions (keel/db/dialect.hpp): row locks, SKIP
// LOCKED, data-modifying CTEs, bytea columns and SQLSTATEs.
#include <string>

#include "db/detail/dialects.hpp"

namespace keel::store::detail {

namespace {

struct PostgresDialect final : Dialect {
  bool row_level_locks() const noexcept override { return true; }
  std::string_view lock_rows() const noexcept override { return " FOR UPDATE"; }
  std::string_view try_transaction_lock() const noexcept override {
    return "SELECT pg_try_advisory_xact_lock($1)::int";
  }
  std::string_view lock_rows_skip_locked() const noexcept override {
    return " FOR UPDATE SKIP LOCKED";
  }
  bool data_modifying_ctes() const noexcept override { return true; }
  std::string_view inserted_id_query() const noexcept override { return ""; }
  bool commit_without_flush() const noexcept override { return true; }
  // The UPDATE's rows counted by a data-modifying CTE, divided into 1: division by zero when it
  // changed none, which aborts the transaction, so that the COMMIT behind it rolls back instead.
  std::string update_exactly_one_row(std::string_view update) const override {
    return "WITH changed AS (" + std::string(update) +
           " RETURNING 1) SELECT 1 / COUNT(*) FROM changed";
  }
  bool listen_notify() const noexcept override { return true; }

  std::string substring_position(std::string_view haystack,
                                 std::string_view needle) const override {
    return "strpos(" + std::string(haystack) + ", " + std::string(needle) + ")";
  }
  std::string bytes_from_hex(std::string_view hex) const override {
    return "decode(" + std::string(hex) + ", 'hex')";
  }

  std::string_view table_exists_query() const noexcept override {
    return "SELECT 1 WHERE to_regclass($1) IS NOT NULL";
  }
  // One lock for all schema work in this database: two processes opening it at once take turns
  // instead of racing on CREATE TABLE.
  std::string_view migration_lock() const noexcept override {
    return "SELECT pg_advisory_xact_lock(7370041911)";
  }
  std::string_view migration_sql(const Migration& step) const noexcept override {
    return step.postgres.empty() ? step.sql : step.postgres;
  }

  Outcome classify(const DatabaseError::Details& error) const noexcept override {
    return classify_sqlstate(error.sqlstate, error.during_commit);
  }
  DatabaseFailure failure(const DatabaseError::Details& error) const noexcept override {
    return classify_database_sqlstate(error.sqlstate, error.during_commit);
  }
  bool is_unique_violation(const DatabaseError::Details& error) const noexcept override {
    return error.sqlstate == "23505";  // unique_violation
  }
  bool is_foreign_key_violation(const DatabaseError::Details& error) const noexcept override {
    return error.sqlstate == "23503";  // foreign_key_violation
  }
  bool is_row_count_refusal(const DatabaseError::Details& error) const noexcept override {
    return error.sqlstate == "22012";  // division_by_zero, update_exactly_one_row's refusal
  }
};

}  // namespace

const Dialect& postgres_dialect() noexcept {
  static const PostgresDialect dialect;
  return dialect;
}

}  // namespace keel::store::detail
