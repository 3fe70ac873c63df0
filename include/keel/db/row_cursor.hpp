// RowCursor: reads one row of a statement's result column after column, so that the order of a
// statement's columns is written once: by the order of the reads, in the one function beside
// the statement's column list that turns a row into a struct of named fields (read_job beside
// kJobColumns, ...). No caller indexes into a column list defined elsewhere.
//
// Applications read their own statements' rows with it too: a column read past the result's
// last, a NULL where a value is required, or text where an integer is, is an error naming the
// column, where an index into Rows would read the wrong cell or throw without saying which.
//
// Thread-safety: not thread-safe; one cursor per row read. It refers to the Rows it reads, which
// must outlive it.
//
// Example:
//   // The columns read_attempt reads, in its order.
//   constexpr std::string_view kAttemptColumns = "round, attempt, error";
//   Attempt read_attempt(const Rows& rows, std::size_t row) {
//     RowCursor c(rows, row);
//     return {.round = c.integer(), .attempt = c.integer(), .error = c.text_or_empty()};
//   }
//   // Every row of a statement (read_rows).
//   std::vector<Attempt> attempts = read_rows(rows, [](RowCursor& c) {
//     return Attempt{.round = c.integer(), .attempt = c.integer(), .error = c.text_or_empty()};
//   });
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "keel/db/database.hpp"

namespace keel::store {

class RowCursor {
 public:
  /// Reads row `row` of `rows` from its first column on. Requires: `rows` outlives the cursor.
  RowCursor(const Rows& rows, std::size_t row) noexcept : rows_(&rows), row_(row) {}

  /// The next cell, nullopt for NULL. Throws std::out_of_range naming the row and the column
  /// when either is past the result's last (a read the statement has no column for).
  [[nodiscard]] const Rows::Cell& cell();
  /// The next cell as text; throws DatabaseError naming the column when it is NULL.
  [[nodiscard]] const std::string& text();
  /// The next cell as text, the empty string for NULL.
  [[nodiscard]] std::string text_or_empty();
  /// The next cell as a 64-bit integer; throws DatabaseError naming the column when it is NULL or
  /// not an integer in decimal.
  [[nodiscard]] std::int64_t integer();
  /// The next cell as a 64-bit integer, nullopt for NULL; throws DatabaseError naming the column
  /// when it is not an integer in decimal.
  [[nodiscard]] std::optional<std::int64_t> optional_integer();
  /// Passes over the next `n` columns without reading them.
  void skip(std::size_t n = 1) noexcept { column_ += n; }

 private:
  // "column 3 (attempts) of row 0", for the errors.
  [[nodiscard]] std::string where(std::size_t column) const;
  [[nodiscard]] std::int64_t parse_integer(const std::string& text, std::size_t column) const;

  const Rows* rows_;
  std::size_t row_;
  std::size_t column_ = 0;
};

/// Each row of `rows` as `read(cursor)` makes it, the cursor at the row's first column, in the
/// rows' order: the loop that turns a statement's rows into structs, written once.
template <class Read>
[[nodiscard]] auto read_rows(const Rows& rows, Read read) {
  std::vector<std::invoke_result_t<Read&, RowCursor&>> out;
  out.reserve(rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    RowCursor c(rows, i);
    out.push_back(read(c));
  }
  return out;
}

}  // namespace keel::store
