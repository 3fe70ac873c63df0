// What the fleet's source files share (src/fleet/*.cpp, one file per concept of
// SharedBreakers): the bounds of the domain of what is read back, the statement that bounds a
// transaction, the SQL fragments more than one concept's statements are built of, and the
// readers of a statement's cells. Private to keel::store_fleet; each concept's statements live
// beside their row readers in that concept's file. Stateless functions: safe from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "keel/core/clock.hpp"
#include "keel/db/database.hpp"

namespace keel::store::detail {

// Bounds of the domain.
inline constexpr std::int64_t kMaxCount = std::int64_t{1} << 53;  // breaks, probes, leases, pauses
// The longest duration sent to the database, in ms (ten years): an interval that cannot
// overflow a timestamp.
inline constexpr std::int64_t kMaxMs = std::int64_t{10} * 366 * 24 * 3600 * 1000;
// The longest key shared (NOTIFY payloads are limited to 8,000 bytes).
inline constexpr std::size_t kMaxKey = 1000;

// The statement that bounds the transaction it opens: $1 the limit ("250ms").
inline constexpr std::string_view kLimits =
    "SELECT set_config('statement_timeout', $1, true), set_config('lock_timeout', $1, true)";

// now() of another transaction, a little later.
inline const std::string kSlack = "interval '1 second'";

// The parameter at `place` (ms) as an interval.
[[nodiscard]] std::string ms(const std::string& place);

// The ms from now until `at` (a finite time when later than now), 0 when past.
[[nodiscard]] std::string ms_until(const std::string& at);

// `column` when within [0, 2^53], else 0.
[[nodiscard]] std::string sane_count(const std::string& column);

// A cell the statement made an integer; 0 for anything else.
[[nodiscard]] std::int64_t integer_cell(const Rows::Cell& cell);

// A cell as text for the notices, "NULL" for NULL.
[[nodiscard]] std::string text_cell(const Rows::Cell& cell);

// Whether `key` can be shared: not empty, at most kMaxKey bytes, without a line break (the
// notifications' payload is split at line breaks).
[[nodiscard]] bool shareable(std::string_view key);

// Whole milliseconds (keel::to_ms) within [0, kMaxMs]. The options are validated in whole
// milliseconds (>= 1 ms where 0 would mean none).
[[nodiscard]] std::int64_t clamped_ms(Duration d);

// A database error caused by a value (class 22, data exception): no retry reads it otherwise.
[[nodiscard]] bool value_error(const DatabaseError& e);

}  // namespace keel::store::detail
