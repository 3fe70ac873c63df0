#include "policies.hpp"

#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>

#include "keel/core/breaker.hpp"
#include "keel/core/budget.hpp"
#include "keel/core/expected.hpp"
#include "keel/sim/scenarios.hpp"

namespace keel::sim {

namespace {

using std::chrono::seconds;

// "Immediate": the smallest delay core's Backoff accepts (it requires base > 0).
constexpr Duration kImmediate{1};

// One client process's budget and breaker: keel::core's own objects on the run's virtual clock.
// They guard the process's calls to the layer below it (the top layer's calls).
class CoreCallContext final : public CallContext {
 public:
  CoreCallContext(Clock& clock, bool budget, bool breaker, double ratio) {
    if (budget) {
      RatioBudgetOptions b;
      b.ratio = ratio;
      b.reserve_per_second = 10;  // Finagle's floor, so a quiet client may still retry
      b.window = seconds(10);
      b.clock = &clock;
      budget_ = std::make_unique<RatioBudget>(b);
    }
    if (breaker) {
      BreakerOptions b = BreakerOptions::more_than_half_failed(seconds(10), 20);
      b.break_duration = seconds(2);
      b.clock = &clock;
      breaker_ = std::make_unique<CircuitBreaker>(b);
    }
  }
  void apply(CallOptions& call, int layer) override {
    if (layer != 0) return;
    call.budget = budget_.get();
    call.breaker = breaker_.get();
  }
  [[nodiscard]] CircuitBreaker* breaker() override { return breaker_.get(); }
  [[nodiscard]] int breaker_state() const override {
    if (!breaker_) return -1;
    switch (breaker_->state()) {
      case BreakerState::kClosed:
        return 0;
      case BreakerState::kOpen:
        return 1;
      case BreakerState::kHalfOpen:
        return 2;
    }
    return -1;
  }

