#include "keel/core/retry_after.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <limits>

namespace keel {
namespace {

constexpr std::array<std::string_view, 7> kDayShort = {"Mon", "Tue", "Wed", "Thu",
                                                       "Fri", "Sat", "Sun"};
constexpr std::array<std::string_view, 7> kDayLong = {"Monday", "Tuesday",  "Wednesday", "Thursday",
                                                      "Friday", "Saturday", "Sunday"};
constexpr std::array<std::string_view, 12> kMonth = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                                     "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};

// A cursor over the input; every reader returns false on a mismatch.
class Cursor {
 public:
  explicit Cursor(std::string_view s) : s_(s) {}
  bool done() const { return i_ == s_.size(); }
  bool lit(std::string_view t) {
    if (s_.substr(i_, t.size()) != t) return false;
    i_ += t.size();
    return true;
  }
  bool digits(std::size_t n, int& out) {
    if (s_.size() - i_ < n) return false;
    int v = 0;
    for (std::size_t k = 0; k < n; ++k) {
      const char c = s_[i_ + k];
      if (c < '0' || c > '9') return false;
      v = v * 10 + (c - '0');
    }
    i_ += n;
    out = v;
    return true;
  }
  // One of `names`; returns its index or -1.
  template <std::size_t N>
  int one_of(const std::array<std::string_view, N>& names) {
    for (std::size_t k = 0; k < N; ++k) {
      if (lit(names[k])) return static_cast<int>(k);
    }
    return -1;
  }

