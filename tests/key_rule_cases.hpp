// The idempotency key rule's cases (keel/core/idempotency_key.hpp), one table for every test that
// checks a place applying the rule: the core function (tests/unit/idempotency_key_test.cpp) and
// the queue, the clients and the receiver side by side
// (tests/integration/idempotency/key_rule_test.cpp).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "keel/core/idempotency_key.hpp"

namespace keel::test {

struct KeyRuleCase {
  const char* name;
  std::string input;
  /// The canonical key when valid; nullopt when refused.
  std::optional<std::string> canonical;
  IdempotencyKeyProblem problem = IdempotencyKeyProblem::kNone;
};

inline std::vector<KeyRuleCase> key_rule_cases() {
  using P = IdempotencyKeyProblem;
  const std::string k255(255, 'k');
  const std::string k256(256, 'k');
  return {
      {"plain token", "order-77-charge-1", "order-77-charge-1"},
      {"uuid", "8e03978e-40d5-43e8-bc93-6894a57f9324", "8e03978e-40d5-43e8-bc93-6894a57f9324"},
      {"visible ascii", "a!#$&'()*+-./:;<=>?@[]^_`{|}~Z", "a!#$&'()*+-./:;<=>?@[]^_`{|}~Z"},
      {"leading space", " abc", std::nullopt, P::kSpace},
      {"trailing space", "abc ", std::nullopt, P::kSpace},
      {"inner space", "a b", std::nullopt, P::kSpace},
      {"tab", "a\tb", std::nullopt, P::kControlCharacter},
      {"leading tab", "\tabc", std::nullopt, P::kControlCharacter},
      {"newline", "a\nb", std::nullopt, P::kControlCharacter},
      {"delete", "a\x7f", std::nullopt, P::kControlCharacter},
      {"utf-8", "caf\xc3\xa9", std::nullopt, P::kNonAscii},
      {"invalid utf-8", "abc\xff", std::nullopt, P::kNonAscii},
      {"lone utf-8 lead byte", "\xc3", std::nullopt, P::kNonAscii},
      {"comma", "a,b", std::nullopt, P::kForbidden},
      {"percent", "a%41", std::nullopt, P::kForbidden},
      {"quote inside", "a\"b", std::nullopt, P::kForbidden},
      {"quoted", "\"abc\"", "abc"},
      {"quoted uuid", "\"4f1c-9a\"", "4f1c-9a"},
      {"quoted not closed", "\"open", std::nullopt, P::kMalformedQuoted},
      {"text after closing quote", "\"a\"b", std::nullopt, P::kMalformedQuoted},
      {"escaped quote", "\"a\\\"b\"", std::nullopt, P::kForbidden},
      {"escaped backslash", "\"a\\\\b\"", "a\\b"},
      {"bare backslash", "a\\b", "a\\b"},
      {"invalid escape", "\"a\\nb\"", std::nullopt, P::kMalformedQuoted},
      {"quoted space", "\" abc\"", std::nullopt, P::kSpace},
      {"quoted comma", "\"a,b\"", std::nullopt, P::kForbidden},
      {"quoted tab", "\"a\tb\"", std::nullopt, P::kControlCharacter},
      {"quoted utf-8", "\"caf\xc3\xa9\"", std::nullopt, P::kNonAscii},
      {"255 bytes", k255, k255},
      {"256 bytes", k256, std::nullopt, P::kTooLong},
      {"255 bytes quoted", "\"" + k255 + "\"", k255},
      {"256 bytes quoted", "\"" + k256 + "\"", std::nullopt, P::kTooLong},
      {"empty quoted", "\"\"", std::nullopt, P::kEmpty},
      {"empty", "", std::nullopt, P::kEmpty},
  };
}

}  // namespace keel::test
