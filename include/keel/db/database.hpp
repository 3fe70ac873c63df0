// keel::store's database layer: a URL naming the database, one small Connection interface with
// two implementations (SQLite for the embedded default, PostgreSQL via libpq for fleets), a
// bounded connection pool, and versioned schema migrations that each component (idempotency,
// job queue, ...) applies for itself on open.
//
// SQL is written once for both backends: placeholders are $1, $2, ... (PostgreSQL's spelling,
// which the SQLite connection binds by name), values are text, 64-bit integers or NULL, and
// results come back as text cells. Only parameterised statements take values; nothing is ever
// spliced into SQL text. Where the backends' SQL differs, callers ask the connection's dialect
// (dialect.hpp), the one place that knows each backend's SQL and error codes.
//
// Errors: a failed statement throws keel::store::DatabaseError. That is the one place keel::store
// uses exceptions, because a database error must unwind the transaction body that hit it;
// with_transaction_retry (transaction.hpp) turns it back into a value. DatabaseError carries the
// SQLSTATE (PostgreSQL) or the SQLite result code, and outcome() classifies it with
// keel::classify_sqlstate, so 40001/40P01 and SQLITE_BUSY read as transient and a connection lost
// during COMMIT as ambiguous ("commit in doubt").
//
// Thread-safety: a Connection is not thread-safe: one thread uses it at a time (take one from a
// ConnectionPool per request or per worker). ConnectionPool and parse_database_url are safe for
// concurrent use.
//
// Example:
//   auto url = keel::store::parse_database_url("sqlite:keel.db").value();
//   auto conn = keel::store::open_database(url);
//   keel::store::migrate(*conn, "demo", {{"CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)"}});
//   conn->begin();
//   conn->query("INSERT INTO t (id, v) VALUES ($1, $2)", {keel::store::Value(1), "one"});
//   conn->commit();
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "keel/core/classify.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/expected.hpp"

namespace keel::store {

enum class Backend : unsigned char { kSqlite, kPostgres };

class Dialect;  // dialect.hpp

/// "sqlite", "postgres".
[[nodiscard]] std::string_view to_string(Backend backend) noexcept;

/// The URL used when none is given.
inline constexpr std::string_view kDefaultDatabaseUrl = "sqlite:keel.db";

/// A parsed database URL.
///   sqlite:PATH                         a file (relative or absolute); sqlite::memory: for tests
///   postgres://... or postgresql://...  a libpq connection URI, passed to libpq without keel's
///                                       own parameter below. Name a cluster with several hosts
///                                       (postgresql://h1:5432,h2:5432/db): keel writes only to a
///                                       read-write node (target_session_attrs=read-write unless
///                                       the URL says otherwise), see docs/operations.md.
///   ...?keel_pooler=transaction         keel's parameter, removed before libpq sees the URI: the
///                                       URL reaches PostgreSQL through a transaction pooler
///                                       (PgBouncer pool_mode=transaction), so keel sends no named
///                                       prepared statements and keeps no state in the session.
///                                       `session` or `none` (the default) say it does not.
struct DatabaseUrl {
  Backend backend = Backend::kSqlite;
  /// SQLite: the file path. PostgreSQL: the URI, without keel's own parameters.
  std::string target;
  /// The URL as given, with any password replaced by "***" (safe to log).
  std::string redacted;
  /// PostgreSQL: keel_pooler=transaction was given (see above). Always false for SQLite.
  bool transaction_pooler = false;
};

/// Parses a database URL. Returns an Error (field "database URL", the value quoted with any
/// password redacted) on anything malformed: unknown scheme, empty path, a URI libpq rejects.
[[nodiscard]] Expected<DatabaseUrl> parse_database_url(std::string_view text);

/// Whether the database can be opened without creating it: a SQLite file (other than :memory:)
/// must exist; a server database (PostgreSQL) is always taken to exist, opening it says if not.
/// For commands that read or administer a database and must never create one by a typo.
[[nodiscard]] bool database_exists(const DatabaseUrl& url);

/// A failed database operation.
class DatabaseError : public std::runtime_error {
 public:
  struct Details {
    Backend backend = Backend::kSqlite;
    /// PostgreSQL's SQLSTATE (five characters); "08006" when the connection was lost without one.
    /// Empty for SQLite.
    std::string sqlstate;
    /// SQLite's extended result code; 0 for PostgreSQL.
    int sqlite_code = 0;
    /// The error happened while committing: the transaction may or may not have been applied.
    bool during_commit = false;
    /// The connection is unusable (PostgreSQL connection lost); the pool discards it.
    bool connection_lost = false;
  };

