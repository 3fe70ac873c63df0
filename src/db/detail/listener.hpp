// A connection that only listens: PostgreSQL's LISTEN on a connection of its own, waited on with
// poll(2) on its socket, so that a process learns at once that another session committed a
// NOTIFY (the job queue wakes its idle workers with one; shared breakers announce their changes
// with one). SQLite has no equivalent. Private to keel::store_db, keel::store_queue (Worker
// wakeups) and keel::store_fleet (SharedBreakers).
//
// Thread-safety: one thread calls listen() and wait(); interrupt() may be called from any thread
// at any time (it writes to an eventfd that wait() polls beside the socket).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/clock.hpp"
#include "keel/db/database.hpp"

namespace keel::store::detail {

struct Notification {
  std::string channel;
  std::string payload;
};

class Listener {
 public:
  virtual ~Listener() = default;

  /// LISTEN on `channel` (quoted as an identifier). One transaction on the server. Throws
  /// DatabaseError.
  virtual void listen(std::string_view channel) = 0;

  /// Runs `sql`, a query without parameters, and returns its first row's first cell ("" for
  /// NULL or no row). Throws DatabaseError.
  [[nodiscard]] virtual std::string scalar(std::string_view sql) = 0;

  /// Whether the listener's node takes writes now (a primary), asked of the server in one bounded
  /// round trip: false on a standby or a primary turned read-only, where no transaction that
  /// notifies will ever commit. Throws DatabaseError.
  [[nodiscard]] virtual bool takes_writes() = 0;

  /// Waits until a notification arrives, interrupt() is called or `timeout` passes, and returns
  /// the notifications received (empty on a timeout or an interrupt). Sends nothing to the
  /// server. Throws DatabaseError (connection_lost) when the connection is lost.
  [[nodiscard]] virtual std::vector<Notification> wait(Duration timeout) = 0;

  /// Makes the current or next wait() return. Safe from any thread.
  virtual void interrupt() noexcept = 0;
};

/// A listening connection to `url`: PostgreSQL only (nullptr for SQLite). Throws DatabaseError
/// when the server cannot be reached.
[[nodiscard]] std::unique_ptr<Listener> open_listener(const DatabaseUrl& url,
                                                      const ConnectOptions& options = {});

}  // namespace keel::store::detail
