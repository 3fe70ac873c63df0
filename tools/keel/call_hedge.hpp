// keel call's --hedge DELAY [--max-hedges N]: the flags, read into the client's
// ClientOptions::hedge (keel/core/hedge.hpp). Part of the keel command, not a library.
//
// Thread-safety: a pure function.
#pragma once

#include <cstdio>
#include <optional>
#include <string>

#include "commands.hpp"
#include "keel/core/expected.hpp"
#include "keel/core/hedge.hpp"
#include "policy_flags.hpp"

namespace keel::cli {

/// The values of --hedge DELAY and --max-hedges N, and the --max-hedges option for its message.
struct HedgeFlags {
  std::optional<Duration> delay;
  std::optional<int> max_hedges;
  CLI::Option* max_hedges_option = nullptr;
};

/// Registers --hedge and --max-hedges on `sub` (keel call), read into `flags`.
inline void add_hedge_flags(CLI::App* sub, HedgeFlags& flags) {
  // A hedge waits on a timer that counts whole milliseconds.
  add_duration(sub, "keel call", "--hedge", flags.delay,
               DurationRange{.min = std::chrono::milliseconds(1), .why_min = kWholeMilliseconds},
               "Send another attempt when none has answered after DELAY (safe requests only)")
      ->type_name("DELAY");
  flags.max_hedges_option =
      add_count(sub, "keel call", "--max-hedges", flags.max_hedges, 1, HedgePolicy::kMaxHedges,
                "Hedges in flight at once, with --hedge (1-10)")
          ->type_name("N");
}

/// The hedging options of --hedge DELAY [--max-hedges N]: an empty inner optional without
/// --hedge; nullopt when --max-hedges is given without --hedge (the message, naming the flag, is
/// printed).
inline std::optional<std::optional<HedgeOptions>> hedge_options(const HedgeFlags& flags) {
  if (!flags.delay) {
    if (!flags.max_hedges) return std::optional<HedgeOptions>();
    flag_error("call", Error{.field = "--max-hedges",
                             .problem = "needs --hedge DELAY",
                             .got = quote_value(flags.max_hedges_option->results().back())}
                           .message());
    return std::nullopt;
  }
  HedgeOptions hedge{.delay = *flags.delay};
  if (flags.max_hedges) hedge.max_hedges = *flags.max_hedges;
  return std::optional<HedgeOptions>(hedge);
}

}  // namespace keel::cli
