// Fuzzes check_json(), the validation of untrusted JSON bodies: no crash, no UB, no stack
// exhaustion at any nesting; the depth pre-scan and the verdict agree; a valid body's canonical
// form is itself valid and canonical (a fixed point), so fingerprints are stable.
#include <cstdint>
#include <cstdlib>
#include <keel/json/json_check.hpp>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  // The first byte picks the limit (1..16, or the default 64), the rest is the body.
  const std::size_t limit = data[0] < 128 ? 64 : 1 + data[0] % 16;
  const std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  const keel::store::JsonLimits limits{.max_depth = limit};
  const keel::store::JsonCheck c = keel::store::check_json(body, limits);
  const std::size_t depth = keel::store::json_nesting_depth(body, limit);
  if ((c.status == keel::store::JsonStatus::kTooDeep) != (depth > limit)) std::abort();
  if (!c.ok() && c.detail.empty()) std::abort();  // a refusal always says why
  if (c.ok()) {
    const keel::store::JsonCheck again = keel::store::check_json(c.canonical, limits);
    if (!again.ok() || again.canonical != c.canonical) std::abort();
  }
  return 0;
}
