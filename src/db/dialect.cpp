// dialect_of: which dialect answers for a backend.
#include "keel/db/dialect.hpp"

#include "db/detail/dialects.hpp"

namespace keel::store {

const Dialect& dialect_of(Backend backend) noexcept {
  switch (backend) {
    case Backend::kPostgres:
      return detail::postgres_dialect();
    case Backend::kSqlite:
      break;
  }
  return detail::sqlite_dialect();
}

const Dialect& Connection::dialect() const noexcept { return dialect_of(backend()); }

const Dialect& ConnectionPool::dialect() const noexcept { return dialect_of(backend()); }

}  // namespace keel::store
