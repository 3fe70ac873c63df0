// Exponential backoff with jitter. The ceiling for retry n (n = 0 before the first retry) is
// clamp(base * multiplier^n, min_ceiling, cap), that is min(cap, base * multiplier^n) with the
// default min_ceiling of 0; the delay actually waited depends on the jitter kind:
//
//   full          uniform[0, ceiling)                    (default; fewest calls across a fleet)
//   equal         ceiling/2 + uniform[0, ceiling/2)
//   decorrelated  min(cap, uniform[base, previous * 3))  (previous = the last delay, base at first)
//   none          ceiling                                (synchronises a fleet: for comparison)
//
// The defaults (base 100 ms, cap 10 s, full jitter) are for interactive calls: the median client
// has made five retries 1.6 s after its failure. BackoffOptions::fleet() is for many clients that
// fail together (a dependency's outage): a 5 s floor under the first ceilings spreads the fleet's
// retries so that the busiest 100 ms sees about a third of what AWS's standard retries send, with
// the median client done sooner. See docs/backoff.md ("At fleet scale") for the numbers.
//
// Thread-safety: a Backoff is immutable after construction and safe for concurrent use; the
// random generator passed to delay() is the caller's.
//
// Example:
//   keel::Backoff backoff({.base = 100ms, .cap = 5s});    // full jitter
//   keel::Rng rng(7);
//   auto d0 = backoff.delay(0, {}, rng);                  // in [0, 100ms)
//   auto d1 = backoff.delay(1, d0, rng);                  // in [0, 200ms)
//   keel::Backoff fleet(keel::BackoffOptions::fleet());  // 5s, 5s, 5s, 5s, 8s, 16s, 20s, ...
#pragma once

#include <chrono>
#include <optional>
#include <string_view>

#include "keel/core/clock.hpp"
#include "keel/core/random.hpp"

namespace keel {

enum class Jitter : unsigned char { kFull, kEqual, kDecorrelated, kNone };

/// "full", "equal", "decorrelated", "none".
[[nodiscard]] std::string_view to_string(Jitter jitter) noexcept;
/// Inverse of to_string; nullopt for anything else.
[[nodiscard]] std::optional<Jitter> parse_jitter(std::string_view text) noexcept;

struct BackoffOptions {
  /// Ceiling before the first retry. Requires: > 0. Default 100 ms.
  Duration base = std::chrono::milliseconds(100);
  /// Largest ceiling (and largest delay). Requires: >= base. Default 10 s.
  Duration cap = std::chrono::seconds(10);
  /// Growth per retry. Requires: >= 1 and finite. Default 2.
  double multiplier = 2.0;
  /// How the delay is drawn under the ceiling. Default full jitter.
  Jitter jitter = Jitter::kFull;
  /// Smallest ceiling: no retry's ceiling is below it, so clients that fail together spread
  /// their first retries over min_ceiling instead of over base, and the ceilings grow from
  /// base * multiplier^n once that passes it. Requires: >= 0 and <= cap; 0 with decorrelated
  /// jitter (which draws from the previous delay, not from a ceiling). Default 0 (no floor).
  Duration min_ceiling = Duration::zero();

  /// Backoff for a fleet of clients that fail at the same time: full jitter, base 500 ms, x2,
  /// cap 20 s, min_ceiling 5 s (ceilings 5, 5, 5, 5, 8, 16, 20, 20 ... s). With 10,000 clients
  /// retrying 5 times into an outage the busiest 100 ms sees about 540 retries (AWS standard
  /// 1,528, the default 12,665) and the median client's last retry is at 14.0 s (AWS 15.6 s).
  /// Not for interactive calls: the first retry waits 2.5 s on average (the default: 50 ms).
  [[nodiscard]] static BackoffOptions fleet();
};

class Backoff {
 public:
  /// Throws std::invalid_argument naming the field and the value when the options break a
  /// Requires line above.
  explicit Backoff(BackoffOptions options = {});

  /// clamp(base * multiplier^retry, min_ceiling, cap), saturating. Requires: retry >= 0.
  [[nodiscard]] Duration ceiling(int retry) const noexcept;

  /// The delay to wait before retry number `retry` (0-based). `previous` is the delay chosen
  /// before the previous retry (only decorrelated jitter uses it; pass zero for the first).
  [[nodiscard]] Duration delay(int retry, Duration previous, BitGenRef gen) const noexcept;

  [[nodiscard]] const BackoffOptions& options() const noexcept { return options_; }

