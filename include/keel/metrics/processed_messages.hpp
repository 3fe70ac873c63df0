// A consumer's processed-message counts (keel::store::ProcessedMessages,
// keel/consumers/processed_messages.hpp) as Prometheus metrics through keel::metrics' Scrape.
// Header-only and written against what the records offer (counts() and options().consumer), so
// that keel::metrics includes nothing of keel::store: a program that has the records has
// included their header already.
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

#include <cstdint>
#include <string>
#include <utility>

#include "keel/metrics/metrics.hpp"

namespace keel::metrics {

/// Adds `records`' counts (ProcessedMessages::counts()) to `scrape`, labelled with its consumer.
/// `Records`: keel::store::ProcessedMessages (or anything with the same counts() and options()).
template <class Records>
Scrape& add_processed_messages(Scrape& scrape, const Records& records) {
  const auto c = records.counts();
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
