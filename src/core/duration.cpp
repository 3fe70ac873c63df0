#include "keel/core/duration.hpp"

#include <cstdint>
#include <cstdio>

namespace keel {
namespace {

__extension__ using u128 = unsigned __int128;  // exact arithmetic for overflow checks

constexpr std::string_view kUnitHint = "use ns, us, ms, s, m or h, like 250ms, 1.5s, 2m or 1h";

Error fail(std::string_view text, std::string problem) {
  return Error{.field = "duration", .problem = std::move(problem), .got = quote_value(text)};
}

struct Unit {
  std::string_view name;
  std::int64_t nanos;
};
constexpr Unit kUnits[] = {{"ns", 1},
                           {"us", 1'000},
                           {"ms", 1'000'000},
                           {"s", 1'000'000'000},
                           {"m", 60'000'000'000},
                           {"h", 3'600'000'000'000}};

}  // namespace

Expected<Duration> parse_duration(std::string_view text) {
  if (text.empty()) {
    return fail(text, "is empty; " + std::string(kUnitHint));
  }
  std::size_t i = 0;
  // Integer part, exact, with overflow detection.
  u128 whole = 0;
  std::size_t int_digits = 0;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
    whole = whole * 10 + static_cast<unsigned>(text[i] - '0');
    if (whole > (static_cast<u128>(1) << 80)) {
      return fail(text, "is too large");
    }
    ++i;
    ++int_digits;
  }
  // Fractional part: up to 18 digits kept (more are accepted and ignored beyond ns precision).
  std::uint64_t frac = 0;
  std::uint64_t frac_scale = 1;
  std::size_t frac_digits = 0;
  if (i < text.size() && text[i] == '.') {
    ++i;
    while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
      if (frac_scale < 1'000'000'000'000'000'000ULL) {
        frac = frac * 10 + static_cast<unsigned>(text[i] - '0');
        frac_scale *= 10;
      }
      ++i;
      ++frac_digits;
    }
    if (frac_digits == 0) {
      return fail(text, "has no digits after the decimal point");
    }
  }
  if (int_digits == 0 && frac_digits == 0) {
    return fail(text, "does not start with a number; " + std::string(kUnitHint));
  }
  const std::string_view unit_text = text.substr(i);
  const Unit* unit = nullptr;
  for (const Unit& u : kUnits) {
    if (unit_text == u.name) unit = &u;
  }
  if (unit == nullptr) {
    return fail(text, unit_text.empty() ? "has no unit; " + std::string(kUnitHint)
                                        : "has an unknown unit " + quote_value(unit_text, 16) +
                                              "; " + std::string(kUnitHint));
  }
  const u128 max_ns = static_cast<u128>(kInfinite.count());
  u128 ns = whole * static_cast<u128>(unit->nanos);
  // frac / frac_scale of a unit, rounded down to whole nanoseconds.
  ns += (static_cast<u128>(frac) * static_cast<u128>(unit->nanos)) / frac_scale;
  if (ns >= max_ns) {
    return fail(text, "is too large");
  }
  if (ns == 0 && (whole != 0 || frac != 0)) {
    return fail(text, "is shorter than one nanosecond");
  }
  return Duration(static_cast<Duration::rep>(ns));
}

std::string format_duration(Duration d) {
  if (d >= kInfinite) return "inf";
  std::string sign;
  if (d < Duration::zero()) {
    if (d == Duration::min()) return "-inf";
    sign = "-";
    d = -d;
  }
  const auto ns = d.count();
  char buf[64];
  if (ns == 0) return "0s";
  if (ns % 3'600'000'000'000 == 0) {
    std::snprintf(buf, sizeof buf, "%lldh", static_cast<long long>(ns / 3'600'000'000'000));
  } else if (ns % 60'000'000'000 == 0) {
    std::snprintf(buf, sizeof buf, "%lldm", static_cast<long long>(ns / 60'000'000'000));
  } else if (ns >= 1'000'000'000) {
    std::snprintf(buf, sizeof buf, "%.4g", static_cast<double>(ns) / 1e9);
    return sign + buf + "s";
  } else if (ns >= 1'000'000) {
    std::snprintf(buf, sizeof buf, "%.4gms", static_cast<double>(ns) / 1e6);
  } else if (ns >= 1'000) {
    std::snprintf(buf, sizeof buf, "%.4gus", static_cast<double>(ns) / 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%lldns", static_cast<long long>(ns));
  }
  return sign + buf;
}

}  // namespace keel
