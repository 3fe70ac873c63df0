#include "keel/sim/scenarios.hpp"

#include <algorithm>
#include <chrono>
#include <sstream>
#include <stdexcept>
#include <string>

#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "policies.hpp"

namespace keel::sim {

using std::chrono::milliseconds;
using std::chrono::seconds;

namespace {

struct Definition {
  ScenarioInfo info;
  Scenario scenario;
  PolicySettings settings;
};

Scenario worked_example(bool feedback) {
  Scenario s;
  s.name = feedback ? "worked-example-feedback" : "worked-example";
  s.clients.arrivals_per_s = 10'000;
  s.dependency.capacity_per_s = 12'000;
  s.dependency.service_time = milliseconds(10);
  s.dependency.failure_fraction = 0.5;
  if (feedback) {
    // Failed attempts cost a full service time, the queue holds 100 ms of work, and a request
    // that arrives while every server is busy fails more often: overload feeds failures.
    s.dependency.failures_are_free = false;
    s.dependency.queue_limit = 1200;
    s.dependency.overload_failure = 0.25;
  } else {
    // The article's arithmetic: failures are independent of load and cost nothing.
    s.dependency.failures_are_free = true;
    s.dependency.queue_limit = 12'000;
  }
  s.duration = seconds(20);
  s.slice = seconds(1);
  s.steady = {seconds(5), seconds(20)};
  return s;
}

Scenario herd() {
  Scenario s;
  s.name = "herd";
  s.clients.population = 1000;
  s.dependency.capacity_per_s = 100'000;
  s.dependency.service_time = milliseconds(10);
  s.dependency.queue_limit = 100'000;
  s.dependency.outage = {Duration::zero(), seconds(10)};
  s.duration = seconds(20);
  s.slice = milliseconds(100);
  s.trigger_end = seconds(10);
  return s;
}

// A fleet-wide outage: every client's first call fails at t = 0, the dependency stays down for
// kFleetOutage and then serves kFleetCapacity requests/s with 100 ms of queue; requests beyond
// that are shed and retried like the outage's failures.
constexpr Duration kFleetOutage = seconds(5);
constexpr double kFleetCapacity = 2'000;

Scenario fleet_herd() {
  Scenario s;
  s.name = "fleet-herd";
  s.clients.population = 10'000;
  s.dependency.capacity_per_s = kFleetCapacity;
  s.dependency.service_time = milliseconds(10);
  s.dependency.queue_limit = static_cast<std::int64_t>(kFleetCapacity / 10);
  s.dependency.outage = {Duration::zero(), kFleetOutage};
  s.duration = seconds(60);
  s.slice = milliseconds(100);
  s.trigger_end = kFleetOutage;
  return s;
}

Scenario layers() {
  Scenario s;
  s.name = "layers";
  s.clients.population = 1;
  s.clients.layers = 3;
  s.dependency.capacity_per_s = 1000;
  s.dependency.failure_fraction = 1.0;
  s.dependency.failures_are_free = true;
  s.duration = seconds(10);
  s.slice = milliseconds(100);
  return s;
}

}  // namespace

Scenario blip_scenario(Duration trigger) {
  Scenario s;
  s.name = "blip";
  s.clients.arrivals_per_s = 900;
  s.dependency.capacity_per_s = 1000;
  s.dependency.service_time = milliseconds(20);
  s.dependency.queue_limit = 1000;
  s.dependency.capacity_drop = {seconds(10), seconds(10) + trigger};
  s.dependency.capacity_drop_factor = 0.5;
  s.duration = seconds(60);
  s.slice = milliseconds(500);
  s.trigger_end = seconds(10) + trigger;
  return s;
}

// Seed 003's fleet: kFleetPods pods behind a load balancer (each operation goes to a pod at
// random), together kFleetOutageRate operations/s (one per pod per second) against a dependency
// with capacity to spare, which refuses every request at once from t = 10 s for `outage`.
constexpr int kFleetPods = 500;
constexpr double kFleetOutageRate = 500;
constexpr Duration kFleetOutageStart = seconds(10);

Scenario fleet_outage_scenario(Duration outage) {
  Scenario s;
  s.name = "fleet-outage";
  s.clients.arrivals_per_s = kFleetOutageRate;
  s.clients.processes = kFleetPods;
  s.clients.random_process = true;
  s.dependency.capacity_per_s = 2000;
  s.dependency.service_time = milliseconds(10);
  s.dependency.queue_limit = 200;
  s.dependency.outage = {kFleetOutageStart, kFleetOutageStart + outage};
  s.duration = kFleetOutageStart + outage + seconds(20);
  s.slice = milliseconds(500);
  s.trigger_end = kFleetOutageStart + outage;
  return s;
}

namespace {

// The demo's story on one timeline (docs/simulator.md, "demo-story"): the blip's dependency
// (capacity 1,000/s, 20 ms per request, a queue of 1,000, clients giving up on an attempt after
// 300 ms) with arrivals at 70% of capacity, so a 10% budget's load (about 770/s) stays well under
// it; capacity halves for 3 s, then the dependency is down for 10 s.
constexpr double kStoryArrivals = 700;
constexpr Duration kStoryBlipStart = seconds(10);
constexpr Duration kStoryBlipEnd = seconds(13);
constexpr Duration kStoryOutageStart = seconds(35);
constexpr Duration kStoryOutageEnd = seconds(45);
constexpr Duration kStoryDuration = seconds(60);

Scenario demo_story_scenario() {
  Scenario s = blip_scenario(kStoryBlipEnd - kStoryBlipStart);
  s.name = "demo-story";
  s.clients.arrivals_per_s = kStoryArrivals;
  s.dependency.capacity_drop = {kStoryBlipStart, kStoryBlipEnd};
  s.dependency.outage = {kStoryOutageStart, kStoryOutageEnd};
  s.duration = kStoryDuration;
  // Summary::recovery is measured from the outage's end; the blip's aftermath is read from the
  // phases (phase_loads).
  s.trigger_end = kStoryOutageEnd;
  return s;
}

std::vector<Phase> demo_story_phases() {
  return {{"steady", {Duration::zero(), kStoryBlipStart}},
          {"blip", {kStoryBlipStart, kStoryBlipEnd}},
          {"after the blip", {kStoryBlipEnd, kStoryOutageStart}},
          {"outage", {kStoryOutageStart, kStoryOutageEnd}},
          {"after the outage", {kStoryOutageEnd, kStoryDuration}}};
}

// The blip with receiver-side shedding (keel::AdmissionLimiter at the dependency): at most
// kShedLimit requests in the dependency (served or queued) before retries are refused, for free,
// with a full-jitter Retry-After under 1 s; first attempts kShedQueue beyond that. 200 in the
// dependency at 1,000 req/s is a 200 ms wait, inside the clients' 300 ms per-attempt timeout.
constexpr std::int64_t kShedLimit = 150;
constexpr std::int64_t kShedQueue = 50;

Scenario blip_shed_scenario() {
  Scenario s = blip_scenario(seconds(5));
  s.name = "blip-shed";
  s.dependency.admission_limit = kShedLimit;
  s.dependency.admission_queue = kShedQueue;
  s.dependency.admission_retry_after_max = seconds(1);
  return s;
}

// A receiver under 3x overload (docs/concurrency.md): 3,000 new requests/s against 10 servers of
// 10 ms (1,000/s), behind keel's admission, whose clients retry a shed request after its
// Retry-After (full jitter under 1 s). The bound: p99 of an admitted request's time in the
// receiver at most 2x its unloaded 10 ms, so at most 20 in it at once; a fixed limit set there
// (18 + 2 first attempts beyond) meets it, one set 2x too high (38 + 2) does not, and the
// adaptive limit finds its own.
constexpr std::int64_t kOverloadQueue = 2;
constexpr std::int64_t kOverloadFixed = 18;

Scenario overload_scenario(std::string_view admission) {
  Scenario s;
  s.name = "overload-3x";
  s.clients.arrivals_per_s = 3000;
  s.dependency.capacity_per_s = 1000;
  s.dependency.service_time = milliseconds(10);
  s.dependency.queue_limit = 1000;
  s.dependency.admission_queue = kOverloadQueue;
  s.dependency.admission_retry_after_max = seconds(1);
  if (admission == "adaptive-admission") {
    s.dependency.admission_adaptive = ConcurrencyLimitOptions{};
  } else if (admission == "fixed-admission-2x") {
    s.dependency.admission_limit = 2 * (kOverloadFixed + kOverloadQueue) - kOverloadQueue;
  } else {
    s.dependency.admission_limit = kOverloadFixed;
  }
  s.duration = seconds(30);
  s.slice = seconds(1);
  s.steady = {seconds(5), seconds(30)};
  return s;
}

// A fleet of 8 worker processes against an API that answers 429 (Retry-After: 1 s) above 50
// requests in any second: 100 jobs/s arrive, spread over the processes. With a bucket of 50/s
// per process the fleet may send 400/s; with the fleet's shared bucket, 50/s.
Scenario fleet_rate_scenario() {
  Scenario s;
  s.name = "fleet-rate-limit";
  s.clients.arrivals_per_s = 100;
  s.clients.processes = 8;
  s.dependency.capacity_per_s = 1000;
  s.dependency.service_time = milliseconds(10);
  s.dependency.rate_limit_per_s = 50;
  s.dependency.rate_limit_retry_after = seconds(1);
  s.duration = seconds(30);
  s.slice = seconds(1);
  s.steady = {seconds(5), seconds(30)};
  return s;
}

// The retry storms: worked examples, herds, fleets failing together, layers of retries.
void add_storm_definitions(std::vector<Definition>& d) {
  const std::vector<std::string> common = {"naive",
                                           "fixed",
                                           "exponential",
                                           "full-jitter",
                                           "full-jitter+budget",
                                           "full-jitter+budget+breaker"};
  d.push_back({{"worked-example",
                "10,000 req/s against capacity 12,000 with 50% of requests failing "
                "independently: naive retries offer about 18,750 req/s, a 10% budget about "
                "11,000",
                common},
               worked_example(false),
               {.max_attempts = 4, .base = milliseconds(100), .cap = seconds(1)}});
  d.push_back({{"worked-example-feedback",
                "the same, but failures cost capacity and overload raises the failure rate: "
                "naive retries feed the overload, a budget stays under capacity",
                common},
               worked_example(true),
               {.max_attempts = 4,
                .base = milliseconds(100),
                .cap = seconds(1),
                .per_try_timeout = seconds(1)}});
  d.push_back({{"herd",
                "1,000 clients fail together at t=0 (a 10 s outage): fixed delays retry in "
                "spikes of 1,000 every second, exponential at 1, 3, 7 s, full jitter flat",
                {"naive", "fixed", "exponential", "full-jitter", "full-jitter+budget",
                 "full-jitter+budget+breaker"}},
               herd(),
               {.max_attempts = 5, .base = seconds(1), .cap = seconds(60)}});
  d.push_back({{"fleet-herd",
                "10,000 clients fail together at t=0, the dependency stays down 5 s and then "
                "serves 2,000 req/s; 6 attempts: keel's default retries fastest and gives up "
                "inside the outage, the fleet preset has the lowest peak and its median client "
                "succeeds before AWS standard's",
                {"keel-default", "aws-standard", "fleet"}},
               fleet_herd(),
               {.max_attempts = 6}});
  d.push_back({{"layers",
                "three layers each retrying an always-failing call: 3 attempts per layer send "
                "27 calls to the bottom, 4 attempts (naive) 64, one retrying layer 3",
                {"naive", "exponential", "full-jitter", "one-layer"}},
               layers(),
               {.max_attempts = 3, .base = milliseconds(10), .cap = milliseconds(100)}});
}

// The dependency's capacity: a blip, shedding, the demo's timeline, a receiver overloaded 3x.
void add_capacity_definitions(std::vector<Definition>& d) {
  d.push_back({{"blip",
                "arrivals at 90% of capacity, 300 ms per-attempt timeout; capacity halves for "
                "5 s at t=10 s: naive retries keep the dependency overloaded after capacity "
                "returns (metastable), full jitter with a budget recovers",
                {"naive", "exponential", "full-jitter", "full-jitter+budget",
                 "full-jitter+budget+breaker"}},
               blip_scenario(seconds(5)),
               {.max_attempts = 4,
                .base = milliseconds(100),
                .cap = seconds(2),
                .per_try_timeout = milliseconds(300)}});
  d.push_back({{"blip-shed",
                "the blip with receiver-side shedding: past 150 requests in the dependency "
                "retries are refused first (free, Retry-After under 1 s), first attempts past "
                "200; naive clients recover where they never do in blip",
                {"naive", "full-jitter", "full-jitter+budget", "full-jitter+adaptive-limit",
                 "full-jitter+fixed-limit"}},
               blip_shed_scenario(),
               {.max_attempts = 4,
                .base = milliseconds(100),
                .cap = seconds(2),
                .per_try_timeout = milliseconds(300)}});
  d.push_back({{"demo-story",
                "the demo's timeline: steady arrivals at 70% of capacity; capacity halves for "
                "3 s at t=10 s (naive retries keep the load over capacity until the outage, a "
                "budget is back under at once); the dependency is down from t=35 s to 45 s "
                "(naive sends 4 calls per operation into it, a budget about 1.1)",
                {"naive", "full-jitter", "full-jitter+budget"}},
               demo_story_scenario(),
               {.max_attempts = 4,
                .base = milliseconds(100),
                .cap = seconds(2),
                .per_try_timeout = milliseconds(300)}});
  d.push_back({{"overload-3x",
                "a receiver under 3x overload (3,000 requests/s against 1,000/s, 10 ms each): "
                "adaptive admission keeps goodput at capacity with p99 inside 2x the unloaded "
                "10 ms; a fixed limit set where the bound allows meets it too, one set 2x too "
                "high does not (p99 about 40 ms: the queue it admits)",
                admission_policies()},
               Scenario{},
               {.max_attempts = 3,
                .base = milliseconds(100),
                .cap = seconds(1),
                .per_try_timeout = seconds(1)}});
}

// What a fleet shares, contention on one row (brooker), and hedging.
void add_fleet_contention_hedge_definitions(std::vector<Definition>& d) {
  d.push_back({{"fleet-rate-limit",
                "8 worker processes, 100 jobs/s, against an API that answers 429 above 50 "
                "requests in any second: a 50/s bucket per process lets the fleet send 8 "
                "times the limit and collect 429s; the fleet's shared bucket sends 50/s and "
                "none",
                {"full-jitter", "full-jitter+rate-limit", "full-jitter+shared-rate-limit"}},
               fleet_rate_scenario(),
               {.max_attempts = 4, .base = milliseconds(100), .cap = seconds(2)}});
  d.push_back({{"fleet-outage",
                "seed 003's fleet: 500 pods, 1 operation/s each, the dependency refuses "
                "everything for 20 s: per-pod breakers each learn and probe alone, shared "
                "breakers open together and send one probe per break",
                {"full-jitter+breaker", "full-jitter+shared-breaker"}},
               fleet_outage_scenario(seconds(20)),
               {.max_attempts = 4, .base = milliseconds(200), .cap = seconds(2)}});
  d.push_back({{"brooker",
                "AWS 2015 contention experiment: 100 clients race to update one row with "
                "optimistic concurrency (network normal(10 ms, 2 ms) per hop, base 5 ms, cap "
                "2 s), calls and completion time averaged over 100 runs",
                brooker_policies()},
               Scenario{},
               {}});
  d.push_back({{"hedge-tail",
                "1,000 safe requests/s for 30 s, 3% of attempts slow (300 ms to 1.2 s, "
                "else lognormal around 8 ms): a hedge after 30 ms cuts p99 to the fast "
                "path's, for about 3% more load",
                hedge_policies()},
               Scenario{},
               {}});
  d.push_back({{"hedge-brownout",
                "hedge-tail with half of all attempts slow from t=10 s to t=20 s: unbudgeted "
                "hedges add half again to the load of a struggling dependency, hedges "
                "charged to a 10% budget stay within it",
                hedge_policies()},
               Scenario{},
               {}});
}

const std::vector<Definition>& definitions() {
  static const std::vector<Definition> defs = [] {
    std::vector<Definition> d;
    add_storm_definitions(d);
    add_capacity_definitions(d);
    add_fleet_contention_hedge_definitions(d);
    return d;
  }();
  return defs;
}

}  // namespace

const std::vector<ScenarioInfo>& scenarios() {
  static const std::vector<ScenarioInfo> infos = [] {
    std::vector<ScenarioInfo> out;
    for (const auto& d : definitions()) out.push_back(d.info);
    return out;
  }();
  return infos;
}

const ScenarioInfo* find_scenario(std::string_view name) {
  for (const auto& info : scenarios()) {
    if (info.name == name) return &info;
  }
  return nullptr;
}

namespace {

const Definition& definition(std::string_view name) {
  for (const auto& d : definitions()) {
    if (d.info.name == name) return d;
  }
  std::vector<std::string> known;
  for (const auto& d : definitions()) known.push_back(d.info.name);
  refuse_unknown_name("keel::sim::run_scenario", "scenario", "a known scenario", known, name);
}

HedgeTailConfig hedge_brownout_config() {
  HedgeTailConfig c;
  c.brownout_start = seconds(10);
  c.brownout_end = seconds(20);
  c.brownout_slow_fraction = 0.5;
  return c;
}

Report report_of(const Scenario& s, std::string_view policy, std::uint64_t seed, Result r) {
  Report out;
  out.scenario = s.name;
  out.policy = std::string(policy);
  out.seed = seed;
  out.summary = r.summary;
  out.slices = std::move(r.slices);
  out.slice = s.slice;
  out.duration = s.duration;
  out.trigger_end = s.trigger_end;
  const auto& dep = s.dependency;
  out.capacity.reserve(out.slices.size());
  for (std::size_t i = 0; i < out.slices.size(); ++i) {
    const Duration at = s.slice * static_cast<std::int64_t>(i);
    double capacity = dep.capacity_per_s;
    if (dep.capacity_drop.contains(at)) capacity *= dep.capacity_drop_factor;
    if (dep.outage.contains(at)) capacity = 0;
    out.capacity.push_back(capacity);
  }
  if (s.name == "demo-story") out.phases = demo_story_phases();
  return out;
}

}  // namespace

Report run_scenario(std::string_view scenario, std::string_view policy, std::uint64_t seed) {
  const Definition& d = definition(scenario);
  if (d.info.name == "brooker") return run_brooker(policy, BrookerConfig{}, seed);
  if (d.info.name == "hedge-tail") return run_hedge_tail(policy, HedgeTailConfig{}, seed);
  if (d.info.name == "hedge-brownout") {
    Report r = run_hedge_tail(policy, hedge_brownout_config(), seed);
    r.scenario = "hedge-brownout";
    return r;
  }
  if (d.info.name == "overload-3x") {
    if (std::find(admission_policies().begin(), admission_policies().end(), policy) ==
        admission_policies().end()) {
      refuse_unknown_name("keel::sim::run_scenario", "policy", "one of the overload-3x admissions",
                          admission_policies(), policy);
    }
    const Scenario s = overload_scenario(policy);
    return report_of(s, policy, seed, run(s, make_policy("full-jitter", d.settings), seed));
  }
  const ClientPolicy p = make_policy(policy, d.settings);
  return report_of(d.scenario, policy, seed, run(d.scenario, p, seed));
}

const std::vector<std::string>& admission_policies() {
  static const std::vector<std::string> names = {"fixed-admission", "fixed-admission-2x",
                                                 "adaptive-admission"};
  return names;
}

const std::vector<std::string>& scenario_policies(std::string_view scenario) {
  if (scenario == "brooker") return brooker_policies();
  if (scenario == "hedge-tail" || scenario == "hedge-brownout") return hedge_policies();
  if (scenario == "overload-3x") return admission_policies();
  return policy_names();
}

Report run_blip(std::string_view policy, Duration trigger, std::uint64_t seed) {
  const Definition& d = definition("blip");
  const Scenario s = blip_scenario(trigger);
  const ClientPolicy p = make_policy(policy, d.settings);
  return report_of(s, policy, seed, run(s, p, seed));
}

Report run_fleet_outage(std::string_view policy, Duration outage, std::uint64_t seed) {
  const Definition& d = definition("fleet-outage");
  const Scenario s = fleet_outage_scenario(outage);
  const ClientPolicy p = make_policy(policy, d.settings);
  return report_of(s, policy, seed, run(s, p, seed));
}

std::vector<PhaseLoad> phase_loads(const Report& r) {
  std::vector<PhaseLoad> out;
  if (r.capacity.size() != r.slices.size() || r.slice <= Duration::zero()) return out;
  const double slice_s = std::chrono::duration<double>(r.slice).count();
  for (const Phase& phase : r.phases) {
    PhaseLoad p;
    p.label = phase.label;
    p.span = phase.span;
    // The first slice of the phase's final run of slices at or under capacity (none yet: npos).
    constexpr std::size_t kNoSlice = static_cast<std::size_t>(-1);
    std::size_t settled = kNoSlice;
    bool last_over = false;
    for (std::size_t i = 0; i < r.slices.size(); ++i) {
      const Duration at = r.slice * static_cast<std::int64_t>(i);
      if (!phase.span.contains(at)) continue;
      const double per_s = static_cast<double>(r.slices[i].offered) / slice_s;
      p.calls += r.slices[i].offered;
      p.peak_per_s = std::max(p.peak_per_s, per_s);
      p.capacity_per_s = std::max(p.capacity_per_s, r.capacity[i]);
      last_over = per_s > r.capacity[i];
      if (last_over) {
        p.over_capacity += r.slice;
        settled = kNoSlice;
      } else if (settled == kNoSlice) {
        settled = i;
      }
    }
    const double span_s = std::chrono::duration<double>(phase.span.end - phase.span.start).count();
    p.mean_per_s = span_s > 0 ? static_cast<double>(p.calls) / span_s : 0.0;
    if (!last_over) {
      const Duration from =
          settled != kNoSlice ? r.slice * static_cast<std::int64_t>(settled) : phase.span.start;
      p.under_capacity_after = std::max(Duration::zero(), from - phase.span.start);
    }
    out.push_back(std::move(p));
  }
  return out;
}

std::optional<Duration> blip_threshold(std::string_view policy, Duration step, Duration limit,
                                       std::uint64_t seed) {
  if (step <= Duration::zero()) {
    throw_invalid({.context = "keel::sim::blip_threshold",
                   .field = "step",
                   .problem = "must be > 0",
                   .got = format_duration(step)});
  }
  for (Duration t = step; t <= limit; t += step) {
    if (!run_blip(policy, t, seed).summary.recovered) return t;
  }
  return std::nullopt;
}

Report run_explorer_query(const ExplorerQuery& q) {
  if (!q.scenario.empty()) return run_scenario(q.scenario, q.policy, q.seed);
  if (!q.fleet_breakers) return run_explorer(q.params, q.seed);
  if (q.params.outage < Duration::zero() || q.params.outage > seconds(60)) {
    throw_invalid({.context = "keel::sim::ExplorerParams",
                   .field = "outage",
                   .problem = "must be in [0s, 60s]",
                   .got = format_duration(q.params.outage)});
  }
  return run_fleet_outage(*q.fleet_breakers ? "full-jitter+shared-breaker" : "full-jitter+breaker",
                          q.params.outage, q.seed);
}

Report run_explorer(const ExplorerParams& p, std::uint64_t seed) {
  const auto bad = [](std::string_view field, std::string_view requirement, std::string got) {
    throw_invalid({.context = "keel::sim::ExplorerParams",
                   .field = std::string(field),
                   .problem = "must be in " + std::string(requirement),
                   .got = std::move(got)});
  };
  if (p.fleet < 1 || p.fleet > 100'000) bad("fleet", "[1, 100000]", std::to_string(p.fleet));
  if (!(p.capacity_per_s >= 1 && p.capacity_per_s <= 1e6)) {
    std::ostringstream got;
    got << p.capacity_per_s << " req/s";
    bad("capacity_per_s", "[1, 1000000] req/s", got.str());
  }
  if (p.outage < Duration::zero() || p.outage > seconds(60)) {
    bad("outage", "[0s, 60s]", format_duration(p.outage));
  }
  if (p.attempts < 1 || p.attempts > 20) bad("attempts", "[1, 20]", std::to_string(p.attempts));
  if (p.base < milliseconds(1) || p.base > seconds(10)) {
    bad("base", "[1ms, 10s]", format_duration(p.base));
  }
  Scenario s;
  s.name = "explorer";
  s.clients.population = p.fleet;
  s.dependency.capacity_per_s = p.capacity_per_s;
  s.dependency.service_time = milliseconds(10);
  s.dependency.queue_limit = std::max<std::int64_t>(1, static_cast<std::int64_t>(p.capacity_per_s));
  s.dependency.outage = {Duration::zero(), p.outage};
  s.duration = seconds(30);
  s.slice = milliseconds(100);
  s.trigger_end = p.outage;
  PolicySettings settings{.max_attempts = p.attempts, .base = p.base, .cap = seconds(60)};
  std::string name = p.jitter ? "full-jitter" : "exponential";
  if (p.budget) name += "+budget";
  if (p.breaker) name += "+breaker";
  if (p.limit) name += "+adaptive-limit";
  ClientPolicy policy = make_explorer_policy(p.jitter, p.budget, p.breaker, settings);
  if (p.limit) policy.concurrency_limit = ConcurrencyLimitOptions{};
  return report_of(s, name, seed, run(s, policy, seed));
}

}  // namespace keel::sim
