#include "keel/core/policy_check.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>

#include "keel/core/backoff.hpp"
#include "keel/core/duration.hpp"

namespace keel {
namespace {

// After this many distinct waits the last one is repeated for the rest of the attempts.
constexpr std::int64_t kMaxDistinctWaits = 1'000'000;

// d * n, saturating at kInfinite. Requires: d >= 0, n >= 0.
Duration saturating_times(Duration d, std::int64_t n) noexcept {
  Duration::rep out{};
  if (__builtin_mul_overflow(d.count(), n, &out)) return kInfinite;
  return Duration(out);
}

bool operator==(const WaitRange& a, const WaitRange& b) noexcept {
  return a.min == b.min && a.max == b.max && a.mean == b.mean;
}

// E[min(cap, uniform[lo, hi))].
Duration capped_uniform_mean(Duration lo, Duration hi, Duration cap) noexcept {
  if (hi <= lo) return std::min(lo, cap);
  if (hi <= cap) return lo + (hi - lo) / 2;
  const double a = static_cast<double>(lo.count());
  const double b = static_cast<double>(hi.count());
  const double c = static_cast<double>(cap.count());
  const double mean = ((c - a) * (c + a) / 2.0 + (b - c) * c) / (b - a);
  return Duration(static_cast<Duration::rep>(mean));
}

// The waits before retries 0, 1, 2, ... of a Backoff, as ranges (see policy_check.hpp).
class Waits {
 public:
  explicit Waits(const Backoff& backoff) : backoff_(backoff) {}

  WaitRange next() {
    const BackoffOptions& o = backoff_.options();
    WaitRange w;
    switch (o.jitter) {
      case Jitter::kFull: {
        const Duration c = backoff_.ceiling(retry_);
        w = {Duration::zero(), c, c / 2};
        break;
      }
      case Jitter::kEqual: {
        const Duration c = backoff_.ceiling(retry_);
        const Duration half = c / 2;
        w = {half, c, half + (c - half) / 2};
        break;
      }
      case Jitter::kNone: {
        const Duration c = backoff_.ceiling(retry_);
        w = {c, c, c};
        break;
      }
      case Jitter::kDecorrelated: {
        const Duration prev_max = retry_ == 0 ? o.base : max_;
        const Duration prev_mean = retry_ == 0 ? o.base : mean_;
        max_ = std::min(o.cap, saturating_scale(prev_max, 3.0));
        mean_ = capped_uniform_mean(o.base, saturating_scale(prev_mean, 3.0), o.cap);
        w = {o.base, max_, mean_};
        break;
      }
    }
    ++retry_;
    return w;
  }

 private:
  const Backoff& backoff_;
  int retry_ = 0;
  Duration max_{};   // decorrelated: the previous retry's longest wait
  Duration mean_{};  // decorrelated: the previous retry's mean wait
};

class Builder {
 public:
  explicit Builder(const RetryPolicy& policy) : opt_(policy.options()) {
    s_.max_attempts = opt_.max_attempts;
    s_.per_try_timeout = opt_.per_try_timeout;
    s_.deadline = opt_.overall_timeout;
    s_.retry_after_cap = opt_.retry_after_cap;
  }

  // Attempt 1, then one attempt after wait `w`.
  void first() { add(WaitRange{}); }
  void one(const WaitRange& w) {
    earliest_ = saturating_add(earliest_, w.min);
    expected_ = saturating_add(expected_, saturating_add(opt_.per_try_timeout, w.mean));
    latest_ = saturating_add(latest_, saturating_add(opt_.per_try_timeout, w.max));
    latest_ra_ = saturating_add(
        latest_ra_, saturating_add(opt_.per_try_timeout, std::max(w.max, opt_.retry_after_cap)));
    ++number_;
    add(w);
  }

