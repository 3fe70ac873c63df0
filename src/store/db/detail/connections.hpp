// The two Connection implementations, opened by open_database. Private to keel::store_db.
#pragma once

#include <memory>
#include <string>

#include "keel/store/db/database.hpp"

namespace keel::store::detail {

/// Throws DatabaseError when the file cannot be opened or configured.
[[nodiscard]] std::unique_ptr<Connection> open_sqlite(const std::string& path,
                                                      const ConnectOptions& options);
/// Throws DatabaseError (SQLSTATE 08001) when the server cannot be reached.
[[nodiscard]] std::unique_ptr<Connection> open_postgres(const std::string& uri,
                                                        const ConnectOptions& options);

}  // namespace keel::store::detail
