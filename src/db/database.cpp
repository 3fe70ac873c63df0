// Backend-independent parts of keel::store's database layer: errors, values, rows, migrations,
// the connection pool, and open_database's dispatch.
#include "keel/db/database.hpp"

#include <charconv>
#include <stdexcept>

#include "db/detail/connections.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "keel/db/dialect.hpp"

namespace keel::store {

namespace {

// Every PostgreSQL error names its SQLSTATE, whoever wrote the message.
std::string with_sqlstate(const std::string& message, const DatabaseError::Details& details) {
  if (details.backend != Backend::kPostgres || details.sqlstate.empty() ||
      message.find("SQLSTATE " + details.sqlstate) != std::string::npos) {
    return message;
  }
  return message + " (SQLSTATE " + details.sqlstate + ")";
}

}  // namespace

DatabaseError::DatabaseError(const std::string& message, Details details)
    : std::runtime_error(with_sqlstate(message, details)), details_(std::move(details)) {}

namespace {

std::string schema_version_message(const std::string& component, int found, int expected) {
  if (found > expected) {
    return "the database's schema for '" + component + "' is version " + std::to_string(found) +
           ", newer than this program's " + std::to_string(expected) +
           " (refusing to downgrade; run a keel that knows version " + std::to_string(found) + ")";
  }
  return "the database's schema for '" + component + "' is version " + std::to_string(found) +
         ", older than this program's " + std::to_string(expected) +
         " (run `keel migrate` with a role that may create tables)";
}

}  // namespace

SchemaVersionError::SchemaVersionError(std::string component, int found, int expected)
    : std::runtime_error(schema_version_message(component, found, expected)),
      component_(std::move(component)),
      found_(found),
      expected_(expected) {}

Outcome DatabaseError::outcome() const noexcept {
  return dialect_of(details_.backend).classify(details_);
}

DatabaseFailure DatabaseError::failure() const noexcept {
  return dialect_of(details_.backend).failure(details_);
}

bool DatabaseError::is_unique_violation() const noexcept {
  return dialect_of(details_.backend).is_unique_violation(details_);
}

std::string Value::to_text() const {
  if (const auto* i = as_int()) return std::to_string(*i);
  if (const auto* s = as_text()) return *s;
  throw std::logic_error("keel::store::Value::to_text on NULL");
}

const Rows::Cell& Rows::cell(std::size_t row, std::size_t column) const {
  return rows_.at(row).at(column);
}

const std::string& Rows::text(std::size_t row, std::size_t column) const {
  const Cell& c = cell(row, column);
  if (!c) {
    throw DatabaseError("column " + std::to_string(column) + " of row " + std::to_string(row) +
                            " is NULL where a value was expected",
                        {});
  }
  return *c;
}

std::int64_t Rows::integer(std::size_t row, std::size_t column) const {
  const std::string& s = text(row, column);
  std::int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size()) {
    throw DatabaseError(
        "column " + std::to_string(column) + " holds '" + s + "' where an integer was expected",
        {});
  }
  return v;
}

namespace detail {

void refuse_nested_transaction(const Connection& connection, std::string_view what) {
  if (!connection.in_transaction()) return;
  throw std::logic_error(
      "keel::store: " + std::string(what) +
      ": a transaction is already open on this connection; keel never commits or ends a "
      "transaction it did not open (call the API that runs inside the caller's transaction, or "
      "use another connection)");
}

}  // namespace detail

// One statement after another where nothing is saved by sending them together (SQLite: no round
// trips).
Rows Connection::query_then_begin(std::string_view sql, std::span<const Value> params,
                                  Isolation isolation) {
  detail::refuse_nested_transaction(*this, "query_then_begin");
  Rows rows = query(sql, params);
  begin(isolation);
  return rows;
}

Rows Connection::query_then_commit(std::string_view sql, std::span<const Value> params) {
  Rows rows;
  try {
    rows = query(sql, params);
  } catch (const DatabaseError&) {
    rollback();
    throw;
  }
  commit();
  return rows;
}