  /// what() is `message`, followed by " (SQLSTATE xxxxx)" for a PostgreSQL error whose
  /// message does not name its SQLSTATE already.
  DatabaseError(const std::string& message, Details details);

  [[nodiscard]] const Details& details() const noexcept { return details_; }
  /// How a retry would fare: 40001/40P01 and SQLITE_BUSY/SQLITE_LOCKED transient; a connection
  /// lost during COMMIT ambiguous; constraint violations and syntax errors permanent.
  [[nodiscard]] Outcome outcome() const noexcept;
  /// What the error means for the work that hit it (core's DatabaseFailure): a lost race, a wait
  /// that ran out, an unreachable database, a node that cannot serve the connection (never reuse
  /// it), a commit in doubt, or a permanent error.
  [[nodiscard]] DatabaseFailure failure() const noexcept;
  /// 23505 unique_violation, or SQLite's SQLITE_CONSTRAINT_PRIMARYKEY/UNIQUE.
  [[nodiscard]] bool is_unique_violation() const noexcept;

 private:
  Details details_;
};

/// A component's schema in the database is not the version this program works with: newer (a
/// later keel migrated it; this program refuses to downgrade or to write rows it does not know),
/// or, where a program only checks the schema and does not migrate it, older. Not an outage: no
/// retry fixes it, only running the matching program or the migration does. what() names the
/// component and both versions.
class SchemaVersionError : public std::runtime_error {
 public:
  SchemaVersionError(std::string component, int found, int expected);

  [[nodiscard]] const std::string& component() const noexcept { return component_; }
  /// The version recorded in the database (0: none).
  [[nodiscard]] int found() const noexcept { return found_; }
  /// The version this program works with.
  [[nodiscard]] int expected() const noexcept { return expected_; }

 private:
  std::string component_;
  int found_;
  int expected_;
};

/// A statement parameter: NULL, a 64-bit integer or text.
class Value {
 public:
  Value() noexcept = default;
  Value(std::nullptr_t) noexcept {}                  // NOLINT(google-explicit-constructor)
  Value(std::int64_t v) : v_(v) {}                   // NOLINT(google-explicit-constructor)
  Value(int v) : v_(std::int64_t{v}) {}              // NOLINT(google-explicit-constructor)
  Value(std::string v) : v_(std::move(v)) {}         // NOLINT(google-explicit-constructor)
  Value(std::string_view v) : v_(std::string(v)) {}  // NOLINT(google-explicit-constructor)
  Value(const char* v) : v_(std::string(v)) {}       // NOLINT(google-explicit-constructor)

  [[nodiscard]] bool is_null() const noexcept { return std::holds_alternative<std::monostate>(v_); }
  [[nodiscard]] const std::int64_t* as_int() const noexcept {
    return std::get_if<std::int64_t>(&v_);
  }
  [[nodiscard]] const std::string* as_text() const noexcept {
    return std::get_if<std::string>(&v_);
  }
  /// Text form: "NULL"-free; integers in decimal. Requires: !is_null().
  [[nodiscard]] std::string to_text() const;

 private:
  std::variant<std::monostate, std::int64_t, std::string> v_;
};

/// The rows a statement returned (empty for statements without RETURNING/SELECT) and how many
/// rows it changed.
class Rows {
 public:
  using Cell = std::optional<std::string>;

