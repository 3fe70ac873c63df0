// Validation of untrusted JSON request bodies, in one place: the request fingerprint, the
// idempotency middleware and application handlers all go through check_json() before parsing.
//
// Two classes of hostile input are refused:
//   - nesting deeper than JsonLimits.max_depth: found by a linear, non-recursive, allocation-free
//     pre-scan (json_nesting_depth) before any parser runs, so that 100,000 nested arrays cannot
//     exhaust the stack of a recursive parser or serialiser;
//   - an object naming the same member twice ({"amount":5,"amount":500000}): parsers disagree on
//     which one wins, so a body that reads as one charge to a proxy or a log and as another to the
//     handler is refused.
//
// Thread-safety: free functions without shared state; safe for concurrent use.
//
// Example:
//   const keel::store::JsonCheck c = keel::store::check_json(body, {.max_depth = 64});
//   if (c.status == keel::store::JsonStatus::kTooDeep) ...  // answer 400 with c.detail
//   if (c.ok()) { auto j = nlohmann::json::parse(body); ... }  // bounded depth, unique members
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace keel::store {

struct JsonLimits {
  /// Deepest nesting of arrays and objects accepted (a scalar is depth 0, [] is 1, [[]] is 2).
  /// Requires: >= 1 and <= 10000. Default 64.
  std::size_t max_depth = 64;
};

enum class JsonStatus : unsigned char {
  kValid,         // valid JSON within the limits; JsonCheck.canonical holds its canonical form
  kNotJson,       // not JSON (a syntax error): callers may treat the body as opaque bytes
  kTooDeep,       // nested deeper than max_depth (decided by the pre-scan; nothing was parsed)
  kDuplicateKey,  // an object names a member twice
};

/// "valid", "not_json", "too_deep", "duplicate_key".
[[nodiscard]] std::string_view to_string(JsonStatus status) noexcept;

struct JsonCheck {
  JsonStatus status = JsonStatus::kNotJson;
  /// kValid: the body re-serialised with members sorted by name and no whitespace.
  std::string canonical;
  /// Not kValid: a sentence for a problem+json detail (names the limit or the member).
  std::string detail;
  [[nodiscard]] bool ok() const noexcept { return status == JsonStatus::kValid; }
};

/// The deepest nesting of '[' and '{' in `text`, not counting brackets inside strings (escapes
/// understood). Stops scanning and returns `stop_above + 1` as soon as the depth exceeds
/// `stop_above`. Linear time, constant space, never allocates or throws; works on any bytes
/// (unbalanced or invalid JSON included).
[[nodiscard]] std::size_t json_nesting_depth(std::string_view text,
                                             std::size_t stop_above) noexcept;

/// Checks `body` against `limits` (pre-scan first, then a parse that records member names) and
/// returns its status, canonical form or the reason it was refused. Throws std::invalid_argument
/// when limits break a Requires line; never throws for any body.
[[nodiscard]] JsonCheck check_json(std::string_view body, const JsonLimits& limits = {});

/// Throws std::invalid_argument naming the field and value when limits break a Requires line.
void validate(const JsonLimits& limits);

}  // namespace keel::store
