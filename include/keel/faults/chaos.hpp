// keel::faults::Chaos: seeded fault injection for a cpp-httplib server, the failures that make
// clients retry: a fraction of requests answered 503 (optionally with Retry-After), delayed,
// hung (until the hang passes or the server stops), or committed and then dropped without an
// answer.
//
// Two halves. ChaosDecider is the decision alone: which fault this request gets, from one seeded
// generator (std::mt19937_64), so a seed replays the same sequence of decisions for the same
// sequence of calls; a fraction of 0 draws nothing. Chaos applies the decisions to a server
// through the hooks it installs (pre_routing(), wrap(), after_commit()) and counts each fault
// kind it injected (injected(), for a metric per kind).
//
// The answer to an injected 503 and the dropping of a connection are the server's: Chaos calls
// the hooks ChaosHooks gives (a 503 has a plain-text default, a drop fraction needs a drop hook).
// A server other than cpp-httplib uses the three framework-free calls instead, which decide,
// apply what needs no server (the delays and hangs) and count: inject_503(), slow_down() and
// drop_after_commit() (as on keel::store::beast::Server, through its hooks).
//
// Thread-safety: ChaosDecider and Chaos are safe for concurrent use from cpp-httplib's worker
// threads (the generator is behind a mutex, the counters are atomic). The hooks are called from
// those threads. Chaos must outlive the server's use of the handlers it returned.
//
// Example:
//   keel::faults::Chaos chaos({.fraction_503 = 0.2, .delay_fraction = 0.05, .delay = 300ms,
//                               .seed = 42});
//   server.set_pre_routing_handler([&](const auto& req, auto& res) {
//     return chaos.pre_routing(req, res);
//   });
//   server.Get("/v1/things", chaos.wrap(handler));
#pragma once

#include <httplib.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>

#include "keel/core/clock.hpp"

namespace keel::faults {

/// The kinds of injected fault, as counted and as labelled in metrics ("503", "delay", "hang",
/// "drop").
enum class ChaosFault : unsigned char { k503, kDelay, kHang, kDrop };
inline constexpr int kChaosFaults = 4;
[[nodiscard]] std::string_view to_string(ChaosFault fault) noexcept;

struct ChaosOptions {
  /// Fraction of requests answered 503 before routing. Requires: in [0, 1]. Default 0.
  double fraction_503 = 0;
  /// Retry-After sent with injected 503s, in whole seconds rounded up. Default none.
  std::optional<Duration> retry_after_503;
  /// Fraction of the requests not hung that are delayed by `delay`. Requires: in [0, 1].
  /// Default 0.
  double delay_fraction = 0;
  /// Requires: >= 0. Default 1s.
  Duration delay = std::chrono::seconds(1);
  /// Fraction of requests that hang for `hang` (or until stop()). Requires: in [0, 1]. Default 0.
  double hang_fraction = 0;
  /// Requires: >= 0. Default 1 minute.
  Duration hang = std::chrono::minutes(1);
  /// Fraction of committed requests whose response is dropped. Requires: in [0, 1]. Default 0.
  double drop_after_commit = 0;
  /// Seed of the decisions. Default 1.
  std::uint64_t seed = 1;
};

/// What slow_down() decided for a request.
enum class ChaosSlowdown : unsigned char { kNone, kDelay, kHang };

/// The seeded decisions. Each call draws from the one generator only when its fraction is > 0.
class ChaosDecider {
 public:
  /// Throws std::invalid_argument naming the field when a fraction is outside [0, 1] or a
  /// duration is negative.
  explicit ChaosDecider(const ChaosOptions& options);

  /// Whether this request is answered 503 (true with probability fraction_503).
  [[nodiscard]] bool answer_503();
  /// Whether this request hangs (probability hang_fraction) and, if not, whether it is delayed
  /// (probability delay_fraction of the rest).
  [[nodiscard]] ChaosSlowdown slow_down();
  /// Whether this committed request's response is dropped (probability drop_after_commit).
  [[nodiscard]] bool drop_after_commit();

  [[nodiscard]] const ChaosOptions& options() const noexcept { return options_; }

 private:
  [[nodiscard]] bool chance(double p);

  ChaosOptions options_;
  std::mutex mu_;
  std::mt19937_64 rng_;  // guarded by mu_
};

struct ChaosHooks {
  /// Writes the answer to an injected 503 (Retry-After is already set when configured).
  /// Default: status 503, "Service unavailable\n" as text/plain.
  std::function<void(httplib::Response& response, std::string_view detail)> answer_503;
  /// Closes the request's connection without an answer; false when it could not. Required for
  /// after_commit() when drop_after_commit > 0 (drop_after_commit(), the framework-free form,
  /// needs none).
  std::function<bool(const httplib::Request& request)> drop_connection;
};

/// The decisions applied to a cpp-httplib server, with a counter per fault kind.
class Chaos {
 public:
  /// Throws std::invalid_argument as ChaosDecider does.
  explicit Chaos(ChaosOptions options, ChaosHooks hooks = {});
  Chaos(const Chaos&) = delete;
  Chaos& operator=(const Chaos&) = delete;

  /// For a pre-routing handler: Handled after answering an injected 503, otherwise Unhandled.
  [[nodiscard]] httplib::Server::HandlerResponse pre_routing(const httplib::Request& request,
                                                             httplib::Response& response);
  /// `handler` behind the injected hangs and delays (they run before it, as a slow handler
  /// would).
  [[nodiscard]] httplib::Server::Handler wrap(httplib::Server::Handler handler);
  /// For after a request committed: drops its connection when so decided. Returns whether it
  /// did. Throws std::logic_error when a drop is decided and there is no drop_connection hook.
  bool after_commit(const httplib::Request& request);
  /// Framework-free: whether this request is answered 503 (counted when so); the caller writes
  /// the answer, with Retry-After retry_after_503() when set.
  [[nodiscard]] bool inject_503();
  /// Framework-free: the injected hang or delay for this request, if any, on the calling thread
  /// (it blocks: call it where a slow handler would run, never on an event loop).
  void slow_down();
  /// Framework-free: whether this committed request's answer is dropped; the caller drops it
  /// and the drop is counted.
  [[nodiscard]] bool drop_after_commit();
  /// ChaosOptions::retry_after_503.
  [[nodiscard]] const std::optional<Duration>& retry_after_503() const noexcept {
    return decider_.options().retry_after_503;
  }
  /// Ends the hangs in progress and makes new ones return at once (at shutdown). Idempotent.
  void stop() noexcept;

  /// Faults of this kind injected so far.
  [[nodiscard]] std::uint64_t injected(ChaosFault fault) const noexcept;

 private:
  ChaosDecider decider_;
  ChaosHooks hooks_;
  std::atomic<bool> stopping_{false};
  std::atomic<std::uint64_t> injected_[kChaosFaults] = {};
};

}  // namespace keel::faults
