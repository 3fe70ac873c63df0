// The contention experiment of "Exponential Backoff And Jitter" (AWS Architecture Blog, 2015):
// N clients each want one read-modify-write of the same row with optimistic concurrency. One call
// is a read of the row's version followed by a conditional write carrying that version; the row
// accepts the write only if no other write landed in between. Every hop of the network takes
// normal(mean, sd). Losers back off with core's Backoff (driven through RetryState) and try
// again, until every client has written once.
#include <algorithm>
#include <cmath>
#include <numbers>
#include <queue>
#include <stdexcept>
#include <string>
#include <vector>

#include "keel/core/expected.hpp"
#include "keel/core/random.hpp"
#include "keel/core/retry.hpp"
#include "keel/sim/scenarios.hpp"
#include "policies.hpp"

namespace keel::sim {

namespace {

constexpr Duration kImmediate{1};

struct Ev {
  std::int64_t at;
  std::uint64_t order;
  int client;
  enum Type : std::uint8_t { kAttempt, kReadAtRow, kReadAnswer, kWriteAtRow, kAnswer } type;
  bool ok;               // kAnswer: the write was accepted
  std::int64_t version;  // kReadAnswer, kWriteAtRow: the version read
};
struct LaterEv {
  bool operator()(const Ev& a, const Ev& b) const noexcept {
    return a.at != b.at ? a.at > b.at : a.order > b.order;
  }
};

RetryOptions brooker_options(std::string_view policy, const BrookerConfig& c) {
  RetryOptions o;
  o.max_attempts = 1'000'000;  // until success: the experiment counts calls, not give-ups
  o.backoff.base = c.base;
  o.backoff.cap = c.cap;
  o.backoff.multiplier = 2.0;
  if (policy == "none") {
    o.backoff = {.base = kImmediate, .cap = kImmediate, .multiplier = 1.0, .jitter = Jitter::kNone};
  } else if (policy == "exponential") {
    o.backoff.jitter = Jitter::kNone;
  } else if (policy == "full") {
    o.backoff.jitter = Jitter::kFull;
  } else if (policy == "equal") {
    o.backoff.jitter = Jitter::kEqual;
  } else if (policy == "decorrelated") {
    o.backoff.jitter = Jitter::kDecorrelated;
  } else {
    refuse_unknown_name("keel::sim::run_brooker", "policy", "a known brooker policy",
                        brooker_policies(), policy);
  }
  return o;
}

class Normal {
 public:
  explicit Normal(std::uint64_t seed) : rng_(seed) {}
  std::int64_t draw(Duration mean, Duration sd) {
    const double u1 = 1.0 - uniform01(rng_);  // (0, 1]
    const double u2 = uniform01(rng_);
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
    const double v = static_cast<double>(mean.count()) + z * static_cast<double>(sd.count());
    return v > 0 ? static_cast<std::int64_t>(v) : 0;
  }

