#include "keel/core/events.hpp"

#include <utility>

#include "keel/core/duration.hpp"

namespace keel {

std::string_view to_string(EventKind kind) noexcept {
  switch (kind) {
    case EventKind::kAttemptStarted:
      return "attempt started";
    case EventKind::kAttemptFinished:
      return "attempt finished";
    case EventKind::kBudgetRefused:
      return "budget refused";
    case EventKind::kGaveUp:
      return "gave up";
    case EventKind::kBreakerTransition:
      return "breaker transition";
  }
  return "unknown";
}

std::string format_decision(bool will_retry, Duration delay, StopReason reason) {
  if (will_retry) return "retry in " + format_duration(delay);
  return "stop: " + std::string(to_string(reason));
}

std::string format_event(const Event& e) {
  if (e.kind == EventKind::kGaveUp) {
    GiveUpEvent g;
    g.attempts = e.attempt;
    g.elapsed = e.elapsed;
    g.reason = e.reason;
    g.last = e.outcome;
    return format_give_up(g, e.operation);
  }
  std::string line = "keel: ";
  if (e.kind == EventKind::kBreakerTransition) {
    line += "breaker ";
    line += e.key;
    line += ": ";
    line += to_string(e.from);
    line += " -> ";
    line += to_string(e.to);
    return line;
  }
  if (!e.operation.empty()) {
    line += e.operation;
    line += ": ";
  }
  line += "attempt " + std::to_string(e.attempt);
  switch (e.kind) {
    case EventKind::kAttemptStarted:
      line += " started";
      break;
    case EventKind::kAttemptFinished:
      line +=
          " -> " + describe(e.outcome) + "; " + format_decision(e.will_retry, e.delay, e.reason);
      break;
    case EventKind::kBudgetRefused:
      line += " -> " + describe(e.outcome) + "; budget refused the retry";
      break;
    case EventKind::kGaveUp:
    case EventKind::kBreakerTransition:
      break;
  }
  return line;
}

namespace {
class CallbackSink final : public EventSink {
 public:
  explicit CallbackSink(std::function<void(const Event&)> fn) : fn_(std::move(fn)) {}
  void on_event(const Event& event) override { fn_(event); }

 private:
  std::function<void(const Event&)> fn_;
};
}  // namespace

EventStream::EventStream() = default;
EventStream::~EventStream() = default;

SubscriptionId EventStream::subscribe(std::shared_ptr<EventSink> sink, EventMask kinds) {
  if (sink == nullptr) return 0;
  const std::lock_guard lock(mu_);
  for (std::size_t i = 0; i < kMaxSubscribers; ++i) {
    if (ids_[i] != 0) continue;
    const SubscriptionId id = next_id_++;
    ids_[i] = id;
    masks_[i].store(kinds & kAllEvents, std::memory_order_relaxed);
    // Published with release: a publisher that sees the pointer sees the constructed sink.
    slots_[i].store(sink.get(), std::memory_order_release);
    owned_[i] = std::move(sink);
    const int used = static_cast<int>(i) + 1;
    if (used_.load(std::memory_order_relaxed) < used) {
      used_.store(used, std::memory_order_release);
    }
    subscribers_.fetch_add(1, std::memory_order_release);
    wanted_.store(wanted_.load(std::memory_order_relaxed) | (kinds & kAllEvents),
                  std::memory_order_release);
    return id;
  }
  return 0;
}

SubscriptionId EventStream::subscribe(std::function<void(const Event&)> callback, EventMask kinds) {
  if (!callback) return 0;
  return subscribe(std::make_shared<CallbackSink>(std::move(callback)), kinds);
}

void EventStream::unsubscribe(SubscriptionId id) {
  if (id == 0) return;
  const std::lock_guard lock(mu_);
  for (std::size_t i = 0; i < kMaxSubscribers; ++i) {
    if (ids_[i] != id) continue;
    slots_[i].store(nullptr, std::memory_order_release);
    subscribers_.fetch_sub(1, std::memory_order_release);
    ids_[i] = 0;
    EventMask wanted = 0;
    for (std::size_t j = 0; j < kMaxSubscribers; ++j) {
      if (ids_[j] != 0) wanted |= masks_[j].load(std::memory_order_relaxed);
    }
    wanted_.store(wanted, std::memory_order_release);
    // A publish under way may still be calling it: keep it alive (the lifetime rule).
    retired_.push_back(std::move(owned_[i]));
    return;
  }
}

void EventStream::reclaim() {
  std::vector<std::shared_ptr<EventSink>> dropped;
  {
    const std::lock_guard lock(mu_);
    dropped.swap(retired_);
  }
}  // the sinks are destroyed here, outside the lock

void publish_breaker_transitions(BreakerRegistry& registry, EventStream& stream) {
  registry.add_listener([&stream](std::string_view key, BreakerState from, BreakerState to) {
    if (!stream.wants(EventKind::kBreakerTransition)) return;
    Event e;
    e.kind = EventKind::kBreakerTransition;
    e.key = key;
    e.from = from;
    e.to = to;
    stream.publish(e);
  });
}

}  // namespace keel
