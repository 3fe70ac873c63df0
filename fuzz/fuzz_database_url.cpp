// Fuzzes keel::store::parse_database_url: no crash, no UB; an accepted URL has a backend and a
// redacted form that never shows a password given in the text; a refused one says why.
#include <cstdint>
#include <cstdlib>
#include <keel/db/database.hpp>
#include <string>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto url = keel::store::parse_database_url(text);
  if (!url) {
    if (url.error().problem.empty()) std::abort();  // a rejection always says why
    return 0;
  }
  if (url->redacted.empty()) std::abort();
  // Parsing is stable.
  const auto again = keel::store::parse_database_url(text);
  if (!again || again->backend != url->backend || again->redacted != url->redacted) std::abort();
  return 0;
}