std::vector<Rows> Connection::begin_then_query(Isolation isolation,
                                               std::span<const Statement> statements) {
  detail::refuse_nested_transaction(*this, "begin_then_query");
  begin(isolation);
  std::vector<Rows> out;
  out.reserve(statements.size());
  try {
    for (const Statement& statement : statements) {
      out.push_back(query(statement.sql, statement.params));
    }
  } catch (const DatabaseError&) {
    rollback();
    throw;
  }
  return out;
}

std::unique_ptr<Connection> open_database(const DatabaseUrl& url, const ConnectOptions& options) {
  if (options.busy_timeout.count() < 0) {
    throw_invalid({.context = "keel::store::ConnectOptions",
                   .field = "busy_timeout",
                   .problem = "must be >= 0",
                   .got = format_duration(options.busy_timeout)});
  }
  if (options.statement_timeout.count() < 1) {
    throw_invalid({.context = "keel::store::ConnectOptions",
                   .field = "statement_timeout",
                   .problem = "must be >= 1ms",
                   .got = format_duration(options.statement_timeout)});
  }
  if (options.connect_timeout.count() < 1) {
    throw_invalid({.context = "keel::store::ConnectOptions",
                   .field = "connect_timeout",
                   .problem = "must be >= 1s",
                   .got = format_duration(options.connect_timeout)});
  }
  if (url.backend == Backend::kSqlite) return detail::open_sqlite(url.target, options);
  return detail::open_postgres(url.target, options, url.transaction_pooler);
}

namespace {

constexpr std::string_view kCreateSchemaTable =
    "CREATE TABLE IF NOT EXISTS keel_schema ("
    " component TEXT PRIMARY KEY,"
    " version INTEGER NOT NULL)";

int read_version(Connection& connection, std::string_view component) {
  const Rows rows =
      connection.query("SELECT version FROM keel_schema WHERE component = $1", {component});
  return rows.empty() ? 0 : static_cast<int>(rows.integer(0, 0));
}

}  // namespace

int schema_version(Connection& connection, std::string_view component) {
  if (connection.query(connection.dialect().table_exists_query(), {"keel_schema"}).empty()) {
    return 0;
  }
  return read_version(connection, component);
}

int migrate(Connection& connection, std::string_view component, std::span<const Migration> steps) {
  const Dialect& dialect = connection.dialect();
  const int target = static_cast<int>(steps.size());
  // A current schema is only read (SELECT): a role that may write rows but not create tables runs
  // every program over a database its owner migrated.
  if (!connection.in_transaction()) {
    const int current = schema_version(connection, component);
    if (current > target) throw SchemaVersionError(std::string(component), current, target);
    if (current == target) return current;
  }
  // Schema work may wait for another process's migration and rewrite large tables: bounded, but
  // not by the timeouts of ordinary statements.
  struct LongTimeouts {
    Connection& c;
    std::optional<StatementTimeouts> saved;
    ~LongTimeouts() { c.set_timeouts(saved); }
  } restore{connection, std::nullopt};
  connection.set_timeouts(
      StatementTimeouts{.lock = std::chrono::minutes(1), .statement = std::chrono::minutes(60)});
  connection.begin(Isolation::kReadCommitted);
  try {
    // Two processes opening the database at once take turns instead of racing on CREATE TABLE.
    if (const std::string_view lock = dialect.migration_lock(); !lock.empty()) {
      connection.query(lock);
    }
    connection.execute(kCreateSchemaTable);
    const int found = read_version(connection, component);
    if (found > target) {
      throw SchemaVersionError(std::string(component), found, target);
    }
    for (int i = found; i < target; ++i) {
      connection.execute(dialect.migration_sql(steps[static_cast<std::size_t>(i)]));
    }
    if (found != target) {
      connection.query(
          "INSERT INTO keel_schema (component, version) VALUES ($1, $2) "
          "ON CONFLICT (component) DO UPDATE SET version = excluded.version",
          {component, target});
    }
    connection.commit();
    return found;
  } catch (const DatabaseError& e) {
    connection.rollback();
    if (e.details().sqlstate != "42501") throw;  // insufficient_privilege
    int found = 0;
    try {
      found = schema_version(connection, component);
    } catch (const DatabaseError&) {
      throw e;
    }
    DatabaseError::Details details = e.details();
    throw DatabaseError("the database's schema for '" + std::string(component) + "' is version " +
                            std::to_string(found) + " and this program needs " +
                            std::to_string(target) + ", but this role may not change the schema (" +
                            e.what() +
                            "): run `keel migrate --db URL` as a role that may create tables",
                        std::move(details));
  } catch (...) {
    connection.rollback();
    throw;
  }
}

