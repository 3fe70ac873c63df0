// A command-line program of keel (keel, keel-demo): subcommands that each register their flags
// with CLI11 and return the body to run, one of them chosen per run.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "flag_options.hpp"
#include "flags.hpp"
#include "keel/version.hpp"

namespace keel::cli {

/// A subcommand's body, run after parsing; returns the process exit status.
using Runner = std::function<int()>;

/// Adds one subcommand to the program and returns its body.
using Registrar = Runner (*)(CLI::App&);

/// Adds each of `registrars` to `app`, parses argv and runs the subcommand given. Returns that
/// subcommand's exit status; 0 after --help or --version; kExitUsage (after CLI11's message, or a
/// FlagError's alone) for invalid arguments; 1 (after "NAME: what" on stderr, NAME the app's name)
/// when the subcommand throws. Requires: `app` requires exactly one subcommand and has none yet.
inline int run_program(CLI::App& app, const std::vector<Registrar>& registrars, int argc,
                       char** argv) {
  std::vector<std::pair<CLI::App*, Runner>> runners;
  for (const Registrar registrar : registrars) {
    const std::size_t before = app.get_subcommands({}).size();
    Runner runner = registrar(app);
    runners.emplace_back(app.get_subcommands({})[before], std::move(runner));
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const FlagError& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return kExitUsage;
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kExitUsage;
  }
  try {
    for (auto& [sub, run] : runners) {
      if (sub->parsed()) return run();
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", app.get_name().c_str(), e.what());
    return 1;
  }
  return kExitUsage;
}

/// The program `name` (keel, keel-demo) with its one-line `description`: exactly one subcommand
/// of `registrars` per run, and --version printing "NAME VERSION". Runs as the overload above.
inline int run_program(const std::string& name, const std::string& description,
                       const std::vector<Registrar>& registrars, int argc, char** argv) {
  CLI::App app{description, name};
  app.require_subcommand(1);
  app.set_version_flag("--version", name + " " + KEEL_VERSION_STRING);
  return run_program(app, registrars, argc, argv);
}

/// Adds the subcommand `name` to `app` with its one-line `description` and the `footer` its
/// --help ends with (none when empty), whose flags `add_flags(sub, flags)` registers into a new
/// Flags; returns its body, `run(flags)`.
template <class Flags, class AddFlags, class Run>
Runner add_command(CLI::App& app, const std::string& name, const std::string& description,
                   const std::string& footer, AddFlags add_flags, Run run) {
  auto flags = std::make_shared<Flags>();
  CLI::App* sub = app.add_subcommand(name, description);
  if (!footer.empty()) sub->footer(footer);
  add_flags(sub, *flags);
  return [flags, run] { return run(*flags); };
}

}  // namespace keel::cli
