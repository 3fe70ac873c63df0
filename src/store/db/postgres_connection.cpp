// keel::store's PostgreSQL connection over libpq: parameterised statements only (prepared once per
// connection and reused), text results, the SQLSTATE of every failure in the error, and a lost
// connection reported as SQLSTATE 08006 (with during_commit set when it happened in COMMIT:
// the transaction may or may not have been applied).
#include <libpq-fe.h>

#include <cstring>
#include <memory>
#include <span>
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
    const Params bound(params);
    Result r(
        PQexecPrepared(conn_, name.c_str(), bound.size(), bound.values(), nullptr, nullptr, 0));
    check(r, false);
    return to_rows(r.get());
  }

  // The statement, a Sync (which commits it: it ran in an implicit transaction of its own) and
  // BEGIN, sent in one pipeline without waiting between them.
  Rows query_then_begin(std::string_view sql, std::span<const Value> params,
                        Isolation isolation) override {
    const std::string& name = prepare(sql, static_cast<int>(params.size()));
    const Params bound(params);
    Pipeline pipeline(*this);
    pipeline.send_prepared(name, bound);
    pipeline.sync();
    pipeline.send_text(begin_sql(isolation));
    pipeline.sync();
    Result statement = pipeline.next();
    pipeline.end_of_sync();
    Result begun = pipeline.next();
    pipeline.end_of_sync();
    pipeline.close();
    try {
      check(statement, false);
    } catch (const DatabaseError&) {
      rollback();  // the BEGIN after the statement's Sync ran regardless
      throw;
    }
    check(begun, false);
    return to_rows(statement.get());
  }

  // The statement and COMMIT in one pipeline: when the statement fails, the server skips the
  // COMMIT (the pipeline is aborted until its Sync) and the transaction is left failed, then
  // rolled back here.
  Rows query_then_commit(std::string_view sql, std::span<const Value> params) override {
    const std::string& name = prepare(sql, static_cast<int>(params.size()));
    const Params bound(params);
    Result statement;
    Result committed;
    {
      Pipeline pipeline(*this);
      pipeline.send_prepared(name, bound);
      pipeline.send_text("COMMIT");
      pipeline.sync();
      statement = pipeline.next();
      committed = pipeline.next();
      pipeline.end_of_sync();
      pipeline.close();
    }
    try {
      check(statement, false);
    } catch (const DatabaseError&) {
      rollback();
      throw;
    }
    check_commit(committed);
    return to_rows(statement.get());
  }

  // BEGIN and the statements in one pipeline with one Sync: when one fails, the server skips the
  // rest (PGRES_PIPELINE_ABORTED) and the transaction is left failed, then rolled back here.
  std::vector<Rows> begin_then_query(Isolation isolation,
                                     std::span<const Statement> statements) override {
    std::vector<std::string> names;
    std::vector<std::unique_ptr<Params>> bound;
    names.reserve(statements.size());
    bound.reserve(statements.size());
    for (const Statement& statement : statements) {
      names.push_back(prepare(statement.sql, static_cast<int>(statement.params.size())));
      bound.push_back(std::make_unique<Params>(statement.params));
    }
    Result begun;
    std::vector<Result> results;
    results.reserve(statements.size());
    {
      Pipeline pipeline(*this);
      pipeline.send_text(begin_sql(isolation));
      for (std::size_t i = 0; i < statements.size(); ++i)
        pipeline.send_prepared(names[i], *bound[i]);
      pipeline.sync();
      begun = pipeline.next();
      for (std::size_t i = 0; i < statements.size(); ++i) results.push_back(pipeline.next());
      pipeline.end_of_sync();
      pipeline.close();
    }
    std::vector<Rows> out;
    out.reserve(statements.size());
    try {
      check(begun, false);
      for (const Result& r : results) {
        check(r, false);
        out.push_back(to_rows(r.get()));
      }
    } catch (const DatabaseError&) {
      rollback();
      throw;
    }
    return out;
  }

  void begin(Isolation isolation) override { execute(begin_sql(isolation)); }

  void commit() override { check_commit(Result(PQexec(conn_, "COMMIT"))); }

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
  static const char* begin_sql(Isolation isolation) noexcept {
    return isolation == Isolation::kSerializable ? "BEGIN ISOLATION LEVEL SERIALIZABLE" : "BEGIN";
  }

  // A statement's parameters as libpq takes them: text, or a null pointer for NULL.
  class Params {
   public:
    explicit Params(std::span<const Value> params)
        : texts_(params.size()), values_(params.size(), nullptr) {
      for (std::size_t i = 0; i < params.size(); ++i) {
        if (params[i].is_null()) continue;
        texts_[i] = params[i].to_text();
        values_[i] = texts_[i].c_str();
      }
    }
    Params(const Params&) = delete;  // values_ points into texts_
    Params& operator=(const Params&) = delete;
    [[nodiscard]] int size() const noexcept { return static_cast<int>(values_.size()); }
    [[nodiscard]] const char* const* values() const noexcept { return values_.data(); }

   private:
    std::vector<std::string> texts_;
    std::vector<const char*> values_;
  };

  // libpq's pipeline mode for one exchange: statements sent without waiting, then their results
  // read in order. A failure to send or a lost connection throws as check() does; a statement the
  // server skipped because an earlier one failed comes back as PGRES_PIPELINE_ABORTED.
  class Pipeline {
   public:
    explicit Pipeline(PostgresConnection& c) : c_(c) {
      if (PQenterPipelineMode(c_.conn_) != 1) c_.check(Result(), false);
    }
    ~Pipeline() {
      if (open_) c_.abandon_pipeline();
    }
    Pipeline(const Pipeline&) = delete;
    Pipeline& operator=(const Pipeline&) = delete;

    // A statement prepared on this connection, with its parameters.
    void send_prepared(const std::string& name, const Params& bound) {
      sent(PQsendQueryPrepared(c_.conn_, name.c_str(), bound.size(), bound.values(), nullptr,
                               nullptr, 0));
    }
    // A statement without parameters (BEGIN, COMMIT).
    void send_text(const char* sql) {
      sent(PQsendQueryParams(c_.conn_, sql, 0, nullptr, nullptr, nullptr, nullptr, 0));
    }
    void sync() {
      if (PQpipelineSync(c_.conn_) != 1) c_.check(Result(), false);
    }
    // The next statement's result (libpq ends each with a null result).
    Result next() {
      Result r(PQgetResult(c_.conn_));
      if (!r) c_.check(r, false);
      if (const Result extra(PQgetResult(c_.conn_)); extra) {
        c_.broken_ = true;  // one result per statement was expected
      }
      return r;
    }
    // The Sync's marker, after the results of the statements before it.
    void end_of_sync() {
      const Result r(PQgetResult(c_.conn_));
      if (!r || PQresultStatus(r.get()) != PGRES_PIPELINE_SYNC) c_.check(r, false);
    }
    void close() {
      open_ = false;
      if (PQexitPipelineMode(c_.conn_) != 1) c_.check(Result(), false);
    }

   private:
    void sent(int status) {
      if (status != 1) c_.check(Result(), false);
    }

    PostgresConnection& c_;
    bool open_ = true;
  };

  // After a failure inside a pipeline: results may be pending, so the connection is not reused.
  void abandon_pipeline() noexcept {
    broken_ = true;
    while (PGresult* r = PQgetResult(conn_)) PQclear(r);
    PQexitPipelineMode(conn_);
  }

  static Rows to_rows(const PGresult* r) {
    Rows rows;
    const int columns = PQnfields(r);
    std::vector<std::string> names;
    names.reserve(static_cast<std::size_t>(columns));
    for (int c = 0; c < columns; ++c) names.emplace_back(PQfname(r, c));
    rows.set_columns(std::move(names));
    const int n = PQntuples(r);
    for (int i = 0; i < n; ++i) {
      std::vector<Rows::Cell> row;
      row.reserve(static_cast<std::size_t>(columns));
      for (int c = 0; c < columns; ++c) {
        if (PQgetisnull(r, i, c) != 0) {
          row.emplace_back(std::nullopt);
        } else {
          row.emplace_back(
              std::string(PQgetvalue(r, i, c), static_cast<std::size_t>(PQgetlength(r, i, c))));
        }
      }
      rows.add_row(std::move(row));
    }
    const char* tuples = PQcmdTuples(const_cast<PGresult*>(r));
    rows.set_affected(tuples != nullptr && *tuples != '\0' ? std::stoll(tuples) : 0);
    return rows;
  }

  const std::string& prepare(std::string_view sql, int nparams) {
    const std::string key(sql);
    if (auto it = prepared_.find(key); it != prepared_.end()) return it->second;
    std::string name = "keel_" + std::to_string(prepared_.size() + 1);
    check(Result(PQprepare(conn_, name.c_str(), key.c_str(), nparams, nullptr)), false);
    return prepared_.emplace(key, std::move(name)).first->second;
  }

  void check_commit(const Result& r) {
    check(r, true);
    // COMMIT of a transaction that already failed answers "ROLLBACK" without an error.
    if (std::strcmp(PQcmdStatus(r.get()), "ROLLBACK") == 0) {
      throw DatabaseError("PostgreSQL: COMMIT rolled back a failed transaction",
                          {.backend = Backend::kPostgres, .sqlstate = "25P02"});
    }
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
