// The payments API's /metrics through prometheus-cpp (keel::metrics::Scrape).
#include <string>

#include "keel/metrics/metrics.hpp"
#include "payments_api.hpp"

namespace payments {

namespace store = keel::store;
using keel::AdmissionStats;
using keel::ShedReason;

std::string Metrics::render() const {
  keel::metrics::Scrape scrape;
  for (int i = 0; i < store::kIdempotencyOutcomes; ++i) {
    scrape.counter("keel_idempotency_requests_total",
                   "Requests through the idempotency layer by outcome.",
                   {{"outcome", std::string(to_string(static_cast<store::IdempotencyOutcome>(i)))}},
                   static_cast<double>(outcomes[i].load()));
  }
  scrape.counter("keel_charges_created_total", "Charges committed.", {},
                 static_cast<double>(charges_created.load()));
  scrape.counter("keel_rate_limited_total", "Requests answered 429.", {},
                 static_cast<double>(rate_limited.load()));
  scrape.gauge("keel_rate_limit_principals", "Principals with a rate-limit bucket of their own.",
               {}, static_cast<double>(rate_limit_principals.load()));
  return scrape.text();
}

std::string render_admission(const AdmissionStats& s) {
  keel::metrics::Scrape scrape;
  for (const ShedReason r : {ShedReason::kRetryOverLimit, ShedReason::kOverCapacity}) {
    scrape.counter("keel_admission_shed_total",
                   "Requests answered 503 by --max-concurrency, by reason (retry: a retry at the "
                   "limit; over_capacity: a first attempt past the queue bound).",
                   {{"reason", std::string(to_string(r))}},
                   static_cast<double>(s.shed[static_cast<int>(r)]));
  }
  const char* admitted_help = "Requests admitted by --max-concurrency, by attempt.";
  scrape.counter("keel_admission_admitted_total", admitted_help, {{"attempt", "first"}},
                 static_cast<double>(s.admitted_first));
  scrape.counter("keel_admission_admitted_total", admitted_help, {{"attempt", "retry"}},
                 static_cast<double>(s.admitted_retry));
  scrape.gauge("keel_admission_limit", "In-flight requests beyond which retries are shed now.", {},
               static_cast<double>(s.limit));
  scrape.gauge("keel_admission_in_flight", "Requests holding an admission slot.", {},
               static_cast<double>(s.in_flight));
  return scrape.text();
}

}  // namespace payments
