// The event stream: what the retry engine and the circuit breakers did, as it happens, for logs,
// traces and metrics. A RetryState whose policy names a stream (RetryOptions::events) publishes
// every attempt it starts and finishes (with the outcome and the decision: the delay before the
// next attempt, or why the operation stops), every retry the budget refuses and every give-up
// (with its StopReason); a BreakerRegistry connected with publish_breaker_transitions() adds
// every breaker's state changes (key, from, to). The words are those of keel's log lines: an
// outcome is keel::describe(outcome), a decision "retry in 200ms" or
// "stop: attempts exhausted" (format_decision), a reason keel::to_string(StopReason).
//
// Subscribers are EventSinks (or callbacks), at most kMaxSubscribers at once, each for the event
// kinds it asks for (an EventMask; kOutcomeEvents leaves out kAttemptStarted, so a counting sink
// costs a success one event, not two). Publishing takes no lock and allocates nothing: for a kind
// nobody asked for it is one atomic load and a branch; otherwise a walk over a fixed array of
// atomic sink pointers and one virtual call per sink, on the thread that publishes. Subscribing and
// unsubscribing take a mutex (they are configuration changes).
//
// Lifetime rule for sinks: the stream shares ownership of every sink it was given. After
// unsubscribe() returns, a publish that starts later does not call the sink, but one already
// under way on another thread may still be calling it; so the stream keeps its reference to the
// sink until the stream is destroyed (or until reclaim(), which the caller may call once no such
// publish can be running). The caller may drop its own reference at any time.
//
// Thread-safety: EventStream is safe for concurrent use. A sink is called from every thread that
// publishes, concurrently, and must be safe for that; it must not throw, and must not subscribe
// or unsubscribe on the stream that calls it. Requires: the stream outlives every policy and
// registry that publishes to it.
//
// Example:
//   keel::EventStream events;
//   auto id = events.subscribe([](const keel::Event& e) { log(keel::format_event(e)); });
//   keel::RetryPolicy policy({.max_attempts = 3, .events = &events, .operation = "charge"});
//   keel::publish_breaker_transitions(breakers, events);   // a keel::BreakerRegistry
//   ...
//   events.unsubscribe(id);
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/breaker.hpp"
#include "keel/core/classify.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/retry.hpp"

namespace keel {

/// What happened.
enum class EventKind : unsigned char {
  kAttemptStarted,     // an attempt is about to run: attempt
  kAttemptFinished,    // it ended: attempt, outcome and the decision (will_retry, delay, reason)
  kBudgetRefused,      // the retry budget refused a retry: attempt (the one that failed), outcome
  kGaveUp,             // the operation stopped without success: attempt (attempts made), outcome
                       // (the last; kNotAttempted when none ran), reason, elapsed
  kBreakerTransition,  // a breaker changed state: key, from, to
};

/// "attempt started", "attempt finished", "budget refused", "gave up", "breaker transition".
[[nodiscard]] std::string_view to_string(EventKind kind) noexcept;

/// One event. Which fields are meaningful depends on the kind (see EventKind); the others keep
/// their defaults. String views point into the publisher's data and are valid only during the
/// call to the sink.
struct Event {
  // The small fields first: the struct is built on the publishing path.
  EventKind kind = EventKind::kAttemptStarted;
  /// kAttemptFinished: another attempt follows, after delay.
  bool will_retry = false;
  /// kAttemptFinished when !will_retry, and kGaveUp: why the operation stops.
  StopReason reason = StopReason::kSuccess;
  /// kBreakerTransition: the states.
  BreakerState from = BreakerState::kClosed;
  BreakerState to = BreakerState::kClosed;
  /// The attempt's number (1 for the first); for kGaveUp, the attempts made.
  int attempt = 0;
  /// The operation's name (RetryOptions::operation), empty when unnamed. Empty for a breaker.
  std::string_view operation;
  /// kBreakerTransition: the dependency's key.
  std::string_view key;
  /// kAttemptFinished: the wait before the next attempt (when will_retry).
  Duration delay{};
  /// kGaveUp: since the operation started.
  Duration elapsed{};
  /// kAttemptFinished, kBudgetRefused (the failure), kGaveUp (the last; kNotAttempted when none
  /// ran).
  Outcome outcome;
};

/// The decision after an attempt in keel's words: "retry in 200ms" or "stop: deadline" (the
/// wording of keel's log lines).
[[nodiscard]] std::string format_decision(bool will_retry, Duration delay, StopReason reason);

/// One log line for an event, for instance "keel: charge: attempt 2 -> HTTP 503 (throttled); retry
/// in 400ms", "keel: breaker api.example:443: closed -> open", or format_give_up's line.
[[nodiscard]] std::string format_event(const Event& event);

/// Receives events. Called concurrently from every publishing thread; must not throw.
class EventSink {
 public:
  virtual ~EventSink() = default;
  virtual void on_event(const Event& event) = 0;
};

/// A set of event kinds, for a sink that needs only some: bit (1 << kind).
using EventMask = std::uint32_t;
[[nodiscard]] constexpr EventMask event_mask(EventKind kind) noexcept {
  return EventMask{1} << static_cast<unsigned>(kind);
}
inline constexpr EventMask kAllEvents = 0x1f;
/// Every kind but kAttemptStarted: what counting sinks (metrics) need. A success then publishes
/// one event, not two.
inline constexpr EventMask kOutcomeEvents = kAllEvents & ~event_mask(EventKind::kAttemptStarted);

/// A subscription, for unsubscribe(). 0 is "none" (subscribe() refused: every slot is taken).
using SubscriptionId = std::uint64_t;

class EventStream {
 public:
  /// Subscribers at once.
  static constexpr std::size_t kMaxSubscribers = 16;

