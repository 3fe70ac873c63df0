// The keel command-line tool is one small program over the libraries: each subcommand lives in
// its own file and registers itself here.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace keel::cli {

/// Exit status for invalid arguments, shared by every subcommand.
inline constexpr int kExitUsage = 2;

/// A subcommand's body, run after parsing; returns the process exit status.
using Runner = std::function<int()>;

/// Registers `keel demo-core` (the core engine at work on a simulated flaky call).
Runner add_demo_core(CLI::App& app);

/// Registers `keel serve` (a payments API with idempotency keys; needs keel::store).
Runner add_serve(CLI::App& app);

/// Registers `keel call` (one HTTP request with retries done right; needs keel::http).
Runner add_call(CLI::App& app);

/// Registers `keel upstream` (a fault-injecting HTTP server on 127.0.0.1; needs keel::http).
Runner add_upstream(CLI::App& app);

/// Registers `keel sim` (the retry-storm simulator: scenarios, run, serve; needs keel::sim).
Runner add_sim(CLI::App& app);
/// Registers `keel sim serve` under the `sim` subcommand (the storm explorer page).
Runner add_sim_serve(CLI::App& sim);

/// Registers `keel jobs` (the durable job queue: enqueue, work, stats; needs keel::store and
/// keel::http).
Runner add_jobs(CLI::App& app);
/// Registers `keel dlq` (the dead-letter queue: list, show, replay, discard, depth).
Runner add_dlq(CLI::App& app);

}  // namespace keel::cli
