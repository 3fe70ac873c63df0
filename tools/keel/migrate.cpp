// `keel migrate --db URL [--component NAME]... [--dry-run]`: the explicit schema step, run by a
// role that may create tables. Prints each component's plan (its version in the database and the
// version this program migrates it to), applies it, and prints the versions after. Every other
// command and library entry point only reads the version when it is current, so a role with
// DML rights only can run them over a database migrated this way.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "commands.hpp"
#include "keel/consumers/processed_messages.hpp"
#include "keel/db/database.hpp"
#include "keel/db/dialect.hpp"
#include "keel/fleet/shared_breakers.hpp"
#include "keel/idempotency/idempotency.hpp"
#include "keel/queue/queue.hpp"
#include "queue_cli.hpp"

namespace keel::cli {
namespace {

constexpr const char* kMigrateFooter =
    R"(Components: queue (keel jobs, keel dlq, the job queue), idempotency (the receiver's
idempotency records), processed (consumers' processed-message records), breakers (breakers
shared by a fleet; PostgreSQL only). Default: all of them.

Programs over the database (keel jobs, keel dlq, keel-demo serve, the libraries) migrate a
schema they find older themselves when their role may; with a current schema they only read its
version, so a role with SELECT, INSERT, UPDATE and DELETE rights only runs them. A program older
than the schema refuses it, naming both versions.

Exit status:
  0  every component is at this program's version
  1  the database could not be opened or migrated, or its schema is newer than this program's
  2  invalid arguments)";

struct MigrateArgs {
  std::string db = std::string(store::kDefaultDatabaseUrl);
  std::vector<std::string> components;
  bool dry_run = false;
};

std::vector<store::SchemaComponent> all_components(const store::DatabaseUrl& url) {
  std::vector<store::SchemaComponent> out = {store::JobQueue::schema(),
                                             store::IdempotencyStore::schema(),
                                             store::ProcessedMessages::schema()};
  // Fleet sharing needs notifications: PostgreSQL's.
  if (store::dialect_of(url.backend).listen_notify()) {
    out.push_back(store::SharedBreakers::schema());
    out.push_back(store::SharedBreakers::rate_limit_schema());
  }
  return out;
}

int run_migrate(const MigrateArgs& a) {
  const auto url = queue_cli::parse_db_flag("migrate", a.db);
  if (!url) return kExitUsage;
  const std::vector<store::SchemaComponent> known = all_components(*url);
  std::vector<store::SchemaComponent> chosen;
  for (const std::string& name : a.components) {
    const auto it = std::find_if(known.begin(), known.end(),
                                 [&](const store::SchemaComponent& c) { return c.name == name; });
    if (it == known.end()) {
      std::string names;
      for (const auto& c : known) names += (names.empty() ? "" : ", ") + std::string(c.name);
      return queue_cli::usage_error(
          "migrate", Error{.field = "--component",
                           .problem = "must be one of " + names + " (for " + url->redacted + ")",
                           .got = quote_value(name)}
                         .message());
    }
    if (std::find_if(chosen.begin(), chosen.end(), [&](const store::SchemaComponent& c) {
          return c.name == name;
        }) == chosen.end()) {
      chosen.push_back(*it);
    }
  }
  if (chosen.empty()) chosen = known;
  try {
    auto conn = store::open_database(*url);
    std::printf("keel migrate: %s\n", url->redacted.c_str());
    bool newer = false;
    for (const store::SchemaComponent& c : chosen) {
      const int found = store::schema_version(*conn, c.name);
      std::string plan;
      if (found == c.version) {
        plan = "current (version " + std::to_string(found) + ")";
      } else if (found > c.version) {
        plan = "version " + std::to_string(found) + " is newer than this program's " +
               std::to_string(c.version) + ": refused";
        newer = true;
      } else {
        plan = "version " + std::to_string(found) + " -> " + std::to_string(c.version) +
               (found == 0 ? " (created)" : "");
      }
      std::printf("  %-12s %s\n", std::string(c.name).c_str(), plan.c_str());
    }
    if (newer) {
      return queue_cli::failure("migrate",
                                "the database's schema is newer than this program's; run the keel "
                                "that migrated it (nothing was changed)");
    }
    if (a.dry_run) {
      std::printf("keel migrate: --dry-run: nothing changed\n");
      return 0;
    }
    std::string after;
    for (const store::SchemaComponent& c : chosen) {
      c.migrate(*conn);
      after += (after.empty() ? "" : ", ") + std::string(c.name) + " " +
               std::to_string(store::schema_version(*conn, c.name));
    }
    std::printf("keel migrate: done: %s\n", after.c_str());
    return 0;
  } catch (const std::exception& e) {
    return queue_cli::failure("migrate", e.what());
  }
}

void add_migrate_flags(CLI::App* sub, MigrateArgs& args) {
  sub->add_option("--db", args.db, "Database URL: sqlite:PATH or postgres://...")
      ->capture_default_str();
  sub->add_option("--component", args.components,
                  "Only this component (queue, idempotency, processed, breakers); repeatable");
  sub->add_flag("--dry-run", args.dry_run, "Print the plan and change nothing");
}

}  // namespace

Runner add_migrate(CLI::App& app) {
  return add_command<MigrateArgs>(
      app, "migrate", "Create or upgrade keel's tables in a database (run as a role that may)",
      kMigrateFooter, add_migrate_flags, run_migrate);
}

}  // namespace keel::cli
