// The value of --rate-limit (keel call, keel jobs work): RATE[/s], RATE/m or RATE/h, as calls
// per second.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>

#include "flags.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "keel/core/rate_limit.hpp"

namespace keel::cli {

/// "50", "50/s", "3000/m", "0.5/s", "90/h" as calls per second, within [one a day, 1,000,000]
/// per second (keel::RateLimitOptions::rate_per_s); otherwise an Error naming `flag`.
inline Expected<double> parse_rate(std::string_view flag, std::string_view text) {
  double per = 1;
  std::string_view number = text;
  if (const auto slash = text.find('/'); slash != std::string_view::npos) {
    const std::string_view unit = text.substr(slash + 1);
    number = text.substr(0, slash);
    if (unit == "s") {
      per = 1;
    } else if (unit == "m") {
      per = 60;
    } else if (unit == "h") {
      per = 3600;
    } else {
      return Error{.field = std::string(flag),
                   .problem = "must be RATE, RATE/s, RATE/m or RATE/h, like 50/s",
                   .got = quote_value(text)};
    }
  }
  auto value = parse_fraction(flag, number, 0, 1e12);
  if (!value) {
    return Error{.field = std::string(flag),
                 .problem =
                     "must be a decimal number of calls, with /s, /m or /h, like 50/s or "
                     "0.5/s (no exponent)",
                 .got = quote_value(text)};
  }
  if (*value <= 0) {
    return Error{.field = std::string(flag),
                 .problem = "must be more than 0 (leave it out for no limit)",
                 .got = quote_value(text)};
  }
  if (*value / per > 1e6) {
    return Error{.field = std::string(flag),
                 .problem = "must be at most 1000000/s",
                 .got = quote_value(text)};
  }
  if (*value / per < kMinRatePerS) {
    return Error{.field = std::string(flag),
                 .problem =
                     "must be at least one call a day (1/h is 24 a day); a lower rate is "
                     "no limit in practice",
                 .got = quote_value(text)};
  }
  return *value / per;
}

/// The rate limits' options of a command (keel call, keel jobs work): `rate_per_s` (0: pauses
/// only), and one line on stderr, "PROGRAM: KEY asked for a pause of ...; cut to ... (max
/// pause)", the first time a dependency's Retry-After is cut to max_pause. `program`: a literal.
inline RateLimitOptions command_rate_options(double rate_per_s, const char* program) {
  RateLimitOptions options{.rate_per_s = rate_per_s};
  options.on_pause_cut = [program](std::string_view key, Duration asked, Duration cap) {
    std::fprintf(stderr, "%s: %.*s asked for a pause of %s; cut to %s (max pause)\n", program,
                 static_cast<int>(key.size()), key.data(), format_duration(asked).c_str(),
                 format_duration(cap).c_str());
  };
  return options;
}

}  // namespace keel::cli
