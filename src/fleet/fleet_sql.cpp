// The fleet's shared SQL fragments and cell readers (detail/fleet_sql.hpp).
#include "fleet/detail/fleet_sql.hpp"

#include <algorithm>
#include <charconv>

#include "keel/core/duration.hpp"

namespace keel::store::detail {

std::string ms(const std::string& place) { return "(" + place + " * interval '1 millisecond')"; }

std::string ms_until(const std::string& at) {
  return "CASE WHEN " + at + " > now() THEN ceil(extract(epoch FROM " + at +
         " - now()) * 1000)::bigint ELSE 0 END";
}

std::string sane_count(const std::string& column) {
  return "CASE WHEN " + column + " BETWEEN 0 AND " + std::to_string(kMaxCount) + " THEN " + column +
         " ELSE 0 END";
}

std::int64_t integer_cell(const Rows::Cell& cell) {
  std::int64_t value = 0;
  if (cell) (void)std::from_chars(cell->data(), cell->data() + cell->size(), value);
  return value;
}

std::string text_cell(const Rows::Cell& cell) { return cell ? *cell : "NULL"; }

bool shareable(std::string_view key) {
  return !key.empty() && key.size() <= kMaxKey && key.find('\n') == std::string_view::npos;
}

std::int64_t clamped_ms(Duration d) { return std::clamp<std::int64_t>(keel::to_ms(d), 0, kMaxMs); }

bool value_error(const DatabaseError& e) { return e.details().sqlstate.starts_with("22"); }

}  // namespace keel::store::detail
