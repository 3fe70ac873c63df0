// `keel sim`: the retry-storm simulator from the shell.
//   keel sim scenarios
//   keel sim run --scenario NAME [--policy P]... [--seed S] [--json] [--csv FILE] [--plot FILE]
//   keel sim serve [--listen 127.0.0.1:8090] [--web DIR]   (sim_serve.cpp)
// Runs are in virtual time (keel::sim over keel::core's policy objects): instant and, for a
// given --seed, repeatable.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "commands.hpp"
#include "flag_options.hpp"
#include "keel/core/duration.hpp"
#include "keel/sim/scenarios.hpp"
#include "sim_plot.hpp"

namespace keel::cli {

namespace {

struct RunOptions {
  std::string scenario;
  std::vector<std::string> policies;
  std::uint64_t seed = 1;
  bool json = false;
  std::string csv;
  std::string plot;
  std::optional<Duration> trigger;
  CLI::Option* trigger_option = nullptr;  // for the text of a --trigger out of its range
  bool threshold = false;
};

// blip --threshold sweeps triggers of 250 ms, 500 ms, ... up to 20 s.
constexpr Duration kThresholdStep = std::chrono::milliseconds(250);
constexpr Duration kThresholdLimit = std::chrono::seconds(20);

int sim_usage(const std::string& message) {
  std::fprintf(stderr, "keel sim run: %s\n", message.c_str());
  return kExitUsage;
}

bool write_file_atomically(const std::string& path, const std::string& content,
                           std::string& error) {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    error = "cannot write '" + path + "'";
    return false;
  }
  const bool ok = std::fwrite(content.data(), 1, content.size(), f) == content.size();
  if (std::fclose(f) != 0 || !ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    error = "cannot write '" + path + "'";
    return false;
  }
  return true;
}

// The hedging scenarios: the requests' latency and the load hedges added.
void print_latencies(const std::vector<sim::Report>& reports) {
  std::printf("\n%-28s %10s %10s %11s\n", "policy", "p50", "p99", "extra load");
  for (const auto& r : reports) {
    const auto& m = r.summary;
    const auto ms = [](const std::optional<Duration>& d) {
      return d ? format_duration(std::chrono::round<std::chrono::microseconds>(*d)) : "-";
    };
    std::printf("%-28s %10s %10s %10.1f%%\n", r.policy.c_str(), ms(m.p50_latency).c_str(),
                ms(m.p99_latency).c_str(), (m.amplification - 1.0) * 100.0);
  }
}

// The fleet-outage scenario: what the breakers let through while the dependency was down, and
// how long after it returned the operations succeeded again.
void print_breakers(const std::vector<sim::Report>& reports) {
  std::printf("\n%-28s %14s %8s %8s %14s\n", "policy", "outage calls", "probes", "breaks",
              "ops recovery");
  for (const auto& r : reports) {
    const auto& m = r.summary;
    const std::string recovery =
        m.ops_recovery ? format_duration(std::chrono::round<std::chrono::milliseconds>(
                             std::chrono::duration_cast<Duration>(*m.ops_recovery)))
                       : "never";
    std::printf("%-28s %14lld %8lld %8lld %14s\n", r.policy.c_str(),
                static_cast<long long>(m.outage_calls), static_cast<long long>(m.probes),
                static_cast<long long>(m.breaker_opens), recovery.c_str());
  }
  std::printf(
      "(outage calls: attempts that reached the dependency while it was down; probes: half-open "
      "trials; breaks: a pod's breaker opening by itself, or with shared breakers the fleet's; "
      "ops recovery: from the dependency's return until every slice has >= 90%% of its "
      "operations succeeding)\n");
}

// demo-story: each policy's load against the dependency's capacity after the blip, during the
// outage and after it (sim::phase_loads). Starts with "story" so scripts/demo.sh can cut it out.
void print_story(const std::vector<sim::Report>& reports) {
  const auto find = [](const std::vector<sim::PhaseLoad>& phases,
                       std::string_view label) -> const sim::PhaseLoad* {
    for (const auto& p : phases) {
      if (p.label == label) return &p;
    }
    return nullptr;
  };
  const auto secs = [](Duration d) { return std::chrono::duration<double>(d).count(); };
  bool header = false;
  for (const auto& r : reports) {
    const auto phases = sim::phase_loads(r);
    const sim::PhaseLoad* blip = find(phases, "after the blip");
    const sim::PhaseLoad* outage = find(phases, "outage");
    const sim::PhaseLoad* after = find(phases, "after the outage");
    if (blip == nullptr || outage == nullptr || after == nullptr) continue;
    if (!header) {
      header = true;
      std::printf(
          "\nstory: attempts/s to the dependency against its capacity (%.0f/s) after the blip "
          "(%.0f-%.0f s), during the outage (%.0f-%.0f s) and after it\n",
          blip->capacity_per_s, secs(blip->span.start), secs(blip->span.end),
          secs(outage->span.start), secs(outage->span.end));
      std::printf("%-20s %14s %16s %12s %14s %14s\n", "policy", "peak/s", "over capacity",
                  "back under", "outage calls", "back under");
      std::printf("%-20s %14s %16s %12s %14s %14s\n", "", "after blip", "after blip", "after blip",
                  "", "after outage");
    }
    const auto under = [&](const sim::PhaseLoad& p) {
      if (!p.under_capacity_after) return std::string("never");
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.1fs", secs(*p.under_capacity_after));
      return std::string(buf);
    };
    char over[48];
    std::snprintf(over, sizeof over, "%.1fs of %.1fs", secs(blip->over_capacity),
                  secs(blip->span.end - blip->span.start));
    std::printf("%-20s %14.0f %16s %12s %14lld %14s\n", r.policy.c_str(), blip->peak_per_s, over,
                under(*blip).c_str(), static_cast<long long>(outage->calls), under(*after).c_str());
  }
}

// overload-3x and fleet-rate-limit: what the limits did (goodput against capacity, the time
// an admitted request spent in the receiver, the 429s of the dependency's rate limit, the
// attempts the clients held back themselves).
void print_limits(const std::vector<sim::Report>& reports) {
  bool header = false;
  for (const auto& r : reports) {
    if (r.scenario != "overload-3x" && r.scenario != "fleet-rate-limit") continue;
    const auto& m = r.summary;
    if (!header) {
      header = true;
      std::printf("\nlimits: %-21s %12s %10s %10s %10s %12s %10s\n", "policy", "goodput/s",
                  "served p50", "served p99", "429s", "429 share", "held back");
    }
    const auto ms = [](const std::optional<Duration>& d) {
      if (!d) return std::string("-");
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.1fms",
                    std::chrono::duration<double, std::milli>(*d).count());
      return std::string(buf);
    };
    const double share = m.total_calls > 0 ? 100.0 * static_cast<double>(m.throttled) /
                                                 static_cast<double>(m.total_calls)
                                           : 0.0;
    std::printf("        %-21s %12.1f %10s %10s %10lld %11.1f%% %10lld\n", r.policy.c_str(),
                m.goodput_per_s, ms(m.served_p50_latency).c_str(), ms(m.served_p99_latency).c_str(),
                static_cast<long long>(m.throttled), share, static_cast<long long>(m.limited));
  }
}

