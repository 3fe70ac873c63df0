// keel::store's PostgreSQL connection over libpq's asynchronous API. Every exchange is sent in
// pipeline mode and its answers are awaited with poll(2), so that no wait outlasts its bound: a
// statement's own (statement_timeout and lock_timeout, on the server), and the answer's (the
// statement timeout plus half a second, on the client: a frozen or unreachable server costs that,
// then the connection is abandoned). Parameterised statements only, prepared once per connection
// under names no other connection uses, or sent unnamed behind a transaction pooler; text results;
// the SQLSTATE of every failure in the error; a lost connection reported as SQLSTATE 08006 (with
// during_commit set when it happened in COMMIT: the transaction may or may not have been applied).
#include <libpq-fe.h>
#include <poll.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "db/detail/connections.hpp"
#include "db/detail/postgres_connect.hpp"
#include "keel/core/random.hpp"

namespace keel::store::detail {
namespace {

struct ResultDeleter {
  void operator()(PGresult* r) const noexcept { PQclear(r); }
};
using Result = std::unique_ptr<PGresult, ResultDeleter>;
using std::chrono::milliseconds;

// How much longer than a statement's own bound keel waits for the server's answer: the server
// cancels a statement at its statement_timeout and answers; no answer by then means it cannot.
constexpr milliseconds kAnswerMargin(500);
// A deadline (or a changed timeout) is sent to the server only when it differs from the
// timeouts the session already has by more than this: the cheap path sends nothing extra.
constexpr milliseconds kBoundSlack(250);

std::string random_prefix() {
  const std::uint64_t bits = random_seed();
  char out[32];
  std::snprintf(out, sizeof out, "keel_%016llx_", static_cast<unsigned long long>(bits));
  return out;
}

}  // namespace

namespace {

class PostgresConnection final : public Connection {
 public:
  PostgresConnection(const std::string& uri, const ConnectOptions& options, bool pooler)
      : uri_(uri), pooler_(pooler || pooler_noticed(uri)), read_only_(options.read_only) {
    set_default_timeouts({.lock = std::max(options.busy_timeout, milliseconds(1)),
                          .statement = options.statement_timeout});
    session_ = timeouts();
    conn_ = connect_postgres(uri, options, "", pooler_ ? "" : session_options());
    host_port_ = host_port_of(conn_);
    if (PQsetnonblocking(conn_, 1) != 0) {
      PQfinish(conn_);
      conn_ = nullptr;
      throw DatabaseError("PostgreSQL: cannot switch the connection to non-blocking mode",
                          {.backend = Backend::kPostgres, .sqlstate = "08000"});
    }
  }

  ~PostgresConnection() override { PQfinish(conn_); }

  [[nodiscard]] Backend backend() const noexcept override { return Backend::kPostgres; }

  // A multi-statement text (migrations, DDL), sent with the simple protocol: its statements run
  // in one implicit transaction unless they hold their own BEGIN and COMMIT.
  void execute(std::string_view sql) override {
    const bool was_in_transaction = in_transaction();
    const Bounds bounds = bounds_now();
    std::string text;
    if (bounds.send) text = bounds_sql(bounds) + "; ";
    text += sql;
    if (conn_ == nullptr || PQsendQuery(conn_, text.c_str()) != 1) check(Result(), false);
    flush(bounds.answer_wait);
    Result last;
    Result failed;
    while (Result r = result(bounds)) {
      const ExecStatusType status = PQresultStatus(r.get());
      if (status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK && status != PGRES_EMPTY_QUERY &&
          !failed) {
        failed = std::move(r);
      } else {
        last = std::move(r);
      }
    }
    if (failed) check(failed, false);
    // A transaction the text opened (BEGIN of its own) has what the text set, or the session's.
    if (in_transaction() && (bounds.send || !was_in_transaction)) began_with(bounds);
  }

  Rows query(std::string_view sql, std::span<const Value> params) override {
    const Params bound(params);
    const Bounds bounds = bounds_now();
    Result r;
    {
      Pipeline pipeline(*this, bounds);
      pipeline.bounds();
      pipeline.send(sql, bound);
      pipeline.sync();
      pipeline.bounds_result();
      r = pipeline.next();
      pipeline.end_of_sync();
      pipeline.close();
    }
    if (retry_unnamed(r)) return query(sql, params);
    check(r, false);
    return to_rows(r.get());
  }

