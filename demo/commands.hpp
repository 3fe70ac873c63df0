// keel-demo: the showroom around the keel libraries, apart from the installed keel tool: a flaky
// payments API to retry against, a fault-injecting upstream and the core engine at work. Each
// subcommand lives in its own file and registers itself here.
#pragma once

#include <CLI/CLI.hpp>

#include "flags.hpp"
#include "program.hpp"

namespace keel::cli {

/// Registers `keel-demo core` (the core engine at work on a simulated flaky call).
Runner add_core(CLI::App& app);

/// Registers `keel-demo serve` (a payments API with idempotency keys and --chaos-* faults; needs
/// keel::store_http).
Runner add_serve(CLI::App& app);

/// Registers `keel-demo upstream` (a fault-injecting HTTP server on 127.0.0.1; needs keel::http).
Runner add_upstream(CLI::App& app);

}  // namespace keel::cli