void print_table(const std::vector<sim::Report>& reports) {
  std::printf("%-28s %10s %10s %7s %12s %9s %9s %10s %12s\n", "policy", "first", "calls", "ampl",
              "offered/s", "peak", "peak-retry", "recovered", "completion");
  for (const auto& r : reports) {
    const auto& m = r.summary;
    std::string recovered = m.recovered ? "yes" : "no";
    if (m.recovered && m.recovery) {
      recovered += " +" + format_duration(std::chrono::duration_cast<Duration>(*m.recovery));
    }
    std::string completion = "-";
    if (r.completion_ms) {
      completion = std::to_string(static_cast<long long>(*r.completion_ms)) + "ms";
    }
    std::printf("%-28s %10lld %10lld %7.2f %12.1f %9lld %9lld %10s %12s\n", r.policy.c_str(),
                static_cast<long long>(m.first_attempts), static_cast<long long>(m.total_calls),
                m.amplification, m.offered_per_s, static_cast<long long>(m.peak_per_slice),
                static_cast<long long>(m.peak_retries_per_slice), recovered.c_str(),
                completion.c_str());
  }
  if (!reports.empty()) {
    std::printf("(peak = most calls in one %s slice)\n", format_duration(reports[0].slice).c_str());
  }
}

// The scenario and policies the flags name, and whether the scenario's flags apply to it: 0, or
// kExitUsage after the message.
int check_run(const RunOptions& o, const sim::ScenarioInfo*& info,
              std::vector<std::string>& policies) {
  info = sim::find_scenario(o.scenario);
  if (info == nullptr) {
    std::string known;
    for (const auto& s : sim::scenarios()) known += (known.empty() ? "" : ", ") + s.name;
    return sim_usage("--scenario: unknown scenario '" + o.scenario + "' (known: " + known + ")");
  }
  policies = o.policies.empty() ? info->policies : o.policies;
  for (const auto& p : policies) {
    const auto& known = sim::scenario_policies(info->name);
    if (std::find(known.begin(), known.end(), p) == known.end()) {
      std::string list;
      for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
      return sim_usage("--policy: unknown policy '" + p + "' for scenario " + info->name +
                       " (known: " + list + ")");
    }
  }
  const bool fleet_outage = info->name == "fleet-outage";
  if (o.trigger) {
    if (info->name != "blip" && !fleet_outage) {
      return sim_usage("--trigger applies to the blip and fleet-outage scenarios only");
    }
    // blip up to 40 s; fleet-outage up to 15 min (seed 003's outage lasted eleven minutes).
    const Duration limit =
        fleet_outage ? Duration(std::chrono::minutes(15)) : Duration(std::chrono::seconds(40));
    if (*o.trigger <= Duration::zero() || *o.trigger > limit) {
      return sim_usage(
          Error{.field = "--trigger",
                .problem = fleet_outage ? "must be in (0s, 15m]" : "must be in (0s, 40s]",
                .got = quote_value(given_text(o.trigger_option))}
              .message());
    }
  }
  if (o.threshold && info->name != "blip") {
    return sim_usage("--threshold applies to the blip scenario only");
  }
  if (!o.plot.empty() && !plot_format_supported(o.plot)) {
    return sim_usage("--plot: '" + o.plot + "' must end in .svg or .png");
  }
  return 0;
}

