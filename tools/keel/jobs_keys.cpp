// `keel jobs check-keys [--queue Q] [--json]`: the stored jobs whose idempotency key keel's one
// key rule refuses or reads as another job's key (keel::store::check_stored_keys). Reads only;
// exits 3 when it lists any job, so that a script can stop before such jobs are worked.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "jobs_cli.hpp"
#include "keel/core/expected.hpp"
#include "keel/queue/queue_keys.hpp"
#include "queue_cli.hpp"

namespace keel::cli::jobs_cli {

int run_check_keys(const JobsArgs& a) {
  const auto url = queue_cli::parse_db_flag("jobs", a.db);
  if (!url) return kExitUsage;
  if (!a.queue.empty()) {
    if (auto queue = store::check_queue_name(a.queue); !queue) {
      return usage(queue.error().in("--queue").message());
    }
  }
  if (!store::database_exists(*url)) {
    return usage("--db: database '" + url->redacted + "' does not exist");
  }
  bool has_schema = false;
  auto conn = queue_cli::open_queue_db_read_only(*url, &has_schema);
  std::vector<store::StoredKeyProblem> found;
  if (has_schema) found = store::check_stored_keys(*conn, a.queue);
  if (a.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const store::StoredKeyProblem& p : found) {
      nlohmann::json j = {{"id", p.id},
                          {"queue", p.queue},
                          {"state", to_string(p.state)},
                          {"key", p.key},
                          {"issue", to_string(p.issue)},
                          {"reason", p.reason}};
      if (p.issue == store::StoredKeyIssue::kInvalid) j["problem"] = to_string(p.problem);
      if (!p.canonical.empty()) j["canonical"] = p.canonical;
      if (p.same_as) j["same_as"] = *p.same_as;
      out.push_back(std::move(j));
    }
    // A legacy key may hold bytes that are not UTF-8: shown as U+FFFD rather than failing.
    std::printf("%s\n", out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else if (found.empty()) {
    std::printf("every job key follows the rule\n");
  } else {
    std::printf("%-10s %-24s %-16s %-14s %s\n", "ID", "QUEUE", "STATE", "ISSUE", "KEY");
    for (const store::StoredKeyProblem& p : found) {
      std::printf("%-10lld %-24s %-16s %-14s %s\n  the key %s\n", static_cast<long long>(p.id),
                  p.queue.c_str(), std::string(to_string(p.state)).c_str(),
                  std::string(to_string(p.issue)).c_str(), quote_value(p.key, 300).c_str(),
                  p.reason.c_str());
    }
    std::printf(
        "%zu jobs have keys that clients and receivers refuse or read as another key; nothing "
        "was changed (discard or re-enqueue them with a valid key)\n",
        found.size());
  }
  return found.empty() ? 0 : kExitKeysFound;
}

}  // namespace keel::cli::jobs_cli
