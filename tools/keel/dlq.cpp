// `keel dlq --db URL list|show|replay|discard|depth`: the dead-letter queue of keel's job queue.
// Dead jobs stay until an operator replays them (back to ready, attempts reset, the SAME
// idempotency key) or discards them.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "dlq_show.hpp"
#include "keel/core/text.hpp"
#include "keel/queue/dead_letters.hpp"
#include "queue_cli.hpp"

namespace keel::cli {
namespace {

using queue_cli::format_ms;

constexpr const char* kDlqFooter =
    R"(The database is a URL: sqlite:PATH (default sqlite:keel.db) or postgresql://...

replay moves dead jobs back to ready with their attempts reset and the same idempotency key, so a
receiver that deduplicates by key applies each job at most once. discard deletes them for good.

replay and discard take job ids, --all, or filters (which narrow --all, and may be combined):
  --queue Q           jobs of queue Q
  --reason TEXT       jobs whose dead reason contains TEXT (case-sensitive, no wildcards)
  --kind KIND         jobs that died of KIND: permanent, exhausted (attempts_exhausted),
                      max-age (max_age) or crashed (its last run's worker died); list takes it too
  --died-after TIME   jobs that died at or after TIME
  --died-before TIME  jobs that died before TIME
TIME is an RFC 3339 timestamp with a zone (2026-12-01T10:00:00Z, 2026-12-01T11:00:00+01:00) or a
duration ago (90m, 1h, 2.5h). --dry-run lists what would move (for replay, with the time each
would be due) and changes nothing. replay --rate N/s (or N/m, N/h) paces the replay: the jobs,
oldest death first, are made due N per second from now, all in one transaction, so the command
returns at once and the workers take them at that rate instead of all in the same instant.
Dead jobs stay until replayed or discarded, unless a worker runs with --dead-letter-retention
(see keel jobs --help).

list, show and depth only read: they open the database read-only and never migrate it, so a
user who may only read the file can run them.

Exit status:
  0  success (depth: the dead-letter queue is empty, or no --fail-if-nonzero)
  1  depth --fail-if-nonzero found dead jobs, or a database failure
  2  invalid arguments (the message names the flag), or a database file that does not exist
  3  not found: show's job id is not in the database, or a job id given to replay or discard is
     not in the dead-letter queue (the other ids given are still replayed or discarded))";

// Exit status when a job id given is not there (see the footer).
int not_found(const std::string& message) { return dlq_not_found(message); }

int dlq_usage(const std::string& message) { return queue_cli::usage_error("dlq", message); }

struct DlqArgs {
  std::string db = std::string(store::kDefaultDatabaseUrl);
  std::string queue;
  bool json = false;
  bool all = false;
  bool fail_if_nonzero = false;
  std::vector<std::string> ids;
  std::string id;
  std::string reason;
  std::optional<store::DeadReason> kind;
  std::string died_after;
  std::string died_before;
  std::string rate;
  bool dry_run = false;
};

// The slowest --rate N accepted, per its unit.
constexpr double kMinRate = 0.001;

// Parses --rate N/s, N/m or N/h into jobs per second; prints the error and returns nullopt.
std::optional<double> parse_rate(const std::string& text) {
  const std::size_t slash = text.rfind('/');
  const std::string unit = slash == std::string::npos ? "" : text.substr(slash + 1);
  const double per = unit == "s" ? 1.0 : unit == "m" ? 60.0 : unit == "h" ? 3600.0 : 0.0;
  const auto n = parse_fraction("--rate", text.substr(0, slash), 0, 1e9);
  std::string problem;
  if (per == 0) {
    problem = "must be N/s, N/m or N/h (jobs per second, minute or hour)";
  } else if (!n) {
    problem = "must be a decimal number of jobs per " + unit + " (N/" + unit + ")";
  } else if (*n <= 0) {
    problem = "must be greater than zero";
  } else if (*n < kMinRate) {
    // Slower, and the due times of a large replay would run past what a time can hold.
    problem = "must be at least 0.001 jobs per " + unit;
  }
  if (!problem.empty()) {
    dlq_usage(Error{.field = "--rate", .problem = problem, .got = quote_value(text)}.message());
    return std::nullopt;
  }
  return *n / per;
}

// The dead jobs a replay or discard selects, and how to pace a replay; nullopt after printing a
// usage error.
struct Selection {
  store::DeadLetterFilter filter;
  store::ReplayPacing pacing;
};

std::optional<Selection> parse_selection(const DlqArgs& a, const std::vector<std::int64_t>& ids) {
  Selection sel;
  sel.filter.queue = a.queue;
  if (!is_storable_text(a.reason)) {
    // Dead reasons are stored as UTF-8 text (keel::storable_text): such a TEXT matches none, and
    // PostgreSQL refuses it.
    dlq_usage(
        Error{.field = "--reason", .problem = "must be UTF-8 text", .got = quote_value(a.reason)}
            .message());
    return std::nullopt;
  }
  sel.filter.reason_contains = a.reason;
  sel.filter.kind = a.kind;
  sel.filter.ids = ids;
  const std::int64_t now = wall_ms(steady_clock());
  if (!a.died_after.empty()) {
    const auto t = store::dead_letters::parse_time_bound(a.died_after, now);
    if (!t) {
      dlq_usage(t.error().in("--died-after").message());
      return std::nullopt;
    }
    sel.filter.died_at_or_after_ms = *t;
  }
  if (!a.died_before.empty()) {
    const auto t = store::dead_letters::parse_time_bound(a.died_before, now);
    if (!t) {
      dlq_usage(t.error().in("--died-before").message());
      return std::nullopt;
    }
    sel.filter.died_before_ms = *t;
  }
  if (!a.rate.empty()) {
    const auto rate = parse_rate(a.rate);
    if (!rate) return std::nullopt;
    sel.pacing.per_second = *rate;
  }
  return sel;
}

int dry_run(const std::string& cmd, store::Connection& conn, const Selection& sel) {
  const bool replay = cmd == "replay";
  const std::vector<store::DeadLetter> jobs =
      replay ? store::dead_letters::plan_replay(conn, sel.filter, sel.pacing)
             : store::dead_letters::select(conn, sel.filter);
  std::printf("%-8s %-16s %-9s %-24s %s%s\n", "ID", "QUEUE", "ATTEMPTS", "DIED",
              replay ? "DUE                      " : "", "REASON");
  for (const auto& j : jobs) {
    std::printf("%-8lld %-16s %4d/%-4d %-24s %s%s\n", static_cast<long long>(j.id), j.queue.c_str(),
                j.attempts, j.max_attempts, format_ms(j.died_ms).c_str(),
                replay ? (format_ms(j.run_at_ms) + " ").c_str() : "", j.dead_reason.c_str());
  }
  std::fprintf(stderr, "keel dlq: dry run: would %s %zu dead job(s); nothing changed\n",
               cmd.c_str(), jobs.size());
  return 0;
}

std::optional<std::vector<std::int64_t>> parse_ids(const std::vector<std::string>& texts) {
  std::vector<std::int64_t> ids;
  for (const std::string& t : texts) {
    // Digits only: no sign, space or exponent.
    const auto v = parse_count("job id", t, 1, INT64_MAX);
    if (!v) {
      dlq_usage(
          Error{.field = "job id", .problem = "must be a positive integer", .got = quote_value(t)}
              .message());
      return std::nullopt;
    }
    ids.push_back(static_cast<std::int64_t>(*v));
  }
  return ids;
}

// Replay or discard the selection (or, with --dry-run, list what would move); the ids moved.
std::vector<std::int64_t> move_selection(const std::string& cmd, store::Connection& conn,
                                         const Selection& sel, const DlqArgs& a) {
  std::vector<std::int64_t> done;
  if (a.dry_run) {
    // Read-only: only report ids that would be missing.
    for (const auto& j : store::dead_letters::select(conn, sel.filter)) done.push_back(j.id);
    dry_run(cmd, conn, sel);
  } else if (cmd == "replay") {
    const auto moved = store::dead_letters::replay(conn, sel.filter, sel.pacing);
    for (const auto& j : moved) done.push_back(j.id);
    std::string pace;
    if (sel.pacing.per_second > 0 && !moved.empty()) {
      pace = " at " + a.rate + ", due from " + format_ms(moved.front().run_at_ms) + " to " +
             format_ms(moved.back().run_at_ms);
    }
    std::fprintf(stderr, "keel dlq: replayed %zu dead job(s)%s\n", moved.size(), pace.c_str());
  } else {
    done = store::dead_letters::discard(conn, sel.filter);
    std::fprintf(stderr, "keel dlq: discarded %zu dead job(s)\n", done.size());
  }
  return done;
}

// `dlq replay` and `dlq discard`: the count moved, or the ids given that moved, in their order;
// exit 3 naming the ids that were not dead.
int run_move(const std::string& cmd, store::Connection& conn, bool has_schema,
             const std::vector<std::int64_t>& ids, const Selection& sel, const DlqArgs& a) {
  if (!has_schema) {
    if (!ids.empty())
      return not_found(cmd + ": no such dead job(s): the database has no job queue");
    if (a.dry_run) {
      std::fprintf(stderr, "keel dlq: dry run: would %s 0 dead job(s); nothing changed\n",
                   cmd.c_str());
    } else {
      std::printf("0\n");
    }
    return 0;
  }
  const std::vector<std::int64_t> done = move_selection(cmd, conn, sel, a);
  const auto moved = [&](std::int64_t id) {
    return std::find(done.begin(), done.end(), id) != done.end();
  };
  if (ids.empty()) {
    if (!a.dry_run) std::printf("%zu\n", done.size());
    return 0;
  }
  std::string missing;
  for (std::int64_t id : ids) {  // in the order given
    if (!moved(id)) {
      missing += (missing.empty() ? "" : ", ") + std::to_string(id);
    } else if (!a.dry_run) {
      std::printf("%lld\n", static_cast<long long>(id));
    }
  }
  if (!missing.empty()) {
    return not_found(cmd + ": not in the dead-letter queue (skipped): " + missing);
  }
  return 0;
}

// replay's and discard's ids and filters, checked; nullopt after printing a usage error.
std::optional<std::pair<std::vector<std::int64_t>, Selection>> parse_move(const std::string& cmd,
                                                                          const DlqArgs& a) {
  const bool filtered = !a.queue.empty() || !a.reason.empty() || a.kind || !a.died_after.empty() ||
                        !a.died_before.empty();
  if (!a.ids.empty() && (a.all || filtered)) {
    dlq_usage(cmd + ": give job ids, or --all and filters (not both)");
    return std::nullopt;
  }
  if (a.ids.empty() && !a.all && !filtered) {
    dlq_usage(cmd +
              ": give job ids, --all, or a filter (--queue, --reason, --kind, --died-after, "
              "--died-before) (nothing to " +
              cmd + ")");
    return std::nullopt;
  }
  auto ids = parse_ids(a.ids);
  if (!ids) return std::nullopt;
  auto selection = parse_selection(a, *ids);
  if (!selection) return std::nullopt;
  return std::make_pair(*ids, *selection);
}

int run(const std::string& cmd, const DlqArgs& a) {
  const auto url = queue_cli::parse_db_flag("dlq", a.db);
  if (!url) return kExitUsage;
  if (!a.queue.empty()) {
    if (auto queue = store::check_queue_name(a.queue); !queue) {
      return dlq_usage(queue.error().in("--queue").message());
    }
  }
  std::optional<std::pair<std::vector<std::int64_t>, Selection>> move;
  if (cmd == "replay" || cmd == "discard") {
    move = parse_move(cmd, a);
    if (!move) return kExitUsage;
  }
  std::optional<std::int64_t> show_id;
  if (cmd == "show") {
    auto parsed = parse_ids({a.id});
    if (!parsed) return kExitUsage;
    show_id = parsed->front();
  }
  if (!store::database_exists(*url)) {
    return dlq_usage("--db: database '" + url->redacted + "' does not exist");
  }
  bool has_schema = false;
  const bool read_only = cmd == "list" || cmd == "show" || cmd == "depth" || a.dry_run;
  auto conn = read_only ? queue_cli::open_queue_db_read_only(*url, &has_schema)
                        : queue_cli::open_queue_db(*url, false, &has_schema);
  store::JobQueue queue;
  if (!a.queue.empty() && (!has_schema || !queue.queue_exists(*conn, a.queue))) {
    return dlq_usage("--queue: unknown queue '" + a.queue + "' in " + url->redacted);
  }
  if (cmd == "depth") {
    const std::int64_t depth = has_schema ? queue.dead_depth(*conn, a.queue) : 0;
    std::printf("%lld\n", static_cast<long long>(depth));
    return a.fail_if_nonzero && depth > 0 ? 1 : 0;
  }
  if (cmd == "list") return run_list(*conn, has_schema, a.queue, a.kind, a.json);
  if (cmd == "show") return run_show(*conn, has_schema, *show_id, a.json);
  if (move) return run_move(cmd, *conn, has_schema, move->first, move->second, a);
  return kExitUsage;
}

// --kind: a dead job's kind by name (store::parse_dead_reason), refused naming the flag.
void add_kind_option(CLI::App* sub, std::optional<store::DeadReason>& kind) {
  sub->add_option_function<std::string>(
         "--kind",
         [&kind](const std::string& text) {
           kind = store::parse_dead_reason(text);
           if (!kind) {
             throw CLI::ValidationError("--kind",
                                        "must be permanent, exhausted, max-age or crashed (got " +
                                            quote_value(text) + ")");
           }
         },
         "Only jobs that died of KIND: permanent, exhausted, max-age, crashed")
      ->type_name("KIND");
}

}  // namespace

Runner add_dlq(CLI::App& app) {
  auto args = std::make_shared<DlqArgs>();
  auto cmd = std::make_shared<std::string>();
  CLI::App* dlq = app.add_subcommand("dlq", "The dead-letter queue: list, show, replay, discard");
  dlq->footer(kDlqFooter);
  dlq->fallthrough();
  dlq->require_subcommand(1);
  dlq->add_option("--db", args->db, "Database URL (sqlite:PATH or postgresql://...)")
      ->capture_default_str();

  CLI::App* list = dlq->add_subcommand("list", "Dead jobs, oldest first");
  list->add_option("--queue", args->queue, "Only this queue");
  add_kind_option(list, args->kind);
  list->add_flag("--json", args->json, "JSON output");
  list->callback([cmd] { *cmd = "list"; });

  CLI::App* show = dlq->add_subcommand("show", "A job's payload and full attempt history");
  show->add_option("id", args->id, "Job id")->required();
  show->add_flag("--json", args->json, "JSON output");
  show->callback([cmd] { *cmd = "show"; });

  const auto add_filters = [&args](CLI::App* sub) {
    sub->add_option("ids", args->ids, "Job ids");
    sub->add_flag("--all", args->all, "Every dead job (narrowed by the filters)");
    sub->add_option("--queue", args->queue, "Only jobs of this queue");
    sub->add_option("--reason", args->reason, "Only jobs whose dead reason contains TEXT");
    add_kind_option(sub, args->kind);
    sub->add_option("--died-after", args->died_after,
                    "Only jobs that died at or after TIME (RFC 3339, or a duration ago: 1h)");
    sub->add_option("--died-before", args->died_before,
                    "Only jobs that died before TIME (RFC 3339, or a duration ago: 1h)");
    sub->add_flag("--dry-run", args->dry_run, "List what would move; change nothing");
  };
  CLI::App* replay = dlq->add_subcommand("replay", "Back to ready, attempts reset, same key");
  add_filters(replay);
  replay->add_option("--rate", args->rate,
                     "Make the jobs due N per second (N/s, N/m, N/h) instead of all at once");
  replay->callback([cmd] { *cmd = "replay"; });

  CLI::App* discard = dlq->add_subcommand("discard", "Delete dead jobs for good");
  add_filters(discard);
  discard->callback([cmd] { *cmd = "discard"; });

  CLI::App* depth = dlq->add_subcommand("depth", "How many dead jobs");
  depth->add_option("--queue", args->queue, "Only this queue");
  depth->add_flag("--fail-if-nonzero", args->fail_if_nonzero,
                  "Exit 1 when the dead-letter queue is not empty");
  depth->callback([cmd] { *cmd = "depth"; });

  return [args, cmd]() -> int {
    try {
      return run(*cmd, *args);
    } catch (const store::DatabaseError& e) {
      return queue_cli::failure("dlq", std::string("database error: ") + e.what());
    }
  };
}

}  // namespace keel::cli
