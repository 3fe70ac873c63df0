// Untrusted JSON bodies: the depth pre-scan and the duplicate-member check
// (see include/keel/json/json_check.hpp).
#include "keel/json/json_check.hpp"

#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <vector>

#include "keel/core/expected.hpp"

namespace keel::store {

std::string_view to_string(JsonStatus status) noexcept {
  switch (status) {
    case JsonStatus::kValid:
      return "valid";
    case JsonStatus::kNotJson:
      return "not_json";
    case JsonStatus::kTooDeep:
      return "too_deep";
    case JsonStatus::kDuplicateKey:
      return "duplicate_key";
  }
  return "unknown";
}

void validate(const JsonLimits& limits) {
  if (limits.max_depth < 1 || limits.max_depth > 10000) {
    throw_invalid({.context = "keel::store::JsonLimits",
                   .field = "max_depth",
                   .problem = "must be in [1, 10000]",
                   .got = std::to_string(limits.max_depth)});
  }
}

std::size_t json_nesting_depth(std::string_view text, std::size_t stop_above) noexcept {
  std::size_t depth = 0;
  std::size_t deepest = 0;
  bool in_string = false;
  bool escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        break;
      case '[':
      case '{':
        if (++depth > deepest) {
          deepest = depth;
          if (deepest > stop_above) return stop_above + 1;
        }
        break;
      case ']':
      case '}':
        if (depth > 0) --depth;
        break;
      default:
        break;
    }
  }
  return deepest;
}

JsonCheck check_json(std::string_view body, const JsonLimits& limits) {
  validate(limits);
  JsonCheck out;
  if (json_nesting_depth(body, limits.max_depth) > limits.max_depth) {
    out.status = JsonStatus::kTooDeep;
    out.detail = "the JSON body nests arrays or objects deeper than the limit of " +
                 std::to_string(limits.max_depth) + " levels";
    return out;
  }
  // Member names seen in each open object, innermost last. Bounded by the depth limit.
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  bool has_duplicate = false;
  const nlohmann::json::parser_callback_t record =
      [&](int /*depth*/, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
        switch (event) {
          case nlohmann::json::parse_event_t::object_start:
            open_objects.emplace_back();
            break;
          case nlohmann::json::parse_event_t::object_end:
            if (!open_objects.empty()) open_objects.pop_back();
            break;
          case nlohmann::json::parse_event_t::key:
            if (!open_objects.empty() && parsed.is_string() &&
                !open_objects.back().insert(parsed.get<std::string>()).second && !has_duplicate) {
              has_duplicate = true;
              duplicate = parsed.get<std::string>();
            }
            break;
          default:
            break;
        }
        return true;
      };
  try {
    const nlohmann::json parsed = nlohmann::json::parse(body, record, /*allow_exceptions=*/false);
    if (parsed.is_discarded()) {
      out.status = JsonStatus::kNotJson;
      out.detail = "the body is not valid JSON";
      return out;
    }
    if (has_duplicate) {
      out.status = JsonStatus::kDuplicateKey;
      // The name quoted and escaped as JSON, cut to 64 bytes (a detail is no echo chamber).
      const std::string name = nlohmann::json(duplicate.substr(0, 64))
                                   .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      out.detail = "the JSON body names the member " + name + " more than once in one object";
      return out;
    }
    // Objects are std::map: members sorted, and dump() recursion is bounded by max_depth.
    out.canonical = parsed.dump();
    out.status = JsonStatus::kValid;
  } catch (const std::exception&) {
    out = JsonCheck{};
    out.detail = "the body is not valid JSON";
  }
  return out;
}

}  // namespace keel::store
