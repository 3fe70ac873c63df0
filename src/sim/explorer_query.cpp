// The explorer page's query string read into ExplorerParams (see keel/sim/scenarios.hpp): every
// value is outside input, so each is parsed strictly and range-checked with a message that
// names it.
#include <algorithm>
#include <charconv>
#include <sstream>

#include "keel/sim/scenarios.hpp"

namespace keel::sim {
namespace {

using Getter = std::function<std::optional<std::string>(std::string_view)>;

// Reads parameters one by one; the first bad one is kept and the rest are not read.
struct Reader {
  const Getter& get;
  std::optional<Error> error;

  template <class T>
  T number(const char* name, T fallback, T lo, T hi) {
    if (error) return fallback;
    const std::optional<std::string> v = get(name);
    if (!v) return fallback;
    const std::string& text = *v;
    T value{};
    const char* end = text.data() + text.size();
    const auto [ptr, ec] = std::from_chars(text.data(), end, value);
    if (text.empty() || ec != std::errc() || ptr != end) {
      error = Error{.field = name, .problem = "is not a number", .got = quote_value(text)};
      return fallback;
    }
    if (!(value >= lo && value <= hi)) {
      std::ostringstream range;
      range << "must be in [" << lo << ", " << hi << "]";
      error = Error{.field = name, .problem = range.str(), .got = quote_value(text)};
      return fallback;
    }
    return value;
  }

  bool boolean(const char* name, bool fallback) {
    if (error) return fallback;
    const std::optional<std::string> v = get(name);
    if (!v) return fallback;
    if (*v == "1" || *v == "true") return true;
    if (*v == "0" || *v == "false") return false;
    error = Error{.field = name, .problem = "must be 0, 1, true or false", .got = quote_value(*v)};
    return fallback;
  }
};

}  // namespace

Expected<ExplorerQuery> parse_explorer_query(const Getter& get) {
  ExplorerQuery q;
  ExplorerParams& p = q.params;
  Reader r{get, std::nullopt};
  p.fleet = r.number<std::int64_t>("fleet", p.fleet, 1, 100'000);
  p.capacity_per_s = r.number<double>("capacity", p.capacity_per_s, 1, 1e6);
  p.outage = std::chrono::duration_cast<Duration>(
      std::chrono::duration<double>(r.number<double>("outage_s", 5.0, 0.0, 60.0)));
  p.attempts = r.number<int>("attempts", p.attempts, 1, 20);
  p.base = std::chrono::duration_cast<Duration>(std::chrono::duration<double, std::milli>(
      r.number<double>("base_ms", 1000.0, 1.0, 10'000.0)));
  p.jitter = r.boolean("jitter", p.jitter);
  p.budget = r.boolean("budget", p.budget);
  p.breaker = r.boolean("breaker", p.breaker);
  p.limit = r.boolean("limit", p.limit);
  q.seed = r.number<std::uint64_t>("seed", 1, 0, ~std::uint64_t{0});
  if (!r.error) {
    if (const std::optional<std::string> v = get("fleet_breakers")) {
      if (*v == "per-pod") {
        q.fleet_breakers = false;
      } else if (*v == "shared") {
        q.fleet_breakers = true;
      } else {
        r.error = Error{.field = "fleet_breakers",
                        .problem = "must be per-pod or shared",
                        .got = quote_value(*v)};
      }
    }
  }
  if (!r.error) {
    if (const std::optional<std::string> v = get("scenario")) {
      if (*v != "overload-3x" && *v != "fleet-rate-limit") {
        r.error = Error{.field = "scenario",
                        .problem = "must be overload-3x or fleet-rate-limit",
                        .got = quote_value(*v)};
      } else {
        q.scenario = *v;
        const std::optional<std::string> policy = get("policy");
        const auto& known = scenario_policies(q.scenario);
        if (!policy || std::find(known.begin(), known.end(), *policy) == known.end()) {
          std::string names;
          for (const auto& n : known) names += (names.empty() ? "" : ", ") + n;
          r.error = Error{.field = "policy",
                          .problem = "must be one of " + q.scenario + "'s (" + names + ")",
                          .got = policy ? quote_value(*policy) : "nothing"};
        } else {
          q.policy = *policy;
        }
      }
    }
  }
  if (r.error) return *std::move(r.error);
  return q;
}

}  // namespace keel::sim
