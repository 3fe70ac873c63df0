// keel-demo: what `make demo`, the tests and the benchmarks run against keel: a flaky payments
// API (serve), a fault-injecting upstream (upstream) and the core engine on a simulated flaky
// call (core). Not part of the installed keel.
#include <CLI/CLI.hpp>
#include <vector>

#include "commands.hpp"
#include "keel/version.hpp"
#include "program.hpp"

int main(int argc, char** argv) {
  CLI::App app{
      "keel-demo: keel's showroom (a flaky payments API, a fault-injecting upstream, the core "
      "engine at work)",
      "keel-demo"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "keel-demo " KEEL_VERSION_STRING);

  const std::vector<keel::cli::Registrar> registrars = {
      keel::cli::add_core,
#ifdef KEEL_DEMO_SERVE
      keel::cli::add_serve,
#endif
#ifdef KEEL_DEMO_UPSTREAM
      keel::cli::add_upstream,
#endif
  };
  return keel::cli::run_program(app, registrars, argc, argv);
}
