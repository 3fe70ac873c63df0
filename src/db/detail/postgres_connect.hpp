// Opening a libpq connection, shared by the store's PostgreSQL connection and the queue's
// listening connection: the connect timeout, the URI, notices silenced, and a DatabaseError
// (SQLSTATE 08001) naming `what` when the server cannot be reached. Private to keel::store_db.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <string_view>

#include "keel/db/database.hpp"

struct pg_conn;  // libpq's PGconn

namespace keel::store::detail {

/// A connected libpq connection (the caller PQfinish()es it): on a read-write node unless
/// options.read_only (target_session_attrs, which the URI may override), with TCP keepalives,
/// and `session_options` ("-c name=value ...", "" for none) ahead of the URI's own options.
/// Throws DatabaseError.
[[nodiscard]] pg_conn* connect_postgres(const std::string& uri, const ConnectOptions& options,
                                        std::string_view what,
                                        std::string_view session_options = {});

/// libpq's error text without its trailing newlines and spaces.
[[nodiscard]] std::string trim_pg_message(std::string s);

/// Whether a transaction pooler was noticed on `uri` (prepared statements that did not survive
/// between transactions): later connections to it start with unnamed statements.
[[nodiscard]] bool pooler_noticed(const std::string& uri);
/// Records the pooler; true the first time for this URI (the caller says so, once).
[[nodiscard]] bool notice_pooler(const std::string& uri);

/// Hosts that gave no answer within a statement's bound (a frozen server, a partition that drops
/// packets): for a while, new connections try the URL's other hosts first, and pooled
/// connections to them are not lent. Keyed by "host:port". Since when `host_port` is suspect;
/// nullopt when it is not (any more).
[[nodiscard]] std::optional<std::chrono::steady_clock::time_point> suspect_since(
    const std::string& host_port);
void suspect(const std::string& host_port);
/// "address:port" (or "host:port") of a connected libpq connection.
[[nodiscard]] std::string host_port_of(const pg_conn* conn);

}  // namespace keel::store::detail
