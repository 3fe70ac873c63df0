// A consumer's processed-message counts (keel/store/queue/processed_messages.hpp) as Prometheus
// metrics through keel::metrics' Scrape. Header-only, so that keel::metrics does not depend on
// keel::store: a program that links both includes it.
//
// Metrics:
//   keel_consumer_messages_total{consumer,result}   counter  deliveries by result: processed,
//                                                           duplicate, rolled_back, failed
//   keel_consumer_records_pruned_total{consumer}    counter  records deleted by the retention
//
// Thread-safety: as Scrape (one per scrape); counts() may be read while other threads process.
//
// Example:
//   keel::metrics::Scrape scrape;
//   keel::metrics::add_processed_messages(scrape, records);
//   res.set_content(scrape.text(), keel::metrics::kContentType);
#pragma once

#include "keel/metrics/metrics.hpp"
#include "keel/store/queue/processed_messages.hpp"

namespace keel::metrics {

/// Adds `records`' counts (ProcessedMessages::counts()) to `scrape`, labelled with its consumer.
inline Scrape& add_processed_messages(Scrape& scrape, const store::ProcessedMessages& records) {
  const store::ProcessedCounts c = records.counts();
  const std::string& consumer = records.options().consumer;
  const std::pair<const char*, std::int64_t> results[] = {{"processed", c.processed},
                                                          {"duplicate", c.duplicates},
                                                          {"rolled_back", c.rolled_back},
                                                          {"failed", c.failed}};
  for (const auto& [result, n] : results) {
    scrape.counter("keel_consumer_messages_total",
                   "Messages delivered to a consumer, by result (a duplicate's effect is skipped).",
                   {{"consumer", consumer}, {"result", result}}, static_cast<double>(n));
  }
  scrape.counter("keel_consumer_records_pruned_total",
                 "Processed-message records deleted by the retention.", {{"consumer", consumer}},
                 static_cast<double>(c.pruned));
  return scrape;
}

}  // namespace keel::metrics
