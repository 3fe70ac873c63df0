// Hedging against a heavy latency tail (keel issue #18): an open stream of safe-to-repeat
// requests to a dependency whose attempts are mostly fast (lognormal around a median) and
// sometimes very slow (a bad replica, a GC pause, a lost packet: uniform between slow_min and
// slow_max). Each request is a keel::RetryState with a keel::HedgeState, in virtual time; a hedge
// goes when an attempt has not answered after the hedging delay, charged (with a budget) to a
// keel::RatioBudget, and the first answer wins. Attempts' latencies are independent of load, so
// the extra load is what hedging adds and nothing else.
#include <algorithm>
#include <cmath>
#include <memory>
#include <numbers>
#include <queue>
#include <string>
#include <vector>

#include "keel/core/budget.hpp"
#include "keel/core/expected.hpp"
#include "keel/core/hedge.hpp"
#include "keel/core/random.hpp"
#include "keel/core/retry.hpp"
#include "keel/sim/scenarios.hpp"

namespace keel::sim {

namespace {

struct Ev {
  std::int64_t at;
  std::uint64_t order;
  int op;
  enum Type : std::uint8_t { kStart, kHedgeDue, kDone } type;
  int slot;
};
struct LaterEv {
  bool operator()(const Ev& a, const Ev& b) const noexcept {
    return a.at != b.at ? a.at > b.at : a.order > b.order;
  }
};

struct Op {
  Op(const RetryPolicy& policy, const HedgePolicy* hedge, const CallOptions& call)
      : retry(policy, call), hedging(hedge, policy, call, retry) {}
  RetryState retry;
  HedgeState hedging;
  std::int64_t started = 0;
  unsigned flying = 0;  // bit i: slot i in flight
  bool done = false;
};

using EventQueue = std::priority_queue<Ev, std::vector<Ev>, LaterEv>;

void check_policy(std::string_view policy) {
  const auto& known = hedge_policies();
  if (std::find(known.begin(), known.end(), policy) != known.end()) return;
  std::string list;
  for (const auto& n : known) list += (list.empty() ? "" : ", ") + n;
  throw_invalid({.context = "keel::sim::run_hedge_tail",
                 .field = "policy",
                 .problem = "must be a known hedging policy (" + list + ")",
                 .got = quote_value(policy)});
}

// An attempt's latency at `at`: slow (uniform between slow_min and slow_max) with the slow
// fraction, the brownout's inside its window, else lognormal around the median.
std::int64_t draw_latency(const HedgeTailConfig& c, Rng& latencies, std::int64_t at) {
  const Duration t{at};
  const bool brownout = t >= c.brownout_start && t < c.brownout_end;
  const double slow = brownout ? c.brownout_slow_fraction : c.slow_fraction;
  if (uniform01(latencies) < slow) {
    const double span = static_cast<double>((c.slow_max - c.slow_min).count());
    return c.slow_min.count() + static_cast<std::int64_t>(uniform01(latencies) * span);
  }
  const double u1 = 1.0 - uniform01(latencies);
  const double u2 = uniform01(latencies);
  const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  return static_cast<std::int64_t>(static_cast<double>(c.median.count()) * std::exp(c.sigma * z));
}

// The run's report before its first event: what ran, and one empty slice per slice of time.
Report empty_report(std::string_view policy, const HedgeTailConfig& c, std::uint64_t seed) {
  Report r;
  r.scenario = "hedge-tail";
  r.policy = std::string(policy);
  r.seed = seed;
  r.slice = c.slice;
  r.duration = c.duration;
  r.trigger_end = c.brownout_end;
  r.slices.resize(static_cast<std::size_t>(c.duration / c.slice) + 1);
  return r;
}

// Poisson arrivals at rate_per_s until the end, each with its place in `ops`.
void schedule_arrivals(const HedgeTailConfig& c, Rng& arrivals, EventQueue& q, std::uint64_t& order,
                       std::vector<std::unique_ptr<Op>>& ops) {
  const double mean_gap_ns = 1e9 / c.rate_per_s;
  for (double t = 0;;) {
    t += -std::log(1.0 - uniform01(arrivals)) * mean_gap_ns;
    if (t >= static_cast<double>(c.duration.count())) break;
    q.push(Ev{static_cast<std::int64_t>(t), order++, static_cast<int>(ops.size()), Ev::kStart, 0});
    ops.push_back(nullptr);
  }
}

// An attempt's answer (every answer is a success): the first one ends the request and cancels
// its other attempts in flight; any later one is work the dependency did for nothing.
void answer(Op& op, const Ev& ev, Slice& slice, Summary& m, std::vector<std::int64_t>& took) {
  if (op.done) {
    ++m.wasted;  // a loser the dependency finished anyway
    ++slice.wasted;
    return;
  }
  op.flying &= ~(1U << ev.slot);
  ++slice.successes;
  const HedgeVerdict v = op.hedging.finish(ev.slot, Outcome::success());
  if (!v.done) return;
  op.done = true;
  for (int i = 0; i <= HedgePolicy::kMaxHedges; ++i) {
    if ((op.flying & (1U << i)) != 0) op.hedging.cancel(i);
  }
  took.push_back(ev.at - op.started);
  ++m.ops_succeeded;
  ++slice.ops_succeeded;
}

// The summary once every event has run: the load against the requests, the peaks, and the
// requests' latency percentiles (`took` is reordered).
void summarize(const HedgeTailConfig& c, std::vector<std::int64_t>& took, Report& r) {
  Summary& m = r.summary;
  m.layer_calls = m.total_calls;
  m.amplification = m.first_attempts > 0
                        ? static_cast<double>(m.total_calls) / static_cast<double>(m.first_attempts)
                        : 0.0;
  m.offered_per_s =
      static_cast<double>(m.total_calls) / std::chrono::duration<double>(c.duration).count();
  for (std::size_t i = 0; i < r.slices.size(); ++i) {
    const Slice& s = r.slices[i];
    if (s.offered > m.peak_per_slice) {
      m.peak_per_slice = s.offered;
      m.peak_slice_start = c.slice * static_cast<std::int64_t>(i);
    }
    m.peak_retries_per_slice = std::max(m.peak_retries_per_slice, s.retries);
  }
  m.recovered = true;
  m.recovery = Duration::zero();
  if (!took.empty()) {
    const auto at = [&](double p) {
      const auto k = static_cast<std::size_t>(p * static_cast<double>(took.size() - 1));
      std::nth_element(took.begin(), took.begin() + static_cast<std::ptrdiff_t>(k), took.end());
      return Duration(took[k]);
    };
    m.p50_latency = at(0.5);
    m.p99_latency = at(0.99);
  }
}

}  // namespace

const std::vector<std::string>& hedge_policies() {
  static const std::vector<std::string> names = {"no-hedge", "hedge", "hedge+budget"};
  return names;
}

Report run_hedge_tail(std::string_view policy, const HedgeTailConfig& c, std::uint64_t seed) {
  check_policy(policy);
  const bool hedges = policy != "no-hedge";
  const bool budgeted = policy == "hedge+budget";

  ManualClock clock;
  const TimePoint origin = clock.now();
  Rng arrivals(seed * 0x9e3779b97f4a7c15ULL + 21);
  Rng latencies(seed * 0xbf58476d1ce4e5b9ULL + 22);
  Rng jitter(seed * 0x94d049bb133111ebULL + 23);
  const RetryPolicy retry_policy({.max_attempts = 1});
  const HedgePolicy hedge_policy({.delay = c.hedge_delay, .max_hedges = c.max_hedges});
  RatioBudget budget(
      {.ratio = c.budget_ratio, .reserve_per_second = c.reserve_per_second, .clock = &clock});
  CallOptions call;
  call.clock = &clock;
  call.rng = &jitter;
  call.safe_to_repeat = true;
  if (budgeted) call.budget = &budget;

  Report r = empty_report(policy, c, seed);
  const auto slice_of = [&](std::int64_t at) -> Slice& {
    const auto i =
        std::min<std::size_t>(static_cast<std::size_t>(at / c.slice.count()), r.slices.size() - 1);
    return r.slices[i];
  };

  EventQueue q;
  std::uint64_t order = 0;
  std::vector<std::unique_ptr<Op>> ops;
  schedule_arrivals(c, arrivals, q, order, ops);
  std::vector<std::int64_t> took;
  took.reserve(ops.size());
  Summary& m = r.summary;
  const auto send = [&](int op, int slot, std::int64_t now) {
    ops[static_cast<std::size_t>(op)]->flying |= 1U << slot;
    q.push(Ev{now + draw_latency(c, latencies, now), order++, op, Ev::kDone, slot});
    Slice& s = slice_of(now);
    ++s.offered;
    if (slot > 0) ++s.retries;
    ++m.total_calls;
  };
  const auto schedule_hedge = [&](int op) {
    if (auto due = ops[static_cast<std::size_t>(op)]->hedging.next_hedge_at()) {
      q.push(Ev{(*due - origin).count(), order++, op, Ev::kHedgeDue, 0});
    }
  };

  while (!q.empty()) {
    const Ev ev = q.top();
    q.pop();
    ++m.events;
    const std::int64_t now = (clock.now() - origin).count();
    if (ev.at > now) clock.advance(Duration(ev.at - now));
    switch (ev.type) {
      case Ev::kStart: {
        auto& op = ops[static_cast<std::size_t>(ev.op)];
        op = std::make_unique<Op>(retry_policy, hedges ? &hedge_policy : nullptr, call);
        op->started = ev.at;
        const AttemptStart start = op->retry.start_attempt();
        (void)op->hedging.begin_round(start.attempt, hedge_policy.delay(nullptr, clock.now()));
        ++m.first_attempts;
        ++slice_of(ev.at).first_attempts;
        send(ev.op, 0, ev.at);
        schedule_hedge(ev.op);
        break;
      }
      case Ev::kHedgeDue: {
        Op& op = *ops[static_cast<std::size_t>(ev.op)];
        if (op.done) break;
        const HedgeStart h = op.hedging.start_hedge();
        if (h.proceed) send(ev.op, h.index, ev.at);
        schedule_hedge(ev.op);
        break;
      }
      case Ev::kDone:
        answer(*ops[static_cast<std::size_t>(ev.op)], ev, slice_of(ev.at), m, took);
        break;
    }
  }
  summarize(c, took, r);
  return r;
}

}  // namespace keel::sim
