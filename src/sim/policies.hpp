// Private to keel::sim: policy construction shared by the scenarios and the explorer.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "keel/sim/engine.hpp"
#include "keel/sim/scenarios.hpp"

namespace keel::sim {

/// Refuses `name`, none of `known`: throws std::invalid_argument "CONTEXT: FIELD must be
/// REQUIREMENT (KNOWN, ...) (got 'NAME')", the names it takes listed.
[[noreturn]] void refuse_unknown_name(std::string_view context, std::string_view field,
                                      std::string_view requirement,
                                      const std::vector<std::string>& known, std::string_view name);

/// The explorer's policy: full jitter or none (exponential), optionally with the core's budget
/// and breaker. Throws std::invalid_argument when budget or breaker is asked for and this build
/// of keel::core lacks it.
[[nodiscard]] ClientPolicy make_explorer_policy(bool jitter, bool budget, bool breaker,
                                                const PolicySettings& settings);

/// The blip scenario with a capacity drop lasting `trigger`.
[[nodiscard]] Scenario blip_scenario(Duration trigger);

/// The fleet-outage scenario with an outage lasting `outage`.
[[nodiscard]] Scenario fleet_outage_scenario(Duration outage);

}  // namespace keel::sim
