// keel: retries done right, from the shell. A thin layer over the keel libraries.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <vector>

#include "commands.hpp"
#include "keel/version.hpp"

int main(int argc, char** argv) {
  CLI::App app{
      "keel: retries done right (classify, back off with full jitter, budget, break, "
      "and make retried writes safe)",
      "keel"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "keel " KEEL_VERSION_STRING);

  std::vector<std::pair<CLI::App*, keel::cli::Runner>> runners;
  const auto add = [&](auto registrar) {
    const std::size_t before = app.get_subcommands({}).size();
    keel::cli::Runner runner = registrar(app);
    runners.emplace_back(app.get_subcommands({})[before], std::move(runner));
  };
  add(keel::cli::add_demo_core);
  add(keel::cli::add_policy);
#ifdef KEEL_CLI_SIM
  add(keel::cli::add_sim);
#endif
#ifdef KEEL_CLI_SERVE
  add(keel::cli::add_serve);
#endif
#ifdef KEEL_CLI_HTTP
  add(keel::cli::add_call);
  add(keel::cli::add_upstream);
#endif
#ifdef KEEL_CLI_JOBS
  add(keel::cli::add_jobs);
  add(keel::cli::add_dlq);
#endif

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return keel::cli::kExitUsage;
  }
  try {
    for (auto& [sub, run] : runners) {
      if (sub->parsed()) return run();
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "keel: %s\n", e.what());
    return 1;
  }
  return keel::cli::kExitUsage;
}
