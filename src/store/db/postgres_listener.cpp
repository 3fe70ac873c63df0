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
      : conn_(connect_postgres(uri, options, " to listen")) {
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
    PGresult* r = PQexec(conn_, sql.c_str());
    const bool ok = r != nullptr && PQresultStatus(r) == PGRES_COMMAND_OK;
    const std::string reason =
        trim_pg_message(r != nullptr ? PQresultErrorMessage(r) : PQerrorMessage(conn_));
    PQclear(r);
    if (!ok) fail("LISTEN failed: " + reason);
  }

  std::string scalar(std::string_view sql) override {
    const std::string text(sql);
    PGresult* r = PQexec(conn_, text.c_str());
    const bool ok = r != nullptr && PQresultStatus(r) == PGRES_TUPLES_OK;
    std::string out;
    if (ok && PQntuples(r) > 0 && PQnfields(r) > 0 && PQgetisnull(r, 0, 0) == 0) {
      out = PQgetvalue(r, 0, 0);
    }
    const std::string reason =
        trim_pg_message(r != nullptr ? PQresultErrorMessage(r) : PQerrorMessage(conn_));
    PQclear(r);
    if (!ok) fail("query failed: " + reason);
    return out;
  }

  std::vector<Notification> wait(Duration timeout) override {
    std::vector<Notification> out = take();
    if (!out.empty()) return out;
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

  [[noreturn]] void fail(const std::string& reason) {
    const bool lost = PQstatus(conn_) != CONNECTION_OK;
    throw DatabaseError("PostgreSQL: listener: " + reason, {.backend = Backend::kPostgres,
                                                            .sqlstate = lost ? "08006" : "XX000",
                                                            .connection_lost = true});
  }

  PGconn* conn_ = nullptr;
  int wake_fd_ = -1;
};

}  // namespace

std::unique_ptr<Listener> open_listener(const DatabaseUrl& url, const ConnectOptions& options) {
  if (url.backend != Backend::kPostgres) return nullptr;
  return std::make_unique<PostgresListener>(url.target, options);
}

}  // namespace keel::store::detail
