#include "keel/core/breaker.hpp"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#include "detail/invalid.hpp"
#include "detail/stripe.hpp"
#include "detail/time_window.hpp"
#include "keel/core/duration.hpp"

namespace keel {

std::string_view to_string(BreakerState state) noexcept {
  switch (state) {
    case BreakerState::kClosed:
      return "closed";
    case BreakerState::kOpen:
      return "open";
    case BreakerState::kHalfOpen:
      return "half-open";
  }
  return "unknown";
}

BreakerOptions BreakerOptions::more_than_half_failed(Duration window, int minimum_calls) {
  BreakerOptions o;
  o.window = BreakerWindow::kTime;
  o.window_length = window;
  o.minimum_calls = minimum_calls;
  o.failure_rate_threshold = 0.5;
  o.trip_only_above_threshold = true;
  return o;
}

namespace {

constexpr std::int64_t kPpm = 1'000'000;
// Counts are clamped here before multiplying by parts per million (no overflow in int64).
constexpr std::int64_t kMaxCount = 1'000'000'000'000;

// n / calls >= ppm / 1e6 (or >, when strict), in integers.
constexpr bool rate_reached(std::int64_t n, std::int64_t calls, std::int64_t ppm,
                            bool strict) noexcept {
  n = std::min(n, kMaxCount);
  calls = std::min(calls, kMaxCount);
  const std::int64_t lhs = n * kPpm;
  const std::int64_t rhs = ppm * calls;
  return strict ? lhs > rhs : lhs >= rhs;
}

constexpr detail::OptionsCheck reject("CircuitBreaker");

std::string number(double v) { return detail::format_number(v); }

// State word: [state:2][generation:22][ms:40].
constexpr int kTicksBits = 40;
constexpr int kGenBits = 22;
constexpr std::uint64_t kTicksMask = (std::uint64_t{1} << kTicksBits) - 1;
constexpr std::uint64_t kGenMask = (std::uint64_t{1} << kGenBits) - 1;

constexpr BreakerState state_of(std::uint64_t w) noexcept {
  return static_cast<BreakerState>(w >> (kTicksBits + kGenBits));
}
constexpr std::uint32_t gen_of(std::uint64_t w) noexcept {
  return static_cast<std::uint32_t>((w >> kTicksBits) & kGenMask);
}
constexpr std::uint64_t ticks_of(std::uint64_t w) noexcept { return w & kTicksMask; }
// Whether round `a` comes after round `b` (generations wrap at kGenBits).
constexpr bool newer_gen(std::uint32_t a, std::uint32_t b) noexcept {
  const std::uint64_t d = (static_cast<std::uint64_t>(a) - b) & kGenMask;
  return d != 0 && d < (kGenMask >> 1) + 1;
}
constexpr std::uint64_t make_word(BreakerState s, std::uint32_t gen, std::uint64_t ticks) {
  return (static_cast<std::uint64_t>(s) << (kTicksBits + kGenBits)) |
         ((static_cast<std::uint64_t>(gen) & kGenMask) << kTicksBits) | (ticks & kTicksMask);
}

// Trials word: [generation:22][admitted:14][successes:14][failures:14].
constexpr std::uint64_t kCountMask = (std::uint64_t{1} << 14) - 1;
struct Trials {
  std::uint32_t gen;
  std::uint64_t admitted, successes, failures;
};
constexpr Trials unpack(std::uint64_t w) noexcept {
  return {static_cast<std::uint32_t>(w >> 42) & static_cast<std::uint32_t>(kGenMask),
          (w >> 28) & kCountMask, (w >> 14) & kCountMask, w & kCountMask};
}
constexpr std::uint64_t pack(const Trials& t) noexcept {
  return (static_cast<std::uint64_t>(t.gen & kGenMask) << 42) | ((t.admitted & kCountMask) << 28) |
         ((t.successes & kCountMask) << 14) | (t.failures & kCountMask);
}

}  // namespace

// The closed state's sliding window.
//  - kTime: detail::StripedTimeWindow (shared with the ratio budget): calls go to per-thread
//    stripes (no shared cache line written on the success path); failures and slow calls to the
//    bucket and to running totals.
//  - kCount: a ring of window_calls one-byte slots; each call replaces the oldest slot and the
//    totals change by the difference. A thread takes ring slots in runs of `run` consecutive
//    indices, claimed from the shared head once per run and then handed out from its stripe's
//    own cache line, so that threads do not all write one index. One thread fills the ring
//    exactly in order; with several, each may hold up to run - 1 claimed slots not yet written,
//    which keep an older call meanwhile. A call whose slot already holds the same code writes
//    nothing (a healthy dependency's successes leave the ring's cache lines shared).
struct CircuitBreaker::Window {
  static constexpr std::uint8_t kCall = 1, kFailure = 2, kSlow = 4;
  static constexpr int kFailures = 0, kSlowCalls = 1;  // the time window's shared counters

