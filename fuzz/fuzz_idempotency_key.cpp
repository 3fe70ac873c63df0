// Fuzzes keel::store::parse_idempotency_key (an RFC 8941 sf-string or a bare token, as a
// receiver reads the Idempotency-Key header): no crash, no UB; an accepted key is 1 to 255 bytes
// with no control byte; a refused one says why.
#include <cstdint>
#include <cstdlib>
#include <keel/store/idempotency.hpp>
#include <string>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const keel::store::ParsedKey parsed = keel::store::parse_idempotency_key(text);
  if (!parsed.key) {
    if (parsed.detail.empty()) std::abort();
    return 0;
  }
  const std::string& key = *parsed.key;
  if (key.empty() || key.size() > keel::store::kMaxKeyLength) std::abort();
  for (char c : key) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) std::abort();
  }
  // Parsing is stable.
  const keel::store::ParsedKey again = keel::store::parse_idempotency_key(text);
  if (!again.key || *again.key != key) std::abort();
  return 0;
}
