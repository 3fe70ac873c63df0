// Text that keel stores for others to read: a failure reason, a response excerpt, a command's
// stderr tail, a URL or a header value in an error message. Such text comes from outside (a
// receiver's body, a child's stderr, a user's flag) and may be any bytes, while what stores it
// may refuse some: PostgreSQL's TEXT refuses bytes that are not UTF-8 and the NUL byte, so an
// outcome carrying them could not be recorded at all. storable_text is the one place such text
// is made storable, by every writer of it, on every backend: valid UTF-8 without NUL, within a
// byte limit, cut on a character boundary, and unchanged when it already was all that.
//
// The rule. The input is read as UTF-8 (RFC 3629: no overlong forms, no surrogates, nothing
// above U+10FFFF). Each maximal ill-formed subsequence (Unicode's "substitution of maximal
// subparts": a lone continuation byte, a cut sequence, each byte of an overlong or surrogate
// form the first byte already rules out) and each NUL byte becomes U+FFFD, and the text then says
// how many input bytes were replaced with a marker at its end, " [N bytes that were not UTF-8
// text replaced]" (kReplacedMarker), counting those within what is kept. The result, marker
// included, is at most `max_bytes` long: the text is cut at a character boundary (from its end,
// or with Keep::kEnd from its start, so that the marker still fits; a cut loses whole characters
// only). A limit too small for the marker keeps only text without replaced bytes: up to the first
// (with Keep::kEnd, after the last).
//
// Thread-safety: pure functions.
//
// Example:
//   std::string why = keel::storable_text(response_body, 200);   // a response excerpt
//   std::string tail = keel::storable_text(stderr_text, 500, keel::Keep::kEnd);
//   // "x\xC3" (a cut "é") at a limit of 200: "x\xEF\xBF\xBD [1 byte that was not UTF-8 text
//   // replaced]"; "ok" stays "ok"
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "keel/core/expected.hpp"

namespace keel {

/// Which part of a text too long for its limit storable_text keeps.
enum class Keep : unsigned char {
  kStart,  // the beginning (a reason, an excerpt): the end is cut
  kEnd,    // the end (a stderr tail, whose last line says most): the beginning is cut
};

/// The marker's words after the count: " [N bytes that were not UTF-8 text replaced]" ("byte
/// that was" for 1).
inline constexpr std::string_view kReplacedMarker = "not UTF-8 text replaced]";

/// Whether `text` is valid UTF-8 (RFC 3629) without a NUL byte: what storable_text returns
/// unchanged when it fits its limit.
[[nodiscard]] bool is_storable_text(std::string_view text) noexcept;

/// The size of the longest prefix of `text` that is storable text: text.size() when all of it
/// is, else the position of the first byte that is not (for a message naming it).
[[nodiscard]] std::size_t storable_prefix_size(std::string_view text) noexcept;

/// `text` made valid UTF-8 without NUL and at most `max_bytes` long, by the rule above: equal to
/// `text` when is_storable_text(text) and text.size() <= max_bytes. Linear in the bytes kept
/// (only about max_bytes of the input are read). Throws std::bad_alloc only.
[[nodiscard]] std::string storable_text(std::string_view text, std::size_t max_bytes,
                                        Keep keep = Keep::kStart);

/// The longest name keel stores and shows (a queue's, a consumer's), in bytes.
inline constexpr std::size_t kMaxNameBytes = 64;

/// The one rule for the names keel stores, shows and puts in metric labels (a queue, a
/// consumer): 1 to kMaxNameBytes of ASCII letters, digits, '_', '.' and '-'. The Error names
/// `field` ("queue name", "consumer") and quotes the value.
[[nodiscard]] Expected<void> check_name(std::string_view field, std::string_view name);

}  // namespace keel