  BreakerWindow kind = BreakerWindow::kTime;
  // kTime
  Duration step{};
  detail::StripedTimeWindow<2> time;
  // kCount
  // A stripe's claimed run: [first slot index:56][slots handed out:8].
  struct alignas(64) Run {
    std::atomic<std::uint64_t> word{0};  // nothing claimed yet: 0 of a run of 0 handed out
  };
  int size = 0;
  std::uint64_t run = 1;  // slots claimed at a time, in [1, 8]
  int stripes = 1;
  std::unique_ptr<std::atomic<std::uint8_t>[]> ring;
  std::unique_ptr<Run[]> runs;
  alignas(64) std::atomic<std::uint64_t> head{0};
  alignas(64) std::atomic<std::int64_t> ring_calls{0};
  alignas(64) std::atomic<std::int64_t> ring_failures{0};
  std::atomic<std::int64_t> ring_slow{0};

  // Running totals of the window (a time window's may include buckets not yet swept).
  [[nodiscard]] std::int64_t failures() const noexcept {
    return kind == BreakerWindow::kTime ? time.total(kFailures)
                                        : ring_failures.load(std::memory_order_acquire);
  }
  [[nodiscard]] std::int64_t slow() const noexcept {
    return kind == BreakerWindow::kTime ? time.total(kSlowCalls)
                                        : ring_slow.load(std::memory_order_acquire);
  }

  // Records one call into the time window at `now_step`.
  void add_time(std::int64_t now_step, bool failure, bool is_slow) noexcept {
    time.expire(now_step);
    const int i = time.bucket_at(now_step);
    time.add_striped(i, 1);
    if (failure) time.add_shared(i, kFailures, 1);
    if (is_slow) time.add_shared(i, kSlowCalls, 1);
  }

  void init_count(int calls) {
    size = calls;
    run = std::clamp<std::uint64_t>(static_cast<std::uint64_t>(calls) / 16, 1, 8);
    stripes = detail::stripe_count();
    ring = std::make_unique<std::atomic<std::uint8_t>[]>(static_cast<std::size_t>(size));
    for (int i = 0; i < size; ++i) ring[static_cast<std::size_t>(i)].store(0);
    runs = std::make_unique<Run[]>(static_cast<std::size_t>(stripes));
  }

  // The next ring index for the calling thread: the next slot of its stripe's run, or the first
  // of a new run claimed from the head. Two threads that share a stripe take turns by
  // compare-and-swap (a run one of them claimed in vain is skipped).
  std::uint64_t take_index() noexcept {
    Run& r = runs[detail::stripe_id() & static_cast<std::uint32_t>(stripes - 1)];
    std::uint64_t w = r.word.load(std::memory_order_relaxed);
    for (;;) {
      const std::uint64_t taken = w & 0xff;
      if (taken != 0 && taken < run) {
        if (r.word.compare_exchange_weak(w, w + 1, std::memory_order_relaxed)) {
          return (w >> 8) + taken;
        }
        continue;
      }
      const std::uint64_t first = head.fetch_add(run, std::memory_order_relaxed);
      if (r.word.compare_exchange_strong(w, (first << 8) | 1, std::memory_order_relaxed)) {
        return first;
      }
    }
  }