  // `count` more attempts, each after the same wait `w`, in closed form.
  void many(std::int64_t count, const WaitRange& w) {
    const Duration t = opt_.per_try_timeout;
    const Duration step = saturating_add(t, w.max);
    if (s_.first_unfit == 0 && s_.deadline != kInfinite) {
      // Attempt number_ + j starts at latest_ + j * step at the latest.
      const Duration slack = saturating_sub(saturating_sub(s_.deadline, t), latest_);
      const std::int64_t j = slack < Duration::zero() ? 1 : slack / step + 1;
      if (j <= count) {
        s_.first_unfit = static_cast<int>(number_ + j);
        s_.first_unfit_latest_start = saturating_add(latest_, saturating_times(step, j));
      }
    }
    if (s_.first_never_started == 0 && s_.deadline != kInfinite) {
      const Duration slack =
          saturating_sub(saturating_sub(s_.deadline, opt_.min_attempt_time), earliest_);
      std::int64_t j = 0;
      if (slack < Duration::zero()) {
        j = 1;
      } else if (w.min > Duration::zero()) {
        j = slack / w.min + 1;
      }
      if (j > 0 && j <= count) s_.first_never_started = static_cast<int>(number_ + j);
    }
    earliest_ = saturating_add(earliest_, saturating_times(w.min, count));
    expected_ = saturating_add(expected_, saturating_times(saturating_add(t, w.mean), count));
    latest_ = saturating_add(latest_, saturating_times(step, count));
    latest_ra_ = saturating_add(
        latest_ra_,
        saturating_times(saturating_add(t, std::max(w.max, opt_.retry_after_cap)), count));
    number_ += count;
  }

  [[nodiscard]] std::int64_t number() const noexcept { return number_; }

  PolicySchedule finish() {
    const Duration t = opt_.per_try_timeout;
    s_.worst_total = saturating_add(latest_, t);
    s_.expected_total = saturating_add(expected_, t);
    s_.worst_total_with_retry_after = saturating_add(latest_ra_, t);
    return std::move(s_);
  }

 private:
  // Time left at `start`: kInfinite without a deadline, never negative.
  [[nodiscard]] Duration left_at(Duration start) const noexcept {
    if (s_.deadline == kInfinite) return kInfinite;
    return std::max(Duration::zero(), saturating_sub(s_.deadline, start));
  }

  void add(const WaitRange& w) {
    ScheduledAttempt a;
    a.number = static_cast<int>(number_);
    a.wait_before = w;
    a.earliest_start = earliest_;
    a.expected_start = expected_;
    a.latest_start = latest_;
    a.timeout = std::min(opt_.per_try_timeout, left_at(earliest_));
    a.worst_timeout = std::min(opt_.per_try_timeout, left_at(latest_));
    a.fits = saturating_add(latest_, opt_.per_try_timeout) <= s_.deadline;
    a.can_start = saturating_add(earliest_, opt_.min_attempt_time) <= s_.deadline;
    if (!a.fits && s_.first_unfit == 0) {
      s_.first_unfit = a.number;
      s_.first_unfit_latest_start = latest_;
    }
    if (!a.can_start && s_.first_never_started == 0) s_.first_never_started = a.number;
    if (number_ <= kListedAttempts) s_.attempts.push_back(a);
  }

  const RetryOptions& opt_;
  PolicySchedule s_;
  std::int64_t number_ = 1;  // the attempt last added
  Duration earliest_{};
  Duration expected_{};
  Duration latest_{};
  Duration latest_ra_{};  // the latest start with Retry-After waits
};

}  // namespace

PolicySchedule check_policy(const RetryPolicy& policy) {
  const std::int64_t total = policy.options().max_attempts;
  Builder b(policy);
  b.first();
  Waits waits(policy.backoff());
  WaitRange previous;
  std::int64_t distinct = 0;
  while (b.number() < total) {
    const WaitRange w = waits.next();
    const bool past_list = b.number() >= kListedAttempts;
    if (past_list && ((distinct > 0 && w == previous) || distinct >= kMaxDistinctWaits)) {
      b.many(total - b.number(), w);
      break;
    }
    b.one(w);
    previous = w;
    ++distinct;
  }
  return b.finish();
}

std::string format_unfit(const PolicySchedule& s) {
  if (s.fits()) return {};
  std::string out = "attempt " + std::to_string(s.first_unfit) + " of " +
                    std::to_string(s.max_attempts) + " does not fit the " +
                    format_duration(s.deadline) + " deadline: ";
  if (s.per_try_timeout == kInfinite) {
    out += "there is no per-try timeout, so in the worst case an attempt that starts at " +
           format_duration(s.first_unfit_latest_start) + " hangs until the deadline";
  } else {
    out += "in the worst case it starts at " + format_duration(s.first_unfit_latest_start) +
           " and its " + format_duration(s.per_try_timeout) + " timeout ends at " +
           format_duration(saturating_add(s.first_unfit_latest_start, s.per_try_timeout));
  }
  out += " (worst total " + format_duration(s.worst_total) + ")";
  if (s.first_never_started != 0) {
    out += "; attempt " + std::to_string(s.first_never_started) + " can never start";
  }
  return out;
}

}  // namespace keel
