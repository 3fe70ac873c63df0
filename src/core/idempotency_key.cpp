// The idempotency key rule and its canonical form (see include/keel/core/idempotency_key.hpp).
#include "keel/core/idempotency_key.hpp"

#include <string>

namespace keel {
namespace {

IdempotencyKeyCheck refuse(std::string_view value, IdempotencyKeyProblem problem,
                           std::string text) {
  IdempotencyKeyCheck out;
  out.problem = problem;
  out.error =
      Error{.field = "Idempotency-Key", .problem = std::move(text), .got = quote_value(value)};
  return out;
}

// The key's bytes, whether it came bare or out of a quoted string: nothing when valid.
IdempotencyKeyCheck check_bytes(std::string_view value, std::string_view key) {
  using P = IdempotencyKeyProblem;
  if (key.empty()) return refuse(value, P::kEmpty, "is empty");
  for (const char c : key) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      return refuse(value, P::kControlCharacter,
                    "contains a control character (" + byte_text(u) + ")");
    }
    if (u == ' ') {
      return refuse(value, P::kSpace,
                    "contains a space (a key is visible ASCII, 0x21-0x7e, nothing around it)");
    }
    if (u > 0x7f) {
      return refuse(
          value, P::kNonAscii,
          "contains a non-ASCII byte (" + byte_text(u) + "; a key is visible ASCII, 0x21-0x7e)");
    }
    if (c == '"') {
      return refuse(value, P::kForbidden,
                    "contains a double quote (quote the whole key, \"KEY\", or not at all)");
    }
    if (c == ',') {
      return refuse(value, P::kForbidden,
                    "contains a comma (two header fields joined read as one value 'a, b')");
    }
    if (c == '%') {
      return refuse(value, P::kForbidden,
                    "contains '%' (HTTP servers on cpp-httplib decode %XX in header values)");
    }
  }
  if (key.size() > kMaxIdempotencyKeyBytes) {
    return refuse(value, P::kTooLong,
                  "is " + std::to_string(key.size()) + " bytes long; the limit is " +
                      std::to_string(kMaxIdempotencyKeyBytes) + " bytes");
  }
  return {};
}

}  // namespace

std::string_view to_string(IdempotencyKeyProblem problem) noexcept {
  switch (problem) {
    case IdempotencyKeyProblem::kNone:
      return "none";
    case IdempotencyKeyProblem::kEmpty:
      return "empty";
    case IdempotencyKeyProblem::kTooLong:
      return "too_long";
    case IdempotencyKeyProblem::kControlCharacter:
      return "control_character";
    case IdempotencyKeyProblem::kSpace:
      return "space";
    case IdempotencyKeyProblem::kNonAscii:
      return "non_ascii";
    case IdempotencyKeyProblem::kForbidden:
      return "forbidden";
    case IdempotencyKeyProblem::kMalformedQuoted:
      return "malformed_quoted";
  }
  return "unknown";
}

IdempotencyKeyCheck check_idempotency_key(std::string_view value) {
  using P = IdempotencyKeyProblem;
  if (value.empty() || value.front() != '"') {
    IdempotencyKeyCheck out = check_bytes(value, value);
    if (out.ok()) out.key.assign(value);
    return out;
  }
  // An RFC 8941 sf-string (section 3.3.3): DQUOTE *( unescaped / "\" ( DQUOTE / "\" ) ) DQUOTE,
  // and nothing after it.
  std::string key;
  for (std::size_t i = 1; i < value.size(); ++i) {
    const char c = value[i];
    if (c == '\\') {
      if (i + 1 >= value.size() || (value[i + 1] != '"' && value[i + 1] != '\\')) {
        return refuse(value, P::kMalformedQuoted,
                      "has an invalid escape in its quoted string (only \\\" and \\\\)");
      }
      key += value[++i];
    } else if (c == '"') {
      if (i + 1 != value.size()) {
        return refuse(value, P::kMalformedQuoted, "has text after its closing quote");
      }
      IdempotencyKeyCheck out = check_bytes(value, key);
      if (out.ok()) out.key = std::move(key);
      return out;
    } else {
      key += c;
    }
  }
  return refuse(value, P::kMalformedQuoted, "is a quoted string that is not closed");
}

std::string uuid_v4(const UuidBytes& random_bytes) {
  UuidBytes b = random_bytes;
  b[6] = static_cast<unsigned char>((b[6] & 0x0f) | 0x40);  // version 4
  b[8] = static_cast<unsigned char>((b[8] & 0x3f) | 0x80);  // RFC 4122 variant
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(36);
  for (std::size_t i = 0; i < b.size(); ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out.push_back('-');
    out.push_back(kHex[b[i] >> 4]);
    out.push_back(kHex[b[i] & 0x0f]);
  }
  return out;
}

}  // namespace keel
