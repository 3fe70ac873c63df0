// Rendering `keel sim run --plot`: gnuplot draws one panel per policy on the same axes, so a
// fixed-delay spike and a full-jitter carpet are seen side by side.
#pragma once

#include <string>
#include <vector>

#include "keel/sim/scenarios.hpp"

namespace keel::cli {

/// True when `path` ends in .svg or .png.
[[nodiscard]] bool plot_format_supported(const std::string& path);

/// Writes the plot to `path` (through a temporary file renamed into place, so a failure leaves
/// no partial file). Returns false with `error` set when gnuplot is missing or fails.
[[nodiscard]] bool render_plot(const std::vector<sim::Report>& reports, const std::string& path,
                               std::string& error);

/// The gnuplot script render_plot runs (exposed for tests): reads `data_path`, writes `out_path`.
[[nodiscard]] std::string plot_script(const std::vector<sim::Report>& reports,
                                      const std::string& data_path, const std::string& out_path);

}  // namespace keel::cli
