// Fuzzes keel::http::parse_header_field (`keel call -H 'Name: value'`): no crash, no UB, and
// an accepted field can never inject a header line: its name is a non-empty token, its value
// holds no CR, LF, NUL or other control byte but tab and has no surrounding spaces, and the
// field passes check_header_field.
#include <cstdint>
#include <cstdlib>
#include <keel/http/message.hpp>
#include <string>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto field = keel::http::parse_header_field(text);
  if (!field) {
    if (field.error().problem.empty()) std::abort();  // a refusal always says why
    return 0;
  }
  const auto& [name, value] = *field;
  if (name.empty() || name.find_first_of(" \t:\r\n") != std::string::npos) std::abort();
  for (char c : value) {
    const auto u = static_cast<unsigned char>(c);
    if ((u < 0x20 && c != '\t') || u == 0x7f) std::abort();
  }
  if (!value.empty() && (value.front() == ' ' || value.back() == ' ')) std::abort();
  if (!keel::http::check_header_field(name, value)) std::abort();
  // A key taken from the field is either valid or refused with a reason.
  if (keel::http::same_header_name(name, "Idempotency-Key")) {
    const auto key = keel::http::check_idempotency_key(value);
    if (key && (key->empty() || key->size() > keel::http::kMaxIdempotencyKeyBytes)) std::abort();
  }
  return 0;
}
