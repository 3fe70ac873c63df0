// The one rule for an idempotency key: which values are keys, and the canonical form under which
// a key is stored, sent and compared. keel's HTTP clients (before sending), the job queue (before
// storing a job) and the receiver's parser (keel::store::parse_idempotency_key) all decide with
// this function, so a key one of them accepts is accepted by all of them and read by all of them as
// the same key.
//
// The rule. A key is 1 to kMaxIdempotencyKeyBytes (255) bytes of visible ASCII (0x21-0x7e)
// other than:
//   - '"'  a double quote: it would make the key read as a quoted string;
//   - ','  a comma: a receiver may join two header fields into "a, b", so that one value would
//          hold two keys;
//   - '%'  a percent sign: cpp-httplib (0.11, Debian 12's) decodes
//          %XX in header values, so "a%41" would reach the receiver as "aA".
// So no space, tab or other control character and no non-ASCII byte (no UTF-8): one key has one
// byte form on every wire and in every database. The header value may carry the key bare
// (`Idempotency-Key: order-7`) or as an RFC 8941 sf-string (`Idempotency-Key: "order-7"`, as
// the IETF Idempotency-Key draft writes it), with the escapes \" and \\; the key is then the
// string's content, which must follow the same rule (so an escaped quote never yields a valid
// key; an escaped backslash is a backslash). The canonical form is the bare key: "order-7" and
// order-7 are one key, stored once by the queue and sent bare by the clients. The 255-byte limit
// applies to the canonical form. Nothing is trimmed: a value with a leading or trailing space is
// refused (HTTP servers remove the whitespace around a field value before a receiver reads it).
//
// Thread-safety: a pure function.
//
// Example:
//   const keel::IdempotencyKeyCheck k = keel::check_idempotency_key(R"("order-7")");
//   // k.ok(), k.key == "order-7"
//   if (auto key = keel::check_idempotency_key(flag).to_expected(); !key) {
//     std::cerr << key.error().in("--key").message() << "\n";  // exit 2
//   }
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <string_view>

#include "keel/core/expected.hpp"

namespace keel {

/// Longest key, in bytes of its canonical form.
inline constexpr std::size_t kMaxIdempotencyKeyBytes = 255;

/// Why check_idempotency_key refused a value.
enum class IdempotencyKeyProblem : unsigned char {
  kNone,              // valid
  kEmpty,             // no bytes (or an empty quoted string, "")
  kTooLong,           // more than kMaxIdempotencyKeyBytes bytes once unquoted
  kControlCharacter,  // a byte below 0x20 (tab included) or 0x7f
  kSpace,             // a space (0x20), anywhere, including around the value
  kNonAscii,          // a byte above 0x7f (UTF-8 included)
  kForbidden,         // '"' (outside the quotes of a quoted key), ',' or '%'
  kMalformedQuoted,   // a quoted key not closed, with text after it, or with an escape other
                      // than \" and \\ (RFC 8941 section 3.3.3)
};

/// "none", "empty", "too_long", "control_character", "space", "non_ascii", "forbidden",
/// "malformed_quoted".
[[nodiscard]] std::string_view to_string(IdempotencyKeyProblem problem) noexcept;

/// check_idempotency_key's verdict.
struct IdempotencyKeyCheck {
  /// The canonical key (bare, unquoted); empty when refused.
  std::string key;
  /// kNone when valid; otherwise the first problem found.
  IdempotencyKeyProblem problem = IdempotencyKeyProblem::kNone;
  /// When refused: field "Idempotency-Key", what is wrong, and the value quoted
  /// (quote_value). Rename the field for a flag with `.in("--key")`.
  Error error;

  [[nodiscard]] bool ok() const noexcept { return problem == IdempotencyKeyProblem::kNone; }
  /// The canonical key, or the Error.
  [[nodiscard]] Expected<std::string> to_expected() const& {
    if (ok()) return key;
    return error;
  }
  [[nodiscard]] Expected<std::string> to_expected() && {
    if (ok()) return std::move(key);
    return std::move(error);
  }
};

/// Decides whether `value` (a header field value, a flag, a job's key: exactly the bytes given,
/// nothing trimmed) is an idempotency key under the rule above, and its canonical form. Never
/// throws for any input (std::bad_alloc aside).
[[nodiscard]] IdempotencyKeyCheck check_idempotency_key(std::string_view value);

/// Sixteen random bytes, from which uuid_v4 makes a key.
using UuidBytes = std::array<unsigned char, 16>;

/// The one form of a key keel generates: a random (version 4, RFC 4122 variant) UUID in its
/// 36-character lower-case text form ("0f8fad5b-d9cb-469f-a165-70867728950e"), made from
/// `random_bytes` (122 of their bits are kept; the version and variant bits are set). core has
/// no CSPRNG of its own: the caller supplies the bytes (keel::http::make_idempotency_key and
/// keel::store::new_job_key draw them from OpenSSL's RAND_bytes). Always a valid key under
/// check_idempotency_key.
[[nodiscard]] std::string uuid_v4(const UuidBytes& random_bytes);

}  // namespace keel