 private:
  std::unique_ptr<RatioBudget> budget_;
  std::unique_ptr<CircuitBreaker> breaker_;
};

void add_guards(ClientPolicy& p, bool budget, bool breaker, double ratio) {
  if (!budget && !breaker) return;
  p.make_call_context = [budget, breaker, ratio](Clock& clock) -> std::unique_ptr<CallContext> {
    return std::make_unique<CoreCallContext>(clock, budget, breaker, ratio);
  };
}

RetryOptions backoff_options(const PolicySettings& s, Jitter jitter) {
  RetryOptions o;
  o.max_attempts = s.max_attempts;
  o.per_try_timeout = s.per_try_timeout;
  o.backoff = {.base = s.base, .cap = s.cap, .multiplier = 2.0, .jitter = jitter};
  return o;
}

}  // namespace

void refuse_unknown_name(std::string_view context, std::string_view field,
                         std::string_view requirement, const std::vector<std::string>& known,
                         std::string_view name) {
  std::string list;
  for (const auto& n : known) list += (list.empty() ? "" : ", ") + n;
  throw_invalid({.context = std::string(context),
                 .field = std::string(field),
                 .problem = "must be " + std::string(requirement) + " (" + list + ")",
                 .got = quote_value(name)});
}

const std::vector<std::string>& policy_names() {
  static const std::vector<std::string> names = {"naive",
                                                 "fixed",
                                                 "exponential",
                                                 "full-jitter",
                                                 "equal-jitter",
                                                 "decorrelated-jitter",
                                                 "full-jitter+budget",
                                                 "full-jitter+budget+breaker",
                                                 "full-jitter+breaker",
                                                 "full-jitter+shared-breaker",
                                                 "one-layer",
                                                 "keel-default",
                                                 "aws-standard",
                                                 "fleet",
                                                 "full-jitter+adaptive-limit",
                                                 "full-jitter+fixed-limit",
                                                 "full-jitter+rate-limit",
                                                 "full-jitter+shared-rate-limit"};
  return names;
}

ClientPolicy make_policy(std::string_view name, const PolicySettings& s) {
  if (!(s.budget_ratio > 0 && s.budget_ratio <= 1)) {
    std::ostringstream got;
    got << s.budget_ratio;
    throw_invalid({.context = "keel::sim::PolicySettings",
                   .field = "budget_ratio",
                   .problem = "must be in (0, 1]",
                   .got = got.str()});
  }
  if (s.fixed_limit < 1 || s.fixed_limit > (1 << 20)) {
    throw_invalid({.context = "keel::sim::PolicySettings",
                   .field = "fixed_limit",
                   .problem = "must be in [1, 2^20]",
                   .got = std::to_string(s.fixed_limit)});
  }
  if (!(s.rate_per_s > 0 && s.rate_per_s <= 1e6)) {
    std::ostringstream got;
    got << s.rate_per_s;
    throw_invalid({.context = "keel::sim::PolicySettings",
                   .field = "rate_per_s",
                   .problem = "must be in (0, 1e6]",
                   .got = got.str()});
  }
  ClientPolicy p;
  p.name = std::string(name);
  if (name == "naive") {
    p.retry = backoff_options(s, Jitter::kNone);
    p.retry.max_attempts = 4;
    p.retry.backoff = {
        .base = kImmediate, .cap = kImmediate, .multiplier = 1.0, .jitter = Jitter::kNone};
  } else if (name == "fixed") {
    p.retry = backoff_options(s, Jitter::kNone);
    p.retry.backoff = {.base = s.base, .cap = s.base, .multiplier = 1.0, .jitter = Jitter::kNone};
  } else if (name == "exponential") {
    p.retry = backoff_options(s, Jitter::kNone);
  } else if (name == "full-jitter") {
    p.retry = backoff_options(s, Jitter::kFull);
  } else if (name == "equal-jitter") {
    p.retry = backoff_options(s, Jitter::kEqual);
  } else if (name == "decorrelated-jitter") {
    p.retry = backoff_options(s, Jitter::kDecorrelated);
  } else if (name == "full-jitter+budget") {
    p.retry = backoff_options(s, Jitter::kFull);
    add_guards(p, true, false, s.budget_ratio);
  } else if (name == "full-jitter+budget+breaker") {
    p.retry = backoff_options(s, Jitter::kFull);
    add_guards(p, true, true, s.budget_ratio);
  } else if (name == "full-jitter+breaker") {
    p.retry = backoff_options(s, Jitter::kFull);
    add_guards(p, false, true, s.budget_ratio);
  } else if (name == "full-jitter+shared-breaker") {
    p.retry = backoff_options(s, Jitter::kFull);
    add_guards(p, false, true, s.budget_ratio);
    p.shared_breakers = SharedBreakers{};
  } else if (name == "full-jitter+adaptive-limit") {
    // No budget: the limit alone (keel::AdaptiveConcurrencyLimit, its defaults).
    p.retry = backoff_options(s, Jitter::kFull);
    p.concurrency_limit = ConcurrencyLimitOptions{};
  } else if (name == "full-jitter+fixed-limit") {
    p.retry = backoff_options(s, Jitter::kFull);
    p.concurrency_limit = ConcurrencyLimitOptions{
        .initial_limit = s.fixed_limit, .min_limit = s.fixed_limit, .max_limit = s.fixed_limit};
  } else if (name == "full-jitter+rate-limit" || name == "full-jitter+shared-rate-limit") {
    p.retry = backoff_options(s, Jitter::kFull);
    p.rate_limit = RateLimitOptions{.rate_per_s = s.rate_per_s};
    p.shared_rate_limit = name == "full-jitter+shared-rate-limit";
  } else if (name == "one-layer") {
    p.retry = backoff_options(s, Jitter::kFull);
    p.one_retrying_layer = true;
  } else if (name == "keel-default") {
    // The three fixed formulas take only max_attempts and per_try_timeout from the scenario.
    p.retry = backoff_options(s, Jitter::kFull);
    p.retry.backoff = BackoffOptions{};
  } else if (name == "aws-standard") {
    p.retry = backoff_options(s, Jitter::kFull);
    p.retry.backoff = {.base = seconds(1), .cap = seconds(20), .jitter = Jitter::kFull};
  } else if (name == "fleet") {
    p.retry = backoff_options(s, Jitter::kFull);
    p.retry.backoff = BackoffOptions::fleet();
  } else {
    refuse_unknown_name("keel::sim::make_policy", "name", "a known policy", policy_names(), name);
  }
  return p;
}

ClientPolicy make_explorer_policy(bool jitter, bool budget, bool breaker,
                                  const PolicySettings& settings) {
  ClientPolicy p = make_policy(jitter ? "full-jitter" : "exponential", settings);
  add_guards(p, budget, breaker, settings.budget_ratio);
  return p;
}

}  // namespace keel::sim