ConnectionPool::ConnectionPool(DatabaseUrl url, PoolOptions options)
    : url_(std::move(url)), options_(options) {
  if (options_.acquire_timeout.count() < 0) {
    throw_invalid({.context = "keel::store::PoolOptions",
                   .field = "acquire_timeout",
                   .problem = "must be >= 0",
                   .got = format_duration(options_.acquire_timeout)});
  }
  if (options_.max_connections < 1) {
    throw_invalid({.context = "keel::store::PoolOptions",
                   .field = "max_connections",
                   .problem = "must be >= 1",
                   .got = std::to_string(options_.max_connections)});
  }
}

ConnectionPool::~ConnectionPool() = default;

ConnectionPool::Lease::~Lease() {
  if (pool_ != nullptr && conn_ != nullptr) pool_->release(std::move(conn_));
}

ConnectionPool::Lease ConnectionPool::acquire(Deadline deadline) {
  const TimePoint start = steady_clock().now();
  const Deadline until =
      deadline.min(Deadline::at(saturating_add(start, options_.acquire_timeout)));
  const auto lend = [&](std::unique_ptr<Connection> conn) {
    conn->set_deadline(deadline);
    return Lease(this, std::move(conn));
  };
  std::unique_lock lock(mu_);
  for (;;) {
    const auto ready = [&] { return !idle_.empty() || open_ < options_.max_connections; };
    if (!ready()) {
      const Duration left = until.remaining(steady_clock().now());
      // wait: bound: the pool's acquire_timeout or the caller's deadline
      if (left <= Duration::zero() || !cv_.wait_for(lock, left, ready)) {
        throw DatabaseError(
            "no database connection free within " + format_duration(steady_clock().now() - start) +
                " (all " + std::to_string(options_.max_connections) +
                " of the pool's connections are lent)",
            {.backend = url_.backend,
             .sqlstate = url_.backend == Backend::kPostgres ? "08000" : "",
             .sqlite_code = url_.backend == Backend::kSqlite ? 5 /* SQLITE_BUSY */ : 0});
      }
    }
    if (idle_.empty()) break;
    std::unique_ptr<Connection> conn = std::move(idle_.back());
    idle_.pop_back();
    // A session the server ended while it sat idle (a terminated backend, a restart, a node
    // demoted under it) is closed here rather than lent to fail its borrower's first statement.
    if (conn->usable()) return lend(std::move(conn));
    --open_;
    lock.unlock();
    conn.reset();
    lock.lock();
  }
  ++open_;
  lock.unlock();
  try {
    return lend(options_.open ? options_.open(url_, options_.connect)
                              : open_database(url_, options_.connect));
  } catch (...) {
    lock.lock();
    --open_;
    cv_.notify_one();
    throw;
  }
}

void ConnectionPool::release(std::unique_ptr<Connection> conn) noexcept {
  if (conn->in_transaction()) conn->rollback();
  conn->set_deadline(Deadline::infinite());
  conn->set_timeouts(std::nullopt);
  const bool keep = !conn->broken();
  if (!keep) conn.reset();
  std::lock_guard lock(mu_);
  if (keep) {
    idle_.push_back(std::move(conn));
  } else {
    --open_;
  }
  cv_.notify_one();
}

}  // namespace keel::store
