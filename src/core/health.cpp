#include "keel/core/health.hpp"

#include <algorithm>

namespace keel {

bool HealthSnapshot::all_closed() const noexcept {
  return std::all_of(breakers.begin(), breakers.end(),
                     [](const BreakerHealth& b) { return b.state == BreakerState::kClosed; });
}

std::vector<BreakerHealth> breaker_health(const BreakerRegistry& registry) {
  std::vector<BreakerHealth> out;
  for (auto& [key, snap] : registry.snapshot()) {
    BreakerHealth h;
    h.key = key;
    h.state = snap.state;
    h.failure_rate = snap.failure_rate();
    h.calls = snap.calls;
    h.failures = snap.failures;
    h.open_remaining = snap.open_remaining;
    out.push_back(std::move(h));
  }
  return out;
}

BudgetHealth budget_health(std::string_view name, const RetryBudget& budget) {
  BudgetHealth h;
  h.name = std::string(name);
  h.model = budget.model();
  h.available = budget.available();
  return h;
}

HealthSnapshot health_snapshot(
    const BreakerRegistry& registry,
    std::initializer_list<std::pair<std::string_view, const RetryBudget*>> budgets) {
  HealthSnapshot s;
  s.breakers = breaker_health(registry);
  for (const auto& [name, budget] : budgets) {
    if (budget != nullptr) s.budgets.push_back(budget_health(name, *budget));
  }
  return s;
}

}  // namespace keel
