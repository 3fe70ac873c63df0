// keel::store's SQLite connection: WAL, a busy timeout, a prepared-statement cache, and
// BEGIN IMMEDIATE transactions (the write lock is taken at BEGIN, so two writers never deadlock
// upgrading a read lock; the loser waits up to the busy timeout and then gets SQLITE_BUSY), with
// a busy handler whose waits start at 100 us (see on_busy).
#include <sqlite3.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <unordered_map>

#include "db/detail/connections.hpp"

namespace keel::store::detail {
namespace {

class SqliteConnection final : public Connection {
 public:
  SqliteConnection(const std::string& path, const ConnectOptions& options) {
    const int flags =
        (options.read_only ? SQLITE_OPEN_READONLY : SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE) |
        SQLITE_OPEN_NOMUTEX;
    open(path, flags);
    if (options.read_only && !can_read() && !wal_file_exists(path)) {
      // A WAL database needs its -shm file to be read, and a reader that may not write the
      // directory cannot create it. With no -wal file either, no writer has the database open
      // and everything committed is in the main file: read it as immutable (no locks, no -shm).
      sqlite3_close_v2(db_);
      db_ = nullptr;
      open(immutable_uri(path), SQLITE_OPEN_READONLY | SQLITE_OPEN_URI | SQLITE_OPEN_NOMUTEX);
    }
    sqlite3_extended_result_codes(db_, 1);
    set_default_timeouts({.lock = options.busy_timeout, .statement = options.statement_timeout});
    // The handler also ends a wait at the connection's deadline; with a busy timeout of 0 it
    // refuses at once.
    sqlite3_busy_handler(db_, &SqliteConnection::on_busy, this);
    try {
      // WAL lets readers run beside the one writer; synchronous=NORMAL keeps every committed
      // transaction across a process crash (only a power loss can drop the last few).
      if (!options.read_only) {
        execute_waiting_while_busy("PRAGMA journal_mode=WAL");
        execute("PRAGMA synchronous=NORMAL");
      }
      execute("PRAGMA foreign_keys=ON");
    } catch (...) {
      sqlite3_close_v2(db_);
      db_ = nullptr;
      throw;
    }
  }

  ~SqliteConnection() override {
    for (auto& [sql, stmt] : statements_) sqlite3_finalize(stmt);
    sqlite3_close_v2(db_);
  }

  [[nodiscard]] Backend backend() const noexcept override { return Backend::kSqlite; }

  void execute(std::string_view sql) override {
    const std::string text(sql);
    char* message = nullptr;
    const int rc = sqlite3_exec(db_, text.c_str(), nullptr, nullptr, &message);
    if (rc != SQLITE_OK) {
      const std::string reason = message != nullptr ? message : sqlite3_errstr(rc);
      sqlite3_free(message);
      fail(reason, sqlite3_extended_errcode(db_), false);
    }
  }

