// RowCursor, the store's one way of reading a result's row: each read takes the next
// column, and a read the result has no cell for, a NULL where a value is required or text where
// an integer is required is an error naming the column, never a read out of bounds.
#include "keel/db/row_cursor.hpp"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "keel/db/database.hpp"
#include "support/test_support.hpp"

namespace keel::store {
namespace {

Rows two_rows() {
  Rows rows;
  rows.set_columns({"id", "name", "note"});
  rows.add_row({"7", "seven", std::nullopt});
  rows.add_row({"8", "x8", "n"});
  return rows;
}

// The message of what `read` throws, which must be of type E.
template <typename E, typename Read>
std::string thrown(Read read) {
  try {
    read();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "nothing thrown";
  return {};
}

TEST(RowCursor, ReadsTheColumnsInOrder) {
  const Rows rows = two_rows();
  RowCursor c(rows, 1);
  EXPECT_EQ(c.integer(), 8);
  EXPECT_EQ(c.text(), "x8");
  EXPECT_EQ(c.text_or_empty(), "n");

  RowCursor nulls(rows, 0);
  nulls.skip(2);
  EXPECT_FALSE(nulls.cell().has_value());
  RowCursor empty(rows, 0);
  empty.skip(2);
  EXPECT_EQ(empty.text_or_empty(), "");
  RowCursor none(rows, 0);
  none.skip(2);
  EXPECT_EQ(none.optional_integer(), std::nullopt);

  RowCursor skipped(rows, 0);
  skipped.skip();
  EXPECT_EQ(skipped.text(), "seven");
}

TEST(RowCursor, AReadPastTheLastColumnOrRowIsAnErrorNamingIt) {
  const Rows rows = two_rows();
  RowCursor c(rows, 0);
  c.skip(3);
  EXPECT_EQ(thrown<std::out_of_range>([&] { (void)c.cell(); }),
            "read of column 3 of row 0: the result has 2 row(s) of 3 column(s)");
  RowCursor past(rows, 2);
  EXPECT_EQ(thrown<std::out_of_range>([&] { (void)past.integer(); }),
            "read of column 0 of row 2: the result has 2 row(s) of 3 column(s)");
  const Rows nothing;
  RowCursor in_nothing(nothing, 0);
  EXPECT_THROW((void)in_nothing.text_or_empty(), std::out_of_range);
}

TEST(RowCursor, ANullOrNonIntegerWhereAValueIsRequiredIsAnErrorNamingTheColumn) {
  const Rows rows = two_rows();
  RowCursor text(rows, 0);
  text.skip(2);
  EXPECT_EQ(thrown<DatabaseError>([&] { (void)text.text(); }),
            "column 2 (note) of row 0 is NULL where a value was expected");
  RowCursor integer(rows, 0);
  integer.skip(2);
  EXPECT_EQ(thrown<DatabaseError>([&] { (void)integer.integer(); }),
            "column 2 (note) of row 0 is NULL where a value was expected");
  RowCursor word(rows, 1);
  word.skip(1);
  EXPECT_EQ(thrown<DatabaseError>([&] { (void)word.integer(); }),
            "column 1 (name) of row 1 holds 'x8' where an integer was expected");
  RowCursor optional(rows, 1);
  optional.skip(1);
  EXPECT_THROW((void)optional.optional_integer(), DatabaseError);
  RowCursor trailing(rows, 1);
  trailing.skip(2);
  EXPECT_THROW((void)trailing.integer(), DatabaseError);
}

class RowCursorOn : public test::BackendTest {};

// Both backends' results read the same: integers and text as text cells, NULL as none, and the
// column names the statement gave.
TEST_P(RowCursorOn, AStatementsResult) {
  auto conn = open_database(url());
  const Rows rows = conn->query(
      "SELECT CAST($1 AS BIGINT) AS big, CAST($2 AS TEXT) AS word, CAST(NULL AS BIGINT) AS none",
      {Value(std::int64_t{1} << 40), "it's"});
  RowCursor c(rows, 0);
  EXPECT_EQ(c.integer(), std::int64_t{1} << 40);
  EXPECT_EQ(c.text(), "it's");
  EXPECT_EQ(c.optional_integer(), std::nullopt);
  EXPECT_THROW((void)c.cell(), std::out_of_range);
  RowCursor null(rows, 0);
  null.skip(2);
  EXPECT_EQ(thrown<DatabaseError>([&] { (void)null.integer(); }),
            "column 2 (none) of row 0 is NULL where a value was expected");
}

INSTANTIATE_TEST_SUITE_P(Backends, RowCursorOn,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

}  // namespace
}  // namespace keel::store
