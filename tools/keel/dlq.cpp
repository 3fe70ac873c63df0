// `keel dlq --db URL list|show|replay|discard|depth`: the dead-letter queue of keel's job queue.
// Dead jobs stay until an operator replays them (back to ready, attempts reset, the SAME
// idempotency key) or discards them.
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "queue_cli.hpp"

namespace keel::cli {
namespace {

using queue_cli::format_ms;

constexpr const char* kDlqFooter =
    R"(The database is a URL: sqlite:PATH (default sqlite:keel.db) or postgresql://...

replay moves dead jobs back to ready with their attempts reset and the same idempotency key, so a
receiver that deduplicates by key applies each job at most once. discard deletes them for good.

list, show and depth only read: they open the database read-only and never migrate it, so a
user who may only read the file can run them.

Exit status:
  0  success (depth: the dead-letter queue is empty, or no --fail-if-nonzero)
  1  depth --fail-if-nonzero found dead jobs, or a database failure
  2  invalid arguments (the message names the flag), or a database file that does not exist
  3  not found: show's job id is not in the database, or a job id given to replay or discard is
     not in the dead-letter queue (the other ids given are still replayed or discarded))";

// Exit status when a job id given is not there (see the footer).
constexpr int kExitNotFound = 3;

int not_found(const std::string& message) {
  std::fprintf(stderr, "keel dlq: %s\n", message.c_str());
  return kExitNotFound;
}

int usage(const std::string& message) { return queue_cli::usage_error("dlq", message); }

struct DlqArgs {
  std::string db = std::string(store::kDefaultDatabaseUrl);
  std::string queue;
  bool json = false;
  bool all = false;
  bool fail_if_nonzero = false;
  std::vector<std::string> ids;
  std::string id;
};

std::optional<std::vector<std::int64_t>> parse_ids(const std::vector<std::string>& texts) {
  std::vector<std::int64_t> ids;
  for (const std::string& t : texts) {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(t.c_str(), &end, 10);
    if (t.empty() || end == nullptr || *end != '\0' || errno != 0 || v < 1) {
      usage("invalid job id '" + t + "' (expected a positive integer)");
      return std::nullopt;
    }
    ids.push_back(v);
  }
  return ids;
}

nlohmann::json job_json(const store::Job& j) {
  nlohmann::json out = {{"id", j.id},
                        {"queue", j.queue},
                        {"state", to_string(j.state)},
                        {"idempotency_key", j.idempotency_key},
                        {"attempts", j.attempts},
                        {"max_attempts", j.max_attempts},
                        {"replays", j.replays},
                        {"dead_reason", j.dead_reason},
                        {"last_error", j.last_error},
                        {"created", format_ms(j.created_ms)},
                        {"updated", format_ms(j.updated_ms)}};
  const nlohmann::json payload = nlohmann::json::parse(j.payload, nullptr, false);
  out["payload"] = payload.is_discarded() ? nlohmann::json(j.payload) : payload;
  return out;
}

int run(const std::string& cmd, const DlqArgs& a) {
  const auto url = queue_cli::parse_db_flag("dlq", a.db);
  if (!url) return kExitUsage;
  if (!a.queue.empty()) {
    if (std::string why = store::check_queue_name(a.queue); !why.empty()) {
      return usage("--queue: " + why);
    }
  }
  std::vector<std::int64_t> ids;
  if (cmd == "replay" || cmd == "discard") {
    if (a.all == !a.ids.empty()) {
      return usage(cmd + ": give job ids or --all" +
                   (a.all ? " (not both)" : " (nothing to " + cmd + ")"));
    }
    if (!a.all && !a.queue.empty()) return usage("--queue: only with --all");
    auto parsed = parse_ids(a.ids);
    if (!parsed) return kExitUsage;
    ids = *parsed;
  }
  std::optional<std::int64_t> show_id;
  if (cmd == "show") {
    auto parsed = parse_ids({a.id});
    if (!parsed) return kExitUsage;
    show_id = parsed->front();
  }
  if (!queue_cli::database_exists(*url)) {
    return usage("--db: database '" + url->redacted + "' does not exist");
  }
  bool has_schema = false;
  const bool read_only = cmd == "list" || cmd == "show" || cmd == "depth";
  auto conn = read_only ? queue_cli::open_queue_db_read_only(*url, &has_schema)
                        : queue_cli::open_queue_db(*url, false, &has_schema);
  store::JobQueue queue;
  if (!a.queue.empty() && (!has_schema || !queue.queue_exists(*conn, a.queue))) {
    return usage("--queue: unknown queue '" + a.queue + "' in " + url->redacted);
  }

  if (cmd == "depth") {
    const std::int64_t depth = has_schema ? queue.dead_depth(*conn, a.queue) : 0;
    std::printf("%lld\n", static_cast<long long>(depth));
    return a.fail_if_nonzero && depth > 0 ? 1 : 0;
  }
  if (cmd == "list") {
    const std::vector<store::Job> dead =
        has_schema ? queue.list_dead(*conn, a.queue, 100000) : std::vector<store::Job>{};
    if (a.json) {
      nlohmann::json out = nlohmann::json::array();
      for (const auto& j : dead) out.push_back(job_json(j));
      std::printf("%s\n", out.dump(2).c_str());
      return 0;
    }
    std::printf("%-8s %-16s %-9s %-24s %s\n", "ID", "QUEUE", "ATTEMPTS", "DIED", "REASON");
    for (const auto& j : dead) {
      std::printf("%-8lld %-16s %4d/%-4d %-24s %s\n", static_cast<long long>(j.id), j.queue.c_str(),
                  j.attempts, j.max_attempts, format_ms(j.updated_ms).c_str(),
                  j.dead_reason.c_str());
    }
    return 0;
  }
  if (cmd == "show") {
    const auto job = has_schema ? queue.get(*conn, *show_id) : std::nullopt;
    if (!job) return not_found("show: no job " + std::to_string(*show_id));
    if (a.json) {
      nlohmann::json out = job_json(*job);
      out["history"] = nlohmann::json::array();
      for (const auto& h : job->history) {
        out["history"].push_back(
            {{"round", h.round},
             {"attempt", h.attempt},
             {"started", format_ms(h.started_ms)},
             {"finished", format_ms(h.finished_ms)},
             {"outcome", h.outcome},
             {"error", h.error},
             {"delay_ms", h.delay_ms ? nlohmann::json(*h.delay_ms) : nlohmann::json()},
             {"worker", h.worker}});
      }
      std::printf("%s\n", out.dump(2).c_str());
      return 0;
    }
    std::printf("job %lld on queue '%s': %s\n", static_cast<long long>(job->id), job->queue.c_str(),
                std::string(to_string(job->state)).c_str());
    std::printf("idempotency key: %s\n", job->idempotency_key.c_str());
    std::printf("attempts: %d of %d (replayed %d times)\n", job->attempts, job->max_attempts,
                job->replays);
    if (!job->dead_reason.empty()) std::printf("dead: %s\n", job->dead_reason.c_str());
    std::printf("payload: %s\nhistory:\n", job->payload.c_str());
    for (const auto& h : job->history) {
      std::string line = "  " + format_ms(h.started_ms) + "  ";
      if (h.round > 0) line += "replay " + std::to_string(h.round) + " ";
      line += "attempt " + std::to_string(h.attempt) + "  " + h.outcome;
      if (h.delay_ms) line += "  next in " + std::to_string(*h.delay_ms) + "ms";
      if (!h.error.empty()) line += "  " + h.error;
      std::printf("%s\n", line.c_str());
    }
    return 0;
  }
  if (!has_schema) {
    if (!a.all) return not_found(cmd + ": no such dead job(s): the database has no job queue");
    std::printf("0\n");
    return 0;
  }
  if (cmd == "replay" || cmd == "discard") {
    if (a.all) {
      const std::int64_t n =
          cmd == "replay" ? queue.replay_all(*conn, a.queue) : queue.discard_all(*conn, a.queue);
      std::fprintf(stderr, "keel dlq: %s %lld dead job(s)\n",
                   cmd == "replay" ? "replayed" : "discarded", static_cast<long long>(n));
      std::printf("%lld\n", static_cast<long long>(n));
      return 0;
    }
    const std::vector<std::int64_t> done =
        cmd == "replay" ? queue.replay(*conn, ids) : queue.discard(*conn, ids);
    for (std::int64_t id : done) std::printf("%lld\n", static_cast<long long>(id));
    if (done.size() != ids.size()) {
      std::string missing;
      for (std::int64_t id : ids) {
        if (std::find(done.begin(), done.end(), id) == done.end()) {
          missing += (missing.empty() ? "" : ", ") + std::to_string(id);
        }
      }
      return not_found(cmd + ": not in the dead-letter queue (skipped): " + missing);
    }
    return 0;
  }
  return kExitUsage;
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
  list->add_flag("--json", args->json, "JSON output");
  list->callback([cmd] { *cmd = "list"; });

  CLI::App* show = dlq->add_subcommand("show", "A job's payload and full attempt history");
  show->add_option("id", args->id, "Job id")->required();
  show->add_flag("--json", args->json, "JSON output");
  show->callback([cmd] { *cmd = "show"; });

  CLI::App* replay = dlq->add_subcommand("replay", "Back to ready, attempts reset, same key");
  replay->add_option("ids", args->ids, "Job ids");
  replay->add_flag("--all", args->all, "Every dead job (of --queue)");
  replay->add_option("--queue", args->queue, "With --all: only this queue");
  replay->callback([cmd] { *cmd = "replay"; });

  CLI::App* discard = dlq->add_subcommand("discard", "Delete dead jobs for good");
  discard->add_option("ids", args->ids, "Job ids");
  discard->add_flag("--all", args->all, "Every dead job (of --queue)");
  discard->add_option("--queue", args->queue, "With --all: only this queue");
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
