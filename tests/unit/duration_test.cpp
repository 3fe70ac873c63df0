#include "keel/core/duration.hpp"

#include <gtest/gtest.h>

using namespace std::chrono_literals;
using keel::parse_duration;

TEST(ParseDuration, AcceptsNumberAndUnit) {
  EXPECT_EQ(parse_duration("250ms"), 250ms);
  EXPECT_EQ(parse_duration("1.5s"), 1500ms);
  EXPECT_EQ(parse_duration("2m"), 2min);
  EXPECT_EQ(parse_duration("1h"), 1h);
  EXPECT_EQ(parse_duration("10us"), 10us);
  EXPECT_EQ(parse_duration("7ns"), 7ns);
  EXPECT_EQ(parse_duration("0s"), 0s);
  EXPECT_EQ(parse_duration(".5s"), 500ms);
  EXPECT_EQ(parse_duration("0.001ms"), 1us);
  EXPECT_EQ(parse_duration("87600h"), std::chrono::hours(87600));  // ten years
}

TEST(ParseDuration, RejectsWithAMessage) {
  struct Case {
    const char* text;
    const char* says;
  };
  for (const Case& c :
       {Case{"", "empty"}, Case{"5", "no unit"}, Case{"fast", "does not start"},
        Case{"-5s", "does not start"}, Case{"1e3s", "unknown unit"}, Case{"5 s", "unknown unit"},
        Case{"5sec", "unknown unit"}, Case{"1.s", "no digits after"},
        Case{"0.1ns", "shorter than one"}, Case{"99999999999999999999999h", "too large"},
        Case{"3000000h", "too large"}}) {
    const auto d = parse_duration(c.text);
    ASSERT_FALSE(d) << c.text;
    const std::string error = d.error().message();
    EXPECT_EQ(d.error().field, "duration");
    EXPECT_NE(error.find(c.says), std::string::npos) << c.text << " -> " << error;
  }
}

TEST(FormatDuration, ShortHumanForms) {
  EXPECT_EQ(keel::format_duration(0s), "0s");
  EXPECT_EQ(keel::format_duration(250ms), "250ms");
  EXPECT_EQ(keel::format_duration(1500ms), "1.5s");
  EXPECT_EQ(keel::format_duration(2min), "2m");
  EXPECT_EQ(keel::format_duration(1h), "1h");
  EXPECT_EQ(keel::format_duration(-5ms), "-5ms");
  EXPECT_EQ(keel::format_duration(keel::kInfinite), "inf");
  EXPECT_EQ(keel::format_duration(12ns), "12ns");
}

TEST(FormatDuration, RoundTripsThroughParse) {
  for (keel::Duration d : {keel::Duration(250ms), keel::Duration(1500ms), keel::Duration(2min),
                           keel::Duration(7ns), keel::Duration(3h)}) {
    EXPECT_EQ(parse_duration(keel::format_duration(d)), d);
  }
}

TEST(ToMs, TruncatesTowardZeroSoThatADueTimeIsNeverLate) {
  using namespace std::chrono_literals;
  EXPECT_EQ(keel::to_ms(0ns), 0);
  EXPECT_EQ(keel::to_ms(999us), 0);
  EXPECT_EQ(keel::to_ms(1ms), 1);
  EXPECT_EQ(keel::to_ms(1999us), 1);
  EXPECT_EQ(keel::to_ms(90s), 90'000);
  EXPECT_EQ(keel::to_ms(-1500us), -1);
}
