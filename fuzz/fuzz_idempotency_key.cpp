// Fuzzes keel's one idempotency key rule (keel::check_idempotency_key) and the receiver's parser
// over it (keel::store::parse_idempotency_key, an RFC 8941 sf-string or a bare key, as a receiver
// reads the Idempotency-Key header): no crash, no UB; both give one verdict and one canonical
// form; an accepted key is 1 to 255 bytes of visible ASCII without '"', ',' or '%', is its own
// canonical form, and reads the same quoted; a refused one says why.
#include <cstdint>
#include <cstdlib>
#include <keel/core/idempotency_key.hpp>
#include <keel/idempotency/idempotency.hpp>
#include <string>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const keel::IdempotencyKeyCheck checked = keel::check_idempotency_key(text);
  const keel::store::ParsedKey parsed = keel::store::parse_idempotency_key(text);
  if (checked.ok() != parsed.key.has_value()) std::abort();  // one verdict
  if (!parsed.key) {
    if (parsed.detail.empty() || checked.error.problem.empty()) std::abort();
    return 0;
  }
  const std::string& key = *parsed.key;
  if (key != checked.key) std::abort();  // one canonical form
  if (key.empty() || key.size() > keel::kMaxIdempotencyKeyBytes) std::abort();
  for (char c : key) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x21 || u > 0x7e || c == '"' || c == ',' || c == '%') std::abort();
  }
  // The canonical form is canonical, and its quoted string is the same key.
  const keel::IdempotencyKeyCheck again = keel::check_idempotency_key(key);
  if (!again.ok() || again.key != key) std::abort();
  std::string quoted = "\"";
  for (char c : key) {
    if (c == '\\') quoted += '\\';
    quoted += c;
  }
  quoted += '"';
  const keel::IdempotencyKeyCheck unquoted = keel::check_idempotency_key(quoted);
  if (!unquoted.ok() || unquoted.key != key) std::abort();
  return 0;
}