// Runs the scenario under each policy into `reports`: 0, or kExitUsage after the message.
int simulate(const RunOptions& o, const sim::ScenarioInfo& info,
             const std::vector<std::string>& policies, std::vector<sim::Report>& reports) {
  for (const auto& p : policies) {
    try {
      if (o.trigger && info.name == "fleet-outage") {
        reports.push_back(sim::run_fleet_outage(p, *o.trigger, o.seed));
      } else if (o.trigger) {
        reports.push_back(sim::run_blip(p, *o.trigger, o.seed));
      } else {
        reports.push_back(sim::run_scenario(info.name, p, o.seed));
      }
      if (o.threshold) {
        reports.back().stops_recovering_at =
            sim::blip_threshold(p, kThresholdStep, kThresholdLimit, o.seed);
      }
    } catch (const std::invalid_argument& e) {
      return sim_usage(std::string("--policy: ") + e.what());
    }
  }
  return 0;
}

// The tables of a run for a reader.
void print_run(const RunOptions& o, const sim::ScenarioInfo& info,
               const std::vector<sim::Report>& reports) {
  std::printf("scenario %s (seed %llu): %s\n\n", info.name.c_str(),
              static_cast<unsigned long long>(o.seed), info.description.c_str());
  print_table(reports);
  if (&sim::scenario_policies(info.name) == &sim::hedge_policies()) print_latencies(reports);
  if (info.name == "fleet-outage") print_breakers(reports);
  if (info.name == "demo-story") print_story(reports);
  print_limits(reports);
  for (const auto& r : reports) {
    if (!r.stops_recovering_at) continue;
    if (*r.stops_recovering_at) {
      std::printf("%s stops recovering once capacity stays halved for %s\n", r.policy.c_str(),
                  format_duration(**r.stops_recovering_at).c_str());
    } else {
      std::printf("%s recovers from every capacity drop up to %s\n", r.policy.c_str(),
                  format_duration(kThresholdLimit).c_str());
    }
  }
}

