// RowCursor (keel/db/row_cursor.hpp): one row of a result read column after column.
#include "keel/db/row_cursor.hpp"

#include <charconv>
#include <stdexcept>
#include <system_error>

namespace keel::store {

std::string RowCursor::where(std::size_t column) const {
  std::string out = "column " + std::to_string(column);
  if (column < rows_->column_names().size() && !rows_->column_names()[column].empty()) {
    out += " (" + rows_->column_names()[column] + ")";
  }
  return out + " of row " + std::to_string(row_);
}

const Rows::Cell& RowCursor::cell() {
  const std::size_t column = column_++;
  try {
    return rows_->cell(row_, column);
  } catch (const std::out_of_range&) {
    throw std::out_of_range("read of column " + std::to_string(column) + " of row " +
                            std::to_string(row_) + ": the result has " +
                            std::to_string(rows_->size()) + " row(s) of " +
                            std::to_string(rows_->columns()) + " column(s)");
  }
}

const std::string& RowCursor::text() {
  const Rows::Cell& c = cell();
  if (!c) throw DatabaseError(where(column_ - 1) + " is NULL where a value was expected", {});
  return *c;
}

std::string RowCursor::text_or_empty() {
  const Rows::Cell& c = cell();
  return c ? *c : std::string();
}

std::int64_t RowCursor::parse_integer(const std::string& text, std::size_t column) const {
  std::int64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size()) {
    throw DatabaseError(where(column) + " holds '" + text + "' where an integer was expected", {});
  }
  return v;
}

std::int64_t RowCursor::integer() {
  const std::string& t = text();
  return parse_integer(t, column_ - 1);
}

std::optional<std::int64_t> RowCursor::optional_integer() {
  const Rows::Cell& c = cell();
  if (!c) return std::nullopt;
  return parse_integer(*c, column_ - 1);
}

}  // namespace keel::store