  Rows query(std::string_view sql, std::span<const Value> params) override {
    sqlite3_stmt* stmt = prepare(sql);
    // Always leave the statement reset and unbound, whatever happens below.
    struct ResetGuard {
      sqlite3_stmt* s;
      ~ResetGuard() {
        sqlite3_reset(s);
        sqlite3_clear_bindings(s);
      }
    } guard{stmt};
    const int expected = sqlite3_bind_parameter_count(stmt);
    if (expected != static_cast<int>(params.size())) {
      fail("statement takes " + std::to_string(expected) + " parameters, " +
               std::to_string(params.size()) + " given: " + std::string(sql),
           SQLITE_RANGE, false);
    }
    for (std::size_t i = 0; i < params.size(); ++i) {
      const std::string name = "$" + std::to_string(i + 1);
      const int index = sqlite3_bind_parameter_index(stmt, name.c_str());
      if (index == 0) {
        fail("statement has no parameter " + name + ": " + std::string(sql), SQLITE_RANGE, false);
      }
      int rc = SQLITE_OK;
      const Value& v = params[i];
      if (v.is_null()) {
        rc = sqlite3_bind_null(stmt, index);
      } else if (const auto* n = v.as_int()) {
        rc = sqlite3_bind_int64(stmt, index, *n);
      } else {
        const std::string* s = v.as_text();
        rc = sqlite3_bind_text(stmt, index, s->data(), static_cast<int>(s->size()),
                               SQLITE_TRANSIENT);
      }
      if (rc != SQLITE_OK) fail(sqlite3_errmsg(db_), rc, false);
    }
    Rows rows;
    const int columns = sqlite3_column_count(stmt);
    std::vector<std::string> names;
    names.reserve(static_cast<std::size_t>(columns));
    for (int c = 0; c < columns; ++c) names.emplace_back(sqlite3_column_name(stmt, c));
    rows.set_columns(std::move(names));
    for (;;) {
      const int rc = sqlite3_step(stmt);
      if (rc == SQLITE_DONE) break;
      if (rc != SQLITE_ROW) fail(sqlite3_errmsg(db_), sqlite3_extended_errcode(db_), false);
      std::vector<Rows::Cell> row;
      row.reserve(static_cast<std::size_t>(columns));
      for (int c = 0; c < columns; ++c) {
        if (sqlite3_column_type(stmt, c) == SQLITE_NULL) {
          row.emplace_back(std::nullopt);
        } else {
          const auto* p = reinterpret_cast<const char*>(sqlite3_column_text(stmt, c));
          row.emplace_back(std::string(p, static_cast<std::size_t>(sqlite3_column_bytes(stmt, c))));
        }
      }
      rows.add_row(std::move(row));
    }
    rows.set_affected(sqlite3_changes64(db_));
    return rows;
  }

  void begin(Isolation /*isolation*/) override {
    refuse_nested_transaction(*this, "begin");
    execute("BEGIN IMMEDIATE");
  }

  void commit() override {
    const int rc = sqlite3_exec(db_, "COMMIT", nullptr, nullptr, nullptr);
    if (rc != SQLITE_OK) fail(sqlite3_errmsg(db_), sqlite3_extended_errcode(db_), true);
  }

  void rollback() noexcept override {
    if (sqlite3_get_autocommit(db_) != 0) return;
    if (sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr) != SQLITE_OK) broken_ = true;
  }

  [[nodiscard]] bool in_transaction() const noexcept override {
    return sqlite3_get_autocommit(db_) == 0;
  }

  [[nodiscard]] bool broken() const noexcept override { return broken_; }

  [[nodiscard]] std::string database_identity() const override {
    // The absolute path SQLite resolved; "" for an in-memory database (its own per connection).
    const char* file = sqlite3_db_filename(db_, "main");
    return file != nullptr && *file != '\0' ? std::string("sqlite:") + file : std::string();
  }

 private:
  void open(const std::string& name, int flags) {
    const int rc = sqlite3_open_v2(name.c_str(), &db_, flags, nullptr);
    if (rc != SQLITE_OK) {
      const std::string message = db_ != nullptr ? sqlite3_errmsg(db_) : sqlite3_errstr(rc);
      sqlite3_close_v2(db_);
      db_ = nullptr;
      throw DatabaseError("cannot open SQLite database '" + name + "': " + message,
                          {.backend = Backend::kSqlite, .sqlite_code = rc});
    }
  }

  // Whether the schema can be read (a read-only WAL database may not be).
  bool can_read() {
    return sqlite3_exec(db_, "SELECT count(*) FROM sqlite_master", nullptr, nullptr, nullptr) ==
           SQLITE_OK;
  }

  static bool wal_file_exists(const std::string& path) {
    std::error_code ec;
    return std::filesystem::exists(path + "-wal", ec);
  }

  static std::string immutable_uri(const std::string& path) {
    std::string uri = "file:";
    for (char c : path) {
      if (c == '?' || c == '#' || c == '%') {
        static constexpr char kHex[] = "0123456789ABCDEF";
        uri += '%';
        uri += kHex[static_cast<unsigned char>(c) >> 4];
        uri += kHex[static_cast<unsigned char>(c) & 0x0f];
      } else {
        uri += c;
      }
    }
    return uri + "?mode=ro&immutable=1";
  }

