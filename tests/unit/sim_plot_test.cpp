// `keel sim run --plot`'s gnuplot script and data (tools/keel/sim_plot.cpp), checked in process:
// every panel has its policy's title, axis labels with units and a legend, the dependency's
// capacity as a step line, and the scenario's phases shaded and named.
#include "sim_plot.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "keel/sim/scenarios.hpp"

namespace {

std::vector<keel::sim::Report> demo_story() {
  std::vector<keel::sim::Report> reports;
  for (const char* policy : {"naive", "full-jitter", "full-jitter+budget"}) {
    reports.push_back(keel::sim::run_scenario("demo-story", policy, 1));
  }
  return reports;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(SimPlot, ScriptDrawsTheCapacityLineAndNamesThePhasesOnEveryPanel) {
  const auto reports = demo_story();
  const std::string script = keel::cli::plot_script(reports, "/tmp/series.dat", "/tmp/out.svg");
  EXPECT_TRUE(has(script, "set terminal svg")) << script;
  EXPECT_TRUE(has(script, "set output '/tmp/out.svg'")) << script;
  EXPECT_TRUE(has(script, "set multiplot layout 3,1")) << script;
  // Axis labels with units, and a legend.
  EXPECT_TRUE(has(script, "set ylabel 'attempts/s'")) << script;
  EXPECT_TRUE(has(script, "set xlabel 'time (s)'")) << script;
  EXPECT_TRUE(has(script, "set key ")) << script;
  EXPECT_FALSE(has(script, "unset key")) << script;
  // One titled panel per policy, each with its capacity line (data index 2i + 1) in the legend.
  for (std::size_t i = 0; i < reports.size(); ++i) {
    EXPECT_TRUE(has(script, "set title 'policy: " + reports[i].policy + "'")) << script;
    EXPECT_TRUE(has(script, "index " + std::to_string(2 * i + 1) +
                                " using 1:2 with steps lw 2.5 lc rgb '#111111' title "
                                "'CAPACITY 1000/s'"))
        << script;
  }
  // The phases: shaded behind the bars and named, set once for every panel.
  int id = 1;
  for (const char* label : {"steady", "blip", "after the blip", "outage", "after the outage"}) {
    EXPECT_TRUE(has(script, "set object " + std::to_string(id) + " rect from first ")) << script;
    EXPECT_TRUE(has(script, "set label " + std::to_string(id) + " '" + label + "' at first "))
        << script;
    ++id;
  }
  EXPECT_TRUE(has(script, "set object 4 rect from first 35, graph 0 to first 45, graph 1 behind"))
      << script;
  EXPECT_LT(script.find("set label 5"), script.find("plot '/tmp/series.dat'")) << script;
}

TEST(SimPlot, DataHasAttemptsPerSecondAndTheCapacitysSteps) {
  const auto reports = demo_story();
  const std::string data = keel::cli::plot_data(reports);
  // Report 0's capacity block: 1,000/s, halved from 10 s to 13 s, 0 in the outage, then back.
  const auto block = data.find("# naive: capacity");
  ASSERT_NE(block, std::string::npos) << data;
  const std::string capacity = data.substr(block, data.find("\n\n\n", block) - block);
  for (const char* row :
       {"\n0.000000 1000.000000\n", "\n10.000000 500.000000\n", "\n12.500000 500.000000\n",
        "\n13.000000 1000.000000\n", "\n35.000000 0.000000\n", "\n45.000000 1000.000000\n",
        "\n60.000000 1000.000000"}) {
    EXPECT_TRUE(has(capacity, row)) << row << " in " << capacity;
  }
  // Attempts per second, not per slice: slice 0's 500 ms holds offered calls, twice that per s.
  const auto& s0 = reports[0].slices[0];
  EXPECT_TRUE(has(data, "\n0.250000 " + std::to_string(2 * s0.offered) + ".000000 " +
                            std::to_string(2 * s0.retries) + ".000000\n"))
      << data.substr(0, 200);
  // Two blocks per report, apart by two blank lines (gnuplot's index 0 to 5).
  std::size_t separators = 0;
  for (auto at = data.find("\n\n\n"); at != std::string::npos; at = data.find("\n\n\n", at + 3)) {
    ++separators;
  }
  EXPECT_EQ(separators, 2 * reports.size());
}

TEST(SimPlot, AModelWithoutADependencyHasNoCapacityLineAFarCapacityIsOffScale) {
  const std::vector<keel::sim::Report> brooker = {keel::sim::run_scenario("brooker", "full", 1)};
  const std::string script = keel::cli::plot_script(brooker, "d", "out.png");
  EXPECT_TRUE(has(script, "set terminal pngcairo")) << script;
  EXPECT_FALSE(has(script, "CAPACITY")) << script;
  EXPECT_FALSE(has(script, "set object")) << script;  // no phases
  const std::vector<keel::sim::Report> herd = {keel::sim::run_scenario("herd", "fixed", 1)};
  EXPECT_TRUE(has(keel::cli::plot_script(herd, "d", "out.svg"), "'CAPACITY 100000/s (off scale)'"));
}

}  // namespace
