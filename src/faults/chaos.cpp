#include "keel/faults/chaos.hpp"

#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "keel/core/retry_after.hpp"

namespace keel::faults {
namespace {

constexpr std::string_view kOptions = "keel::faults::ChaosOptions";

void check_fraction(const char* field, double value) {
  if (!(value >= 0.0 && value <= 1.0)) {
    std::ostringstream got;
    got << value;
    throw_invalid({.context = std::string(kOptions),
                   .field = field,
                   .problem = "must be in [0, 1]",
                   .got = got.str()});
  }
}

void check_duration(const char* field, Duration value) {
  if (value < Duration::zero()) {
    throw_invalid({.context = std::string(kOptions),
                   .field = field,
                   .problem = "must not be negative",
                   .got = format_duration(value)});
  }
}

}  // namespace

std::string_view to_string(ChaosFault fault) noexcept {
  switch (fault) {
    case ChaosFault::k503:
      return "503";
    case ChaosFault::kDelay:
      return "delay";
    case ChaosFault::kHang:
      return "hang";
    case ChaosFault::kDrop:
      return "drop";
  }
  return "unknown";
}

ChaosDecider::ChaosDecider(const ChaosOptions& options) : options_(options), rng_(options.seed) {
  check_fraction("fraction_503", options.fraction_503);
  check_fraction("delay_fraction", options.delay_fraction);
  check_fraction("hang_fraction", options.hang_fraction);
  check_fraction("drop_after_commit", options.drop_after_commit);
  check_duration("delay", options.delay);
  check_duration("hang", options.hang);
  if (options.retry_after_503) check_duration("retry_after_503", *options.retry_after_503);
}

bool ChaosDecider::chance(double p) {
  if (p <= 0) return false;
  std::lock_guard lock(mu_);
  return std::uniform_real_distribution<double>(0, 1)(rng_) < p;
}

bool ChaosDecider::answer_503() { return chance(options_.fraction_503); }

ChaosSlowdown ChaosDecider::slow_down() {
  if (chance(options_.hang_fraction)) return ChaosSlowdown::kHang;
  if (chance(options_.delay_fraction)) return ChaosSlowdown::kDelay;
  return ChaosSlowdown::kNone;
}

bool ChaosDecider::drop_after_commit() { return chance(options_.drop_after_commit); }

Chaos::Chaos(ChaosOptions options, ChaosHooks hooks) : decider_(options), hooks_(std::move(hooks)) {
  if (!hooks_.answer_503) {
    hooks_.answer_503 = [](httplib::Response& response, std::string_view /*detail*/) {
      response.status = 503;
      response.set_content("Service unavailable\n", "text/plain");
    };
  }
}

bool Chaos::inject_503() {
  if (!decider_.answer_503()) return false;
  ++injected_[static_cast<int>(ChaosFault::k503)];
  return true;
}

void Chaos::slow_down() {
  switch (decider_.slow_down()) {
    case ChaosSlowdown::kHang: {
      ++injected_[static_cast<int>(ChaosFault::kHang)];
      const TimePoint until = saturating_add(steady_clock().now(), decider_.options().hang);
      while (!stopping_.load() && steady_clock().now() < until) {
        // wait: scripted: the chaos decider's hang, in steps that see a stop
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      break;
    }
    case ChaosSlowdown::kDelay:
      ++injected_[static_cast<int>(ChaosFault::kDelay)];
      // wait: scripted: the chaos decider's configured delay
      std::this_thread::sleep_for(decider_.options().delay);
      break;
    case ChaosSlowdown::kNone:
      break;
  }
}

bool Chaos::drop_after_commit() {
  if (!decider_.drop_after_commit()) return false;
  ++injected_[static_cast<int>(ChaosFault::kDrop)];
  return true;
}

httplib::Server::HandlerResponse Chaos::pre_routing(const httplib::Request& /*request*/,
                                                    httplib::Response& response) {
  if (!inject_503()) return httplib::Server::HandlerResponse::Unhandled;
  if (const auto& retry_after = retry_after_503()) {
    response.set_header("Retry-After", format_retry_after(*retry_after));
  }
  hooks_.answer_503(response, "an injected fault");
  return httplib::Server::HandlerResponse::Handled;
}

httplib::Server::Handler Chaos::wrap(httplib::Server::Handler handler) {
  return [this, handler = std::move(handler)](const httplib::Request& request,
                                              httplib::Response& response) {
    slow_down();
    handler(request, response);
  };
}

bool Chaos::after_commit(const httplib::Request& request) {
  if (!decider_.drop_after_commit()) return false;
  if (!hooks_.drop_connection) {
    throw std::logic_error(
        "keel::faults::Chaos::after_commit: a drop was decided and hooks.drop_connection is empty");
  }
  if (!hooks_.drop_connection(request)) return false;
  ++injected_[static_cast<int>(ChaosFault::kDrop)];
  return true;
}

void Chaos::stop() noexcept { stopping_ = true; }

std::uint64_t Chaos::injected(ChaosFault fault) const noexcept {
  return injected_[static_cast<int>(fault)].load();
}

}  // namespace keel::faults
