// The payments API's /metrics as hand-written exposition text: the build without prometheus-cpp
// (payments_metrics.cpp writes the same metrics through prometheus-cpp when it is found).
#include <string>

#include "payments_api.hpp"

namespace payments {

namespace store = keel::store;
using keel::AdmissionStats;
using keel::ShedReason;

std::string Metrics::render() const {
  std::string out =
      "# HELP keel_idempotency_requests_total Requests through the idempotency layer by "
      "outcome.\n# TYPE keel_idempotency_requests_total counter\n";
  for (int i = 0; i < store::kIdempotencyOutcomes; ++i) {
    out += "keel_idempotency_requests_total{outcome=\"" +
           std::string(to_string(static_cast<store::IdempotencyOutcome>(i))) + "\"} " +
           std::to_string(outcomes[i].load()) + "\n";
  }
  out +=
      "# HELP keel_charges_created_total Charges committed.\n"
      "# TYPE keel_charges_created_total counter\n"
      "keel_charges_created_total " +
      std::to_string(charges_created.load()) + "\n";
  out +=
      "# HELP keel_rate_limited_total Requests answered 429.\n"
      "# TYPE keel_rate_limited_total counter\n"
      "keel_rate_limited_total " +
      std::to_string(rate_limited.load()) + "\n";
  out +=
      "# HELP keel_rate_limit_principals Principals with a rate-limit bucket of their own.\n"
      "# TYPE keel_rate_limit_principals gauge\n"
      "keel_rate_limit_principals " +
      std::to_string(rate_limit_principals.load()) + "\n";
  return out;
}

std::string render_admission(const AdmissionStats& s) {
  std::string out =
      "# HELP keel_admission_shed_total Requests answered 503 by --max-concurrency, by reason "
      "(retry: a retry at the limit; over_capacity: a first attempt past the queue bound).\n"
      "# TYPE keel_admission_shed_total counter\n";
  for (const ShedReason r : {ShedReason::kRetryOverLimit, ShedReason::kOverCapacity}) {
    out += "keel_admission_shed_total{reason=\"" + std::string(to_string(r)) + "\"} " +
           std::to_string(s.shed[static_cast<int>(r)]) + "\n";
  }
  out +=
      "# HELP keel_admission_admitted_total Requests admitted by --max-concurrency, by attempt.\n"
      "# TYPE keel_admission_admitted_total counter\n"
      "keel_admission_admitted_total{attempt=\"first\"} " +
      std::to_string(s.admitted_first) + "\nkeel_admission_admitted_total{attempt=\"retry\"} " +
      std::to_string(s.admitted_retry) + "\n";
  out +=
      "# HELP keel_admission_limit In-flight requests beyond which retries are shed now.\n"
      "# TYPE keel_admission_limit gauge\n"
      "keel_admission_limit " +
      std::to_string(s.limit) + "\n";
  out +=
      "# HELP keel_admission_in_flight Requests holding an admission slot.\n"
      "# TYPE keel_admission_in_flight gauge\n"
      "keel_admission_in_flight " +
      std::to_string(s.in_flight) + "\n";
  return out;
}

}  // namespace payments
