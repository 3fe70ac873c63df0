#include "keel/core/text.hpp"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace keel {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// One step of reading UTF-8 at text[i]: the length of the valid character there (`valid`), or,
// when there is none, the length of the maximal ill-formed subpart to replace (`bad`).
struct Step {
  std::size_t valid = 0;
  std::size_t bad = 0;
};

Step step(std::string_view text, std::size_t i) noexcept {
  const auto lead = static_cast<std::uint8_t>(text[i]);
  if (lead == 0) return {.bad = 1};  // NUL: valid UTF-8, refused by PostgreSQL's TEXT
  if (lead < 0x80) return {.valid = 1};
  std::size_t n = 0;
  std::uint8_t lo = 0x80;
  std::uint8_t hi = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    n = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    n = 3;
    if (lead == 0xE0) lo = 0xA0;  // overlong below U+0800
    if (lead == 0xED) hi = 0x9F;  // surrogates U+D800..U+DFFF
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    n = 4;
    if (lead == 0xF0) lo = 0x90;  // overlong below U+10000
    if (lead == 0xF4) hi = 0x8F;  // above U+10FFFF
  } else {
    return {.bad = 1};  // a continuation byte, C0/C1 (overlong) or F5..FF
  }
  for (std::size_t k = 1; k < n; ++k) {
    if (i + k >= text.size()) return {.bad = k};
    const auto b = static_cast<std::uint8_t>(text[i + k]);
    if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) return {.bad = k};
  }
  return {.valid = n};
}

bool is_continuation(char c) noexcept { return (static_cast<std::uint8_t>(c) & 0xC0) == 0x80; }

std::string marker(std::size_t replaced) {
  return " [" + std::to_string(replaced) +
         (replaced == 1 ? " byte that was " : " bytes that were ") + std::string(kReplacedMarker);
}

std::size_t marker_size(std::size_t replaced) {
  return replaced == 0 ? 0 : marker(replaced).size();
}

// text[from, until) read as UTF-8 into `out`, each ill-formed subpart and NUL as U+FFFD; stops
// early once `out` is longer than `stop_above`. `replaced` gets, for each replacement, its
// position in `out` and the input bytes it stands for. Returns the input position reached.
std::size_t decode(std::string_view text, std::size_t from, std::size_t stop_above,
                   std::string& out, std::vector<std::pair<std::size_t, std::size_t>>& replaced) {
  std::size_t i = from;
  while (i < text.size() && out.size() <= stop_above) {
    const Step s = step(text, i);
    if (s.valid > 0) {
      out.append(text.data() + i, s.valid);
      i += s.valid;
    } else {
      replaced.emplace_back(out.size(), s.bad);
      out.append(kReplacement);
      i += s.bad;
    }
  }
  return i;
}

}  // namespace

std::size_t storable_prefix_size(std::string_view text) noexcept {
  std::size_t i = 0;
  while (i < text.size()) {
    const Step s = step(text, i);
    if (s.valid == 0) break;
    i += s.valid;
  }
  return i;
}

bool is_storable_text(std::string_view text) noexcept {
  return storable_prefix_size(text) == text.size();
}

std::string storable_text(std::string_view text, std::size_t max_bytes, Keep keep) {
  std::string out;
  std::vector<std::pair<std::size_t, std::size_t>> replaced;  // (position in out, input bytes)
  if (keep == Keep::kStart) {
    out.reserve(std::min(text.size(), max_bytes) + 4);
    const std::size_t reached = decode(text, 0, max_bytes, out, replaced);
    if (reached == text.size() && replaced.empty() && out.size() <= max_bytes) return out;
    // The longest prefix ending on a character boundary that fits with the marker it needs.
    std::size_t total = 0;
    for (const auto& r : replaced) total += r.second;
    std::size_t next = replaced.size();  // replacements at positions >= end are not kept
    std::size_t end = out.size();
    while (true) {
      while (next > 0 && replaced[next - 1].first >= end) total -= replaced[--next].second;
      if (end == 0 || (end <= max_bytes && end + marker_size(total) <= max_bytes)) break;
      do {
        --end;
      } while (end > 0 && is_continuation(out[end]));
    }
    out.resize(end);
    if (total > 0) out += marker(total);
    return out;
  }
  // Keep::kEnd: what may fit is in the last max_bytes of the input (each input byte is at least
  // one byte out); bytes of a character cut by that start are not read.
  std::size_t from = text.size() > max_bytes ? text.size() - max_bytes : 0;
  for (int skipped = 0;
       from > 0 && from < text.size() && skipped < 3 && is_continuation(text[from]); ++skipped) {
    ++from;
  }
  out.reserve(text.size() - from + 4);
  (void)decode(text, from, std::string::npos, out, replaced);
  if (replaced.empty() && out.size() <= max_bytes) return out;
  // The shortest cut of the start, on a character boundary, that fits with its marker.
  std::size_t total = 0;
  for (const auto& r : replaced) total += r.second;
  std::size_t first = 0;  // replacements before `first` are cut
  std::size_t begin = 0;
  while (true) {
    while (first < replaced.size() && replaced[first].first < begin)
      total -= replaced[first++].second;
    const std::size_t kept = out.size() - begin;
    if (kept == 0 || (kept <= max_bytes && kept + marker_size(total) <= max_bytes)) break;
    do {
      ++begin;
    } while (begin < out.size() && is_continuation(out[begin]));
  }
  std::string kept = out.substr(begin);
  if (total > 0) kept += marker(total);
  return kept;
}

Expected<void> check_name(std::string_view field, std::string_view name) {
  const auto bad = [&](std::string problem) {
    return Error{
        .field = std::string(field), .problem = std::move(problem), .got = quote_value(name)};
  };
  if (name.empty()) return Error{.field = std::string(field), .problem = "must not be empty"};
  if (name.size() > kMaxNameBytes) {
    return bad("must be at most " + std::to_string(kMaxNameBytes) + " characters");
  }
  for (const char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == '-';
    if (!ok) return bad("may only contain letters, digits, '_', '.' and '-'");
  }
  return {};
}

}  // namespace keel
