// Fuzzes keel::storable_text: for any bytes, any limit and either end kept, the result is valid
// UTF-8 without NUL (is_storable_text, and an independent decoder here), at most the limit long,
// equal to the input when the input was storable and fit, and a fixed point (storing it again
// changes nothing). The first two bytes choose the limit, the third which end is kept.
#include <cstdint>
#include <cstdlib>
#include <keel/core/text.hpp>
#include <string>
#include <string_view>

namespace {

// RFC 3629 by code point value, apart from the library's byte-range reading.
bool valid_utf8_without_nul(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const auto b = static_cast<std::uint8_t>(s[i]);
    std::size_t n = b < 0x80             ? 1
                    : (b & 0xE0) == 0xC0 ? 2
                    : (b & 0xF0) == 0xE0 ? 3
                    : (b & 0xF8) == 0xF0 ? 4
                                         : 0;
    if (n == 0 || i + n > s.size()) return false;
    std::uint32_t cp = n == 1 ? b : b & (0x7F >> n);
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

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 3) return 0;
  const std::size_t limit = (std::size_t{data[0]} << 8 | data[1]) % 2100;
  const keel::Keep keep = (data[2] & 1) != 0 ? keel::Keep::kEnd : keel::Keep::kStart;
  const std::string_view text(reinterpret_cast<const char*>(data) + 3, size - 3);
  const std::string out = keel::storable_text(text, limit, keep);
  if (out.size() > limit) std::abort();
  if (!valid_utf8_without_nul(out) || !keel::is_storable_text(out)) std::abort();
  if (keel::is_storable_text(text) != valid_utf8_without_nul(text)) std::abort();
  if (valid_utf8_without_nul(text) && text.size() <= limit && out != text) std::abort();
  if (keel::storable_text(out, limit, keep) != out) std::abort();
  return 0;
}
