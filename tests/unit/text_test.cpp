// keel::storable_text: the one place a text keel stores for others is made valid UTF-8 within a
// byte limit. Hostile input as a class: each kind of ill-formed UTF-8, NUL, cuts inside each
// sequence length, limits at and around the text's size, and seeded random bytes checked
// against an independent decoder.
#include "keel/core/text.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace keel {
namespace {

using namespace std::string_literals;

const std::string kFffd = "\xEF\xBF\xBD";

// An independent reading of RFC 3629, by code point value rather than by byte ranges.
bool valid_utf8_without_nul(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const auto b = static_cast<std::uint8_t>(s[i]);
    std::size_t n = 0;
    std::uint32_t cp = 0;
    if (b < 0x80) {
      n = 1;
      cp = b;
    } else if ((b & 0xE0) == 0xC0) {
      n = 2;
      cp = b & 0x1F;
    } else if ((b & 0xF0) == 0xE0) {
      n = 3;
      cp = b & 0x0F;
    } else if ((b & 0xF8) == 0xF0) {
      n = 4;
      cp = b & 0x07;
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (std::size_t k = 1; k < n; ++k) {
      const auto c = static_cast<std::uint8_t>(s[i + k]);
      if ((c & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (c & 0x3F);
    }
    const std::uint32_t min[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF) || cp == 0) return false;
    i += n;
  }
  return true;
}

std::string marked(std::string_view text, int replaced) {
  return std::string(text) + " [" + std::to_string(replaced) +
         (replaced == 1 ? " byte that was " : " bytes that were ") + std::string(kReplacedMarker);
}

TEST(StorableText, ValidShortTextIsUnchanged) {
  for (const std::string& s :
       {""s, "ok"s, "caf\xC3\xA9"s, "\xE2\x82\xAC 5"s, "\xF0\x9F\x98\x80"s, "\xF4\x8F\xBF\xBF"s,
        "\xEF\xBF\xBD already a replacement"s, "\x7F\x01 control bytes are text"s}) {
    SCOPED_TRACE(s);
    EXPECT_TRUE(is_storable_text(s));
    EXPECT_EQ(storable_text(s, 2000), s);
    EXPECT_EQ(storable_text(s, s.size()), s);  // exactly at the limit
    EXPECT_EQ(storable_text(s, s.size(), Keep::kEnd), s);
  }
}

TEST(StorableText, EachIllFormedSubpartBecomesOneReplacementAndIsCounted) {
  struct Case {
    const char* name;
    std::string in;
    std::string text;       // the text before the marker
    int replaced;           // input bytes replaced
    std::size_t first_bad;  // where the first byte that is not storable text is
  };
  const Case cases[] = {
      {"Latin-1 byte", "ung\xFCltig", "ung" + kFffd + "ltig", 1, 3},
      {"lone continuation byte", "a\x80z", "a" + kFffd + "z", 1, 1},
      {"two continuation bytes", "a\x80\xBFz", "a" + kFffd + kFffd + "z", 2, 1},
      {"2-byte sequence cut", "a\xC3z", "a" + kFffd + "z", 1, 1},
      {"3-byte sequence cut after 1", "a\xE2z", "a" + kFffd + "z", 1, 1},
      {"3-byte sequence cut after 2", "a\xE2\x82z", "a" + kFffd + "z", 2, 1},
      {"4-byte sequence cut after 3", "a\xF0\x9F\x98z", "a" + kFffd + "z", 3, 1},
      {"sequence cut at the end", "abc\xF0\x9F\x98", "abc" + kFffd, 3, 3},
      {"overlong C0 AF ('/')", "\xC0\xAF", kFffd + kFffd, 2, 0},
      {"overlong E0 80 AF", "\xE0\x80\xAF", kFffd + kFffd + kFffd, 3, 0},
      {"overlong F0 80 80 AF", "\xF0\x80\x80\xAF", kFffd + kFffd + kFffd + kFffd, 4, 0},
      {"surrogate ED A0 80", "\xED\xA0\x80", kFffd + kFffd + kFffd, 3, 0},
      {"above U+10FFFF (F4 90 80 80)", "\xF4\x90\x80\x80", kFffd + kFffd + kFffd + kFffd, 4, 0},
      {"F5..FF lead bytes", "\xF5\xFE\xFF", kFffd + kFffd + kFffd, 3, 0},
      {"NUL byte", "a\0b"s, "a" + kFffd + "b", 1, 1},
      {"NUL bytes only", "\0\0"s, kFffd + kFffd, 2, 0},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_FALSE(is_storable_text(c.in));
    EXPECT_EQ(storable_prefix_size(c.in), c.first_bad);
    const std::string out = storable_text(c.in, 2000);
    EXPECT_EQ(out, marked(c.text, c.replaced));
    EXPECT_TRUE(valid_utf8_without_nul(out));
    EXPECT_EQ(storable_text(c.in, 2000, Keep::kEnd), out);
  }
}

TEST(StorableText, CutsOnACharacterBoundaryUnderTheLimit) {
  // A body of 199 ASCII bytes and an "é": a byte limit of 200 falls inside the "é".
  const std::string body = std::string(199, 'x') + "\xC3\xA9";
  EXPECT_EQ(storable_text(body, 200), std::string(199, 'x'));  // cut, not replaced
  EXPECT_EQ(storable_text(body, 201), body);
  // A cut inside each sequence length, from the start and from the end.
  for (const std::string& ch : {"\xC3\xA9"s, "\xE2\x82\xAC"s, "\xF0\x9F\x98\x80"s}) {
    SCOPED_TRACE(ch.size());
    const std::string s = "ab" + ch + "cd";
    for (std::size_t limit = 2; limit < 2 + ch.size(); ++limit) {
      EXPECT_EQ(storable_text(s, limit), "ab");
    }
    EXPECT_EQ(storable_text(s, 2 + ch.size()), "ab" + ch);
    const std::string t = "ab" + ch;
    for (std::size_t limit = 0; limit < ch.size(); ++limit) {
      EXPECT_EQ(storable_text(t, limit, Keep::kEnd), "");
    }
    EXPECT_EQ(storable_text(t, ch.size(), Keep::kEnd), ch);
    EXPECT_EQ(storable_text(t, ch.size() + 1, Keep::kEnd), "b" + ch);
  }
  EXPECT_EQ(storable_text("", 0), "");
  EXPECT_EQ(storable_text("abc", 0), "");
  EXPECT_EQ(storable_text("abc", 0, Keep::kEnd), "");
}

TEST(StorableText, TheMarkerFitsUnderTheLimitAndCountsOnlyWhatIsKept) {
  const std::string in = std::string(100, 'a') + "\xFF" + std::string(100, 'b') + "\xFF";
  const std::string out = storable_text(in, 150);
  EXPECT_LE(out.size(), 150u);
  EXPECT_TRUE(out.starts_with(std::string(100, 'a') + kFffd + "bbb"));
  EXPECT_TRUE(out.ends_with(" [1 byte that was " + std::string(kReplacedMarker))) << out;
  const std::string tail = storable_text(in, 150, Keep::kEnd);
  EXPECT_LE(tail.size(), 150u);
  // Both replacements fit at the end (3 + 100 + 3 bytes and the marker).
  EXPECT_EQ(tail, marked(kFffd + std::string(100, 'b') + kFffd, 2));
  // Exactly at the limit: the marked text fits with nothing cut.
  const std::string whole = marked("ung" + kFffd + "ltig", 1);
  EXPECT_EQ(storable_text("ung\xFCltig", whole.size()), whole);
  EXPECT_EQ(storable_text("ung\xFCltig", whole.size() - 1), marked("ung" + kFffd + "lti", 1));
}

TEST(StorableText, ALimitTooSmallForTheMarkerKeepsTextWithoutReplacedBytes) {
  EXPECT_EQ(storable_text("ab\xFF"
                          "cd",
                          10),
            "ab");
  EXPECT_EQ(storable_text("ab\xFF"
                          "cd",
                          10, Keep::kEnd),
            "cd");
  EXPECT_EQ(storable_text("\xFF", 5), "");
}

TEST(StorableText, KeepEndSkipsTheCutCharacterAndKeepsTheLastLine) {
  // 600 bytes of "ü" (2 bytes each): the last 500 bytes start on a character boundary.
  std::string s;
  for (int i = 0; i < 300; ++i) s += "\xC3\xBC";
  s += "!";  // 601 bytes: the last 500 start inside an "ü"
  const std::string tail = storable_text(s, 500, Keep::kEnd);
  EXPECT_TRUE(is_storable_text(tail));
  EXPECT_EQ(tail.size(), 499u);
  EXPECT_TRUE(tail.ends_with("\xC3\xBC!"));
  // A Latin-1 stderr tail keeps its end and says what it replaced.
  const std::string latin1 = std::string(1000, 'x') + "Fehler: ung\xFCltig";
  const std::string t = storable_text(latin1, 500, Keep::kEnd);
  EXPECT_LE(t.size(), 500u);
  EXPECT_NE(t.find("Fehler: ung" + kFffd + "ltig [1 byte"), std::string::npos) << t;
}

TEST(StorableText, AnyBytesGiveValidTextWithinTheLimitSeeded) {
  std::mt19937_64 rng(20240611);
  const std::string pieces[] = {
      "a",    "\0"s,      "\xC3\xA9",     "\xE2\x82\xAC", "\xF0\x9F\x98\x80", "\x80",
      "\xC3", "\xE2\x82", "\xF0\x9F\x98", "\xED\xA0\x80", "\xC0\xAF",         "\xF4\x90",
      "\xFF", "\n"};
  for (int round = 0; round < 20000; ++round) {
    std::string in;
    const int n = static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) in += pieces[rng() % std::size(pieces)];
    const std::size_t limit = rng() % 120;
    for (Keep keep : {Keep::kStart, Keep::kEnd}) {
      const std::string out = storable_text(in, limit, keep);
      ASSERT_TRUE(valid_utf8_without_nul(out)) << round;
      ASSERT_LE(out.size(), limit) << round;
      ASSERT_EQ(is_storable_text(out), true);
      if (valid_utf8_without_nul(in) && in.size() <= limit) {
        ASSERT_EQ(out, in) << round;
      }
      ASSERT_EQ(is_storable_text(in), valid_utf8_without_nul(in)) << round;
    }
  }
}

}  // namespace
}  // namespace keel

TEST(CheckName, TheOneRuleForStoredNamesNamesItsField) {
  EXPECT_TRUE(keel::check_name("queue name", "payments.v2-retry_1"));
  EXPECT_TRUE(keel::check_name("consumer", std::string(keel::kMaxNameBytes, 'a')));
  const auto empty = keel::check_name("consumer", "");
  ASSERT_FALSE(empty);
  EXPECT_EQ(empty.error().field, "consumer");
  const auto long_name = keel::check_name("queue name", std::string(keel::kMaxNameBytes + 1, 'a'));
  ASSERT_FALSE(long_name);
  EXPECT_NE(long_name.error().problem.find("at most 64"), std::string::npos);
  for (const std::string& bad :
       std::vector<std::string>{"a b", "a/b", "caf\xC3\xA9", std::string("a\0b", 3), "a\n"}) {
    const auto r = keel::check_name("queue name", bad);
    ASSERT_FALSE(r) << bad;
    EXPECT_EQ(r.error().field, "queue name");
  }
}
