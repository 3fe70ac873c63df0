// keel: retries done right, from the shell. A thin layer over the keel libraries.
#include <vector>

#include "commands.hpp"
#include "program.hpp"

int main(int argc, char** argv) {
  const std::vector<keel::cli::Registrar> registrars = {
      keel::cli::add_policy,
#ifdef KEEL_CLI_SIM
      keel::cli::add_sim,
#endif
#ifdef KEEL_CLI_HTTP
      keel::cli::add_call,
#endif
#ifdef KEEL_CLI_JOBS
      keel::cli::add_jobs,   keel::cli::add_dlq, keel::cli::add_migrate,
#endif
  };
  return keel::cli::run_program(
      "keel",
      "keel: retries done right (classify, back off with full jitter, budget, break, and make "
      "retried writes safe)",
      registrars, argc, argv);
}