 private:
  BackoffOptions options_;
};

/// uniform[lo, hi) in nanoseconds; lo when hi <= lo.
[[nodiscard]] Duration uniform_duration(Duration lo, Duration hi, BitGenRef gen) noexcept;

/// The retries of one thing that keeps failing (a reconnect loop, a task that cannot run): each
/// next() is the Backoff's delay for one more failure in a row, drawn from the sequence's own
/// generator; reset() once it works again, so that the next failure starts from the first
/// ceiling (gRPC's BackOff: NextAttemptDelay and Reset). It keeps the failures in a row and the
/// previous delay, which every loop over a stateless Backoff otherwise keeps by hand.
///
/// Thread-safety: not thread-safe; one per loop, or guarded by the loop's own mutex.
///
/// Example:
///   keel::BackoffSequence reconnect({.base = 100ms, .cap = 5s}, seed);
///   while (!stopping) {
///     if (try_connect()) { reconnect.reset(); serve(); continue; }
///     wait_for(reconnect.next());          // in [0, 100ms), then [0, 200ms) ...
///   }
class BackoffSequence {
 public:
  /// Throws std::invalid_argument as Backoff does.
  explicit BackoffSequence(BackoffOptions options = {}, std::uint64_t seed = 1);

  /// The delay before the next try after one more failure in a row.
  [[nodiscard]] Duration next() noexcept;
  /// It worked: failures() is 0 again and the next delay is drawn under the first ceiling.
  void reset() noexcept;
  /// Failures in a row so far (next() calls since the last reset()).
  [[nodiscard]] int failures() const noexcept { return failures_; }

 private:
  Backoff backoff_;
  Rng rng_;
  int failures_ = 0;
  Duration previous_{};
};

/// How one session of a loop that keeps a connection ended (keep_reconnecting).
enum class SessionEnd : unsigned char {
  kLost,    // it was connected and working, then failed: the backoff starts over
  kFailed,  // it failed again before it worked: one more failure in a row
  kStop,    // the loop is done (its owner stops, or a refusal no retry changes)
};

/// The one reconnect loop of keel's background connections (the Worker's listener, the fleet's
/// thread): runs `session()` until it returns SessionEnd::kStop; after each other end, waits
/// `backoff`'s next delay (reset() first after kLost, so that a connection that worked for a
/// while starts over at the first ceiling) with `wait(delay)`, which returns false when the loop
/// must stop. No I/O of its own: the caller's session connects and serves until it fails, the
/// caller's wait sleeps on its own condition variable or timer, so that a stop is seen at once.
///
/// Example:
///   keel::BackoffSequence backoff({.base = 100ms, .cap = 5s}, seed);
///   keel::keep_reconnecting(backoff, [&] { return serve_until_lost(); },
///                           [&](keel::Duration d) { return !stop_wait(d); });
template <class Session, class Wait>
void keep_reconnecting(BackoffSequence& backoff, Session&& session, Wait&& wait) {
  for (;;) {
    const SessionEnd end = session();
    if (end == SessionEnd::kStop) return;
    if (end == SessionEnd::kLost) backoff.reset();
    if (!wait(backoff.next())) return;
  }
}

/// When a periodic task (a heartbeat, a prune, a poll, a check) runs next: after a success, its
/// interval with ±50% jitter (jittered()), so that the processes of a fleet do not do it in
/// step; after a failure, the backoff's next delay, and the backoff starts over at the first
/// success. For a loop whose period may stretch (a sweep, a poll, a check); the loop itself (a
/// thread, a timer on an event loop) waits for the delay it is given; loops without a failure
/// path of their own (the Worker's prune, the fleet's membership heartbeat) take jittered()
/// directly, the same spread. A loop that must run within its interval, as the Worker's lease
/// heartbeat must, spreads its waits over the interval's second half instead
/// (uniform_duration(interval / 2, interval)): +50% would let the lease expire.
///
/// Thread-safety: not thread-safe; one per loop.
class PeriodicSchedule {
 public:
  /// `interval`: the mean wait between successful runs. Requires: > 0. Throws
  /// std::invalid_argument naming the field, or as Backoff does for `on_failure`.
  PeriodicSchedule(Duration interval, BackoffOptions on_failure, std::uint64_t seed = 1);

  /// The wait after a run that worked.
  [[nodiscard]] Duration after_success() noexcept;
  /// The wait after a run that failed (one more in a row).
  [[nodiscard]] Duration after_failure() noexcept;
  /// Failures in a row so far.
  [[nodiscard]] int failures() const noexcept { return failures_.failures(); }
  [[nodiscard]] Duration interval() const noexcept { return interval_; }

 private:
  Duration interval_;
  BackoffSequence failures_;
  Rng rng_;
};

/// A periodic wait with ±50% jitter: uniform[interval / 2, interval × 3/2), so that the
/// processes of a fleet that started together (or were all woken by one event) spread their
/// periodic work instead of doing it in step. The mean is `interval`. Zero or negative: zero.
[[nodiscard]] Duration jittered(Duration interval, BitGenRef gen) noexcept;

}  // namespace keel
