// detail::Listener on libpq: a connection of its own that runs LISTEN, then waits on its socket
// with poll(2) (PQsocket, PQconsumeInput, PQnotifies) beside an eventfd that interrupt() writes.
#include <libpq-fe.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <string>

#include "db/detail/listener.hpp"
#include "db/detail/postgres_connect.hpp"

namespace keel::store::detail {
namespace {

class PostgresListener final : public Listener {
 public:
  PostgresListener(const std::string& uri, const ConnectOptions& options)
      : conn_(connect_postgres(uri, options, " to listen")),
        answer_wait_(options.statement_timeout + std::chrono::milliseconds(500)) {
    if (PQsetnonblocking(conn_, 1) != 0) {
      PQfinish(conn_);
      throw DatabaseError("PostgreSQL: listener: cannot switch to non-blocking mode",
                          {.backend = Backend::kPostgres, .sqlstate = "08000"});
    }
    wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_fd_ < 0) {
      PQfinish(conn_);
      throw DatabaseError("PostgreSQL: listener: eventfd failed", {.backend = Backend::kPostgres});
    }
  }

  ~PostgresListener() override {
    PQfinish(conn_);
    close(wake_fd_);
  }

  void listen(std::string_view channel) override {
    // A channel is an identifier: quoted, with any '"' doubled.
    std::string sql = "LISTEN \"";
    for (const char c : channel) sql += c == '"' ? std::string("\"\"") : std::string(1, c);
    sql += '"';
    (void)run(sql, PGRES_COMMAND_OK, "LISTEN failed: ");
  }

  std::string scalar(std::string_view sql) override {
    return run(std::string(sql), PGRES_TUPLES_OK, "query failed: ");
  }

  // transaction_read_only is on in recovery (a standby) and where default_transaction_read_only
  // was turned on (a demoted primary, as the session sees it once it reads its configuration,
  // which this statement makes it do).
  bool takes_writes() override {
    return scalar("SELECT current_setting('transaction_read_only')") != "on";
  }

  std::vector<Notification> wait(Duration timeout) override {
    std::vector<Notification> out = take();
    if (!out.empty()) return out;
    if (conn_ == nullptr) fail("the connection was closed");
    pollfd fds[2] = {{.fd = PQsocket(conn_), .events = POLLIN, .revents = 0},
                     {.fd = wake_fd_, .events = POLLIN, .revents = 0}};
    if (fds[0].fd < 0) fail("the connection has no socket");
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(timeout).count();
    const int wait_ms =
        timeout >= kInfinite
            ? -1
            : static_cast<int>(std::min<std::int64_t>(ms, std::int64_t{24} * 3600 * 1000));
    const int n = poll(fds, 2, wait_ms);
    if (n < 0 && errno != EINTR) fail("poll failed");
    if (n > 0 && (fds[1].revents & POLLIN) != 0) {
      std::uint64_t count = 0;
      (void)read(wake_fd_, &count, sizeof count);
    }
    if (n > 0 && fds[0].revents != 0) {
      if (PQconsumeInput(conn_) == 0) fail(trim_pg_message(PQerrorMessage(conn_)));
      out = take();
    }
    return out;
  }

  void interrupt() noexcept override {
    const std::uint64_t one = 1;
    (void)write(wake_fd_, &one, sizeof one);
  }

 private:
  std::vector<Notification> take() {
    std::vector<Notification> out;
    while (PGnotify* n = PQnotifies(conn_)) {
      out.push_back({.channel = n->relname, .payload = n->extra != nullptr ? n->extra : ""});
      PQfreemem(n);
    }
    return out;
  }

  // Sends `sql` and waits for its answer at most the statement timeout and half a second (a
  // frozen server must not hold the listener's thread); returns the first row's first cell.
  std::string run(const std::string& sql, ExecStatusType expected, const std::string& what) {
    if (PQsendQuery(conn_, sql.c_str()) != 1) fail(what + trim_pg_message(PQerrorMessage(conn_)));
    const auto until = std::chrono::steady_clock::now() + answer_wait_;
    while (PQflush(conn_) == 1) wait_socket(POLLIN | POLLOUT, until);
    std::string out;
    std::string reason;
    bool ok = true;
    bool first = true;
    for (;;) {
      while (PQisBusy(conn_) != 0) {
        wait_socket(POLLIN, until);
        if (PQconsumeInput(conn_) == 0) fail(what + trim_pg_message(PQerrorMessage(conn_)));
      }
      PGresult* r = PQgetResult(conn_);
      if (r == nullptr) break;
      if (first) {
        first = false;
        ok = PQresultStatus(r) == expected;
        if (ok && PQntuples(r) > 0 && PQnfields(r) > 0 && PQgetisnull(r, 0, 0) == 0) {
          out = PQgetvalue(r, 0, 0);
        }
        if (!ok) reason = trim_pg_message(PQresultErrorMessage(r));
      }
      PQclear(r);
    }
    if (!ok) fail(what + reason);
    return out;
  }

  void wait_socket(short events, std::chrono::steady_clock::time_point until) {
    for (;;) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= until) {
        PQfinish(conn_);
        conn_ = nullptr;
        throw DatabaseError(
            "PostgreSQL: listener: no answer from the server within " +
                std::to_string(answer_wait_.count()) +
                " ms (frozen or unreachable); the connection was closed",
            {.backend = Backend::kPostgres, .sqlstate = "08006", .connection_lost = true});
      }
      pollfd fd{.fd = PQsocket(conn_), .events = events, .revents = 0};
      if (fd.fd < 0) fail("the connection has no socket");
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - now).count();
      const int n = poll(&fd, 1, static_cast<int>(left));
      if (n > 0) return;
      if (n < 0 && errno != EINTR) fail("poll failed");
    }
  }

  [[noreturn]] void fail(const std::string& reason) {
    const bool lost = conn_ == nullptr || PQstatus(conn_) != CONNECTION_OK;
    throw DatabaseError("PostgreSQL: listener: " + reason, {.backend = Backend::kPostgres,
                                                            .sqlstate = lost ? "08006" : "XX000",
                                                            .connection_lost = true});
  }

  PGconn* conn_ = nullptr;
  std::chrono::milliseconds answer_wait_;
  int wake_fd_ = -1;
};

}  // namespace

std::unique_ptr<Listener> open_listener(const DatabaseUrl& url, const ConnectOptions& options) {
  if (url.backend != Backend::kPostgres) return nullptr;
  return std::make_unique<PostgresListener>(url.target, options);
}

}  // namespace keel::store::detail
