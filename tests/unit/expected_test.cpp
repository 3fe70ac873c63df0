// keel::Expected and keel::Error: the one error style for parsing and validation.
#include "keel/core/expected.hpp"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "keel/core/duration.hpp"
#include "keel/core/retry.hpp"

using keel::Error;
using keel::Expected;

TEST(Error, OneMessageFormatNamingFieldProblemAndValue) {
  const Error e{.field = "duration", .problem = "has no unit", .got = "'5'"};
  EXPECT_EQ(e.message(), "duration has no unit (got '5')");
  EXPECT_EQ(e.in("--deadline").message(), "--deadline has no unit (got '5')");
  EXPECT_EQ(e.in("--deadline", "keel call").message(),
            "keel call: --deadline has no unit (got '5')");
  EXPECT_EQ((Error{.field = "URL", .problem = "is empty"}).message(), "URL is empty");
}

TEST(Error, ConfigurationErrorsUseTheSameFormat) {
  try {
    (void)keel::RetryPolicy(keel::RetryOptions{.max_attempts = 0});
    FAIL() << "max_attempts 0 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()).rfind("keel::RetryPolicy: max_attempts must be", 0), 0u)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("(got 0)"), std::string::npos) << e.what();
  }
}

TEST(QuoteValue, EscapesControlBytesAndCapsTheShownForm) {
  EXPECT_EQ(keel::quote_value("abc"), "'abc'");
  EXPECT_EQ(keel::quote_value(std::string("a\nb\0c", 5)), "'a\\x0ab\\x00c'");
  const std::string long_text(1000, 'x');
  EXPECT_LE(keel::quote_value(long_text, 64).size(), 64u + 8u);
  EXPECT_NE(keel::quote_value(long_text, 64).find("..."), std::string::npos);
  // Escapes count against the cap: a kilobyte of NULs is not quoted as four kilobytes.
  EXPECT_LE(keel::quote_value(std::string(1000, '\0'), 64).size(), 64u + 8u);
}

TEST(Expected, HoldsAValueOrAnError) {
  Expected<int> ok = 5;
  ASSERT_TRUE(ok);
  EXPECT_EQ(*ok, 5);
  EXPECT_EQ(ok, 5);
  EXPECT_EQ(ok.value_or(7), 5);
  Expected<int> bad = Error{.field = "n", .problem = "must be positive", .got = "-1"};
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.value_or(7), 7);
  EXPECT_FALSE(bad.to_optional().has_value());
  EXPECT_EQ(bad.error().message(), "n must be positive (got -1)");
  // Asking for a value that is not there is a programming error, reported with the message.
  try {
    (void)bad.value();
    FAIL() << "value() of an error returned";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("n must be positive"), std::string::npos) << e.what();
  }
  Expected<void> fine;
  EXPECT_TRUE(fine);
  Expected<void> refused = Error{.field = "key", .problem = "is empty"};
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().field, "key");
}

TEST(Expected, ParsersReportTheirField) {
  const auto d = keel::parse_duration("5");
  ASSERT_FALSE(d);
  EXPECT_EQ(d.error().field, "duration");
  EXPECT_EQ(d.error().got, "'5'");
  EXPECT_NE(d.error().problem.find("no unit"), std::string::npos);
}
