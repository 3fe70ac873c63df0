// keel::store's PostgreSQL connection over libpq: parameterised statements only (prepared once per
// connection and reused), text results, the SQLSTATE of every failure in the error, and a lost
// connection reported as SQLSTATE 08006 (with during_commit set when it happened in COMMIT:
// the transaction may or may not have been applied).
#include <libpq-fe.h>

#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "db/detail/connections.hpp"
#include "db/detail/postgres_connect.hpp"

namespace keel::store::detail {
namespace {

struct ResultDeleter {
  void operator()(PGresult* r) const noexcept { PQclear(r); }
};
using Result = std::unique_ptr<PGresult, ResultDeleter>;

void ignore_notice(void* /*arg*/, const char* /*message*/) {}

}  // namespace

std::string trim_pg_message(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

pg_conn* connect_postgres(const std::string& uri, const ConnectOptions& options,
                          std::string_view what) {
  const std::string timeout = std::to_string(options.connect_timeout.count());
  // Later entries win: the URI (expanded from dbname) may override the timeout.
  const char* keys[] = {"connect_timeout", "dbname", nullptr};
  const char* values[] = {timeout.c_str(), uri.c_str(), nullptr};
  PGconn* conn = PQconnectdbParams(keys, values, /*expand_dbname=*/1);
  if (conn == nullptr || PQstatus(conn) != CONNECTION_OK) {
    const std::string reason =
        conn != nullptr ? trim_pg_message(PQerrorMessage(conn)) : "out of memory";
    PQfinish(conn);
    throw DatabaseError(
        "PostgreSQL: cannot connect" + std::string(what) + ": " + reason,
        {.backend = Backend::kPostgres, .sqlstate = "08001", .connection_lost = true});
  }
  PQsetNoticeProcessor(conn, ignore_notice, nullptr);
  return conn;
}

namespace {

class PostgresConnection final : public Connection {
 public:
  PostgresConnection(const std::string& uri, const ConnectOptions& options)
      : conn_(connect_postgres(uri, options, "")) {
    if (options.read_only) {
      try {
        execute("SET default_transaction_read_only = on");
      } catch (...) {
        PQfinish(conn_);
        conn_ = nullptr;
        throw;
      }
    }
  }

  ~PostgresConnection() override { PQfinish(conn_); }

  [[nodiscard]] Backend backend() const noexcept override { return Backend::kPostgres; }

  void execute(std::string_view sql) override {
    const std::string text(sql);
    check(Result(PQexec(conn_, text.c_str())), false);
  }

  Rows query(std::string_view sql, std::span<const Value> params) override {
    const std::string& name = prepare(sql, static_cast<int>(params.size()));
    std::vector<std::string> texts(params.size());
    std::vector<const char*> values(params.size(), nullptr);
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (params[i].is_null()) continue;
      texts[i] = params[i].to_text();
      values[i] = texts[i].c_str();
    }
    Result r(PQexecPrepared(conn_, name.c_str(), static_cast<int>(params.size()), values.data(),
                            nullptr, nullptr, 0));
    check(r, false);
    Rows rows;
    const int columns = PQnfields(r.get());
    std::vector<std::string> names;
    names.reserve(static_cast<std::size_t>(columns));
    for (int c = 0; c < columns; ++c) names.emplace_back(PQfname(r.get(), c));
    rows.set_columns(std::move(names));
    const int n = PQntuples(r.get());
    for (int i = 0; i < n; ++i) {
      std::vector<Rows::Cell> row;
      row.reserve(static_cast<std::size_t>(columns));
      for (int c = 0; c < columns; ++c) {
        if (PQgetisnull(r.get(), i, c) != 0) {
          row.emplace_back(std::nullopt);
        } else {
          row.emplace_back(std::string(PQgetvalue(r.get(), i, c),
                                       static_cast<std::size_t>(PQgetlength(r.get(), i, c))));
        }
      }
      rows.add_row(std::move(row));
    }
    const char* tuples = PQcmdTuples(r.get());
    rows.set_affected(tuples != nullptr && *tuples != '\0' ? std::stoll(tuples) : 0);
    return rows;
  }

  void begin(Isolation isolation) override {
    execute(isolation == Isolation::kSerializable ? "BEGIN ISOLATION LEVEL SERIALIZABLE" : "BEGIN");
  }

  void commit() override {
    Result r(PQexec(conn_, "COMMIT"));
    check(r, true);
    // COMMIT of a transaction that already failed answers "ROLLBACK" without an error.
    if (std::strcmp(PQcmdStatus(r.get()), "ROLLBACK") == 0) {
      throw DatabaseError("PostgreSQL: COMMIT rolled back a failed transaction",
                          {.backend = Backend::kPostgres, .sqlstate = "25P02"});
    }
  }

  void rollback() noexcept override {
    if (!in_transaction()) return;
    PGresult* r = PQexec(conn_, "ROLLBACK");
    if (r == nullptr || PQresultStatus(r) != PGRES_COMMAND_OK) broken_ = true;
    PQclear(r);
  }

  [[nodiscard]] bool in_transaction() const noexcept override {
    const PGTransactionStatusType s = PQtransactionStatus(conn_);
    return s == PQTRANS_INTRANS || s == PQTRANS_INERROR || s == PQTRANS_ACTIVE;
  }

  [[nodiscard]] bool broken() const noexcept override {
    return broken_ || PQstatus(conn_) != CONNECTION_OK;
  }

  [[nodiscard]] std::string database_identity() const override {
    const auto text = [](const char* s) { return std::string(s != nullptr ? s : ""); };
    return "postgres:" + text(PQhost(conn_)) + ":" + text(PQport(conn_)) + "/" + text(PQdb(conn_)) +
           "?" + text(PQoptions(conn_));
  }

 private:
  const std::string& prepare(std::string_view sql, int nparams) {
    const std::string key(sql);
    if (auto it = prepared_.find(key); it != prepared_.end()) return it->second;
    std::string name = "keel_" + std::to_string(prepared_.size() + 1);
    check(Result(PQprepare(conn_, name.c_str(), key.c_str(), nparams, nullptr)), false);
    return prepared_.emplace(key, std::move(name)).first->second;
  }

  void check(const Result& r, bool during_commit) {
    const ExecStatusType status = r ? PQresultStatus(r.get()) : PGRES_FATAL_ERROR;
    if (status == PGRES_COMMAND_OK || status == PGRES_TUPLES_OK || status == PGRES_EMPTY_QUERY) {
      return;
    }
    const char* state = r ? PQresultErrorField(r.get(), PG_DIAG_SQLSTATE) : nullptr;
    const bool lost = PQstatus(conn_) != CONNECTION_OK;
    if (lost) broken_ = true;
    std::string sqlstate = state != nullptr ? state : (lost ? "08006" : "XX000");
    std::string reason = trim_pg_message(r ? PQresultErrorMessage(r.get()) : PQerrorMessage(conn_));
    if (reason.empty()) reason = trim_pg_message(PQerrorMessage(conn_));
    throw DatabaseError("PostgreSQL: " + reason,  // the constructor appends the SQLSTATE
                        {.backend = Backend::kPostgres,
                         .sqlstate = std::move(sqlstate),
                         .during_commit = during_commit,
                         .connection_lost = lost});
  }

  PGconn* conn_ = nullptr;
  std::unordered_map<std::string, std::string> prepared_;
  bool broken_ = false;
};

}  // namespace

std::unique_ptr<Connection> open_postgres(const std::string& uri, const ConnectOptions& options) {
  return std::make_unique<PostgresConnection>(uri, options);
}

}  // namespace keel::store::detail
