// keel call's --hedge DELAY [--max-hedges N]: the flags read into the client's
// ClientOptions::hedge (keel/hedge.hpp). Part of the keel command, not a library.
//
// Thread-safety: a pure function.
#pragma once

#include <cstdio>
#include <optional>
#include <string>

#include "commands.hpp"
#include "keel/expected.hpp"
#include "keel/hedge.hpp"
#include "policy_flags.hpp"

namespace keel::cli {

/// The hedging options of --hedge DELAY [--max-hedges N]: an empty inner optional without
/// --hedge; nullopt when a value is invalid (the message, naming the flag, is printed).
inline std::optional<std::optional<HedgeOptions>> parse_hedge_flags(const std::string& hedge_flag,
                                                                    const std::string& max_hedges) {
  if (hedge_flag.empty()) {
    if (max_hedges.empty()) return std::optional<HedgeOptions>();
    flag_error("call", Error{.field = "--max-hedges",
                             .problem = "needs --hedge DELAY",
                             .got = quote_value(max_hedges)}
                           .message());
    return std::nullopt;
  }
  // A hedge waits on a timer that counts whole milliseconds.
  const auto delay = duration_flag(
      "call", "--hedge", hedge_flag,
      DurationRange{.min = std::chrono::milliseconds(1), .why_min = kWholeMilliseconds});
  if (!delay) return std::nullopt;
  HedgeOptions hedge{.delay = *delay};
  if (!max_hedges.empty()) {
    auto n = parse_count("--max-hedges", max_hedges, 1, HedgePolicy::kMaxHedges);
    if (!n) {
      flag_error("call", n.error().message());
      return std::nullopt;
    }
    hedge.max_hedges = static_cast<int>(*n);
  }
  return std::optional<HedgeOptions>(hedge);
}

}  // namespace keel::cli
