// Opening a libpq connection, shared by the store's PostgreSQL connection and the queue's
// listening connection: the connect timeout, the URI, notices silenced, and a DatabaseError
// (SQLSTATE 08001) naming `what` when the server cannot be reached. Private to keel::store_db.
#pragma once

#include <string>
#include <string_view>

#include "keel/store/db/database.hpp"

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

}  // namespace keel::store::detail
