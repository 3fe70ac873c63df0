// keel-demo: what `make demo`, the tests and the benchmarks run against keel: a flaky payments
// API (serve), a fault-injecting upstream (upstream) and the core engine on a simulated flaky
// call (core). Not part of the installed keel.
#include <vector>

#include "commands.hpp"
#include "program.hpp"

int main(int argc, char** argv) {
  const std::vector<keel::cli::Registrar> registrars = {
      keel::cli::add_core,
#ifdef KEEL_DEMO_SERVE
      keel::cli::add_serve,
#endif
#ifdef KEEL_DEMO_UPSTREAM
      keel::cli::add_upstream,
#endif
  };
  return keel::cli::run_program(
      "keel-demo",
      "keel-demo: keel's showroom (a flaky payments API, a fault-injecting upstream, the core "
      "engine at work)",
      registrars, argc, argv);
}
