// The explorer page's query string read into ExplorerParams (see keel/sim/scenarios.hpp): every
// value is outside input, so each is parsed strictly and range-checked with a message that
// names it.
#include <charconv>
#include <sstream>
#include <stdexcept>

#include "keel/sim/scenarios.hpp"

namespace keel::sim {
namespace {

struct BadParam : std::runtime_error {
  using std::runtime_error::runtime_error;
};

using Getter = std::function<std::optional<std::string>(std::string_view)>;

template <class T>
T number(const Getter& get, const char* name, T fallback, T lo, T hi) {
  const std::optional<std::string> v = get(name);
  if (!v) return fallback;
  const std::string& text = *v;
  T value{};
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || ptr != end) {
    throw BadParam(std::string(name) + ": '" + text.substr(0, 64) + "' is not a number");
  }
  if (!(value >= lo && value <= hi)) {
    std::ostringstream msg;
    msg << name << ": " << text.substr(0, 64) << " is out of range [" << lo << ", " << hi << "]";
    throw BadParam(msg.str());
  }
  return value;
}

bool boolean(const Getter& get, const char* name, bool fallback) {
  const std::optional<std::string> v = get(name);
  if (!v) return fallback;
  if (*v == "1" || *v == "true") return true;
  if (*v == "0" || *v == "false") return false;
  throw BadParam(std::string(name) + ": '" + v->substr(0, 64) + "' must be 0, 1, true or false");
}

}  // namespace

ExplorerQuery parse_explorer_query(const Getter& get) {
  ExplorerQuery q;
  ExplorerParams& p = q.params;
  try {
    p.fleet = number<std::int64_t>(get, "fleet", p.fleet, 1, 100'000);
    p.capacity_per_s = number<double>(get, "capacity", p.capacity_per_s, 1, 1e6);
    p.outage = std::chrono::duration_cast<Duration>(
        std::chrono::duration<double>(number<double>(get, "outage_s", 5.0, 0.0, 60.0)));
    p.attempts = number<int>(get, "attempts", p.attempts, 1, 20);
    p.base = std::chrono::duration_cast<Duration>(std::chrono::duration<double, std::milli>(
        number<double>(get, "base_ms", 1000.0, 1.0, 10'000.0)));
    p.jitter = boolean(get, "jitter", p.jitter);
    p.budget = boolean(get, "budget", p.budget);
    p.breaker = boolean(get, "breaker", p.breaker);
    q.seed = number<std::uint64_t>(get, "seed", 1, 0, ~std::uint64_t{0});
  } catch (const BadParam& e) {
    q.error = e.what();
  }
  return q;
}

}  // namespace keel::sim
