// keel dlq's views of dead jobs (dlq_show.hpp).
#include "dlq_show.hpp"

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "keel/handlers/deferred_request.hpp"
#include "keel/json/json_check.hpp"
#include "queue_cli.hpp"

namespace keel::cli {
namespace {

using queue_cli::format_ms;

// Payloads nested deeper than this are shown as a JSON string: the depth is found by a linear
// pre-scan, so that no payload, however it was stored, reaches a recursive parser or printer.
constexpr std::size_t kMaxShownDepth = 64;

// The payload as JSON text for --json: the payload itself, compact, when it is JSON nested no
// deeper than kMaxShownDepth, otherwise the payload as a JSON string; a deferred request's
// credentials redacted. Linear in the payload's size.
std::string payload_json(const std::string& stored) {
  const std::string payload = store::redact_deferred_request(stored);
  constexpr auto kReplace = nlohmann::json::error_handler_t::replace;
  if (store::json_nesting_depth(payload, kMaxShownDepth) <= kMaxShownDepth) {
    const nlohmann::json parsed = nlohmann::json::parse(payload, nullptr, false);
    if (!parsed.is_discarded()) return parsed.dump(-1, ' ', false, kReplace);
  }
  return nlohmann::json(payload).dump(-1, ' ', false, kReplace);
}

// A job for --json: `fields` (a JSON object, without the payload) indented by two spaces per
// level, with "payload" added as its last member in payload_json's compact form, every line
// after the first indented by `margin` more. The payload is spliced in as text, never parsed
// or printed recursively, so the output is linear in its size.
std::string job_text(const nlohmann::json& fields, const std::string& payload,
                     const std::string& margin = {}) {
  std::string text = fields.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
  text.resize(text.size() - 2);  // "\n}"
  text += ",\n  \"payload\": " + payload_json(payload) + "\n}";
  if (margin.empty()) return text;
  std::string out;
  out.reserve(text.size() + text.size() / 16);
  for (const char c : text) {
    out += c;
    if (c == '\n') out += margin;
  }
  return out;
}

// A job's fields for --json, without its payload (job_text adds it).
nlohmann::json job_json(const store::Job& j) {
  nlohmann::json out = {
      {"id", j.id},
      {"queue", j.queue},
      {"state", to_string(j.state)},
      {"idempotency_key", j.idempotency_key},
      {"attempts", j.attempts},
      {"max_attempts", j.max_attempts},
      {"replays", j.replays},
      {"crashed_batches", j.crashed_batches},
      {"dead_reason", j.dead_reason},
      {"dead_kind", j.dead_kind ? nlohmann::json(std::string(to_string(*j.dead_kind)))
                                : nlohmann::json(nullptr)},
      {"last_error", j.last_error},
      {"created", format_ms(j.created_ms)},
      {"updated", format_ms(j.updated_ms)}};
  return out;
}

// `dlq show --json`: the job, its payload and its history.
void show_json(const store::Job& job) {
  nlohmann::json out = job_json(job);
  out["history"] = nlohmann::json::array();
  for (const auto& h : job.history) {
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
  std::printf("%s\n", job_text(out, job.payload).c_str());
}

}  // namespace

int dlq_not_found(const std::string& message) {
  std::fprintf(stderr, "keel dlq: %s\n", message.c_str());
  return kExitNotFound;
}

// `dlq list`: the dead jobs (of --queue, of --kind), oldest first, as a table or --json.
int run_list(store::Connection& conn, bool has_schema, const std::string& queue_name,
             std::optional<store::DeadReason> kind, bool json) {
  store::JobQueue queue;
  std::vector<store::Job> dead =
      has_schema ? queue.list_dead(conn, queue_name, 100000) : std::vector<store::Job>{};
  if (kind) std::erase_if(dead, [&](const store::Job& j) { return j.dead_kind != kind; });
  if (json) {
    std::string out = dead.empty() ? "[]" : "[";
    for (std::size_t i = 0; i < dead.size(); ++i) {
      out += (i == 0 ? "\n  " : ",\n  ") + job_text(job_json(dead[i]), dead[i].payload, "  ");
    }
    if (!dead.empty()) out += "\n]";
    std::printf("%s\n", out.c_str());
    return 0;
  }
  std::printf("%-8s %-16s %-9s %-24s %s\n", "ID", "QUEUE", "ATTEMPTS", "DIED", "REASON");
  for (const auto& j : dead) {
    std::printf("%-8lld %-16s %4d/%-4d %-24s %s\n", static_cast<long long>(j.id), j.queue.c_str(),
                j.attempts, j.max_attempts, format_ms(j.updated_ms).c_str(), j.dead_reason.c_str());
  }
  return 0;
}

// `dlq show`: one job with its payload (credentials redacted) and full attempt history.
int run_show(store::Connection& conn, bool has_schema, std::int64_t id, bool json) {
  store::JobQueue queue;
  const auto job = has_schema ? queue.get(conn, id) : std::nullopt;
  if (!job) return dlq_not_found("show: no job " + std::to_string(id));
  if (json) {
    show_json(*job);
    return 0;
  }
  std::printf("job %lld on queue '%s': %s\n", static_cast<long long>(job->id), job->queue.c_str(),
              std::string(to_string(job->state)).c_str());
  std::printf("idempotency key: %s\n", job->idempotency_key.c_str());
  std::printf("attempts: %d of %d (replayed %d times)\n", job->attempts, job->max_attempts,
              job->replays);
  if (job->crashed_batches > 0) {
    std::printf("in crashed batches: %d (returned uncharged each time; it runs alone)\n",
                job->crashed_batches);
  }
  if (!job->dead_reason.empty()) std::printf("dead: %s\n", job->dead_reason.c_str());
  if (job->dead_kind) {
    std::printf("dead kind: %s\n", std::string(to_string(*job->dead_kind)).c_str());
  }
  std::printf("payload: %s\nhistory:\n", store::redact_deferred_request(job->payload).c_str());
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

}  // namespace keel::cli
