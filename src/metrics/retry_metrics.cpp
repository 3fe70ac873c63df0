#include <prometheus/text_serializer.h>

#include <string>

#include "keel/metrics/metrics.hpp"

namespace keel::metrics {

std::string serialize(std::initializer_list<const prometheus::Registry*> registries) {
  std::vector<prometheus::MetricFamily> families;
  for (const prometheus::Registry* r : registries) {
    if (r == nullptr) continue;
    auto collected = r->Collect();
    families.insert(families.end(), std::make_move_iterator(collected.begin()),
                    std::make_move_iterator(collected.end()));
  }
  return prometheus::TextSerializer().Serialize(families);
}

std::string label_value(std::string_view words) {
  std::string out(words);
  for (char& c : out) {
    if (c == ' ' || c == '-') c = '_';
  }
  return out;
}

Scrape& Scrape::counter(const std::string& name, const std::string& help, prometheus::Labels labels,
                        double value) {
  prometheus::BuildCounter().Name(name).Help(help).Register(registry_).Add(labels).Increment(value);
  return *this;
}

Scrape& Scrape::gauge(const std::string& name, const std::string& help, prometheus::Labels labels,
                      double value) {
  prometheus::BuildGauge().Name(name).Help(help).Register(registry_).Add(labels).Set(value);
  return *this;
}

std::string Scrape::text() const { return serialize({&registry_}); }

namespace {
const prometheus::Histogram::BucketBoundaries& attempt_buckets() {
  static const prometheus::Histogram::BucketBoundaries buckets{1, 2, 3, 4, 5, 6, 8, 10};
  return buckets;
}
}  // namespace

RetryMetrics::RetryMetrics(prometheus::Registry& registry)
    : attempts_(prometheus::BuildCounter()
                    .Name("keel_attempts_total")
                    .Help("Attempts finished, by operation and outcome kind.")
                    .Register(registry)),
      retries_(prometheus::BuildCounter()
                   .Name("keel_retries_total")
                   .Help("Attempts followed by a retry, by operation.")
                   .Register(registry)),
      budget_refusals_(prometheus::BuildCounter()
                           .Name("keel_budget_refusals_total")
                           .Help("Retries the retry budget refused, by operation.")
                           .Register(registry)),
      give_ups_(prometheus::BuildCounter()
                    .Name("keel_give_ups_total")
                    .Help("Operations that stopped without success, by operation and reason.")
                    .Register(registry)),
      attempts_per_operation_(prometheus::BuildHistogram()
                                  .Name("keel_attempts_per_operation")
                                  .Help("Attempts each finished operation made.")
                                  .Register(registry)),
      breaker_transitions_(prometheus::BuildCounter()
                               .Name("keel_breaker_transitions_total")
                               .Help("Circuit breaker state changes, by dependency and new state.")
                               .Register(registry)),
      breaker_state_(prometheus::BuildGauge()
                         .Name("keel_breaker_state")
                         .Help("1 for the circuit breaker's current state, 0 for the others.")
                         .Register(registry)),
      breaker_failure_rate_(prometheus::BuildGauge()
                                .Name("keel_breaker_failure_rate")
                                .Help("Failures / calls in the circuit breaker's window.")
                                .Register(registry)),
      breaker_window_calls_(prometheus::BuildGauge()
                                .Name("keel_breaker_window_calls")
                                .Help("Calls in the circuit breaker's window.")
                                .Register(registry)),
      budget_available_(
          prometheus::BuildGauge()
              .Name("keel_retry_budget_available")
              .Help("Retries (the throttle: tokens) the retry budget would grant now.")
              .Register(registry)) {}

void RetryMetrics::on_event(const Event& e) {
  const std::string operation(e.operation);
  switch (e.kind) {
    case EventKind::kAttemptStarted:
      return;
    case EventKind::kAttemptFinished:
      attempts_.Add({{"operation", operation}, {"outcome", label_value(to_string(e.outcome.kind))}})
          .Increment();
      if (e.will_retry) {
        retries_.Add({{"operation", operation}}).Increment();
      } else if (e.reason == StopReason::kSuccess) {
        attempts_per_operation_.Add({{"operation", operation}}, attempt_buckets())
            .Observe(e.attempt);
      }
      return;
    case EventKind::kBudgetRefused:
      budget_refusals_.Add({{"operation", operation}}).Increment();
      return;
    case EventKind::kGaveUp:
      give_ups_.Add({{"operation", operation}, {"reason", label_value(to_string(e.reason))}})
          .Increment();
      attempts_per_operation_.Add({{"operation", operation}}, attempt_buckets()).Observe(e.attempt);
      return;
    case EventKind::kBreakerTransition: {
      const std::string dependency(e.key);
      breaker_transitions_.Add({{"dependency", dependency}, {"to", label_value(to_string(e.to))}})
          .Increment();
      set_breaker_state(dependency, e.to);
      return;
    }
  }
}

void RetryMetrics::set_breaker_state(const std::string& dependency, BreakerState state) {
  for (const BreakerState s :
       {BreakerState::kClosed, BreakerState::kHalfOpen, BreakerState::kOpen}) {
    breaker_state_.Add({{"dependency", dependency}, {"state", label_value(to_string(s))}})
        .Set(s == state ? 1.0 : 0.0);
  }
}

void RetryMetrics::observe(const HealthSnapshot& health) {
  for (const BreakerHealth& b : health.breakers) {
    set_breaker_state(b.key, b.state);
    breaker_failure_rate_.Add({{"dependency", b.key}}).Set(b.failure_rate);
    breaker_window_calls_.Add({{"dependency", b.key}}).Set(static_cast<double>(b.calls));
  }
  for (const BudgetHealth& b : health.budgets) {
    budget_available_.Add({{"budget", b.name}, {"model", label_value(b.model)}}).Set(b.available);
  }
}

}  // namespace keel::metrics
