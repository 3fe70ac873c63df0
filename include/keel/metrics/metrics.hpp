// keel::metrics: what keel's brakes do, as Prometheus metrics on prometheus-cpp. RetryMetrics is
// an EventSink (keel/core/events.hpp) that counts attempts, retries, budget refusals and give-ups
// by reason, the attempts each operation took (a histogram) and the breakers' transitions, and sets
// gauges from a health snapshot (keel/core/health.hpp): each breaker's state, failure rate and
// calls in its window, each budget's level. Everything is registered with a prometheus::Registry
// the caller owns and serves; serialize() writes the text exposition of any registries
// (prometheus::TextSerializer).
//
// Metrics (label values are keel's words with '_' for ' ': "attempts_exhausted", "half_open"):
//   keel_attempts_total{operation,outcome}          counter  attempts finished, by outcome kind
//   keel_retries_total{operation}                   counter  attempts followed by a retry
//   keel_budget_refusals_total{operation}           counter  retries the budget refused
//   keel_give_ups_total{operation,reason}           counter  operations stopped without success
//   keel_attempts_per_operation{operation}          histogram attempts of each finished operation
//   keel_breaker_transitions_total{dependency,to}   counter  breaker state changes
//   keel_breaker_state{dependency,state}            gauge    1 for the breaker's state, else 0
//   keel_breaker_failure_rate{dependency}           gauge    failures / calls in the window
//   keel_breaker_window_calls{dependency}           gauge    calls in the window
//   keel_retry_budget_available{budget,model}       gauge    retries (or tokens) available
//
// Thread-safety: RetryMetrics is safe for concurrent use (prometheus-cpp's families take a mutex
// to find a labelled series, then count with atomics): it may be subscribed to a stream that many
// threads publish to. Requires: the registry outlives it.
//
// Example:
//   prometheus::Registry registry;
//   auto metrics = std::make_shared<keel::metrics::RetryMetrics>(registry);
//   (void)events.subscribe(metrics, keel::kOutcomeEvents);  // a keel::EventStream
//   // on GET /metrics:
//   metrics->observe(keel::health_snapshot(breakers, {{"payments", &budget}}));
//   res.set_content(keel::metrics::serialize({&registry}), keel::metrics::kContentType);
#pragma once

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <initializer_list>
#include <string>
#include <string_view>

#include "keel/core/events.hpp"
#include "keel/core/health.hpp"

namespace keel::metrics {

/// The text exposition format's content type.
inline constexpr const char* kContentType = "text/plain; version=0.0.4";

/// The text exposition of every family the registries hold, in order (prometheus-cpp's
/// TextSerializer).
[[nodiscard]] std::string serialize(std::initializer_list<const prometheus::Registry*> registries);

/// keel's words as a label value: spaces and '-' become '_' ("attempts exhausted" ->
/// "attempts_exhausted", "half-open" -> "half_open").
[[nodiscard]] std::string label_value(std::string_view words);

/// One scrape's metrics from values read at scrape time (a queue's depths from its database,
/// counters a program keeps itself), in a registry of their own, serialised by prometheus-cpp.
/// Counter families come first, then gauges (prometheus-cpp's order). Not thread-safe; one per
/// scrape.
class Scrape {
 public:
  /// Adds one series of a counter (gauge) family, registering the family on first use.
  Scrape& counter(const std::string& name, const std::string& help, prometheus::Labels labels,
                  double value);
  Scrape& gauge(const std::string& name, const std::string& help, prometheus::Labels labels,
                double value);
  [[nodiscard]] const prometheus::Registry& registry() const noexcept { return registry_; }
  /// serialize({&registry()}).
  [[nodiscard]] std::string text() const;

 private:
  prometheus::Registry registry_;
};

class RetryMetrics final : public EventSink {
 public:
  /// Registers the families above with `registry`. Throws what prometheus-cpp throws when a
  /// family of the same name is registered already with another type.
  explicit RetryMetrics(prometheus::Registry& registry);

  /// Every kind but kAttemptStarted is counted: subscribe with keel::kOutcomeEvents.
  void on_event(const Event& event) override;

  /// Sets the breaker and budget gauges from `health` (call it before each scrape).
  void observe(const HealthSnapshot& health);

 private:
  void set_breaker_state(const std::string& dependency, BreakerState state);

  prometheus::Family<prometheus::Counter>& attempts_;
  prometheus::Family<prometheus::Counter>& retries_;
  prometheus::Family<prometheus::Counter>& budget_refusals_;
  prometheus::Family<prometheus::Counter>& give_ups_;
  prometheus::Family<prometheus::Histogram>& attempts_per_operation_;
  prometheus::Family<prometheus::Counter>& breaker_transitions_;
  prometheus::Family<prometheus::Gauge>& breaker_state_;
  prometheus::Family<prometheus::Gauge>& breaker_failure_rate_;
  prometheus::Family<prometheus::Gauge>& breaker_window_calls_;
  prometheus::Family<prometheus::Gauge>& budget_available_;
};

}  // namespace keel::metrics