  [[nodiscard]] std::size_t size() const noexcept { return rows_.size(); }
  [[nodiscard]] bool empty() const noexcept { return rows_.empty(); }
  [[nodiscard]] std::size_t columns() const noexcept { return columns_.size(); }
  [[nodiscard]] const std::vector<std::string>& column_names() const noexcept { return columns_; }
  /// Rows changed by INSERT/UPDATE/DELETE.
  [[nodiscard]] std::int64_t affected() const noexcept { return affected_; }

  /// The cell, or nullopt for NULL. Throws std::out_of_range outside the result.
  [[nodiscard]] const Cell& cell(std::size_t row, std::size_t column) const;
  /// The cell as text; throws DatabaseError for NULL.
  [[nodiscard]] const std::string& text(std::size_t row, std::size_t column) const;
  /// The cell as a 64-bit integer; throws DatabaseError for NULL or non-integer text.
  [[nodiscard]] std::int64_t integer(std::size_t row, std::size_t column) const;

  // Filled by the connections.
  void set_columns(std::vector<std::string> names) { columns_ = std::move(names); }
  void add_row(std::vector<Cell> row) { rows_.push_back(std::move(row)); }
  void set_affected(std::int64_t n) noexcept { affected_ = n; }

 private:
  std::vector<std::string> columns_;
  std::vector<std::vector<Cell>> rows_;
  std::int64_t affected_ = 0;
};

enum class Isolation : unsigned char {
  /// PostgreSQL READ COMMITTED; SQLite BEGIN IMMEDIATE (SQLite is always serializable).
  kReadCommitted,
  /// PostgreSQL SERIALIZABLE (may fail with 40001: retry with with_transaction_retry); SQLite
  /// BEGIN IMMEDIATE.
  kSerializable,
};

/// How long a connection's statements may wait; ConnectOptions gives each connection its own.
struct StatementTimeouts {
  /// A wait for a lock another transaction holds (SQLite's busy timeout, PostgreSQL's
  /// lock_timeout); a statement still waiting fails as DatabaseFailure::kBusy.
  std::chrono::milliseconds lock = std::chrono::seconds(5);
  /// PostgreSQL: how long one statement may run (statement_timeout, kBusy when it fires), and,
  /// with half a second more, how long keel waits for any answer of the server before it
  /// abandons the connection (a frozen or unreachable server: kUnavailable, or kInDoubt during
  /// COMMIT). SQLite has no such wait.
  std::chrono::milliseconds statement = std::chrono::seconds(5);
};

/// One statement and its parameters, for the calls that send several together.
struct Statement {
  std::string_view sql;
  std::span<const Value> params;
};

/// One database connection. Not thread-safe.
class Connection {
 public:
  virtual ~Connection() = default;
  Connection() = default;
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  [[nodiscard]] virtual Backend backend() const noexcept = 0;
  /// The backend's SQL dialect (dialect.hpp): dialect_of(backend()).
  [[nodiscard]] const Dialect& dialect() const noexcept;

  /// Runs one or more statements without parameters (DDL, migrations). Throws DatabaseError.
  virtual void execute(std::string_view sql) = 0;

  /// Runs one statement with $1..$n bound to `params` (SQLite statements are prepared once and
  /// cached). Throws DatabaseError.
  virtual Rows query(std::string_view sql, std::span<const Value> params) = 0;
  Rows query(std::string_view sql, std::initializer_list<Value> params = {}) {
    return query(sql, std::span<const Value>(params.begin(), params.size()));
  }

  /// BEGIN at the given isolation. Requires: no transaction open: BEGIN inside the caller's
  /// transaction throws std::logic_error and leaves that transaction as it was (keel never
  /// commits or ends a transaction it did not open). Throws DatabaseError.
  virtual void begin(Isolation isolation = Isolation::kReadCommitted) = 0;
  /// COMMIT. A failure is thrown with details().during_commit set. Throws DatabaseError.
  virtual void commit() = 0;
  /// ROLLBACK when a transaction is open; never throws (a failed rollback marks the connection
  /// broken).
  virtual void rollback() noexcept = 0;
  [[nodiscard]] virtual bool in_transaction() const noexcept = 0;