  EventStream();
  ~EventStream();
  EventStream(const EventStream&) = delete;
  EventStream& operator=(const EventStream&) = delete;

  /// Adds a sink for the events of `kinds`; those published from now on reach it. Returns its
  /// id, or 0 when kMaxSubscribers sinks are subscribed already (or `sink` is null). An event
  /// kind no sink asked for is not even built by the publishers.
  [[nodiscard]] SubscriptionId subscribe(std::shared_ptr<EventSink> sink,
                                         EventMask kinds = kAllEvents);
  /// As above, for a callback (the same contract as EventSink::on_event).
  [[nodiscard]] SubscriptionId subscribe(std::function<void(const Event&)> callback,
                                         EventMask kinds = kAllEvents);
  /// Removes a subscription (no-op for an unknown or already removed id). Publishes that start
  /// after it returns do not reach the sink; see the lifetime rule above.
  void unsubscribe(SubscriptionId id);
  /// Drops the stream's references to unsubscribed sinks. Requires: no publish that started
  /// before their unsubscribe() returned is still running (the publishing threads were joined,
  /// or are known to be past the operations they were in).
  void reclaim();

  /// Sinks subscribed now (a snapshot).
  [[nodiscard]] std::size_t subscribers() const noexcept {
    return static_cast<std::size_t>(subscribers_.load(std::memory_order_relaxed));
  }
  [[nodiscard]] bool has_subscribers() const noexcept {
    return subscribers_.load(std::memory_order_relaxed) != 0;
  }
  /// Whether a sink wants events of `kind`: test it before building an event.
  [[nodiscard]] bool wants(EventKind kind) const noexcept {
    return (wanted_.load(std::memory_order_relaxed) & event_mask(kind)) != 0;
  }
  /// Calls every sink subscribed to the event's kind, on this thread. No lock, no allocation.
  void publish(const Event& event) const {
    if (wants(event.kind)) deliver(event);
  }

 private:
  void deliver(const Event& event) const {
    const EventMask bit = event_mask(event.kind);
    const int used = used_.load(std::memory_order_acquire);
    for (int i = 0; i < used; ++i) {
      const auto slot = static_cast<std::size_t>(i);
      EventSink* sink = slots_[slot].load(std::memory_order_acquire);
      if (sink != nullptr && (masks_[slot].load(std::memory_order_relaxed) & bit) != 0) {
        sink->on_event(event);
      }
    }
  }

  std::atomic<int> subscribers_{0};
  std::atomic<EventMask> wanted_{0};  // the union of the subscribed sinks' masks
  // Slots [0, used_) may hold a sink; publish reads each with one acquire load.
  std::atomic<int> used_{0};
  std::array<std::atomic<EventSink*>, kMaxSubscribers> slots_{};
  // Each slot's kinds, stored before its sink pointer (a publisher that sees the pointer sees
  // its mask; while a slot is reused, a publish under way may filter one event by either).
  std::array<std::atomic<EventMask>, kMaxSubscribers> masks_{};

  std::mutex mu_;
  std::array<std::shared_ptr<EventSink>, kMaxSubscribers> owned_;  // guarded by mu_
  std::array<SubscriptionId, kMaxSubscribers> ids_{};              // guarded by mu_
  std::vector<std::shared_ptr<EventSink>> retired_;                // guarded by mu_
  SubscriptionId next_id_ = 1;                                     // guarded by mu_
};

/// Publishes every state change of every breaker of `registry` to `stream` as a
/// kBreakerTransition event (through BreakerRegistry::add_listener). Requires: `stream` outlives
/// `registry`.
void publish_breaker_transitions(BreakerRegistry& registry, EventStream& stream);

}  // namespace keel