  void add_count(bool failure, bool is_slow) noexcept {
    const std::uint8_t code =
        static_cast<std::uint8_t>(kCall | (failure ? kFailure : 0) | (is_slow ? kSlow : 0));
    const auto i = static_cast<std::size_t>(take_index() % static_cast<std::uint64_t>(size));
    // The totals do not change when the slot already holds this code (the common all-success
    // case): then nothing is written.
    if (ring[i].load(std::memory_order_acquire) == code) return;
    const std::uint8_t old = ring[i].exchange(code, std::memory_order_acq_rel);
    if (old == code) return;
    apply(old, -1);
    apply(code, +1);
  }

  void apply(std::uint8_t code, std::int64_t sign) noexcept {
    if ((code & kCall) != 0) ring_calls.fetch_add(sign, std::memory_order_acq_rel);
    if ((code & kFailure) != 0) ring_failures.fetch_add(sign, std::memory_order_acq_rel);
    if ((code & kSlow) != 0) ring_slow.fetch_add(sign, std::memory_order_acq_rel);
  }

  // Calls in the window (time: the live buckets' stripes).
  std::int64_t live_calls(std::int64_t now_step) const noexcept {
    if (kind == BreakerWindow::kCount) return ring_calls.load(std::memory_order_acquire);
    return time.live_striped(now_step);
  }

  // Failures and slow calls of the live buckets only (for snapshots, which do not sweep).
  std::pair<std::int64_t, std::int64_t> live_failures(std::int64_t now_step) const noexcept {
    if (kind == BreakerWindow::kCount) return {failures(), slow()};
    return {time.live_shared(now_step, kFailures), time.live_shared(now_step, kSlowCalls)};
  }

  void clear() noexcept {
    if (kind == BreakerWindow::kTime) {
      time.clear();
    } else {
      for (int i = 0; i < size; ++i) {
        apply(ring[static_cast<std::size_t>(i)].exchange(0, std::memory_order_acq_rel), -1);
      }
    }
  }
};

CircuitBreaker::CircuitBreaker(BreakerOptions options)
    : options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : &steady_clock()),
      window_clock_(clock_) {
  const BreakerOptions& o = options_;
  if (o.window_calls < 1 || o.window_calls > 100000) {
    reject("window_calls", "in [1, 100000]", std::to_string(o.window_calls));
  }
  if (o.window_length < std::chrono::milliseconds(1)) {
    reject("window_length", ">= 1ms", format_duration(o.window_length));
  }
  if (o.window_buckets < 1 || o.window_buckets > 1000) {
    reject("window_buckets", "in [1, 1000]", std::to_string(o.window_buckets));
  }
  if (o.minimum_calls < 1) reject("minimum_calls", ">= 1", std::to_string(o.minimum_calls));
  if (!(o.failure_rate_threshold > 0.0 && o.failure_rate_threshold <= 1.0)) {
    reject("failure_rate_threshold", "in (0, 1]", number(o.failure_rate_threshold));
  }
  if (o.slow_call_duration <= Duration::zero()) {
    reject("slow_call_duration", "> 0", format_duration(o.slow_call_duration));
  }
  if (!(o.slow_call_rate_threshold > 0.0 && o.slow_call_rate_threshold <= 1.0)) {
    reject("slow_call_rate_threshold", "in (0, 1]", number(o.slow_call_rate_threshold));
  }
  if (o.break_duration < std::chrono::milliseconds(1)) {
    reject("break_duration", ">= 1ms", format_duration(o.break_duration));
  }
  if (!(o.break_growth >= 1.0 && o.break_growth <= 1000.0)) {
    reject("break_growth", "in [1, 1000]", number(o.break_growth));
  }
  if (o.max_break_duration < o.break_duration) {
    reject("max_break_duration", ">= break_duration (" + format_duration(o.break_duration) + ")",
           format_duration(o.max_break_duration));
  }
  if (o.half_open_trials < 1 || o.half_open_trials > 10000) {
    reject("half_open_trials", "in [1, 10000]", std::to_string(o.half_open_trials));
  }
  if (o.half_open_timeout < std::chrono::milliseconds(1)) {
    reject("half_open_timeout", ">= 1ms", format_duration(o.half_open_timeout));
  }
  failure_ppm_ = std::llround(o.failure_rate_threshold * kPpm);
  slow_ppm_ = std::llround(o.slow_call_rate_threshold * kPpm);
  track_slow_ = o.slow_call_duration < kInfinite;

  window_ = std::make_unique<Window>();
  Window& w = *window_;
  w.kind = o.window;
  if (o.window == BreakerWindow::kTime) {
    w.step = o.window_length / o.window_buckets;
    if (w.step < std::chrono::microseconds(1)) {
      reject("window_buckets", "at most window_length / 1us", std::to_string(o.window_buckets));
    }
    w.time.init(o.window_buckets);
    // Buckets of 100 ms or more do not need more than the kernel tick's resolution (1-10 ms):
    // on the process's steady clock they are placed by the coarse one, the same monotonic time
    // for a few ns instead of ~25. Any other clock (a ManualClock) places calls by its own time.
    if (clock_ == &steady_clock() && w.step >= std::chrono::milliseconds(100)) {
      window_clock_ = &coarse_clock();
    }
  } else {
    w.init_count(o.window_calls);
  }
  origin_ = clock_->now();
  minimum_calls_.store(o.minimum_calls, std::memory_order_relaxed);
  state_word_.store(make_word(BreakerState::kClosed, 0, 0), std::memory_order_release);
}