  // The statement, a Sync (which commits it: it ran in an implicit transaction of its own) and
  // BEGIN, sent in one pipeline without waiting between them.
  Rows query_then_begin(std::string_view sql, std::span<const Value> params,
                        Isolation isolation) override {
    refuse_nested("query_then_begin");
    const Params bound(params);
    const Bounds bounds = bounds_now();
    Result statement;
    Result begun;
    {
      Pipeline pipeline(*this, bounds);
      pipeline.bounds();
      pipeline.send(sql, bound);
      pipeline.sync();
      pipeline.text(begin_sql(isolation));
      pipeline.bounds();
      pipeline.sync();
      pipeline.bounds_result();
      statement = pipeline.next();
      pipeline.end_of_sync();
      begun = pipeline.next();
      pipeline.bounds_result();
      pipeline.end_of_sync();
      pipeline.close();
    }
    check_in_transaction(statement);  // the BEGIN after the statement's Sync ran regardless
    check(begun, false);
    began_with(bounds);
    return to_rows(statement.get());
  }

  // The statement and COMMIT in one pipeline: when the statement fails, the server skips the
  // COMMIT (the pipeline is aborted until its Sync) and the transaction is left failed, then
  // rolled back here.
  Rows query_then_commit(std::string_view sql, std::span<const Value> params) override {
    const Params bound(params);
    const Bounds bounds = bounds_now();
    Result statement;
    Result committed;
    {
      Pipeline pipeline(*this, bounds);
      pipeline.bounds();
      pipeline.send(sql, bound);
      pipeline.text("COMMIT");
      pipeline.sync();
      // COMMIT went with the statement: from here a lost connection leaves the commit in doubt.
      pipeline.bounds_result(/*during_commit=*/true);
      statement = pipeline.next(/*during_commit=*/true);
      committed = pipeline.next(/*during_commit=*/true);
      pipeline.end_of_sync(/*during_commit=*/true);
      pipeline.close();
    }
    check_in_transaction(statement);
    check_commit(committed);
    return to_rows(statement.get());
  }

