// Backoff at fleet scale: N clients (default 10,000) see their first call fail at the same
// instant, the dependency stays down, and each client retries `--retries` times (default 5) with
// one backoff formula. The program counts retry arrivals per 100 ms slice and reports, per
// formula, the peak slice: how hard the fleet hits the dependency while it tries to recover.
//
// keel's rows use keel::Backoff itself (its default options, full jitter with a 1 s base for a
// like-for-like row, and the fleet preset keel::BackoffOptions::fleet(), whose 5 s floor under the
// first ceilings spreads a fleet's first retries). The peers' rows use their documented default
// formulas:
//   curl --retry         1 s, doubling, cap 10 min, no jitter
//   gRPC (C-core)        1 s, x1.6, cap 120 s, each delay x uniform[0.8, 1.2)
//   cenkalti/backoff v4  500 ms, x1.5, cap 60 s, each delay x uniform[0.5, 1.5]
//   AWS SDK standard     uniform[0, 1 s) x 2^n, cap 20 s (full jitter)
//   cockatiel            ExponentialBackoff() defaults: decorrelated jitter "v2" (Polly's
//                        DecorrelatedJitterV2), initial delay 128 ms, exponent 2, cap 30 s
// A failed attempt takes no time, so arrivals fall exactly where the delays put them.
//
// Output: one JSON object on stdout (rows with peak, the slice it falls in, and when the median
// client made its last retry). Thread-safety: single-threaded program.
//
// Example: keel_bench_fleet --clients 10000 --retries 5 --seed 1
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/backoff.hpp"
#include "keel/core/random.hpp"

namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using Nanos = std::chrono::nanoseconds;

constexpr Nanos kSlice = milliseconds(100);

// Returns the delays before retries 0..retries-1 of one client.
using Formula = std::function<std::vector<Nanos>(int retries, keel::Rng& rng)>;

struct Row {
  std::string name;
  std::string formula;
  bool is_keel = false;
  Formula delays;
};

Nanos to_nanos(double seconds_value) {
  return Nanos(static_cast<std::int64_t>(std::llround(seconds_value * 1e9)));
}

Formula keel_formula(keel::BackoffOptions options) {
  return [backoff = keel::Backoff(options)](int retries, keel::Rng& rng) {
    std::vector<Nanos> out;
    keel::Duration previous{};
    for (int i = 0; i < retries; ++i) {
      previous = backoff.delay(i, previous, rng);
      out.push_back(std::chrono::duration_cast<Nanos>(previous));
    }
    return out;
  };
}

std::vector<Nanos> curl_delays(int retries, keel::Rng&) {
  std::vector<Nanos> out;
  double current = 1.0;
  for (int i = 0; i < retries; ++i) {
    out.push_back(to_nanos(current));
    current = std::min(current * 2.0, 600.0);
  }
  return out;
}

std::vector<Nanos> grpc_delays(int retries, keel::Rng& rng) {
  std::vector<Nanos> out;
  double current = 1.0;
  for (int i = 0; i < retries; ++i) {
    out.push_back(to_nanos(current * (0.8 + 0.4 * keel::uniform01(rng))));
    current = std::min(current * 1.6, 120.0);
  }
  return out;
}

std::vector<Nanos> cenkalti_delays(int retries, keel::Rng& rng) {
  std::vector<Nanos> out;
  double current = 0.5;
  for (int i = 0; i < retries; ++i) {
    out.push_back(to_nanos(current * (0.5 + keel::uniform01(rng))));
    current = std::min(current * 1.5, 60.0);
  }
  return out;
}

std::vector<Nanos> aws_standard_delays(int retries, keel::Rng& rng) {
  std::vector<Nanos> out;
  for (int i = 0; i < retries; ++i) {
    out.push_back(to_nanos(std::min(keel::uniform01(rng) * std::ldexp(1.0, i), 20.0)));
  }
  return out;
}

std::vector<Nanos> cockatiel_delays(int retries, keel::Rng& rng) {
  constexpr double kInitialMs = 128.0;
  constexpr double kMaxMs = 30000.0;
  constexpr double kExponent = 2.0;
  constexpr double kPFactor = 4.0;
  constexpr double kRpScaling = 1.0 / 1.4;
  std::vector<Nanos> out;
  double previous = 0.0;
  for (int i = 0; i < retries; ++i) {
    const double t = i + keel::uniform01(rng);
    const double next = std::pow(kExponent, t) * std::tanh(std::sqrt(kPFactor * t));
    const double intrinsic = std::isfinite(next) ? std::max(0.0, next - previous) : kMaxMs;
    out.push_back(to_nanos(std::min(intrinsic * kRpScaling * kInitialMs, kMaxMs) / 1000.0));
    previous = next;
  }
  return out;
}