CircuitBreaker::~CircuitBreaker() = default;

std::uint64_t CircuitBreaker::to_ticks(TimePoint t) const noexcept {
  const Duration since = t - origin_;
  if (since <= Duration::zero()) return 0;
  // Rounded up: a state never ends early.
  const auto ms = (since.count() + 999'999) / 1'000'000;
  return static_cast<std::uint64_t>(ms) > kTicksMask ? kTicksMask : static_cast<std::uint64_t>(ms);
}

TimePoint CircuitBreaker::from_ticks(std::uint64_t ticks) const noexcept {
  return saturating_add(origin_, std::chrono::milliseconds(static_cast<std::int64_t>(ticks)));
}

Duration CircuitBreaker::break_for(int trips) const noexcept {
  if (trips <= 1 || options_.break_growth == 1.0) return options_.break_duration;
  const double factor = std::pow(options_.break_growth, trips - 1);
  const Duration d = saturating_scale(options_.break_duration, factor);
  return d < options_.max_break_duration ? d : options_.max_break_duration;
}

bool CircuitBreaker::should_trip(std::int64_t calls, std::int64_t failures,
                                 std::int64_t slow) const noexcept {
  if (calls < minimum_calls_.load(std::memory_order_relaxed) || calls <= 0) return false;
  const bool strict = options_.trip_only_above_threshold;
  return rate_reached(failures, calls, failure_ppm_, strict) ||
         (track_slow_ && rate_reached(slow, calls, slow_ppm_, strict));
}

bool CircuitBreaker::transition(std::uint64_t from_word, BreakerState to, TimePoint now) noexcept {
  const BreakerState from = state_of(from_word);
  std::uint64_t ticks = 0;
  if (to == BreakerState::kOpen) {
    const int trips = consecutive_trips_.load(std::memory_order_acquire) + 1;
    ticks = to_ticks(saturating_add(now, break_for(trips)));
  } else if (to == BreakerState::kHalfOpen) {
    ticks = to_ticks(saturating_add(now, options_.half_open_timeout));
  } else {
    window_->clear();  // harmless if the CAS below loses: the window is unused outside closed
  }
  const std::uint64_t next = make_word(to, gen_of(from_word) + 1, ticks);
  std::uint64_t expected = from_word;
  if (!state_word_.compare_exchange_strong(expected, next, std::memory_order_acq_rel)) {
    return false;
  }
  if (to == BreakerState::kOpen) {
    consecutive_trips_.fetch_add(1, std::memory_order_acq_rel);
  } else if (to == BreakerState::kClosed) {
    consecutive_trips_.store(0, std::memory_order_release);
  }
  if (options_.on_state_change) options_.on_state_change(from, to);
  return true;
}

BreakerPermit CircuitBreaker::try_acquire() noexcept {
  BreakerPermit permit;
  std::uint64_t w = state_word_.load(std::memory_order_acquire);
  if (state_of(w) == BreakerState::kClosed) {
    permit.allowed = true;
    permit.generation = gen_of(w);
    if (track_slow_) permit.started = clock_->now();
    return permit;
  }
  const TimePoint now = clock_->now();
  for (int round = 0; round < 8; ++round) {
    switch (state_of(w)) {
      case BreakerState::kClosed:
        permit.allowed = true;
        permit.generation = gen_of(w);
        permit.started = now;
        return permit;
      case BreakerState::kOpen:
        if (now < from_ticks(ticks_of(w))) return permit;
        transition(w, BreakerState::kHalfOpen, now);
        break;
      case BreakerState::kHalfOpen: {
        const std::uint32_t gen = gen_of(w);
        std::uint64_t tw = trials_word_.load(std::memory_order_acquire);
        bool stale = false;
        for (;;) {
          Trials t = unpack(tw);
          if (t.gen != gen) {
            // A later round already counts here: `w` is stale, and resetting the word to its
            // round would free the later round's slots.
            if (newer_gen(t.gen, gen)) {
              stale = true;
              break;
            }
            t = Trials{gen, 0, 0, 0};  // a new half-open round
          }
          if (t.admitted >= static_cast<std::uint64_t>(options_.half_open_trials)) break;
          ++t.admitted;
          if (trials_word_.compare_exchange_weak(tw, pack(t), std::memory_order_acq_rel)) {
            if (options_.trial_gate && !gate_allows_trial(w)) return permit;
            permit.allowed = true;
            permit.trial = true;
            permit.generation = gen;
            permit.started = now;
            return permit;
          }
        }
        if (stale) break;
        // Every trial is out. If they have not reported in time, re-open.
        if (now >= from_ticks(ticks_of(w))) {
          transition(w, BreakerState::kOpen, now);
        }
        return permit;
      }
    }
    w = state_word_.load(std::memory_order_acquire);
  }
  return permit;
}

bool CircuitBreaker::gate_allows_trial(std::uint64_t half_open_word) noexcept {
  Duration hold = Duration::zero();
  try {
    hold = options_.trial_gate();
  } catch (...) {
    hold = Duration::zero();  // a gate that fails lets the breaker decide alone
  }
  if (hold <= Duration::zero()) return true;
  // Somebody else runs the trial: stay open for `hold`, not a trip. The round ends before its
  // slot is given back: a slot freed first could be taken by another thread of the same round,
  // whose trial this move to open would then orphan (its answer read as stale, a second trial
  // in the next round).
  const std::uint64_t next = make_word(BreakerState::kOpen, gen_of(half_open_word) + 1,
                                       to_ticks(saturating_add(clock_->now(), hold)));
  std::uint64_t expected = half_open_word;
  if (state_word_.compare_exchange_strong(expected, next, std::memory_order_acq_rel)) {
    if (options_.on_state_change) {
      options_.on_state_change(BreakerState::kHalfOpen, BreakerState::kOpen);
    }
    return false;  // a new round starts with every slot free
  }
  BreakerPermit slot;  // the round ended some other way: its slot is still ours to give back
  slot.allowed = true;
  slot.trial = true;
  slot.generation = gen_of(half_open_word);
  release(slot);
  return false;
}

void CircuitBreaker::record(const BreakerPermit& permit, const Outcome& outcome) noexcept {
  if (!permit.allowed) return;
  if (!outcome.attempted()) {
    release(permit);
    return;
  }
  const bool failure = is_dependency_failure(outcome.kind);
  if (track_slow_) {
    const TimePoint now = clock_->now();
    const bool slow = now - permit.started >= options_.slow_call_duration;
    if (permit.trial) {
      record_trial(permit, failure);
    } else {
      record_closed(permit, failure, slow, now);
    }
    return;
  }
  if (permit.trial) {
    record_trial(permit, failure);
    return;
  }
  record_closed(permit, failure, false, TimePoint::min());
}

void CircuitBreaker::record(const BreakerPermit& permit, const Outcome& outcome,
                            Duration latency) noexcept {
  if (!permit.allowed) return;
  if (!outcome.attempted()) {
    release(permit);
    return;
  }
  const bool failure = is_dependency_failure(outcome.kind);
  if (permit.trial) {
    record_trial(permit, failure);
    return;
  }
  const bool slow = track_slow_ && latency >= options_.slow_call_duration;
  record_closed(permit, failure, slow, TimePoint::min());
}

void CircuitBreaker::record_closed(const BreakerPermit& permit, bool failure, bool slow,
                                   TimePoint now) noexcept {
  const std::uint64_t w = state_word_.load(std::memory_order_acquire);
  // A late report from before a trip, or from before the breaker last opened and closed again: the
  // call was sent to the dependency as it was then, and counts in no later closed period (a
  // generation is one closed period here: every transition moves it on).
  if (state_of(w) != BreakerState::kClosed || gen_of(w) != permit.generation) return;
  Window& win = *window_;
  std::int64_t now_step = 0;
  if (win.kind == BreakerWindow::kTime) {
    const Duration since = (now == TimePoint::min() ? window_clock_->now() : now) - origin_;
    now_step = since <= Duration::zero() ? 0 : since / win.step;
    win.add_time(now_step, failure, slow);
  } else {
    win.add_count(failure, slow);
  }
  // A trip needs failures (or slow calls) >= threshold * minimum_calls: below that no call, not
  // even a success that brings the window to minimum_calls, can trip it. This keeps the success
  // path of a healthy dependency from summing the window.
  const std::int64_t failures = win.failures();
  const std::int64_t slow_calls = win.slow();
  const std::int64_t minimum = minimum_calls_.load(std::memory_order_relaxed);
  if (!rate_reached(failures, minimum, failure_ppm_, false) &&
      !(track_slow_ && rate_reached(slow_calls, minimum, slow_ppm_, false))) {
    return;
  }
  const std::int64_t calls = win.live_calls(now_step);
  if (!should_trip(calls, failures, slow_calls)) return;
  if (now == TimePoint::min()) now = clock_->now();
  transition(w, BreakerState::kOpen, now);
}

void CircuitBreaker::record_trial(const BreakerPermit& permit, bool failure) noexcept {
  probes_.fetch_add(1, std::memory_order_relaxed);  // it ran, whether or not it still decides
  const std::uint64_t w = state_word_.load(std::memory_order_acquire);
  if (state_of(w) != BreakerState::kHalfOpen || gen_of(w) != permit.generation) return;
  std::uint64_t tw = trials_word_.load(std::memory_order_acquire);
  Trials t{};
  for (;;) {
    t = unpack(tw);
    if (t.gen != permit.generation) return;
    if (failure) {
      ++t.failures;
    } else {
      ++t.successes;
    }
    if (trials_word_.compare_exchange_weak(tw, pack(t), std::memory_order_acq_rel)) break;
  }
  const auto trials = static_cast<std::uint64_t>(options_.half_open_trials);
  if (t.successes + t.failures < trials) return;
  const bool reopen =
      rate_reached(static_cast<std::int64_t>(t.failures), static_cast<std::int64_t>(trials),
                   failure_ppm_, options_.trip_only_above_threshold);
  transition(w, reopen ? BreakerState::kOpen : BreakerState::kClosed, clock_->now());
}

void CircuitBreaker::release(const BreakerPermit& permit) noexcept {
  if (!permit.allowed || !permit.trial) return;  // a closed-state call counts only when recorded
  std::uint64_t tw = trials_word_.load(std::memory_order_acquire);
  for (;;) {
    Trials t = unpack(tw);
    if (t.gen != permit.generation || t.admitted == 0) return;
    --t.admitted;
    if (trials_word_.compare_exchange_weak(tw, pack(t), std::memory_order_acq_rel)) return;
  }
}

Duration CircuitBreaker::retry_in() const noexcept {
  const std::uint64_t w = state_word_.load(std::memory_order_acquire);
  switch (state_of(w)) {
    case BreakerState::kClosed:
      return Duration::zero();
    case BreakerState::kOpen: {
      const TimePoint now = clock_->now();
      const TimePoint until = from_ticks(ticks_of(w));
      return now >= until ? Duration::zero() : until - now;
    }
    case BreakerState::kHalfOpen: {
      const Trials t = unpack(trials_word_.load(std::memory_order_acquire));
      if (t.gen != gen_of(w) ||
          t.admitted < static_cast<std::uint64_t>(options_.half_open_trials)) {
        return Duration::zero();
      }
      // The trials' answers decide soon: look again after a tenth of the break (at most until
      // the trials time out).
      const TimePoint now = clock_->now();
      const TimePoint until = from_ticks(ticks_of(w));
      const Duration left = now >= until ? Duration::zero() : until - now;
      const Duration tenth = options_.break_duration / 10;
      return left < tenth ? left : tenth;
    }
  }
  return Duration::zero();
}

BreakerState CircuitBreaker::state() const noexcept {
  const std::uint64_t w = state_word_.load(std::memory_order_acquire);
  const BreakerState s = state_of(w);
  if (s == BreakerState::kOpen && clock_->now() >= from_ticks(ticks_of(w))) {
    return BreakerState::kHalfOpen;
  }
  return s;
}

BreakerSnapshot CircuitBreaker::snapshot() const noexcept {
  BreakerSnapshot snap;
  const std::uint64_t w = state_word_.load(std::memory_order_acquire);
  const TimePoint now = clock_->now();
  snap.state = state_of(w);
  if (snap.state == BreakerState::kOpen) {
    const TimePoint until = from_ticks(ticks_of(w));
    if (now >= until) {
      snap.state = BreakerState::kHalfOpen;
    } else {
      snap.open_remaining = until - now;
    }
  }
  std::int64_t step = 0;
  if (window_->kind == BreakerWindow::kTime) {
    const Duration since = now - origin_;
    step = since <= Duration::zero() ? 0 : since / window_->step;
  }
  snap.calls = window_->live_calls(step);
  const auto [f, sl] = window_->live_failures(step);
  snap.failures = f;
  snap.slow = sl;
  snap.consecutive_trips = consecutive_trips_.load(std::memory_order_acquire);
  snap.probes = probes_.load(std::memory_order_relaxed);
  return snap;
}

void CircuitBreaker::reset() noexcept {
  std::uint64_t w = state_word_.load(std::memory_order_acquire);
  while (state_of(w) != BreakerState::kClosed) {
    if (transition(w, BreakerState::kClosed, clock_->now())) return;
    w = state_word_.load(std::memory_order_acquire);
  }
  window_->clear();
}

void CircuitBreaker::set_fleet_size(int processes) noexcept {
  const int full = options_.minimum_calls;
  if (processes <= 1) {
    minimum_calls_.store(full, std::memory_order_relaxed);
    return;
  }
  const int share = (full + processes - 1) / processes;
  minimum_calls_.store(std::max(share, std::min(full, 3)), std::memory_order_relaxed);
}

void CircuitBreaker::force_open(Duration break_for) noexcept {
  if (break_for < Duration::zero()) break_for = Duration::zero();
  std::uint64_t w = state_word_.load(std::memory_order_acquire);
  for (;;) {
    const TimePoint now = clock_->now();
    // A break that is already over ends at the current millisecond, rounded down (to_ticks
    // rounds up, which would refuse calls for up to 1 ms more).
    std::uint64_t ticks = 0;
    if (break_for > Duration::zero()) {
      ticks = to_ticks(saturating_add(now, break_for));
    } else if (now > origin_) {
      const auto ms = static_cast<std::uint64_t>((now - origin_).count() / 1'000'000);
      ticks = ms > kTicksMask ? kTicksMask : ms;
    }
    const std::uint64_t next = make_word(BreakerState::kOpen, gen_of(w) + 1, ticks);
    if (state_word_.compare_exchange_weak(w, next, std::memory_order_acq_rel)) break;
  }
  consecutive_trips_.fetch_add(1, std::memory_order_acq_rel);
  const BreakerState from = state_of(w);
  if (from != BreakerState::kOpen && options_.on_state_change) {
    options_.on_state_change(from, BreakerState::kOpen);
  }
}

// ---------------------------------------------------------------------------------------------
// BreakerRegistry

struct BreakerRegistry::Listeners {
  mutable std::shared_mutex mutex;
  std::vector<std::pair<std::uint64_t, BreakerListener>> list;  // guarded by mutex
  std::uint64_t next_id = 0;                                    // guarded by mutex

  void notify(std::string_view key, BreakerState from, BreakerState to) const {
    std::shared_lock lock(mutex);
    for (const auto& [id, l] : list) l(key, from, to);
  }
};

struct BreakerRegistry::Gate {
  mutable std::shared_mutex mutex;
  BreakerTrialGate gate;  // guarded by mutex

  [[nodiscard]] Duration ask(std::string_view key) const {
    std::shared_lock lock(mutex);
    return gate ? gate(key) : Duration::zero();
  }
};

BreakerRegistry::BreakerRegistry(BreakerRegistryOptions options)
    : options_(std::move(options)),
      listeners_(std::make_shared<Listeners>()),
      gate_(std::make_shared<Gate>()) {
  if (options_.max_keys < 1) {
    detail::reject("BreakerRegistry", "max_keys", ">= 1", "0");
  }
  BreakerOptions probe = options_.breaker;
  probe.on_state_change = nullptr;
  probe.trial_gate = nullptr;
  CircuitBreaker validate(probe);  // throws on invalid breaker options
  if (options_.breaker.trial_gate) {
    gate_->gate = [own = options_.breaker.trial_gate](std::string_view) { return own(); };
  }
}

BreakerRegistry::~BreakerRegistry() = default;

std::shared_ptr<CircuitBreaker> BreakerRegistry::find(std::string_view key) const {
  std::shared_lock lock(mutex_);
  const auto it = entries_.find(key);
  return it == entries_.end() ? nullptr : it->second.breaker;
}

std::shared_ptr<CircuitBreaker> BreakerRegistry::get(std::string_view key) {
  {
    std::shared_lock lock(mutex_);
    const auto it = entries_.find(key);
    if (it != entries_.end()) return it->second.breaker;
  }
  std::unique_lock lock(mutex_);
  const auto it = entries_.find(key);
  if (it != entries_.end()) return it->second.breaker;
  if (entries_.size() >= options_.max_keys) {
    // Evict the oldest closed breaker; never share one breaker between two dependencies.
    auto victim = entries_.end();
    for (auto e = entries_.begin(); e != entries_.end(); ++e) {
      if (e->second.breaker->state() != BreakerState::kClosed) continue;
      if (victim == entries_.end() || e->second.created < victim->second.created) victim = e;
    }
    if (victim == entries_.end()) return nullptr;
    entries_.erase(victim);
    evictions_.fetch_add(1, std::memory_order_relaxed);
  }
  BreakerOptions o = options_.breaker;
  o.on_state_change = [listeners = listeners_, name = std::string(key)](BreakerState from,
                                                                        BreakerState to) {
    listeners->notify(name, from, to);
  };
  o.trial_gate = [gate = gate_, name = std::string(key)] { return gate->ask(name); };
  auto breaker = std::make_shared<CircuitBreaker>(std::move(o));
  breaker->set_fleet_size(fleet_size_.load());
  entries_.emplace(std::string(key), Entry{breaker, ++created_});
  return breaker;
}

std::optional<BreakerState> BreakerRegistry::state(std::string_view key) const {
  auto b = find(key);
  if (!b) return std::nullopt;
  return b->state();
}

std::vector<std::pair<std::string, BreakerSnapshot>> BreakerRegistry::snapshot() const {
  std::vector<std::pair<std::string, BreakerSnapshot>> out;
  {
    std::shared_lock lock(mutex_);
    out.reserve(entries_.size());
    for (const auto& [key, entry] : entries_) out.emplace_back(key, entry.breaker->snapshot());
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

std::size_t BreakerRegistry::size() const {
  std::shared_lock lock(mutex_);
  return entries_.size();
}

std::uint64_t BreakerRegistry::add_listener(BreakerListener listener) {
  std::unique_lock lock(listeners_->mutex);
  const std::uint64_t id = ++listeners_->next_id;
  listeners_->list.emplace_back(id, std::move(listener));
  return id;
}

void BreakerRegistry::remove_listener(std::uint64_t id) {
  std::unique_lock lock(listeners_->mutex);
  std::erase_if(listeners_->list, [id](const auto& entry) { return entry.first == id; });
}

void BreakerRegistry::set_fleet_size(int processes) {
  std::shared_lock lock(mutex_);  // get() reads fleet_size_ under the exclusive lock
  fleet_size_.store(processes < 1 ? 1 : processes);
  for (const auto& [key, entry] : entries_) entry.breaker->set_fleet_size(processes);
}

void BreakerRegistry::set_trial_gate(BreakerTrialGate gate) {
  std::unique_lock lock(gate_->mutex);
  gate_->gate = std::move(gate);
}

}  // namespace keel
