// `keel-demo core`: the core engine deciding, step by step, on a simulated flaky dependency.
// Runs in virtual time (a ManualClock), so it is instant and, for a given --seed, repeatable.
#include <cstdio>
#include <string>

#include "commands.hpp"
#include "keel/duration.hpp"
#include "keel/retry.hpp"

namespace keel::cli {

Runner add_core(CLI::App& app) {
  // Taken as text and parsed strictly below (CLI11 would accept nan, hex or a negative seed).
  struct Options {
    std::string operations = "5";
    std::string failure_rate = "0.6";
    std::string seed = "1";
    std::string max_attempts = "4";
  };
  auto opts = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand(
      "core", "Show the retry engine deciding on a simulated flaky call (virtual time)");
  sub->add_option("--operations", opts->operations, "Logical operations to run (1 to 1000)")
      ->capture_default_str();
  sub->add_option("--failure-rate", opts->failure_rate,
                  "Fraction of attempts the simulated dependency fails (0 to 1)")
      ->capture_default_str();
  sub->add_option("--max-attempts", opts->max_attempts,
                  "Attempts per operation, first included (1 to 100)")
      ->capture_default_str();
  sub->add_option("--seed", opts->seed, "Seed for the dependency and the jitter (0 to 2^64-1)")
      ->capture_default_str();

  return [opts]() -> int {
    const auto usage = [](const Error& error) {
      std::fprintf(stderr, "keel-demo core: %s\n", error.message().c_str());
      return kExitUsage;
    };
    const auto operations_flag = parse_count("--operations", opts->operations, 1, 1000);
    if (!operations_flag) return usage(operations_flag.error());
    const auto failure_rate_flag = parse_fraction("--failure-rate", opts->failure_rate, 0.0, 1.0);
    if (!failure_rate_flag) return usage(failure_rate_flag.error());
    const auto max_attempts_flag = parse_count("--max-attempts", opts->max_attempts, 1, 100);
    if (!max_attempts_flag) return usage(max_attempts_flag.error());
    const auto seed = parse_count("--seed", opts->seed, 0, UINT64_MAX);
    if (!seed) return usage(seed.error());
    const int operations = static_cast<int>(*operations_flag);
    const double failure_rate = *failure_rate_flag;
    const int max_attempts = static_cast<int>(*max_attempts_flag);
    ManualClock clock;
    Rng jitter_rng(*seed);
    Rng dependency_rng(*seed ^ 0x5eedULL);
    int attempt_total = 0;
    int successes = 0;
    RetryOptions options;
    options.max_attempts = max_attempts;
    options.overall_timeout = std::chrono::seconds(5);
    options.per_try_timeout = std::chrono::seconds(1);
    options.backoff = {.base = std::chrono::milliseconds(200), .cap = std::chrono::seconds(2)};
    options.on_retry = [&](const RetryEvent& e) {
      std::printf("    attempt %d: %-34s -> retry in %s%s\n", e.attempt,
                  describe(e.outcome).c_str(), format_duration(e.delay).c_str(),
                  e.server_delay_used ? " (the server's Retry-After)" : " (full jitter)");
    };
    options.on_give_up = [&](const GiveUpEvent& e) {
      std::printf("    %s\n", format_give_up(e).c_str());
    };
    const RetryPolicy policy(options);
    std::printf("keel core demo: %d operations against a dependency failing %.0f%% of attempts\n",
                operations, failure_rate * 100);
    std::printf("policy: %d attempts, full jitter base 200ms cap 2s, per-try 1s, deadline 5s\n\n",
                max_attempts);
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
  };
}

}  // namespace keel::cli