  /// Runs one statement on its own (in autocommit: committed when it returns) and then BEGIN at
  /// `isolation`, sent together where the backend can (PostgreSQL's pipeline mode: one round trip
  /// instead of two). Returns the statement's rows with the transaction open. When the statement
  /// fails, no transaction is left open and its DatabaseError is thrown; when BEGIN fails, the
  /// statement has committed and BEGIN's error is thrown. Requires: no transaction open.
  virtual Rows query_then_begin(std::string_view sql, std::span<const Value> params,
                                Isolation isolation = Isolation::kReadCommitted);
  /// Runs one statement as the open transaction's last and COMMITs, sent together where the
  /// backend can (one round trip instead of two); COMMIT runs only when the statement succeeded.
  /// When the statement fails, the transaction is rolled back and its DatabaseError thrown
  /// (during_commit false); a failed COMMIT throws as commit() does. Requires: a transaction open.
  virtual Rows query_then_commit(std::string_view sql, std::span<const Value> params);

  /// BEGIN at `isolation`, then `statements` in that transaction, sent together where the backend
  /// can (PostgreSQL's pipeline mode: one round trip). Returns each statement's rows, with the
  /// transaction open. When BEGIN or a statement fails, the transaction is rolled back (none is
  /// left open) and the first error is thrown. Requires: no transaction open.
  virtual std::vector<Rows> begin_then_query(Isolation isolation,
                                             std::span<const Statement> statements);

  /// The connection cannot be used again (lost, or left in an unknown state).
  [[nodiscard]] virtual bool broken() const noexcept = 0;

  /// Which database the connection reaches, so that a producer and the workers of one process
  /// can find each other (the job queue's in-process wakeups): SQLite, the main file's absolute
  /// path; PostgreSQL, the server's host and port, the database and the connection's options
  /// (a search_path set there names other tables). Empty when unknown: nothing is matched.
  [[nodiscard]] virtual std::string database_identity() const { return {}; }

  /// Whether the connection can still be lent out, checked without a round trip: not broken(),
  /// and (PostgreSQL) no sign on its socket that the server ended the session while it was idle
  /// (pg_terminate_backend, a restart, a failover). ConnectionPool asks before it lends an idle
  /// connection. Default: !broken().
  [[nodiscard]] virtual bool usable() noexcept { return !broken(); }

  // ---- Bounds ----
  // Every wait of a statement ends: a lock wait by the lock timeout, a PostgreSQL statement and
  // its answer by the statement timeout (ConnectOptions), and all of them by the deadline of the
  // work under way when one is set. with_transaction_retry sets each transaction's deadline from
  // its operation's (the policy's overall_timeout, CallOptions' deadline and ceiling: a request's
  // Keel-Deadline-Ms).

  /// Bounds the statements run from now on by `deadline` (on keel::steady_clock()) as well as by
  /// the timeouts; infinite (the default) leaves the timeouts alone. ScopedDeadline sets it for a
  /// scope.
  void set_deadline(Deadline deadline) noexcept { deadline_ = deadline; }
  [[nodiscard]] Deadline deadline() const noexcept { return deadline_; }
  /// Replaces the connection's timeouts for the statements run from now on (work known to be
  /// long, such as migrations); nullopt restores ConnectOptions'. Requires: lock and statement
  /// >= 1 ms.
  void set_timeouts(std::optional<StatementTimeouts> timeouts) noexcept {
    timeouts_override_ = timeouts;
  }
  /// The timeouts in force: set_timeouts' when set, else the connection's own.
  [[nodiscard]] StatementTimeouts timeouts() const noexcept {
    return timeouts_override_.value_or(timeouts_);
  }