int run_command(const RunOptions& o) {
  const sim::ScenarioInfo* info = nullptr;
  std::vector<std::string> policies;
  if (const int status = check_run(o, info, policies); status != 0) return status;
  std::vector<sim::Report> reports;
  if (const int status = simulate(o, *info, policies, reports); status != 0) return status;
  if (o.json) {
    for (const auto& r : reports) std::printf("%s\n", sim::to_json_line(r).c_str());
  } else {
    print_run(o, *info, reports);
  }
  std::string error;
  if (!o.csv.empty() && !write_file_atomically(o.csv, sim::to_csv(reports), error)) {
    std::fprintf(stderr, "keel sim run: --csv: %s\n", error.c_str());
    return 1;
  }
  if (!o.plot.empty() && !render_plot(reports, o.plot, error)) {
    std::fprintf(stderr, "keel sim run: --plot: %s\n", error.c_str());
    return 1;
  }
  return 0;
}

}  // namespace

Runner add_sim(CLI::App& app) {
  CLI::App* sim = app.add_subcommand(
      "sim", "Simulate retry storms in virtual time with keel's own retry policies");
  sim->require_subcommand(1);
  CLI::App* list = sim->add_subcommand("scenarios", "List the scenarios and their policies");
  auto run_opts = std::make_shared<RunOptions>();
  CLI::App* run = sim->add_subcommand("run", "Run a scenario under one or more policies");
  run->add_option("--scenario", run_opts->scenario, "Scenario name (see `keel sim scenarios`)")
      ->required();
  run->add_option("--policy", run_opts->policies,
                  "Policy to run (repeatable; default: the scenario's own list)");
  add_count(run, "keel sim run", "--seed", run_opts->seed, 0, UINT64_MAX,
            "Seed for arrivals, failures and jitter (0 to 2^64-1)")
      ->default_val("1");
  run->add_flag("--json", run_opts->json, "One JSON object per line, one per policy");
  run->add_option("--csv", run_opts->csv, "Write the time series as CSV to FILE");
  run->add_option("--plot", run_opts->plot,
                  "Render the time series with gnuplot to FILE.svg or FILE.png (one panel per "
                  "policy, same axes)");
  run_opts->trigger_option =
      add_checked(run, "keel sim run", "--trigger", run_opts->trigger,
                  FlagParser<Duration>([](std::string_view text) -> Expected<Duration> {
                    auto d = parse_duration(text);
                    if (!d) return d.error().in("--trigger");
                    return d;
                  }),
                  "blip: how long capacity stays halved (default 5s); fleet-outage: how long "
                  "the dependency is down (default 20s)");
  run->add_flag("--threshold", run_opts->threshold,
                "blip only: also find, per policy, the shortest capacity drop it does not "
                "recover from (a sweep in 250 ms steps up to 20s)");
  Runner serve = add_sim_serve(*sim);

  return [list, run, run_opts, serve]() -> int {
    if (list->parsed()) {
      for (const auto& s : sim::scenarios()) {
        std::printf("%-24s %s\n", s.name.c_str(), s.description.c_str());
        std::string policies;
        for (const auto& p : s.policies) policies += (policies.empty() ? "" : ", ") + p;
        std::printf("%-24s policies: %s\n", "", policies.c_str());
      }
      return 0;
    }
    if (run->parsed()) return run_command(*run_opts);
    return serve();
  };
}

}  // namespace keel::cli