 private:
  Rng rng_;
};

struct OneRun {
  std::int64_t calls = 0;
  std::int64_t completion_ns = 0;
  std::int64_t events = 0;
};

OneRun run_once(const RetryPolicy& policy, const BrookerConfig& c, std::uint64_t seed,
                std::vector<Slice>* slices, Duration slice) {
  ManualClock clock;
  const TimePoint base = clock.now();
  Rng jitter(seed * 0x9e3779b97f4a7c15ULL + 11);
  Normal network(seed * 0xbf58476d1ce4e5b9ULL + 12);
  std::priority_queue<Ev, std::vector<Ev>, LaterEv> q;
  std::uint64_t order = 0;
  CallOptions call;
  call.clock = &clock;
  call.rng = &jitter;
  call.safe_to_repeat = true;
  std::vector<RetryState> states;
  states.reserve(static_cast<std::size_t>(c.clients));
  for (int i = 0; i < c.clients; ++i) {
    states.emplace_back(policy, call);
    q.push(Ev{0, order++, i, Ev::kAttempt, false, 0});
  }
  std::int64_t row_version = 0;
  int done = 0;
  OneRun out;
  while (!q.empty() && done < c.clients) {
    const Ev ev = q.top();
    q.pop();
    ++out.events;
    const std::int64_t now = (clock.now() - base).count();
    if (ev.at > now) clock.advance(Duration(ev.at - now));
    RetryState& st = states[static_cast<std::size_t>(ev.client)];
    switch (ev.type) {
      case Ev::kAttempt: {
        const AttemptStart start = st.start_attempt();
        if (!start.proceed) {
          ++done;  // cannot happen without a deadline; counted so the run still ends
          break;
        }
        ++out.calls;
        if (slices != nullptr) {
          const auto i = static_cast<std::size_t>(ev.at / slice.count());
          if (i >= slices->size()) slices->resize(i + 1);
          ++(*slices)[i].offered;
          if (start.attempt.is_retry()) ++(*slices)[i].retries;
          if (!start.attempt.is_retry()) ++(*slices)[i].first_attempts;
        }
        q.push(Ev{ev.at + network.draw(c.network_mean, c.network_sd), order++, ev.client,
                  Ev::kReadAtRow, false, 0});
        break;
      }
      case Ev::kReadAtRow:
        q.push(Ev{ev.at + network.draw(c.network_mean, c.network_sd), order++, ev.client,
                  Ev::kReadAnswer, false, row_version});
        break;
      case Ev::kReadAnswer:
        q.push(Ev{ev.at + network.draw(c.network_mean, c.network_sd), order++, ev.client,
                  Ev::kWriteAtRow, false, ev.version});
        break;
      case Ev::kWriteAtRow: {
        const bool ok = ev.version == row_version;
        if (ok) ++row_version;
        q.push(Ev{ev.at + network.draw(c.network_mean, c.network_sd), order++, ev.client,
                  Ev::kAnswer, ok, row_version});
        break;
      }
      case Ev::kAnswer: {
        if (slices != nullptr) {
          const auto i = static_cast<std::size_t>(ev.at / slice.count());
          if (i >= slices->size()) slices->resize(i + 1);
          ++(ev.ok ? (*slices)[i].successes : (*slices)[i].failures);
          if (ev.ok) ++(*slices)[i].ops_succeeded;
        }
        const Decision d = st.next(ev.ok ? Outcome::success() : Outcome::transient());
        if (d.retry) {
          q.push(Ev{ev.at + d.delay.count(), order++, ev.client, Ev::kAttempt, false, 0});
        } else {
          ++done;
          out.completion_ns = ev.at;
        }
        break;
      }
    }
  }
  return out;
}

}  // namespace

const std::vector<std::string>& brooker_policies() {
  static const std::vector<std::string> names = {"none", "exponential", "full", "equal",
                                                 "decorrelated"};
  return names;
}

Report run_brooker(std::string_view policy_name, const BrookerConfig& c, std::uint64_t seed) {
  if (c.clients < 1) {
    throw_invalid({.context = "keel::sim::BrookerConfig",
                   .field = "clients",
                   .problem = "must be >= 1",
                   .got = std::to_string(c.clients)});
  }
  if (c.runs < 1) {
    throw_invalid({.context = "keel::sim::BrookerConfig",
                   .field = "runs",
                   .problem = "must be >= 1",
                   .got = std::to_string(c.runs)});
  }
  const RetryPolicy policy(brooker_options(policy_name, c));
  Report r;
  r.scenario = "brooker";
  r.policy = std::string(policy_name);
  r.seed = seed;
  r.runs = c.runs;
  r.slice = std::chrono::milliseconds(50);
  double calls = 0;
  double completion = 0;
  for (int i = 0; i < c.runs; ++i) {
    const OneRun one = run_once(policy, c, seed + static_cast<std::uint64_t>(i),
                                i == 0 ? &r.slices : nullptr, r.slice);
    calls += static_cast<double>(one.calls);
    completion += static_cast<double>(one.completion_ns) / 1e6;
    r.summary.events += one.events;
  }
  r.mean_calls = calls / c.runs;
  r.completion_ms = completion / c.runs;
  // Per run (the experiment's unit): mean calls against one first attempt per client.
  r.summary.total_calls = std::llround(*r.mean_calls);
  r.summary.layer_calls = r.summary.total_calls;
  r.summary.first_attempts = c.clients;
  r.summary.amplification =
      static_cast<double>(r.summary.total_calls) / static_cast<double>(r.summary.first_attempts);
  r.summary.ops_succeeded = r.summary.first_attempts;
  r.summary.recovered = true;
  r.summary.recovery = Duration::zero();
  r.duration = r.slice * static_cast<std::int64_t>(std::max<std::size_t>(1, r.slices.size()));
  for (std::size_t i = 0; i < r.slices.size(); ++i) {
    if (r.slices[i].offered > r.summary.peak_per_slice) {
      r.summary.peak_per_slice = r.slices[i].offered;
      r.summary.peak_slice_start = r.slice * static_cast<std::int64_t>(i);
    }
    r.summary.peak_retries_per_slice =
        std::max(r.summary.peak_retries_per_slice, r.slices[i].retries);
  }
  return r;
}

}  // namespace keel::sim
