// keel::check_idempotency_key: the one key rule and its canonical form, case by case.
#include "keel/core/idempotency_key.hpp"

#include <gtest/gtest.h>

#include "key_rule_cases.hpp"

namespace keel {
namespace {

TEST(IdempotencyKeyRule, EachCaseHasOneVerdictAndOneCanonicalForm) {
  for (const test::KeyRuleCase& c : test::key_rule_cases()) {
    SCOPED_TRACE(c.name);
    const IdempotencyKeyCheck k = check_idempotency_key(c.input);
    EXPECT_EQ(k.ok(), c.canonical.has_value()) << k.error.message();
    EXPECT_EQ(k.problem, c.problem) << to_string(k.problem);
    if (c.canonical) {
      EXPECT_EQ(k.key, *c.canonical);
      // The canonical form is its own canonical form.
      EXPECT_EQ(check_idempotency_key(k.key).key, k.key);
      EXPECT_EQ(k.to_expected().value(), *c.canonical);
    } else {
      EXPECT_TRUE(k.key.empty());
      EXPECT_EQ(k.error.field, "Idempotency-Key");
      EXPECT_FALSE(k.error.problem.empty());
      EXPECT_FALSE(k.to_expected().has_value());
    }
  }
}

TEST(IdempotencyKeyRule, MessagesNameTheProblemAndQuoteTheValue) {
  EXPECT_EQ(check_idempotency_key("a\tb").error.message(),
            "Idempotency-Key contains a control character (byte 0x09) (got 'a\\x09b')");
  EXPECT_EQ(check_idempotency_key(std::string(256, 'k')).error.problem,
            "is 256 bytes long; the limit is 255 bytes");
  EXPECT_NE(check_idempotency_key("caf\xc3\xa9").error.problem.find("byte 0xc3"),
            std::string::npos);
  EXPECT_NE(check_idempotency_key("a,b").error.problem.find("comma"), std::string::npos);
  EXPECT_NE(check_idempotency_key("a%41").error.problem.find("'%'"), std::string::npos);
  EXPECT_EQ(check_idempotency_key("\"open").error.problem, "is a quoted string that is not closed");
  EXPECT_EQ(check_idempotency_key("\"a\"b").error.problem, "has text after its closing quote");
  EXPECT_EQ(check_idempotency_key("").error.message(), "Idempotency-Key is empty (got '')");
  EXPECT_EQ(check_idempotency_key(" k").error.in("--key").message().substr(0, 22),
            "--key contains a space");
}

TEST(IdempotencyKeyRule, ProblemsHaveNames) {
  EXPECT_EQ(to_string(IdempotencyKeyProblem::kNone), "none");
  EXPECT_EQ(to_string(IdempotencyKeyProblem::kForbidden), "forbidden");
  EXPECT_EQ(to_string(IdempotencyKeyProblem::kMalformedQuoted), "malformed_quoted");
}

}  // namespace
}  // namespace keel

namespace {

TEST(UuidV4, FormatsTheBytesWithTheVersionAndVariantBitsSet) {
  keel::UuidBytes b{};
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<unsigned char>(0x10 * i + i);
  EXPECT_EQ(keel::uuid_v4(b), "00112233-4455-4677-8899-aabbccddeeff");
  keel::UuidBytes ones;
  ones.fill(0xff);
  EXPECT_EQ(keel::uuid_v4(ones), "ffffffff-ffff-4fff-bfff-ffffffffffff");
  EXPECT_EQ(keel::uuid_v4(keel::UuidBytes{}), "00000000-0000-4000-8000-000000000000");
}

TEST(UuidV4, IsAlwaysAKeyInItsCanonicalForm) {
  keel::UuidBytes b{};
  for (int n = 0; n < 256; ++n) {
    b.fill(static_cast<unsigned char>(n));
    const std::string key = keel::uuid_v4(b);
    ASSERT_EQ(key.size(), 36u);
    const keel::IdempotencyKeyCheck k = keel::check_idempotency_key(key);
    EXPECT_TRUE(k.ok()) << key;
    EXPECT_EQ(k.key, key);
  }
}

}  // namespace
