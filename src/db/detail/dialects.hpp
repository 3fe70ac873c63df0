// The backends' dialects, one file each (sqlite_dialect.cpp, postgres_dialect.cpp), which
// dialect_of (dialect.cpp) hands out. Private to keel::store_db.
#pragma once

#include "keel/db/dialect.hpp"

namespace keel::store::detail {

[[nodiscard]] const Dialect& sqlite_dialect() noexcept;
[[nodiscard]] const Dialect& postgres_dialect() noexcept;

}  // namespace keel::store::detail