  // BEGIN and the statements in one pipeline with one Sync: when one fails, the server skips the
  // rest (PGRES_PIPELINE_ABORTED) and the transaction is left failed, then rolled back here.
  std::vector<Rows> begin_then_query(Isolation isolation,
                                     std::span<const Statement> statements) override {
    refuse_nested("begin_then_query");
    std::vector<std::unique_ptr<Params>> bound;
    bound.reserve(statements.size());
    for (const Statement& statement : statements) {
      bound.push_back(std::make_unique<Params>(statement.params));
    }
    const Bounds bounds = bounds_now();
    Result begun;
    std::vector<Result> results;
    results.reserve(statements.size());
    {
      Pipeline pipeline(*this, bounds);
      pipeline.text(begin_sql(isolation));
      pipeline.bounds();
      for (std::size_t i = 0; i < statements.size(); ++i) {
        pipeline.send(statements[i].sql, *bound[i]);
      }
      pipeline.sync();
      begun = pipeline.next();
      pipeline.bounds_result();
      for (std::size_t i = 0; i < statements.size(); ++i) results.push_back(pipeline.next());
      pipeline.end_of_sync();
      pipeline.close();
    }
    std::vector<Rows> out;
    out.reserve(statements.size());
    try {
      check(begun, false);
      began_with(bounds);
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

  void begin(Isolation isolation) override {
    refuse_nested("begin");
    const Bounds bounds = bounds_now();
    Result begun;
    {
      Pipeline pipeline(*this, bounds);
      pipeline.text(begin_sql(isolation));
      pipeline.bounds();
      pipeline.sync();
      begun = pipeline.next();
      pipeline.bounds_result();
      pipeline.end_of_sync();
      pipeline.close();
    }
    check(begun, false);
    began_with(bounds);
  }

  void commit() override {
    const Bounds bounds = bounds_now();
    Result committed;
    {
      Pipeline pipeline(*this, bounds);
      pipeline.text("COMMIT");
      pipeline.sync();
      committed = pipeline.next(/*during_commit=*/true);
      pipeline.end_of_sync(/*during_commit=*/true);
      pipeline.close();
    }
    check_commit(committed);
  }

  void rollback() noexcept override {
    if (!in_transaction()) return;
    try {
      // A rollback waits as long as any statement may: the server answers it at once.
      Bounds bounds;
      bounds.answer_wait = timeouts().statement + kAnswerMargin;
      Pipeline pipeline(*this, bounds);
      pipeline.text("ROLLBACK");
      pipeline.sync();
      const Result r = pipeline.next();
      pipeline.end_of_sync();
      pipeline.close();
      if (!r || PQresultStatus(r.get()) != PGRES_COMMAND_OK) broken_ = true;
    } catch (...) {
      broken_ = true;
    }
  }

  [[nodiscard]] bool in_transaction() const noexcept override {
    if (conn_ == nullptr) return false;
    const PGTransactionStatusType s = PQtransactionStatus(conn_);
    return s == PQTRANS_INTRANS || s == PQTRANS_INERROR || s == PQTRANS_ACTIVE;
  }

  [[nodiscard]] bool broken() const noexcept override {
    return broken_ || conn_ == nullptr || PQstatus(conn_) != CONNECTION_OK;
  }

  // Idle, a session has nothing to read: anything that arrived (the server's FATAL before it
  // closes the session, the close itself, a changed default_transaction_read_only from a node
  // being demoted) means it is not the session it was. No round trip.
  [[nodiscard]] bool usable() noexcept override {
    if (broken() || in_transaction()) return !broken();
    // Its host gave another connection no answer since this one was opened: frozen, most likely.
    if (const auto since = suspect_since(host_port_); since && *since >= opened_) {
      broken_ = true;
      return false;
    }
    pollfd fd{.fd = PQsocket(conn_), .events = POLLIN, .revents = 0};
    if (fd.fd < 0) {
      broken_ = true;
      return false;
    }
    const int n = poll(&fd, 1, 0);
    if (n == 0) return true;
    broken_ = true;  // readable, hung up or in error while idle
    return false;
  }

  [[nodiscard]] std::string database_identity() const override {
    if (conn_ == nullptr) return {};
    const auto text = [](const char* s) { return std::string(s != nullptr ? s : ""); };
    return "postgres:" + text(PQhost(conn_)) + ":" + text(PQport(conn_)) + "/" + text(PQdb(conn_)) +
           "?" + text(PQoptions(conn_));
  }

 private:
  // The bounds of one exchange: what the server is told (when it must be), and when keel stops
  // waiting for its answers.
  struct Bounds {
    StatementTimeouts server{};
    bool send = false;            // a set_config statement goes first, inside the transaction
    milliseconds answer_wait{0};  // the most one answer may take
  };

  static const char* begin_sql(Isolation isolation) noexcept {
    return isolation == Isolation::kSerializable ? "BEGIN ISOLATION LEVEL SERIALIZABLE" : "BEGIN";
  }

  // The session's defaults, sent once at connect where nothing outlives the connection but the
  // connection itself (no pooler hands the session to another client).
  std::string session_options() const {
    std::string out = "-c lock_timeout=" + std::to_string(session_.lock.count()) +
                      " -c statement_timeout=" + std::to_string(session_.statement.count());
    if (read_only_) out += " -c default_transaction_read_only=on";
    return out;
  }

  static bool differs(milliseconds a, milliseconds b) noexcept {
    return a > b + kBoundSlack || b > a + kBoundSlack;
  }

  // The bounds of an exchange that starts now. `commit`: the exchange commits (a passed deadline
  // stops it before COMMIT is sent).
  Bounds bounds_now() const {
    Bounds b;
    const StatementTimeouts t = timeouts();
    b.server = t;
    const auto now = std::chrono::steady_clock::now();
    const Deadline d = deadline();
    if (!d.is_infinite()) {
      const Duration left = d.remaining(now);
      const milliseconds left_ms = std::max(milliseconds(1), std::chrono::ceil<milliseconds>(left));
      b.server.lock = std::min(b.server.lock, left_ms);
      b.server.statement = std::min(b.server.statement, left_ms);
    }
    // What the server has in force now: the transaction's bounds inside one, else the session's
    // (nothing known behind a pooler: every transaction says its own).
    if (in_transaction()) {
      b.send = differs(b.server.lock, tx_bounds_.lock) ||
               differs(b.server.statement, tx_bounds_.statement);
    } else {
      b.send = pooler_ || differs(b.server.lock, session_.lock) ||
               differs(b.server.statement, session_.statement);
    }
    b.answer_wait = b.server.statement + kAnswerMargin;
    return b;
  }

  std::string bounds_sql(const Bounds& b) const {
    std::string sql = "SELECT set_config('lock_timeout', '" +
                      std::to_string(b.server.lock.count()) +
                      "', true), set_config('statement_timeout', '" +
                      std::to_string(b.server.statement.count()) + "', true)";
    if (read_only_ && pooler_) sql += ", set_config('transaction_read_only', 'on', true)";
    return sql;
  }

  void refuse_nested(std::string_view what) const { refuse_nested_transaction(*this, what); }

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

  // libpq's pipeline mode for one exchange: statements sent without waiting, flushed at each
  // Sync, then their results read in the order they were sent, each within the exchange's answer
  // bound. A failure to send, a lost connection or a bound that passed throws as check() does; a
  // statement the server skipped because an earlier one failed comes back as
  // PGRES_PIPELINE_ABORTED, or as that earlier failure when it was keel's own (the bounds'
  // set_config, a statement's prepare), so that the caller sees the cause.
  class Pipeline {
   public:
    Pipeline(PostgresConnection& c, const Bounds& bounds) : c_(c), bounds_(bounds) {
      if (c_.conn_ == nullptr || PQenterPipelineMode(c_.conn_) != 1) c_.check(Result(), false);
    }
    ~Pipeline() {
      if (open_) c_.abandon_pipeline();
    }
    Pipeline(const Pipeline&) = delete;
    Pipeline& operator=(const Pipeline&) = delete;

    // The bounds' set_config statement, when the bounds say it must go: first in a transaction
    // (after BEGIN, or first in an implicit one).
    void bounds() {
      if (!bounds_.send) return;
      sent(PQsendQueryParams(c_.conn_, c_.bounds_sql(bounds_).c_str(), 0, nullptr, nullptr, nullptr,
                             nullptr, 0));
      ++pending_bounds_;
    }
    // Its result, read where it comes in the pipeline's order.
    void bounds_result(bool during_commit = false) {
      if (pending_bounds_ == 0) return;
      --pending_bounds_;
      Result r = read(during_commit);
      if (PQresultStatus(r.get()) != PGRES_TUPLES_OK) earlier_ = std::move(r);
    }
    // A statement with its parameters: prepared on this connection (prepared in this same
    // pipeline when it is new), or unnamed behind a transaction pooler.
    void send(std::string_view sql, const Params& bound) {
      if (c_.pooler_) {
        const std::string text(sql);
        sent(PQsendQueryParams(c_.conn_, text.c_str(), bound.size(), nullptr, bound.values(),
                               nullptr, nullptr, 0));
        prepares_.push_back(std::nullopt);
        return;
      }
      const std::string key(sql);
      auto it = c_.prepared_.find(key);
      std::optional<std::string> prepared;
      if (it == c_.prepared_.end()) {
        std::string name = c_.prefix_ + std::to_string(++c_.statements_);
        sent(PQsendPrepare(c_.conn_, name.c_str(), key.c_str(), bound.size(), nullptr));
        it = c_.prepared_.emplace(key, std::move(name)).first;
        prepared = key;
      }
      sent(PQsendQueryPrepared(c_.conn_, it->second.c_str(), bound.size(), bound.values(), nullptr,
                               nullptr, 0));
      prepares_.push_back(std::move(prepared));
    }
    // A statement without parameters (BEGIN, COMMIT).
    void text(const char* sql) {
      sent(PQsendQueryParams(c_.conn_, sql, 0, nullptr, nullptr, nullptr, nullptr, 0));
      prepares_.push_back(std::nullopt);
    }
    void sync() {
      if (PQpipelineSync(c_.conn_) != 1) c_.check(Result(), false);
      c_.flush(bounds_.answer_wait);
    }
    // The next statement's result, after its prepare's when one was sent ahead of it.
    Result next(bool during_commit = false) {
      std::optional<std::string> prepared;
      if (!prepares_.empty()) {
        prepared = std::move(prepares_.front());
        prepares_.erase(prepares_.begin());
      }
      if (prepared) {
        Result p = read(during_commit);
        if (PQresultStatus(p.get()) != PGRES_COMMAND_OK) {
          c_.prepared_.erase(*prepared);  // prepared again next time
          if (!earlier_) earlier_ = std::move(p);
        }
      }
      Result r = read(during_commit);
      if (PQresultStatus(r.get()) == PGRES_PIPELINE_ABORTED && earlier_) return std::move(earlier_);
      return r;
    }
    // The Sync's marker, after the results of the statements before it.
    void end_of_sync(bool during_commit = false) {
      const Result r = c_.result(bounds_, during_commit);
      if (!r || PQresultStatus(r.get()) != PGRES_PIPELINE_SYNC) c_.check(r, during_commit);
      earlier_.reset();  // a failure does not reach past its Sync
    }
    void close() {
      open_ = false;
      if (PQexitPipelineMode(c_.conn_) != 1) c_.check(Result(), false);
    }

   private:
    // One statement's result, and the null that ends its results.
    Result read(bool during_commit) {
      Result r = c_.result(bounds_, during_commit);
      if (!r) c_.check(r, during_commit);
      if (const Result extra = c_.result(bounds_, during_commit); extra) {
        c_.broken_ = true;  // one result per statement was expected
      }
      return r;
    }
    void sent(int status) {
      if (status != 1) c_.check(Result(), false);
    }

    PostgresConnection& c_;
    const Bounds& bounds_;
    // Per statement sent, in order: the SQL it was prepared for in this pipeline, if it was.
    std::vector<std::optional<std::string>> prepares_;
    Result earlier_;  // keel's own statement that failed before the statements it aborted
    bool open_ = true;
    int pending_bounds_ = 0;  // set_config results not read yet
  };

  // Writes what libpq holds to the socket, each wait for room at most `wait`.
  void flush(milliseconds wait) {
    for (;;) {
      const int r = PQflush(conn_);
      if (r == 0) return;
      if (r < 0) check(Result(), false);
      wait_socket(POLLIN | POLLOUT, wait, false);
      if (PQconsumeInput(conn_) == 0) check(Result(), false);
    }
  }

  // The next result of the exchange, or null at the end of one statement's results. While libpq
  // has none complete it waits on the socket, each wait at most the exchange's answer bound: the
  // server answers a statement by its own statement_timeout, or cannot answer at all.
  Result result(const Bounds& bounds, bool during_commit = false) {
    while (PQisBusy(conn_) != 0) {
      wait_socket(POLLIN, bounds.answer_wait, during_commit);
      if (PQconsumeInput(conn_) == 0) break;  // lost: PQgetResult reports it
    }
    return Result(PQgetResult(conn_));
  }

  // Waits until the socket is ready for `events`, at most `wait`; then the server is taken to be
  // unable to answer: the connection is closed (a frozen server must not hold the caller, and the
  // server rolls back what it had not committed once it sees the close) and the failure thrown
  // as a lost connection (in doubt when it was COMMIT's answer).
  void wait_socket(short events, milliseconds wait, bool during_commit) {
    const auto until = std::chrono::steady_clock::now() + wait;
    for (;;) {
      const int fd = PQsocket(conn_);
      if (fd < 0) check(Result(), during_commit);
      const auto now = std::chrono::steady_clock::now();
      if (now >= until) abandon(wait, during_commit);
      const auto left = std::chrono::ceil<milliseconds>(until - now).count();
      pollfd p{.fd = fd, .events = events, .revents = 0};
      const int n = poll(&p, 1, static_cast<int>(std::min<long long>(left, 24LL * 3600 * 1000)));
      if (n > 0) return;
      if (n < 0 && errno != EINTR) check(Result(), during_commit);
    }
  }

  [[noreturn]] void abandon(milliseconds waited, bool during_commit) {
    suspect(host_port_);
    PQfinish(conn_);
    conn_ = nullptr;
    broken_ = true;
    throw DatabaseError(
        "PostgreSQL: no answer from the server within " + std::to_string(waited.count()) +
            " ms (frozen or unreachable); the connection was closed" +
            (during_commit ? " during COMMIT: the transaction may or may not have been applied"
                           : ""),
        {.backend = Backend::kPostgres,
         .sqlstate = "08006",
         .during_commit = during_commit,
         .connection_lost = true});
  }

  // After a failure inside a pipeline: results may be pending, so the connection is not reused.
  void abandon_pipeline() noexcept {
    broken_ = true;
    if (conn_ == nullptr) return;
    // Nothing more is awaited from this connection: close it rather than read what it may
    // never send.
    PQfinish(conn_);
    conn_ = nullptr;
  }

  // A named statement that was missing where it was run, or a name already taken where it was
  // prepared: the statements went to another server session than the one that prepared them,
  // which is what a transaction pooler does. From now on this connection (and every new one to
  // this URI) sends its statements unnamed; a statement that failed outside a transaction ran
  // nowhere and is sent again (true). Said once per URI on stderr.
  bool retry_unnamed(const Result& r) {
    if (pooler_ || !r) return false;
    const char* state = PQresultErrorField(r.get(), PG_DIAG_SQLSTATE);
    if (state == nullptr ||
        (std::strcmp(state, "26000") != 0 && std::strcmp(state, "42P05") != 0)) {
      return false;
    }
    pooler_ = true;
    prepared_.clear();
    if (notice_pooler(uri_)) {
      std::fprintf(stderr,
                   "keel::store: PostgreSQL: prepared statements do not survive between "
                   "transactions on this connection (a transaction pooler such as PgBouncer?): "
                   "sending statements unnamed from now on; add keel_pooler=transaction to the "
                   "database URL to say so\n");
    }
    return !in_transaction();
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

  // A transaction begun in an exchange with `bounds` has what they set, or else the session's.
  void began_with(const Bounds& bounds) { tx_bounds_ = bounds.send ? bounds.server : session_; }

  // Checks a statement that ran in a transaction the pipeline left open (failed, or begun after
  // it regardless): when it failed, that transaction is rolled back before the error goes on.
  void check_in_transaction(const Result& statement) {
    try {
      check(statement, false);
    } catch (const DatabaseError&) {
      rollback();
      throw;
    }
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
    if (status == PGRES_COMMAND_OK || status == PGRES_TUPLES_OK || status == PGRES_EMPTY_QUERY ||
        status == PGRES_PIPELINE_SYNC) {
      return;
    }
    const char* state = r ? PQresultErrorField(r.get(), PG_DIAG_SQLSTATE) : nullptr;
    const bool lost = conn_ == nullptr || PQstatus(conn_) != CONNECTION_OK;
    if (lost) broken_ = true;
    std::string sqlstate = state != nullptr ? state : (lost ? "08006" : "XX000");
    std::string reason =
        r ? trim_pg_message(PQresultErrorMessage(r.get()))
          : (conn_ != nullptr ? trim_pg_message(PQerrorMessage(conn_)) : std::string());
    if (reason.empty() && conn_ != nullptr) reason = trim_pg_message(PQerrorMessage(conn_));
    if (reason.empty()) reason = "the connection was lost";
    DatabaseError error("PostgreSQL: " + reason,  // the constructor appends the SQLSTATE
                        {.backend = Backend::kPostgres,
                         .sqlstate = std::move(sqlstate),
                         .during_commit = during_commit,
                         .connection_lost = lost});
    // A node that cannot serve this connection (a standby, a demoted or stopping primary): the
    // connection is never used again; the caller's next one goes through the host list.
    if (error.failure() == DatabaseFailure::kWrongNode) broken_ = true;
    throw error;
  }

  std::string uri_;
  PGconn* conn_ = nullptr;
  bool pooler_ = false;
  bool read_only_ = false;
  StatementTimeouts session_{};    // what the session was given at connect
  StatementTimeouts tx_bounds_{};  // what the open transaction has in force
  std::string prefix_ = random_prefix();
  std::string host_port_;  // the node it reached, for the suspects
  std::chrono::steady_clock::time_point opened_ = std::chrono::steady_clock::now();
  std::unordered_map<std::string, std::string> prepared_;  // SQL -> statement name
  std::uint64_t statements_ = 0;                           // names handed out
  bool broken_ = false;
};

}  // namespace

std::unique_ptr<Connection> open_postgres(const std::string& uri, const ConnectOptions& options,
                                          bool transaction_pooler) {
  return std::make_unique<PostgresConnection>(uri, options, transaction_pooler);
}

}  // namespace keel::store::detail
