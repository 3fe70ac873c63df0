// SQLite's answers to the dialect's questions (keel/db/dialect.hpp). A writer holds the
// database's one write lock from BEGIN IMMEDIATE to COMMIT, so nothing locks rows.
#include <sqlite3.h>

#include <string>

#include "db/detail/dialects.hpp"

namespace keel::store::detail {

namespace {

struct SqliteDialect final : Dialect {
  bool row_level_locks() const noexcept override { return false; }
  std::string_view lock_rows() const noexcept override { return ""; }
  std::string_view try_transaction_lock() const noexcept override { return ""; }
  std::string_view lock_rows_skip_locked() const noexcept override { return ""; }
  bool data_modifying_ctes() const noexcept override { return false; }
  // RETURNING builds a temporary b-tree, which costs a single row a page cache allocated and
  // freed (docs/queue.md); the connection knows the row's id anyway.
  std::string_view inserted_id_query() const noexcept override {
    return "SELECT last_insert_rowid()";
  }
  bool commit_without_flush() const noexcept override { return false; }
  // No data-modifying CTE to count the UPDATE's rows in, and nothing to save: no round trips.
  std::string update_exactly_one_row(std::string_view /*update*/) const override { return ""; }
  bool listen_notify() const noexcept override { return false; }

  std::string substring_position(std::string_view haystack,
                                 std::string_view needle) const override {
    return "instr(" + std::string(haystack) + ", " + std::string(needle) + ")";
  }
  // The column holds the hex text itself.
  std::string bytes_from_hex(std::string_view hex) const override { return std::string(hex); }

  std::string_view table_exists_query() const noexcept override {
    return "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = $1";
  }
  std::string_view migration_lock() const noexcept override { return ""; }
  std::string_view migration_sql(const Migration& step) const noexcept override { return step.sql; }

  Outcome classify(const DatabaseError::Details& error) const noexcept override {
    return classify_sqlite(error.sqlite_code, error.during_commit, error.connection_lost);
  }
  DatabaseFailure failure(const DatabaseError::Details& error) const noexcept override {
    return classify_database_sqlite(error.sqlite_code, error.during_commit, error.connection_lost);
  }
  bool is_unique_violation(const DatabaseError::Details& error) const noexcept override {
    return error.sqlite_code == SQLITE_CONSTRAINT_PRIMARYKEY ||
           error.sqlite_code == SQLITE_CONSTRAINT_UNIQUE;
  }
  bool is_foreign_key_violation(const DatabaseError::Details& error) const noexcept override {
    return error.sqlite_code == SQLITE_CONSTRAINT_FOREIGNKEY;
  }
  bool is_row_count_refusal(const DatabaseError::Details& /*error*/) const noexcept override {
    return false;  // update_exactly_one_row has no statement here
  }
};

}  // namespace

const Dialect& sqlite_dialect() noexcept {
  static const SqliteDialect dialect;
  return dialect;
}

}  // namespace keel::store::detail