struct Result {
  std::int64_t peak = 0;
  double peak_slice_start_s = 0;
  double median_last_retry_s = 0;
  std::int64_t arrivals = 0;
};

Result simulate(const Row& row, int clients, int retries, std::uint64_t seed) {
  keel::Rng rng(seed);
  std::vector<std::int64_t> slices;
  std::vector<Nanos> last_retry;
  last_retry.reserve(static_cast<std::size_t>(clients));
  Result result;
  for (int c = 0; c < clients; ++c) {
    Nanos at{0};  // the first (failed) call; not counted: it is the same for every formula
    for (const Nanos delay : row.delays(retries, rng)) {
      at += delay;
      const auto slice = static_cast<std::size_t>(at / kSlice);
      if (slice >= slices.size()) slices.resize(slice + 1, 0);
      ++slices[slice];
      ++result.arrivals;
    }
    last_retry.push_back(at);
  }
  const auto peak = std::max_element(slices.begin(), slices.end());
  if (peak != slices.end()) {
    result.peak = *peak;
    result.peak_slice_start_s =
        static_cast<double>(peak - slices.begin()) * std::chrono::duration<double>(kSlice).count();
  }
  const auto mid = last_retry.begin() + static_cast<std::ptrdiff_t>(last_retry.size() / 2);
  std::nth_element(last_retry.begin(), mid, last_retry.end());
  if (!last_retry.empty()) result.median_last_retry_s = std::chrono::duration<double>(*mid).count();
  return result;
}

bool parse_int(std::string_view text, long long min, long long& out) {
  const auto* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, out);
  return ec == std::errc() && ptr == end && out >= min;
}

int usage(const std::string& message) {
  std::fprintf(stderr, "keel_bench_fleet: %s\n", message.c_str());
  std::fprintf(stderr,
               "usage: keel_bench_fleet [--clients 1..10000000] [--retries 1..30] [--seed N>=0]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  long long clients = 10000;
  long long retries = 5;
  long long seed = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    long long* target = flag == "--clients"   ? &clients
                        : flag == "--retries" ? &retries
                        : flag == "--seed"    ? &seed
                                              : nullptr;
    if (target == nullptr) return usage("unknown flag '" + flag + "'");
    if (i + 1 >= argc) return usage("missing value for " + flag);
    const std::string value = argv[++i];
    const long long min = target == &seed ? 0 : 1;
    const long long max = target == &clients ? 10'000'000 : target == &retries ? 30 : (1LL << 62);
    if (!parse_int(value, min, *target) || *target > max) {
      return usage(flag + " needs an integer in [" + std::to_string(min) + ", " +
                   std::to_string(max) + "], got '" + value + "'");
    }
  }

  const std::vector<Row> rows = {
      {"keel (default)", "full jitter, base 100 ms, x2, cap 10 s", true, keel_formula({})},
      {"keel (base 1 s)", "full jitter, base 1 s, x2, cap 20 s", true,
       keel_formula({.base = seconds(1), .cap = seconds(20)})},
      {"keel fleet preset", "full jitter, base 500 ms, x2, cap 20 s, min ceiling 5 s", true,
       keel_formula(keel::BackoffOptions::fleet())},
      {"curl --retry", "1 s doubling, cap 10 min, no jitter", false, curl_delays},
      {"gRPC", "1 s x1.6, cap 120 s, +/-20%", false, grpc_delays},
      {"cenkalti/backoff", "500 ms x1.5, cap 60 s, +/-50%", false, cenkalti_delays},
      {"AWS SDK standard", "full jitter, base 1 s, x2, cap 20 s", false, aws_standard_delays},
      {"cockatiel", "decorrelated jitter v2, 128 ms, cap 30 s", false, cockatiel_delays},
  };

  std::printf(
      "{\"clients\": %lld, \"retries\": %lld, \"seed\": %lld, \"slice_ms\": 100, \"rows\": [",
      clients, retries, seed);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Result r = simulate(rows[i], static_cast<int>(clients), static_cast<int>(retries),
                              static_cast<std::uint64_t>(seed));
    std::printf(
        "%s\n  {\"name\": \"%s\", \"formula\": \"%s\", \"keel\": %s, \"peak_per_100ms\": %lld, "
        "\"peak_at_s\": %.1f, \"median_last_retry_s\": %.3f, \"arrivals\": %lld}",
        i == 0 ? "" : ",", rows[i].name.c_str(), rows[i].formula.c_str(),
        rows[i].is_keel ? "true" : "false", static_cast<long long>(r.peak), r.peak_slice_start_s,
        r.median_last_retry_s, static_cast<long long>(r.arrivals));
  }
  std::printf("\n]}\n");
  return 0;
}
