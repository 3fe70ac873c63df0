// Retrying an HTTP call with keel::http::Client: full jitter under a deadline, a retry budget and
// a circuit breaker per host, one Idempotency-Key on every attempt of the POST.
//
// The upstream is keel::faults::FaultServer on 127.0.0.1 (a port the kernel picks), scripted to
// answer 503 twice and then 201. The middle of main() is the example shown in README.md.
#include <cstdio>
#include <keel/faults/fault_server.hpp>
#include <keel/http/client.hpp>
#include <string>

using namespace std::chrono_literals;

int main() {
  keel::faults::FaultServer server({.script = "503*2,201"});
  server.start();
  const std::string url = server.url("/v1/charges");

  // --- README.md example ---
  keel::TokenBucketBudget budget;  // the AWS quota: 500 tokens, a retry costs 5
  keel::BreakerRegistry breakers;  // one breaker per host:port, trips at 50% failures
  keel::http::Client client({
      .retry = {.max_attempts = 4,
                .per_try_timeout = 2s,
                .overall_timeout = 10s,  // the deadline wins over the attempt count
                .backoff = {.base = 50ms, .cap = 2s, .jitter = keel::Jitter::kFull}},
      .brakes = {.breakers = &breakers,  // share these between clients calling the same hosts
                 .budget = &budget},
  });

  keel::http::Result r =
      client.send({.method = "POST", .url = url, .body = R"({"amount": 1250, "currency": "EUR"})"});
  if (r.ok()) {
    std::printf("HTTP %d after %d attempts, Idempotency-Key %s\n", r.response->status, r.attempts,
                r.idempotency_key.c_str());
  } else {
    std::printf("gave up: %s\n", std::string(keel::to_string(r.reason)).c_str());
  }
  // --- end of the README.md example ---

  // Every attempt carried the same key, and Keel-Attempt counted them.
  int same_key = 0;
  for (const auto& arrival : server.arrivals()) {
    const auto key = keel::http::find_header(arrival.headers, "Idempotency-Key");
    const auto attempt = keel::http::find_header(arrival.headers, "Keel-Attempt");
    std::printf("  arrival %d: %s %s, Keel-Attempt %s\n", arrival.seq, arrival.method.c_str(),
                arrival.step.c_str(), attempt ? std::string(*attempt).c_str() : "-");
    if (key && *key == r.idempotency_key) ++same_key;
  }
  const bool ok = r.ok() && r.attempts == 3 && same_key == 3;
  std::printf("%s\n", ok ? "ok: one logical POST, three attempts, one key" : "FAILED");
  return ok ? 0 : 1;
}
