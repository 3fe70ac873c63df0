// The two Connection implementations, opened by open_database. Private to keel::store_db.
#pragma once

#include <memory>
#include <string>

#include "keel/db/database.hpp"

namespace keel::store::detail {

/// Throws std::logic_error naming `what` when `connection` has a transaction open: keel never
/// commits or ends a transaction it did not open. Sends nothing.
void refuse_nested_transaction(const Connection& connection, std::string_view what);

/// Throws DatabaseError when the file cannot be opened or configured.
[[nodiscard]] std::unique_ptr<Connection> open_sqlite(const std::string& path,
                                                      const ConnectOptions& options);
/// Throws DatabaseError (SQLSTATE 08001) when the server cannot be reached.
/// `transaction_pooler`: the URI reaches the server through a transaction pooler (no named
/// statements, no session state).
[[nodiscard]] std::unique_ptr<Connection> open_postgres(const std::string& uri,
                                                        const ConnectOptions& options,
                                                        bool transaction_pooler);

}  // namespace keel::store::detail
