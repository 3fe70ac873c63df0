#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>

#include "keel/sim/scenarios.hpp"

namespace keel::sim {

namespace {

double seconds(Duration d) { return std::chrono::duration<double>(d).count(); }
double millis(Duration d) { return std::chrono::duration<double, std::milli>(d).count(); }
double round3(double v) { return std::round(v * 1000.0) / 1000.0; }

// A quantity that may be missing: rounded to 3 decimals, or null.
nlohmann::ordered_json rounded_or_null(std::optional<double> v) {
  return v ? nlohmann::ordered_json(round3(*v)) : nlohmann::ordered_json(nullptr);
}
// A duration that may be missing, in seconds or in milliseconds (rounded_or_null).
nlohmann::ordered_json seconds_or_null(const std::optional<Duration>& d) {
  return rounded_or_null(d ? std::optional<double>(seconds(*d)) : std::nullopt);
}
nlohmann::ordered_json millis_or_null(const std::optional<Duration>& d) {
  return rounded_or_null(d ? std::optional<double>(millis(*d)) : std::nullopt);
}

nlohmann::ordered_json summary_json(const Report& r) {
  const Summary& m = r.summary;
  nlohmann::ordered_json j;
  j["scenario"] = r.scenario;
  j["policy"] = r.policy;
  j["seed"] = r.seed;
  j["first_attempts"] = m.first_attempts;
  j["total_calls"] = m.total_calls;
  j["amplification"] = round3(m.amplification);
  j["offered_per_s"] = round3(m.offered_per_s);
  j["peak_per_slice"] = m.peak_per_slice;
  j["slice_ms"] = round3(millis(r.slice));
  j["peak_slice_start_s"] = round3(seconds(m.peak_slice_start));
  j["peak_retries_per_slice"] = m.peak_retries_per_slice;
  j["bottom_calls"] = m.total_calls;
  j["layer_calls"] = m.layer_calls;
  j["recovered"] = m.recovered;
  j["recovery_s"] = seconds_or_null(m.recovery);
  j["completion_ms"] = rounded_or_null(r.completion_ms);
  j["ops_succeeded"] = m.ops_succeeded;
  j["ops_failed"] = m.ops_failed;
  j["wasted"] = m.wasted;
  j["outage_calls"] = m.outage_calls;
  j["probes"] = m.probes;
  j["breaker_opens"] = m.breaker_opens;
  j["ops_recovery_s"] = seconds_or_null(m.ops_recovery);
  j["p50_ms"] = millis_or_null(m.p50_latency);
  j["p99_ms"] = millis_or_null(m.p99_latency);
  j["goodput_per_s"] = round3(m.goodput_per_s);
  j["served_p50_ms"] = millis_or_null(m.served_p50_latency);
  j["served_p99_ms"] = millis_or_null(m.served_p99_latency);
  j["limited"] = m.limited;
  j["throttled"] = m.throttled;
  if (r.stops_recovering_at) {
    j["stops_recovering_at_s"] = seconds_or_null(*r.stops_recovering_at);
  }
  if (!r.phases.empty()) {
    nlohmann::ordered_json phases = nlohmann::ordered_json::array();
    for (const PhaseLoad& p : phase_loads(r)) {
      nlohmann::ordered_json ph;
      ph["label"] = p.label;
      ph["start_s"] = round3(seconds(p.span.start));
      ph["end_s"] = round3(seconds(p.span.end));
      ph["calls"] = p.calls;
      ph["mean_per_s"] = round3(p.mean_per_s);
      ph["peak_per_s"] = round3(p.peak_per_s);
      ph["capacity_per_s"] = round3(p.capacity_per_s);
      ph["over_capacity_s"] = round3(seconds(p.over_capacity));
      ph["under_capacity_after_s"] = seconds_or_null(p.under_capacity_after);
      phases.push_back(std::move(ph));
    }
    j["phases"] = std::move(phases);
  }
  j["runs"] = r.runs;
  j["events"] = m.events;
  return j;
}

}  // namespace

std::string to_json_line(const Report& report) { return summary_json(report).dump(); }

std::string to_json_with_series(const Report& r) {
  nlohmann::ordered_json j = summary_json(r);
  nlohmann::ordered_json series;
  std::vector<double> t;
  std::vector<std::int64_t> offered, first, retries, successes, failures, queue, open, limited,
      throttled, served_ok;
  for (std::size_t i = 0; i < r.slices.size(); ++i) {
    const Slice& s = r.slices[i];
    t.push_back(round3(seconds(r.slice * static_cast<std::int64_t>(i))));
    offered.push_back(s.offered);
    first.push_back(s.first_attempts);
    retries.push_back(s.retries);
    successes.push_back(s.successes);
    failures.push_back(s.failures);
    queue.push_back(s.queue_max);
    open.push_back(s.breakers_open);
    limited.push_back(s.limited);
    throttled.push_back(s.throttled);
    served_ok.push_back(s.served_ok);
  }
  series["t_s"] = t;
  series["offered"] = offered;
  series["first_attempts"] = first;
  series["retries"] = retries;
  series["successes"] = successes;
  series["failures"] = failures;
  series["queue"] = queue;
  series["breakers_open"] = open;
  series["limited"] = limited;
  series["throttled"] = throttled;
  series["served_ok"] = served_ok;
  j["series"] = series;
  return j.dump();
}

std::string to_csv(const std::vector<Report>& reports) {
  std::ostringstream out;
  out << "scenario,policy,t_s,offered,first_attempts,retries,successes,failures,timeouts,shed,"
         "wasted,ops_succeeded,ops_failed,queue_max,breakers_closed,breakers_open,"
         "breakers_half_open\n";
  for (const Report& r : reports) {
    for (std::size_t i = 0; i < r.slices.size(); ++i) {
      const Slice& s = r.slices[i];
      out << r.scenario << ',' << r.policy << ','
          << round3(seconds(r.slice * static_cast<std::int64_t>(i))) << ',' << s.offered << ','
          << s.first_attempts << ',' << s.retries << ',' << s.successes << ',' << s.failures << ','
          << s.timeouts << ',' << s.shed << ',' << s.wasted << ',' << s.ops_succeeded << ','
          << s.ops_failed << ',' << s.queue_max << ',' << s.breakers_closed << ','
          << s.breakers_open << ',' << s.breakers_half_open << '\n';
    }
  }
  return out.str();
}

}  // namespace keel::sim
