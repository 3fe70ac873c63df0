// Health snapshots: the state of a service's brakes as plain values, for a health endpoint, a
// readiness probe or a metrics collector. One entry per breaker of a registry (key, state,
// failure rate and calls in its window, time left open) and one per named retry budget (model
// and retries available now). Reading them takes the registry's shared lock and a few atomic
// loads per breaker; nothing is written, so a snapshot never disturbs the calls it observes.
//
// Thread-safety: the functions are safe to call from any thread while other threads use the
// breakers and budgets; each value is a snapshot that may be stale at once.
//
// Example:
//   keel::HealthSnapshot h = keel::health_snapshot(breakers, {{"payments", &budget}});
//   if (!h.all_closed()) status = 503;   // or report h.breakers[i].state per dependency
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "keel/core/breaker.hpp"
#include "keel/core/budget.hpp"
#include "keel/core/clock.hpp"

namespace keel {

/// One breaker of a registry.
struct BreakerHealth {
  std::string key;
  BreakerState state = BreakerState::kClosed;
  double failure_rate = 0.0;  // failures / calls in the window (0 when empty)
  std::int64_t calls = 0;     // in the window
  std::int64_t failures = 0;  // in the window
  Duration open_remaining{};  // until half-open, when open
};

/// One retry budget.
struct BudgetHealth {
  std::string name;
  std::string_view model;  // RetryBudget::model(): "ratio", "token bucket", "throttle"
  double available = 0.0;  // RetryBudget::available(): retries (or tokens) available now
};

struct HealthSnapshot {
  std::vector<BreakerHealth> breakers;  // sorted by key
  std::vector<BudgetHealth> budgets;    // in the order given
  /// No breaker is open or half-open.
  [[nodiscard]] bool all_closed() const noexcept;
};

/// Every breaker of `registry`, sorted by key.
[[nodiscard]] std::vector<BreakerHealth> breaker_health(const BreakerRegistry& registry);

/// The budget's model and level. `name` labels it (a dependency's name).
[[nodiscard]] BudgetHealth budget_health(std::string_view name, const RetryBudget& budget);

/// Both at once. Null budgets are skipped.
[[nodiscard]] HealthSnapshot health_snapshot(
    const BreakerRegistry& registry,
    std::initializer_list<std::pair<std::string_view, const RetryBudget*>> budgets = {});

}  // namespace keel
