// The named scenarios of the simulator: each reproduces a figure from the retry literature with
// fixed seeds, and names the retry policies it compares. Also the Brooker contention experiment
// (AWS Architecture Blog, "Exponential Backoff And Jitter", 2015), which has its own small model:
// clients racing to update one row with optimistic concurrency.
//
// Policies are built from keel::core objects only (RetryPolicy, Backoff, and the core's budget
// and breaker where the policy names them): see make_policy().
//
// Thread-safety: every function here is pure (inputs and seed in, report out) and safe to call
// concurrently.
//
// Example:
//   for (const auto& info : keel::sim::scenarios()) std::puts(info.name.c_str());
//   keel::sim::Report r = keel::sim::run_scenario("herd", "full-jitter", /*seed=*/1);
//   r.summary.peak_retries_per_slice;   // about 150, against 1,000 for "fixed"
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/expected.hpp"
#include "keel/sim/engine.hpp"

namespace keel::sim {

struct ScenarioInfo {
  std::string name;
  std::string description;
  std::vector<std::string> policies;  // compared by default, in display order
};

/// Every named scenario, in display order.
[[nodiscard]] const std::vector<ScenarioInfo>& scenarios();
/// The scenario called `name`; nullptr when there is none.
[[nodiscard]] const ScenarioInfo* find_scenario(std::string_view name);

/// Settings a policy takes from its scenario (each scenario has its own).
struct PolicySettings {
  /// Attempts for every policy but naive (naive is always 4: three immediate retries).
  /// Requires: >= 1. Default 4.
  int max_attempts = 4;
  /// Backoff base (fixed: the fixed delay). Requires: > 0. Default 100 ms.
  Duration base = std::chrono::milliseconds(100);
  /// Backoff cap. Requires: >= base. Default 10 s.
  Duration cap = std::chrono::seconds(10);
  /// Per-attempt timeout. Default none.
  Duration per_try_timeout = kInfinite;
  /// The budget's ratio of retries to requests. Requires: in (0, 1]. Default 0.1.
  double budget_ratio = 0.1;
  /// full-jitter+fixed-limit: each process's fixed concurrency limit. Requires: in [1, 2^20].
  /// Default 40.
  std::int64_t fixed_limit = 40;
  /// full-jitter+rate-limit and +shared-rate-limit: the bucket's rate. Requires: in (0, 1e6].
  /// Default 50.
  double rate_per_s = 50;
};

/// Policy names make_policy() knows, in display order.
[[nodiscard]] const std::vector<std::string>& policy_names();

/// Builds the named policy: naive (3 immediate retries), fixed (the base delay every time),
/// exponential (no jitter), full-jitter, equal-jitter, decorrelated-jitter, full-jitter+budget,
/// full-jitter+budget+breaker, full-jitter+breaker (a breaker per process, no budget),
/// full-jitter+shared-breaker (the same breakers shared by the fleet: SharedBreakers with its
/// default 500 ms propagation), full-jitter+adaptive-limit (a keel::AdaptiveConcurrencyLimit per
/// process, no budget), full-jitter+fixed-limit (a fixed concurrency limit of fixed_limit per
/// process), full-jitter+rate-limit (a keel::RateLimit of rate_per_s per process) and
/// full-jitter+shared-rate-limit (one for the fleet), one-layer, and three fixed formulas that take
/// only max_attempts and per_try_timeout from the settings: keel-default (BackoffOptions{}),
/// aws-standard (full jitter, base 1 s, cap 20 s) and fleet (BackoffOptions::fleet()). Throws
/// std::invalid_argument naming the policy and the known names when `name` is unknown, or when the
/// policy needs a core feature this build lacks.
[[nodiscard]] ClientPolicy make_policy(std::string_view name, const PolicySettings& settings);

/// A labelled span of a scenario's timeline, for reports and plots (demo-story: steady, blip,
/// after the blip, outage, after the outage). The engine does not read it.
struct Phase {
  std::string label;
  Window span;
};

/// One policy's outcome in one scenario (one line of the JSON report, report_json).
struct Report {
  std::string scenario;
  std::string policy;
  std::uint64_t seed = 0;
  Summary summary;
  std::vector<Slice> slices;
  Duration slice{};
  Duration duration{};
  Duration trigger_end{};
  /// Brooker only: mean completion time (the last client's success) and mean calls, over runs.
  std::optional<double> completion_ms;
  std::optional<double> mean_calls;
  int runs = 1;
  /// Blip with a threshold sweep only: the shortest trigger this policy does not recover from
  /// (nullopt: recovered from every trigger swept). Printed as stops_recovering_at_s.
  std::optional<std::optional<Duration>> stops_recovering_at;
  /// The dependency's capacity in requests/s at the start of each slice (one entry per slice):
  /// capacity_per_s, times capacity_drop_factor inside the capacity drop, 0 inside the outage.
  /// Empty for the models without that dependency (brooker, hedge-tail, hedge-brownout).
  std::vector<double> capacity;
  /// The scenario's phases in time order; empty for a scenario without named phases.
  std::vector<Phase> phases;
};

/// One phase of a run measured against the dependency's capacity (Report::capacity): a slice is
/// over capacity when its attempts per second exceed the capacity at the slice's start.
struct PhaseLoad {
  std::string label;
  Window span;
  std::int64_t calls = 0;     // attempts sent to the dependency in the phase's slices
  double mean_per_s = 0;      // calls / the phase's length
  double peak_per_s = 0;      // the phase's busiest slice, in attempts per second
  double capacity_per_s = 0;  // the highest capacity in the phase
  Duration over_capacity{};   // total length of the phase's slices over capacity
  /// From the phase's start to the first slice from which every slice of the phase is at or under
  /// capacity (zero when all are); nullopt when the phase's last slice is over capacity.
  std::optional<Duration> under_capacity_after;
};

/// The report's phases measured, in order; empty when the report has no phases or no capacity.
/// A phase covers the slices whose start lies in its span.
[[nodiscard]] std::vector<PhaseLoad> phase_loads(const Report& report);

/// Runs a named scenario with a named policy. Throws std::invalid_argument for an unknown
/// scenario or policy (the message lists the known names).
[[nodiscard]] Report run_scenario(std::string_view scenario, std::string_view policy,
                                  std::uint64_t seed);

/// The blip scenario with a capacity drop of `trigger` instead of the default.
[[nodiscard]] Report run_blip(std::string_view policy, Duration trigger, std::uint64_t seed);

/// The fleet-outage scenario (500 pods, a dependency down from t = 10 s) with an outage of
/// `outage` instead of the default 20 s; recovery is measured from its end.
[[nodiscard]] Report run_fleet_outage(std::string_view policy, Duration outage, std::uint64_t seed);

/// The shortest trigger in {step, 2*step, ...} up to `limit` after which `policy` does not
/// recover in the blip scenario; nullopt when it recovers from every trigger up to `limit`.
[[nodiscard]] std::optional<Duration> blip_threshold(std::string_view policy, Duration step,
                                                     Duration limit, std::uint64_t seed);

/// The Brooker contention experiment.
struct BrookerConfig {
  /// Clients racing for the row. Requires: >= 1. Default 100.
  int clients = 100;
  /// One-way network delay ~ normal(mean, sd), clamped at 0. Defaults 10 ms and 2 ms.
  Duration network_mean = std::chrono::milliseconds(10);
  Duration network_sd = std::chrono::milliseconds(2);
  /// Backoff base and cap. Defaults 5 ms and 2 s.
  Duration base = std::chrono::milliseconds(5);
  Duration cap = std::chrono::seconds(2);
  /// Independent runs averaged. Requires: >= 1. Default 100.
  int runs = 100;
};

/// "none" (no backoff), "exponential", "full", "equal", "decorrelated" (Brooker's five).
[[nodiscard]] const std::vector<std::string>& brooker_policies();

/// Runs the experiment for one of brooker_policies(). Each run: every client starts at t = 0 and
/// retries until its conditional write succeeds; reports the mean calls and completion time.
[[nodiscard]] Report run_brooker(std::string_view policy, const BrookerConfig& config,
                                 std::uint64_t seed);

/// The hedging experiment (scenarios hedge-tail and hedge-brownout): an open stream of
/// safe-to-repeat requests (Poisson arrivals) whose attempts take lognormal(median, sigma), or,
/// with probability slow_fraction (brownout_slow_fraction between brownout_start and
/// brownout_end), uniform in [slow_min, slow_max]. Each request is a keel::RetryState with a
/// keel::HedgeState; hedges draw on a keel::RatioBudget under the hedge+budget policy.
struct HedgeTailConfig {
  double rate_per_s = 1000;                         // requests per second
  Duration duration = std::chrono::seconds(30);     // of arrivals
  Duration slice = std::chrono::milliseconds(100);  // of the time series
  Duration median = std::chrono::milliseconds(8);   // of a fast attempt
  double sigma = 0.35;                              // lognormal shape of a fast attempt
  double slow_fraction = 0.03;                      // attempts in the tail
  Duration slow_min = std::chrono::milliseconds(300);
  Duration slow_max = std::chrono::milliseconds(1200);
  Duration brownout_start{};  // none by default
  Duration brownout_end{};
  double brownout_slow_fraction = 0.5;
  Duration hedge_delay = std::chrono::milliseconds(30);  // about p99.5 of a fast attempt
  int max_hedges = 1;
  double budget_ratio = 0.1;         // hedges per request (RatioBudgetOptions::ratio)
  double reserve_per_second = 10.0;  // RatioBudgetOptions::reserve_per_second
};

/// "no-hedge", "hedge" (no budget), "hedge+budget" (hedges charged to a 10% RatioBudget).
[[nodiscard]] const std::vector<std::string>& hedge_policies();

/// Runs the hedging experiment for one of hedge_policies(): summary.p50_latency and
/// p99_latency are those of the requests, amplification - 1 the extra load hedging added,
/// wasted the losing attempts the dependency served anyway.
[[nodiscard]] Report run_hedge_tail(std::string_view policy, const HedgeTailConfig& config,
                                    std::uint64_t seed);

/// The receiver's admission in the overload scenario: "fixed-admission" (a fixed limit set
/// where the latency bound allows), "fixed-admission-2x" (the same set 2x too high) and
/// "adaptive-admission" (AdmissionOptions::adaptive). Its clients retry with full jitter.
[[nodiscard]] const std::vector<std::string>& admission_policies();

/// The policies the named scenario compares: brooker_policies(),
/// hedge_policies(), admission_policies() (overload-3x) or policy_names().
[[nodiscard]] const std::vector<std::string>& scenario_policies(std::string_view scenario);

/// The explorer page's model: a fleet of clients that all call at t = 0 into an outage, then a
/// healthy dependency of the given capacity. Every field is validated by explorer_scenario().
struct ExplorerParams {
  std::int64_t fleet = 1000;                  // clients, in [1, 100000]
  double capacity_per_s = 5000;               // in [1, 1e6]
  Duration outage = std::chrono::seconds(5);  // in [0, 60 s]
  int attempts = 5;                           // in [1, 20]
  Duration base = std::chrono::seconds(1);    // in [1 ms, 10 s]
  bool jitter = true;
  bool budget = false;
  bool breaker = false;
  /// An adaptive concurrency limit on the clients' calls (keel::AdaptiveConcurrencyLimit).
  bool limit = false;
};

/// The explorer's query (GET /api/sim?fleet=&capacity=&outage_s=&attempts=&base_ms=&jitter=
/// &budget=&breaker=[&seed=]) read into its parameters: `get(name)` gives a parameter's value or
/// nullopt when absent (an absent one keeps its default). Numbers must be plain decimal in
/// range; booleans 0, 1, true or false. Returns the parameters, or an Error naming the first bad
/// parameter and its value ("fleet must be in [1, 100000] (got '500000')").
/// With `fleet_breakers=per-pod` or `fleet_breakers=shared` the query asks for the fleet-outage
/// scenario instead (its outage lasting outage_s; the other parameters are not used), with
/// breakers per pod or shared by the fleet: fleet_breakers is then false or true. With
/// `scenario=overload-3x` or `scenario=fleet-rate-limit` and `policy=` one of that scenario's
/// policies (scenario_policies), it asks for that named run instead (the limits' comparisons).
/// `limit` (a boolean) adds an adaptive concurrency limit to the explorer model's clients.
struct ExplorerQuery {
  ExplorerParams params;
  std::uint64_t seed = 1;
  std::optional<bool> fleet_breakers;
  std::string scenario;  // empty: the explorer model (or fleet_breakers)
  std::string policy;    // with scenario
};
[[nodiscard]] Expected<ExplorerQuery> parse_explorer_query(
    const std::function<std::optional<std::string>(std::string_view name)>& get);

/// Runs the explorer model (30 s, 100 ms slices). Throws std::invalid_argument naming the
/// parameter when one is out of range.
[[nodiscard]] Report run_explorer(const ExplorerParams& params, std::uint64_t seed);

/// Runs what an explorer query asks for: the explorer model, or the fleet-outage scenario with
/// the query's outage (full-jitter+breaker, or full-jitter+shared-breaker when shared).
[[nodiscard]] Report run_explorer_query(const ExplorerQuery& query);

/// One line of JSON (no newline) with the fields documented in docs/simulator.md: scenario,
/// policy, first_attempts, total_calls, amplification, offered_per_s, peak_per_slice, slice_ms,
/// peak_retries_per_slice, bottom_calls, recovered, recovery_s, completion_ms, ...
[[nodiscard]] std::string to_json_line(const Report& report);

/// The same with the time series added ("series": {"t_s": [...], "offered": [...], ...}).
[[nodiscard]] std::string to_json_with_series(const Report& report);

/// CSV of the time series: a header line, then one line per slice.
[[nodiscard]] std::string to_csv(const std::vector<Report>& reports);

}  // namespace keel::sim