 private:
  std::string_view s_;
  std::size_t i_ = 0;
};

bool read_time(Cursor& c, int& hh, int& mm, int& ss) {
  return c.digits(2, hh) && c.lit(":") && c.digits(2, mm) && c.lit(":") && c.digits(2, ss);
}

std::optional<std::int64_t> to_unix(std::int64_t year, int month0, int day, int hh, int mm,
                                    int ss) {
  const auto month = static_cast<unsigned>(month0 + 1);
  if (day < 1 || static_cast<unsigned>(day) > days_in_month(year, month)) return std::nullopt;
  if (hh > 23 || mm > 59 || ss > 60) return std::nullopt;  // 60: a leap second
  // The last second a 4-digit year can write; a leap second after it would roll into the year
  // 10000, which no HTTP-date can express (found by the fuzzer: the round trip broke).
  constexpr std::int64_t kLastHttpDate = 253402300799;  // 9999-12-31T23:59:59Z
  const std::int64_t t =
      days_from_civil(year, month, static_cast<unsigned>(day)) * 86400 + hh * 3600 + mm * 60 + ss;
  return t < kLastHttpDate ? t : kLastHttpDate;
}

// IMF-fixdate: day-name "," SP 2DIGIT SP month SP 4DIGIT SP time SP "GMT"
std::optional<std::int64_t> parse_imf(std::string_view s) {
  Cursor c(s);
  int day = 0, year = 0, hh = 0, mm = 0, ss = 0;
  if (c.one_of(kDayShort) < 0 || !c.lit(", ") || !c.digits(2, day) || !c.lit(" ")) return {};
  const int month = c.one_of(kMonth);
  if (month < 0 || !c.lit(" ") || !c.digits(4, year) || !c.lit(" ") || !read_time(c, hh, mm, ss) ||
      !c.lit(" GMT") || !c.done()) {
    return {};
  }
  return to_unix(year, month, day, hh, mm, ss);
}

// RFC 850: day-name-l "," SP 2DIGIT "-" month "-" 2DIGIT SP time SP "GMT"
std::optional<std::int64_t> parse_rfc850(std::string_view s, WallTime now) {
  Cursor c(s);
  int day = 0, yy = 0, hh = 0, mm = 0, ss = 0;
  if (c.one_of(kDayLong) < 0 || !c.lit(", ") || !c.digits(2, day) || !c.lit("-")) return {};
  const int month = c.one_of(kMonth);
  if (month < 0 || !c.lit("-") || !c.digits(2, yy) || !c.lit(" ") || !read_time(c, hh, mm, ss) ||
      !c.lit(" GMT") || !c.done()) {
    return {};
  }
  // RFC 9110 5.6.7: a two-digit year more than 50 years in the future is in the past century.
  const std::int64_t now_s =
      std::chrono::duration_cast<std::chrono::seconds>(now.time_since_epoch()).count();
  const std::int64_t now_days = now_s >= 0 ? now_s / 86400 : (now_s - 86399) / 86400;
  const std::int64_t now_year = civil_from_days(now_days).year;
  std::int64_t year = now_year - (now_year % 100 + 100) % 100 + yy;  // same century as now
  auto when = to_unix(year, month, day, hh, mm, ss);
  if (!when) return {};
  if (*when - now_s > 50LL * 365 * 86400 + 12 * 86400) {  // "more than 50 years in the future"
    year -= 100;
    when = to_unix(year, month, day, hh, mm, ss);
  }
  return when;
}

// asctime: day-name SP month SP ( 2DIGIT / ( SP DIGIT ) ) SP time SP 4DIGIT
std::optional<std::int64_t> parse_asctime(std::string_view s) {
  Cursor c(s);
  int day = 0, year = 0, hh = 0, mm = 0, ss = 0;
  if (c.one_of(kDayShort) < 0 || !c.lit(" ")) return {};
  const int month = c.one_of(kMonth);
  if (month < 0 || !c.lit(" ")) return {};
  if (c.lit(" ")) {
    if (!c.digits(1, day)) return {};
  } else if (!c.digits(2, day)) {
    return {};
  }
  if (!c.lit(" ") || !read_time(c, hh, mm, ss) || !c.lit(" ") || !c.digits(4, year) || !c.done()) {
    return {};
  }
  return to_unix(year, month, day, hh, mm, ss);
}

std::string_view trim_ows(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

}  // namespace

std::optional<std::int64_t> parse_http_date(std::string_view text, WallTime now) {
  if (text.size() < 24 || text.size() > 40) return std::nullopt;
  if (text[3] == ',') return parse_imf(text);
  if (text[3] == ' ') return parse_asctime(text);
  return parse_rfc850(text, now);
}

std::optional<Duration> parse_retry_after(std::string_view value, WallTime now) {
  value = trim_ows(value);
  if (value.empty()) return std::nullopt;
  if (value.front() >= '0' && value.front() <= '9') {
    // delta-seconds = 1*DIGIT; anything else in the value rejects it. A number too large for a
    // Duration saturates at kInfinite: it is capped like any long delay (retry_after_cap), never
    // ignored into an immediate retry.
    constexpr std::int64_t kMaxSeconds = kInfinite.count() / 1'000'000'000;
    std::int64_t seconds = 0;
    bool saturated = false;
    for (char ch : value) {
      if (ch < '0' || ch > '9') return std::nullopt;
      if (saturated) continue;
      seconds = seconds * 10 + (ch - '0');
      if (seconds > kMaxSeconds) saturated = true;
    }
    if (saturated) return kInfinite;
    return std::chrono::seconds(seconds);
  }
  const auto when = parse_http_date(value, now);
  if (!when) return std::nullopt;
  const auto now_s = std::chrono::floor<std::chrono::seconds>(now.time_since_epoch());
  if (*when <= now_s.count()) return Duration::zero();
  // A date too far ahead to express in nanoseconds saturates like an oversized delta.
  constexpr std::int64_t kMaxSeconds = kInfinite.count() / 1'000'000'000 - 1;
  const std::int64_t ahead = *when - now_s.count();
  if (ahead > kMaxSeconds) return kInfinite;
  // Dates are whole seconds; measure from `now` exactly (the sub-second part counts).
  return std::chrono::seconds(ahead) - (now.time_since_epoch() - now_s);
}

std::string format_retry_after(Duration wait) {
  const std::int64_t seconds = std::chrono::ceil<std::chrono::seconds>(wait).count();
  return std::to_string(std::max<std::int64_t>(1, seconds));
}

std::chrono::seconds spread_retry_after(int max_seconds, BitGenRef gen) {
  const auto n = static_cast<std::uint64_t>(std::clamp(max_seconds, 1, kMaxRetryAfterSpread));
  // Rejection sampling: uniform over 0..n-1 without the bias of a plain modulo.
  const std::uint64_t limit =
      std::numeric_limits<std::uint64_t>::max() - std::numeric_limits<std::uint64_t>::max() % n;
  std::uint64_t draw = gen();
  while (draw >= limit) draw = gen();
  return std::chrono::seconds(1 + static_cast<std::int64_t>(draw % n));
}

std::string format_http_date(std::int64_t unix_seconds) {
  const std::int64_t days =
      unix_seconds >= 0 ? unix_seconds / 86400 : (unix_seconds - 86399) / 86400;
  const std::int64_t secs = unix_seconds - days * 86400;
  const CivilDate date = civil_from_days(days);
  // 1970-01-01 was a Thursday (index 3 in kDayShort).
  const auto weekday = static_cast<std::size_t>(((days % 7) + 7 + 3) % 7);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s, %02u %s %04lld %02lld:%02lld:%02lld GMT",
                std::string(kDayShort[weekday]).c_str(), date.day,
                std::string(kMonth[date.month - 1]).c_str(), static_cast<long long>(date.year),
                static_cast<long long>(secs / 3600), static_cast<long long>(secs / 60 % 60),
                static_cast<long long>(secs % 60));
  return buf;
}

}  // namespace keel
