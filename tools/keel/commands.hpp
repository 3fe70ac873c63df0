// The keel command-line tool is one small program over the libraries: each subcommand lives in
// its own file and registers itself here.
#pragma once

#include <CLI/CLI.hpp>

#include "flags.hpp"
#include "program.hpp"

namespace keel::cli {

/// Registers `keel policy` (a retry policy's schedule and whether it fits its deadline).
Runner add_policy(CLI::App& app);

/// Registers `keel call` (one HTTP request with retries done right; needs keel::http).
Runner add_call(CLI::App& app);

/// Registers `keel sim` (the retry-storm simulator: scenarios, run, serve; needs keel::sim).
Runner add_sim(CLI::App& app);
/// Registers `keel sim serve` under the `sim` subcommand (the storm explorer page).
Runner add_sim_serve(CLI::App& sim);

/// Registers `keel jobs` (the durable job queue: enqueue, work, stats; needs keel::store and
/// keel::http).
Runner add_jobs(CLI::App& app);
/// Registers `keel dlq` (the dead-letter queue: list, show, replay, discard, depth).
Runner add_dlq(CLI::App& app);
/// Registers `keel migrate` (create or upgrade keel's tables; needs keel::store).
Runner add_migrate(CLI::App& app);

}  // namespace keel::cli