 protected:
  /// The connection's own timeouts (from ConnectOptions), set by the implementation.
  void set_default_timeouts(StatementTimeouts timeouts) noexcept { timeouts_ = timeouts; }

 private:
  Deadline deadline_ = Deadline::infinite();
  StatementTimeouts timeouts_{};
  std::optional<StatementTimeouts> timeouts_override_;
};

/// While alive, the connection's deadline is the earlier of the one it had and `deadline`; the
/// one it had comes back after. Not thread-safe (as the Connection).
class ScopedDeadline {
 public:
  ScopedDeadline(Connection& connection, Deadline deadline) noexcept
      : connection_(connection), saved_(connection.deadline()) {
    connection_.set_deadline(saved_.min(deadline));
  }
  ~ScopedDeadline() { connection_.set_deadline(saved_); }
  ScopedDeadline(const ScopedDeadline&) = delete;
  ScopedDeadline& operator=(const ScopedDeadline&) = delete;

 private:
  Connection& connection_;
  Deadline saved_;
};

struct ConnectOptions {
  /// How long a statement waits for a lock another transaction holds before it fails as busy
  /// (DatabaseFailure::kBusy): SQLite, for another writer, then SQLITE_BUSY (0: at once);
  /// PostgreSQL, lock_timeout (0: 1 ms). Requires: >= 0. Default 5 s.
  std::chrono::milliseconds busy_timeout = std::chrono::seconds(5);
  /// PostgreSQL: how long one statement may run (statement_timeout), and, with half a second
  /// more, how long keel waits for any answer before it abandons the connection as unreachable
  /// (StatementTimeouts::statement). Raise it for a connection whose statements are long by
  /// design. Requires: >= 1 ms. Default 5 s.
  std::chrono::milliseconds statement_timeout = std::chrono::seconds(5);
  /// PostgreSQL: the connect timeout, for each host of a multi-host URL in turn (libpq's
  /// connect_timeout; libpq waits at least 2 s). A connect_timeout in the URL wins. Requires:
  /// >= 1 s. Default 3 s.
  std::chrono::seconds connect_timeout = std::chrono::seconds(3);
  /// Open for reading only: nothing is created or written, so a user who may only read the
  /// database can open it. SQLite: SQLITE_OPEN_READONLY, no journal-mode change; PostgreSQL:
  /// default_transaction_read_only (every transaction read only). A write then fails with
  /// DatabaseError. Default false: PostgreSQL connections are opened on a read-write node only
  /// (target_session_attrs=read-write, unless the URL names another).
  bool read_only = false;
};

/// Opens a connection. SQLite: creates the file if missing, turns on WAL and foreign keys, sets
/// the busy timeout (read_only: the file must exist and is left as it is). PostgreSQL: connects to
/// a read-write node of the URL's hosts (unless read_only), with TCP keepalives, its timeouts
/// as the session's defaults (with keel_pooler=transaction: set in each transaction instead, so
/// that nothing outlives it). Throws DatabaseError when the database cannot be opened,
/// std::invalid_argument for invalid options.
[[nodiscard]] std::unique_ptr<Connection> open_database(const DatabaseUrl& url,
                                                        const ConnectOptions& options = {});

/// One migration step: SQL run in the migration's transaction (several statements allowed).
/// When a step must differ between backends, give `postgres` as well; empty means "same SQL".
struct Migration {
  std::string_view sql;
  std::string_view postgres = {};
};

/// Brings `component`'s schema to version steps.size(): creates keel_schema(component, version)
/// if needed, then runs every step after the recorded version, all in one transaction, and records
/// the new version. Concurrent callers (two processes opening one database) serialise on a lock
/// (PostgreSQL advisory lock; SQLite write lock). Returns the version found before migrating.
/// Throws DatabaseError, or SchemaVersionError when the database's version is newer than the
/// steps this program knows (a downgrade).
int migrate(Connection& connection, std::string_view component, std::span<const Migration> steps);
inline int migrate(Connection& connection, std::string_view component,
                   std::initializer_list<Migration> steps) {
  return migrate(connection, component, std::span<const Migration>(steps.begin(), steps.size()));
}

/// The recorded schema version of a component; 0 when none.
[[nodiscard]] int schema_version(Connection& connection, std::string_view component);

/// One of keel's schema components, as a migration lists and applies them: its name in
/// keel_schema, the version this program migrates it to, and its migration (migrate() over the
/// component's steps). Each component's class hands out its own (JobQueue::schema() ...).
struct SchemaComponent {
  std::string_view name;
  int version = 0;
  void (*migrate)(Connection& connection) = nullptr;
};

/// The SchemaComponent named `name` whose schema `steps` make (its version: one per step),
/// migrated by `migrate`, which runs migrate() over those steps under that name.
[[nodiscard]] inline SchemaComponent schema_component(std::string_view name,
                                                      std::span<const Migration> steps,
                                                      void (*migrate)(Connection&)) noexcept {
  return {.name = name, .version = static_cast<int>(steps.size()), .migrate = migrate};
}

struct PoolOptions {
  /// Most connections open at once; acquire() waits when all are lent. Requires: >= 1. Default 8.
  int max_connections = 8;
  /// The longest acquire() waits for a connection when all are lent; then it throws DatabaseError
  /// (DatabaseFailure::kUnavailable). Requires: >= 0. Default 5 s.
  std::chrono::milliseconds acquire_timeout = std::chrono::seconds(5);
  ConnectOptions connect = {};
  /// Opens each new connection (e.g. to wrap it: tests count the statements a worker runs).
  /// Called from acquire(), possibly from several threads at once; throws as open_database does.
  /// Default none: open_database(url, connect).
  std::function<std::unique_ptr<Connection>(const DatabaseUrl&, const ConnectOptions&)> open;
};

/// A bounded pool of connections to one database. Safe for concurrent use.
class ConnectionPool {
 public:
  /// Throws std::invalid_argument for bad options. Connections are opened lazily.
  explicit ConnectionPool(DatabaseUrl url, PoolOptions options = {});
  ~ConnectionPool();
  ConnectionPool(const ConnectionPool&) = delete;
  ConnectionPool& operator=(const ConnectionPool&) = delete;

