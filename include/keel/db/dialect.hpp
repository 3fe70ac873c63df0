// What differs between keel::store's backends, asked as questions: how a statement locks the rows
// it reads, how to find a substring, how bytes are stored, which statement shapes the backend
// runs, what its error codes mean. The job queue, the idempotency records and the processed
// messages write their SQL once and ask their connection's dialect (Connection::dialect(),
// ConnectionPool::dialect()) for the pieces that differ, so that only the database layer
// (src/db/) knows which backend it is talking to. Capabilities are named by what they are,
// not by the backend that has them: a new backend answers each question for itself.
//
// Thread-safety: a Dialect is immutable, one static instance per backend; safe for concurrent
// use.
//
// Example:
//   const keel::store::Dialect& d = conn.dialect();
//   conn.query("SELECT id FROM jobs WHERE id = $1" + std::string(d.lock_rows()), {id});
#pragma once

#include <string>
#include <string_view>

#include "keel/core/classify.hpp"
#include "keel/db/database.hpp"

namespace keel::store {

class Dialect {
 public:
  virtual ~Dialect() = default;

  // ---- Locking and statement shapes ----

  /// Writers lock the rows they touch, not the whole database: a lone statement runs atomically
  /// in autocommit and waits on its rows' locks (PostgreSQL). False where a writer takes the
  /// database's one write lock, best taken up front at BEGIN IMMEDIATE (SQLite).
  [[nodiscard]] virtual bool row_level_locks() const noexcept = 0;
  /// The suffix of a SELECT, inside a transaction, that locks the rows it reads until the
  /// transaction ends (" FOR UPDATE"); "" where the transaction's write lock covers them already.
  [[nodiscard]] virtual std::string_view lock_rows() const noexcept = 0;
  /// The same, skipping the rows another transaction holds instead of waiting for them
  /// (" FOR UPDATE SKIP LOCKED"); "" where no two writers ever hold rows at once.
  [[nodiscard]] virtual std::string_view lock_rows_skip_locked() const noexcept = 0;
  /// A statement, inside a transaction, that tries to take a lock named by the 64-bit integer
  /// $1 until the transaction ends, without waiting: one row whose one column is 1 when it was
  /// taken, 0 when another transaction holds it (pg_try_advisory_xact_lock). "" where the
  /// transaction's write lock (BEGIN IMMEDIATE) already excludes every other writer.
  [[nodiscard]] virtual std::string_view try_transaction_lock() const noexcept = 0;
  /// A WITH clause may hold INSERT, UPDATE or DELETE ... RETURNING, so that several writes and
  /// the reading of their results are one statement.
  [[nodiscard]] virtual bool data_modifying_ctes() const noexcept = 0;
  /// A query that reads the id of the row the connection's last INSERT created, run right after
  /// it, which costs less than the INSERT's own RETURNING id; "" when the INSERT should say
  /// RETURNING id instead.
  [[nodiscard]] virtual std::string_view inserted_id_query() const noexcept = 0;
  /// A transaction may commit without waiting for its log to reach the disk (PostgreSQL's
  /// synchronous_commit = off, set for one transaction with set_config(..., true)).
  [[nodiscard]] virtual bool commit_without_flush() const noexcept = 0;
  /// A statement that runs `update` (an UPDATE, or an INSERT ... ON CONFLICT DO UPDATE, without
  /// RETURNING) and fails, with an error that
  /// is_row_count_refusal() recognises, unless it changed exactly one row: a COMMIT sent behind it
  /// without waiting for its answer (Connection::query_then_commit) then commits only when it
  /// did. "" where no single statement can do that (the caller reads the UPDATE's count instead).
  [[nodiscard]] virtual std::string update_exactly_one_row(std::string_view update) const = 0;
  /// The server pushes notifications to sessions that listen for them (LISTEN/NOTIFY), which
  /// detail::open_listener opens.
  [[nodiscard]] virtual bool listen_notify() const noexcept = 0;

  // ---- Expressions ----

  /// An expression for the 1-based position of `needle` in `haystack`, 0 when absent: a plain
  /// substring search, no pattern characters. Both arguments are SQL expressions (a column, $N).
  [[nodiscard]] virtual std::string substring_position(std::string_view haystack,
                                                       std::string_view needle) const = 0;
  /// An expression for the stored form of bytes given as lowercase hex text (`hex`, an SQL
  /// expression): the bytes themselves where the column is binary, the hex text where the column
  /// stores that text as it is.
  [[nodiscard]] virtual std::string bytes_from_hex(std::string_view hex) const = 0;

  // ---- Schema ----

  /// A query with the table name as $1 that returns a row when that table exists, none otherwise.
  [[nodiscard]] virtual std::string_view table_exists_query() const noexcept = 0;
  /// A statement, run first in a migration's transaction, that makes concurrent migrations of one
  /// database take turns; "" where BEGIN's write lock does that already.
  [[nodiscard]] virtual std::string_view migration_lock() const noexcept = 0;
  /// The SQL of a migration step on this backend: `step.postgres` or `step.sql`.
  [[nodiscard]] virtual std::string_view migration_sql(const Migration& step) const noexcept = 0;

  // ---- Errors ----

  /// How a retry would fare after the error (core's classify_sqlstate / classify_sqlite).
  [[nodiscard]] virtual Outcome classify(const DatabaseError::Details& error) const noexcept = 0;
  /// What the error means for the work that hit it (core's classify_database_sqlstate /
  /// classify_database_sqlite): retry on this connection, on a new one, later, or never.
  [[nodiscard]] virtual DatabaseFailure failure(
      const DatabaseError::Details& error) const noexcept = 0;
  /// The error is a UNIQUE or PRIMARY KEY constraint refusing a duplicate.
  [[nodiscard]] virtual bool is_unique_violation(
      const DatabaseError::Details& error) const noexcept = 0;
  /// The error is a FOREIGN KEY constraint refusing a row whose parent is missing.
  [[nodiscard]] virtual bool is_foreign_key_violation(
      const DatabaseError::Details& error) const noexcept = 0;
  /// The error is update_exactly_one_row()'s statement refusing an UPDATE that changed no row.
  [[nodiscard]] virtual bool is_row_count_refusal(
      const DatabaseError::Details& error) const noexcept = 0;
};

/// The dialect of a backend. Never fails: every Backend has one.
[[nodiscard]] const Dialect& dialect_of(Backend backend) noexcept;

}  // namespace keel::store
