// Fuzzes keel::sim::parse_explorer_query, the storm explorer's query parameters (GET /api/sim):
// no crash, no UB; accepted parameters are within the documented ranges; a refusal names a
// parameter and stays short (512 characters) whatever the input's size.
#include <cstdint>
#include <cstdlib>
#include <keel/sim/scenarios.hpp>
#include <map>
#include <string>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::map<std::string, std::string, std::less<>> params;  // "k=v&k=v", the first value wins
  std::size_t at = 0;
  while (at <= text.size()) {
    const std::size_t amp = std::min(text.find('&', at), text.size());
    const std::string_view pair = text.substr(at, amp - at);
    const std::size_t eq = pair.find('=');
    params.emplace(std::string(pair.substr(0, eq)),
                   eq == std::string_view::npos ? std::string() : std::string(pair.substr(eq + 1)));
    at = amp + 1;
  }
  const keel::Expected<keel::sim::ExplorerQuery> q =
      keel::sim::parse_explorer_query([&](std::string_view name) -> std::optional<std::string> {
        const auto it = params.find(name);
        if (it == params.end()) return std::nullopt;
        return it->second;
      });
  if (!q) {
    // A refusal names the parameter and stays short whatever the input: the input's share of it
    // is cut. The longest is a fixed text, a missing policy of the scenario with the most
    // policies, which lists them (fleet-rate-limit's 18: 381 characters).
    if (q.error().field.empty() || q.error().message().size() > 512) std::abort();
    return 0;
  }
  const keel::sim::ExplorerParams& p = q->params;
  if (p.fleet < 1 || p.fleet > 100'000) std::abort();
  if (!(p.capacity_per_s >= 1 && p.capacity_per_s <= 1e6)) std::abort();
  if (p.attempts < 1 || p.attempts > 20) std::abort();
  if (p.outage < keel::Duration::zero() || p.outage > std::chrono::seconds(60)) std::abort();
  if (p.base < std::chrono::milliseconds(1) || p.base > std::chrono::seconds(10)) std::abort();
  return 0;
}