  /// A lent connection; returned to the pool when destroyed (rolled back when left in a
  /// transaction; discarded when broken, which includes a connection that met a node unable to
  /// serve it, DatabaseFailure::kWrongNode).
  class Lease {
   public:
    Lease(ConnectionPool* pool, std::unique_ptr<Connection> conn) noexcept
        : pool_(pool), conn_(std::move(conn)) {}
    Lease(Lease&& other) noexcept = default;
    Lease& operator=(Lease&&) = delete;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease();
    Connection& operator*() const noexcept { return *conn_; }
    Connection* operator->() const noexcept { return conn_.get(); }

   private:
    ConnectionPool* pool_;
    std::unique_ptr<Connection> conn_;
  };

  /// Waits for a free connection (opening one when under the limit), at most
  /// PoolOptions::acquire_timeout and never past `deadline` (on keel::steady_clock()). An idle
  /// connection the server ended meanwhile (Connection::usable) is closed, not lent. The lent
  /// connection's deadline is `deadline`. Throws DatabaseError (kUnavailable) when none frees in
  /// time or a new connection cannot be opened.
  [[nodiscard]] Lease acquire(Deadline deadline = Deadline::infinite());

  [[nodiscard]] const DatabaseUrl& url() const noexcept { return url_; }
  [[nodiscard]] Backend backend() const noexcept { return url_.backend; }
  /// The backend's SQL dialect (dialect.hpp): dialect_of(backend()).
  [[nodiscard]] const Dialect& dialect() const noexcept;

 private:
  void release(std::unique_ptr<Connection> conn) noexcept;

  DatabaseUrl url_;
  PoolOptions options_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Connection>> idle_;  // guarded by mu_
  int open_ = 0;                                   // guarded by mu_: lent + idle
};

}  // namespace keel::store