  sqlite3_stmt* prepare(std::string_view sql) {
    const std::string key(sql);
    if (auto it = statements_.find(key); it != statements_.end()) return it->second;
    sqlite3_stmt* stmt = nullptr;
    const int rc = sqlite3_prepare_v3(db_, key.data(), static_cast<int>(key.size()),
                                      SQLITE_PREPARE_PERSISTENT, &stmt, nullptr);
    if (rc != SQLITE_OK) {
      fail(std::string(sqlite3_errmsg(db_)) + " in: " + key, sqlite3_extended_errcode(db_), false);
    }
    statements_.emplace(key, stmt);
    return stmt;
  }

  // Runs sql, and while it fails with SQLITE_BUSY waits as the busy handler does and runs it
  // again. For the statements SQLite answers SQLITE_BUSY at once, without calling the handler:
  // switching a new database to WAL needs an exclusive lock, and when two connections open the
  // same new file at once, each holds the shared lock the other must see gone.
  void execute_waiting_while_busy(std::string_view sql) {
    for (int count = 0;; ++count) {
      try {
        execute(sql);
        return;
      } catch (const DatabaseError& e) {
        const bool busy = (e.details().sqlite_code & 0xff) == SQLITE_BUSY;
        if (!busy || on_busy(this, count) == 0) {
          throw;
        }
      }
    }
  }

  // Called by SQLite while another connection holds the lock this one needs; returns nonzero to
  // try again. SQLite's own handler (sqlite3_busy_timeout) sleeps 1, 2, 5, 10, 15, 20, 25 ... ms
  // between tries, while one of the store's write transactions holds the lock for tens of
  // microseconds: a waiter could oversleep the holder by a hundred times, and with many writers
  // (keel-demo serve's 16 threads) the unlucky ones waited hundreds of milliseconds. This one
  // sleeps 100 us, then 200, 400, 800 us, then 1 ms per try, until busy_timeout has passed since
  // the first call of this wait, or the connection's deadline passes (Connection::deadline), which
  // ends it sooner. Throughput is the same; the tail is shorter (docs/idempotency.md).
  // It is the one wait in src/ that computes its own delays, and it stays here because it is a
  // lock wait inside one statement, called by SQLite with the lock's state, not a retry: a
  // statement still busy after busy_timeout fails, and retrying its transaction is
  // with_transaction_retry's decision, with keel::core's jittered backoff.
  static int on_busy(void* self_ptr, int count) {
    auto* self = static_cast<SqliteConnection*>(self_ptr);
    const auto now = std::chrono::steady_clock::now();
    if (count == 0) self->busy_since_ = now;
    if (now - self->busy_since_ >= self->timeouts().lock) return 0;
    if (self->deadline().expired(steady_clock().now())) return 0;
    const int doublings = std::min(count, 4);  // 100 us << 4 = 1.6 ms
    // wait: documented: SQLite's busy handler (docs/queue.md), bounded by busy_timeout
    std::this_thread::sleep_for(std::min<std::chrono::microseconds>(
        std::chrono::microseconds(100 << doublings), std::chrono::milliseconds(1)));
    return 1;
  }

  [[noreturn]] void fail(const std::string& reason, int code, bool during_commit) const {
    throw DatabaseError(
        "SQLite: " + reason + " (" + sqlite3_errstr(code) + ")",
        {.backend = Backend::kSqlite, .sqlite_code = code, .during_commit = during_commit});
  }

  sqlite3* db_ = nullptr;
  std::chrono::steady_clock::time_point busy_since_;
  std::unordered_map<std::string, sqlite3_stmt*> statements_;
  bool broken_ = false;
};

}  // namespace

std::unique_ptr<Connection> open_sqlite(const std::string& path, const ConnectOptions& options) {
  return std::make_unique<SqliteConnection>(path, options);
}

}  // namespace keel::store::detail
