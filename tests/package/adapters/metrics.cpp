// keel::metrics from an install: the event sink registers with a
// registry and the text comes out of prometheus-cpp's serializer.
#include <keel/metrics/metrics.hpp>
#include <memory>

int consumer_metrics() {
  prometheus::Registry registry;
  keel::EventStream events;
  const auto sink = std::make_shared<keel::metrics::RetryMetrics>(registry);
  const auto id = events.subscribe(sink);
  keel::Event e;
  e.kind = keel::EventKind::kGaveUp;
  e.reason = keel::StopReason::kDeadline;
  events.publish(e);
  events.unsubscribe(id);
  return keel::metrics::serialize({&registry}).find("reason=\"deadline\"") != std::string::npos ? 0
                                                                                                : 1;
}
