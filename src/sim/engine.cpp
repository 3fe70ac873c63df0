// The engine's construction and its event loop (Engine::run), the scenario's checks and the
// entry point run(). What happens at each event is in the files of its concern: the clients'
// operations (engine_client.cpp), the breakers (engine_breakers.cpp), the dependency
// (engine_dependency.cpp) and the summary of a run (engine_summary.cpp).
#include "keel/sim/engine.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>

#include "detail/engine.hpp"
#include "keel/core/admission.hpp"
#include "keel/core/concurrency_limit.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "keel/core/random.hpp"
#include "keel/core/rate_limit.hpp"

namespace keel::sim {

namespace {

[[noreturn]] void reject(const std::string& field, const std::string& requirement,
                         const std::string& got) {
  throw_invalid({.context = "keel::sim::Scenario",
                 .field = field,
                 .problem = "must be " + requirement,
                 .got = got});
}

std::string num(double v) {
  std::string s = std::to_string(v);
  while (s.size() > 1 && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

}  // namespace

namespace detail {

Engine::Engine(const Scenario& s, const ClientPolicy& p, std::uint64_t seed)
    : s_(s),
      policy_(p.retry),
      arrival_rng_(seed * 0x9e3779b97f4a7c15ULL + 1),
      dependency_rng_(seed * 0xbf58476d1ce4e5b9ULL + 2),
      jitter_rng_(jitter_seed(seed)),
      base_(clock_.now()),
      duration_ns_(s.duration.count()),
      slice_ns_(s.slice.count()),
      bottom_(static_cast<std::uint8_t>(s.clients.layers - 1)) {
  const auto slices = static_cast<std::size_t>((duration_ns_ + slice_ns_ - 1) / slice_ns_);
  slices_.resize(slices);
  servers_ = std::max<std::int64_t>(
      1, std::llround(s.dependency.capacity_per_s *
                      std::chrono::duration<double>(s.dependency.service_time).count()));
  processes_.resize(static_cast<std::size_t>(s.clients.processes));
  if (p.make_call_context) {
    for (auto& ctx : processes_) ctx = p.make_call_context(clock_);
  }
  watched_.resize(processes_.size());
  for (std::size_t i = 0; i < processes_.size(); ++i) {
    if (processes_[i]) watched_[i].breaker = processes_[i]->breaker();
  }
  if (p.shared_breakers) {
    shared_ = true;
    propagation_ns_ = p.shared_breakers->propagation.count();
  }
  if (s.clients.random_process) process_rng_.emplace(seed * 0x2545f4914f6cdd1dULL + 5);
  one_retrying_layer_ = p.one_retrying_layer;
  if (s.dependency.admission_limit > 0 || s.dependency.admission_adaptive) {
    admission_rng_ = Rng(seed * 0xd6e8feb86659fd93ULL + 4);
    admission_.emplace(
        AdmissionOptions{.max_concurrency = std::max<std::int64_t>(1, s.dependency.admission_limit),
                         .queue_bound = s.dependency.admission_queue,
                         .retry_after_max = s.dependency.admission_retry_after_max,
                         .adaptive = s.dependency.admission_adaptive});
  }
  if (p.concurrency_limit) {
    for (std::size_t i = 0; i < processes_.size(); ++i) {
      limits_.push_back(std::make_unique<AdaptiveConcurrencyLimit>(*p.concurrency_limit));
    }
    held_.resize(processes_.size());
    woken_.resize(processes_.size());
  }
  if (p.rate_limit) {
    for (std::size_t i = 0; i < processes_.size(); ++i) {
      rates_.push_back(p.shared_rate_limit && i > 0 ? rates_.front()
                                                    : std::make_shared<RateLimit>(*p.rate_limit));
    }
  }
}

Result Engine::run() {
  if (s_.clients.population > 0) {
    for (std::int64_t i = 0; i < s_.clients.population; ++i) start_top_level(0);
  } else {
    schedule(next_interarrival(), EventType::kArrival, kNone, 0);
  }
  const auto& dep = s_.dependency;
  if (!dep.capacity_drop.empty()) {
    schedule(dep.capacity_drop.start.count(), EventType::kCapacityEdge, kNone, 0);
    schedule(dep.capacity_drop.end.count(), EventType::kCapacityEdge, kNone, 0);
  }
  std::int64_t events = 0;
  std::size_t sampled_slice = 0;
  while (!queue_.empty()) {
    const Event ev = queue_.top();
    if (ev.at >= duration_ns_) break;
    queue_.pop();
    ++events;
    advance_to(ev.at);
    const auto slice = static_cast<std::size_t>(ev.at / slice_ns_);
    while (sampled_slice < slice) sample_breakers(sampled_slice++);
    switch (ev.type) {
      case EventType::kArrival:
        start_top_level(ev.at);
        schedule(ev.at + next_interarrival(), EventType::kArrival, kNone, 0);
        break;
      case EventType::kAttempt:
        if (ops_[ev.op].attempt_id == ev.attempt_id) begin_attempt(ev.op);
        break;
      case EventType::kServiceDone:
        service_done(ev);
        break;
      case EventType::kTimeout: {
        Op& op = ops_[ev.op];
        if (op.waiting && op.attempt_id == ev.attempt_id) {
          Outcome o = Outcome::transient();
          o.timed_out = true;
          ++slice_at(ev.at).timeouts;
          deliver(ev.op, o);
        }
        break;
      }
      case EventType::kCapacityEdge:
        serve_queue(ev.at);
        break;
      case EventType::kFleetWord:
        fleet_word(ev.attempt_id, ev.op == 1);
        break;
    }
  }
  while (sampled_slice < slices_.size()) sample_breakers(sampled_slice++);
  return summarize(events);
}

std::int64_t Engine::next_interarrival() {
  const double u = uniform01(arrival_rng_);
  const double seconds = -std::log1p(-u) / s_.clients.arrivals_per_s;
  return std::max<std::int64_t>(1, std::llround(seconds * 1e9));
}

void Engine::sample_breakers(std::size_t index) {
  if (index >= slices_.size()) return;
  Slice& sl = slices_[index];
  for (const auto& ctx : processes_) {
    const int state = ctx ? ctx->breaker_state() : -1;
    if (state == 0) ++sl.breakers_closed;
    if (state == 1) ++sl.breakers_open;
    if (state == 2) ++sl.breakers_half_open;
  }
}

}  // namespace detail

std::uint64_t jitter_seed(std::uint64_t seed) noexcept { return seed * 0x94d049bb133111ebULL + 3; }

void validate(const Scenario& s) {
  const auto& d = s.dependency;
  const auto& c = s.clients;
  if (!(d.capacity_per_s > 0) || !std::isfinite(d.capacity_per_s)) {
    reject("dependency.capacity_per_s", "> 0", num(d.capacity_per_s));
  }
  if (d.service_time <= Duration::zero()) {
    reject("dependency.service_time", "> 0", format_duration(d.service_time));
  }
  if (d.queue_limit < 0) reject("dependency.queue_limit", ">= 0", std::to_string(d.queue_limit));
  if (!(d.failure_fraction >= 0 && d.failure_fraction <= 1)) {
    reject("dependency.failure_fraction", "in [0, 1]", num(d.failure_fraction));
  }
  if (!(d.overload_failure >= 0 && d.overload_failure <= 1)) {
    reject("dependency.overload_failure", "in [0, 1]", num(d.overload_failure));
  }
  if (!(d.capacity_drop_factor >= 0 && d.capacity_drop_factor <= 1)) {
    reject("dependency.capacity_drop_factor", "in [0, 1]", num(d.capacity_drop_factor));
  }
  if (d.admission_limit < 0) {
    reject("dependency.admission_limit", ">= 0", std::to_string(d.admission_limit));
  }
  if (d.admission_queue < 0) {
    reject("dependency.admission_queue", ">= 0", std::to_string(d.admission_queue));
  }
  if (d.admission_limit > 0 && d.admission_retry_after_max <= Duration::zero()) {
    reject("dependency.admission_retry_after_max", "> 0",
           format_duration(d.admission_retry_after_max));
  }
  if (!(d.rate_limit_per_s >= 0) || !std::isfinite(d.rate_limit_per_s)) {
    reject("dependency.rate_limit_per_s", ">= 0", num(d.rate_limit_per_s));
  }
  if (d.rate_limit_retry_after < Duration::zero()) {
    reject("dependency.rate_limit_retry_after", ">= 0", format_duration(d.rate_limit_retry_after));
  }
  if (c.population < 0) reject("clients.population", ">= 0", std::to_string(c.population));
  if (c.population == 0 && (!(c.arrivals_per_s > 0) || !std::isfinite(c.arrivals_per_s))) {
    reject("clients.arrivals_per_s", "> 0 for open-loop clients", num(c.arrivals_per_s));
  }
  if (c.processes < 1) reject("clients.processes", ">= 1", std::to_string(c.processes));
  if (c.layers < 1 || c.layers > 8) reject("clients.layers", "in [1, 8]", std::to_string(c.layers));
  if (s.duration <= Duration::zero()) reject("duration", "> 0", format_duration(s.duration));
  if (s.slice <= Duration::zero() || s.slice > s.duration) {
    reject("slice", "> 0 and <= duration", format_duration(s.slice));
  }
  if (!(s.healthy_ratio > 0 && s.healthy_ratio <= 1)) {
    reject("healthy_ratio", "in (0, 1]", num(s.healthy_ratio));
  }
  // A run's event count grows with arrivals x duration; keep a bound so a typo cannot hang.
  const double seconds = std::chrono::duration<double>(s.duration).count();
  const double operations =
      c.population > 0 ? static_cast<double>(c.population) : c.arrivals_per_s * seconds;
  if (operations > 50e6) {
    reject("clients", "at most 50,000,000 operations per run",
           num(operations) + " (arrivals_per_s x duration or population)");
  }
}

Result run(const Scenario& scenario, const ClientPolicy& policy, std::uint64_t seed) {
  validate(scenario);
  if (policy.shared_breakers && policy.shared_breakers->propagation < Duration::zero()) {
    throw_invalid({.context = "keel::sim::ClientPolicy",
                   .field = "shared_breakers.propagation",
                   .problem = "must be >= 0",
                   .got = format_duration(policy.shared_breakers->propagation)});
  }
  detail::Engine engine(scenario, policy, seed);
  return engine.run();
}

}  // namespace keel::sim
