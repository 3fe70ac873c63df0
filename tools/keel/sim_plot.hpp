// Rendering `keel sim run --plot`: gnuplot draws one panel per policy on the same axes, so a
// fixed-delay spike and a full-jitter carpet are seen side by side, each against the
// dependency's capacity, with the scenario's phases (steady, blip, outage ...) marked.
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

/// The data render_plot hands gnuplot (exposed for tests): per report, in order, one block of
/// slices (mid-slice time in s, attempts/s, retries/s) and one block of the capacity's steps
/// (time in s, requests/s; no rows when the report has no capacity), blocks apart by two blank
/// lines: report i's slices are gnuplot's index 2i, its capacity index 2i+1.
[[nodiscard]] std::string plot_data(const std::vector<sim::Report>& reports);

/// The gnuplot script render_plot runs (exposed for tests): reads `data_path` (plot_data's
/// layout), writes `out_path`. One panel per report titled with its policy, all on the same axes:
/// attempts/s and retries/s as bars, the dependency's capacity as a step line titled CAPACITY,
/// and the reports' phases (Report::phases) shaded and named on every panel.
[[nodiscard]] std::string plot_script(const std::vector<sim::Report>& reports,
                                      const std::string& data_path, const std::string& out_path);

}  // namespace keel::cli
