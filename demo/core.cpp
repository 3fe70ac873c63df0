// `keel-demo core`: the core engine deciding, step by step, on a simulated flaky dependency.
// Runs in virtual time (a ManualClock), so it is instant and, for a given --seed, repeatable.
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "commands.hpp"
#include "flag_options.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/retry.hpp"

namespace keel::cli {

namespace {

// The flags of `keel-demo core`, each checked as it is parsed (CLI11 alone would take nan, hex or
// a negative seed).
struct CoreOptions {
  int operations = 5;
  double failure_rate = 0.6;
  int max_attempts = 4;
  std::uint64_t seed = 1;
};

// A retry policy of --max-attempts, with one line per retry and give-up on stdout.
RetryOptions demo_policy(int max_attempts) {
  RetryOptions options;
  options.max_attempts = max_attempts;
  options.overall_timeout = std::chrono::seconds(5);
  options.per_try_timeout = std::chrono::seconds(1);
  options.backoff = {.base = std::chrono::milliseconds(200), .cap = std::chrono::seconds(2)};
  options.on_retry = [](const RetryEvent& e) {
    std::printf("    attempt %d: %-34s -> retry in %s%s\n", e.attempt, describe(e.outcome).c_str(),
                format_duration(e.delay).c_str(),
                e.server_delay_used ? " (the server's Retry-After)" : " (full jitter)");
  };
  options.on_give_up = [](const GiveUpEvent& e) {
    std::printf("    %s\n", format_give_up(e).c_str());
  };
  return options;
}

int run_core(const CoreOptions& o) {
  const int operations = o.operations;
  const double failure_rate = o.failure_rate;
  ManualClock clock;
  Rng jitter_rng(o.seed);
  Rng dependency_rng(o.seed ^ 0x5eedULL);
  int attempt_total = 0;
  int successes = 0;
  const RetryPolicy policy(demo_policy(o.max_attempts));
  std::printf("keel core demo: %d operations against a dependency failing %.0f%% of attempts\n",
              operations, failure_rate * 100);
  std::printf("policy: %d attempts, full jitter base 200ms cap 2s, per-try 1s, deadline 5s\n\n",
              o.max_attempts);
  const RequestTraits get{Method::kGet, false};
  for (int op = 1; op <= operations; ++op) {
    std::printf("operation %d (GET /v1/balance)\n", op);
    CallOptions call;
    call.clock = &clock;
    call.rng = &jitter_rng;
    call.safe_to_repeat = get.safe_to_repeat();
    auto result = retry(
        policy,
        [&](const AttemptInfo&) {
          ++attempt_total;
          const double u = uniform01(dependency_rng);
          if (u >= failure_rate) return classify_http_status(200, get);
          if (u < failure_rate * 0.25) {
            return classify_http_status(429, get, std::chrono::seconds(1));
          }
          return classify_http_status(503, get);
        },
        call);
    if (result.ok()) {
      ++successes;
      std::printf("    attempt %d: %s -> done after %s\n", result.attempts,
                  describe(result.outcome).c_str(), format_duration(result.elapsed).c_str());
    }
  }
  std::printf("\n%d of %d operations succeeded with %d attempts in all (%.2f per operation)\n",
              successes, operations, attempt_total,
              static_cast<double>(attempt_total) / operations);
  return 0;
}

void add_core_flags(CLI::App* sub, CoreOptions& o) {
  const std::string command = "keel-demo core";
  add_count(sub, command, "--operations", o.operations, 1, 1000,
            "Logical operations to run (1 to 1000)")
      ->default_val("5");
  add_fraction(sub, command, "--failure-rate", o.failure_rate, 0.0, 1.0,
               "Fraction of attempts the simulated dependency fails (0 to 1)")
      ->default_val("0.6");
  add_count(sub, command, "--max-attempts", o.max_attempts, 1, 100,
            "Attempts per operation, first included (1 to 100)")
      ->default_val("4");
  add_count(sub, command, "--seed", o.seed, 0, UINT64_MAX,
            "Seed for the dependency and the jitter (0 to 2^64-1)")
      ->default_val("1");
}

}  // namespace

Runner add_core(CLI::App& app) {
  return add_command<CoreOptions>(
      app, "core", "Show the retry engine deciding on a simulated flaky call (virtual time)", "",
      add_core_flags, run_core);
}

}  // namespace keel::cli
