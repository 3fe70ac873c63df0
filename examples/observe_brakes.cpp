// Looking at the brakes from code: an event stream that logs every attempt, retry, budget
// refusal, give-up and breaker transition in keel's words, and the health snapshot a /health
// endpoint would serve (each breaker's state and failure rate, the budget's level).
// docs/operations.md shows the marked part ("Looking without Grafana"); the doc test checks that
// it is the same as here.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "keel/core/events.hpp"
#include "keel/core/health.hpp"
#include "keel/core/retry.hpp"

using namespace std::chrono_literals;

int main() {
  std::vector<std::string> lines;
  // --- README.md example ---
  keel::EventStream events;
  const keel::SubscriptionId id = events.subscribe([&](const keel::Event& e) {
    lines.push_back(keel::format_event(e));  // a sink: called on the publishing thread
    std::puts(lines.back().c_str());
  });
  keel::BreakerRegistry breakers;
  keel::publish_breaker_transitions(breakers, events);
  keel::TokenBucketBudget budget;
  const keel::RetryPolicy policy({.max_attempts = 3,
                                  .backoff = {.base = 1ms, .cap = 10ms},
                                  .events = &events,
                                  .operation = "charge"});
  const auto breaker = breakers.get("payments.example:443");
  const keel::CallOptions call{.safe_to_repeat = true, .budget = &budget, .breaker = breaker.get()};
  int calls = 0;
  const auto result = keel::retry(
      policy, [&] { return ++calls < 3 ? keel::Outcome::throttled() : keel::Outcome::success(); },
      call);

  // What a /health endpoint reports.
  const keel::HealthSnapshot health = keel::health_snapshot(breakers, {{"payments", &budget}});
  for (const keel::BreakerHealth& b : health.breakers) {
    std::printf("breaker %s: %s, failure rate %.2f over %lld calls\n", b.key.c_str(),
                std::string(keel::to_string(b.state)).c_str(), b.failure_rate,
                static_cast<long long>(b.calls));
  }
  for (const keel::BudgetHealth& b : health.budgets) {
    std::printf("budget %s (%s): %.0f retries available\n", b.name.c_str(),
                std::string(b.model).c_str(), b.available);
  }
  events.unsubscribe(id);
  // --- end of the README.md example ---

  bool ok = result.ok() && result.attempts == 3;
  ok &= lines.size() == 6;  // started and finished, three times
  ok &= lines.size() == 6 && lines[1].find("; retry in ") != std::string::npos;
  ok &= lines.size() == 6 && lines[5].find("-> success; stop: success") != std::string::npos;
  ok &= health.breakers.size() == 1 && health.breakers[0].calls == 3 &&
        health.breakers[0].failures == 2 && health.all_closed();
  ok &= health.budgets.size() == 1 && health.budgets[0].model == "token bucket";
  std::puts(ok ? "observe_brakes: ok" : "observe_brakes: FAILED");
  return ok ? 0 : 1;
}
