// keel dlq's views of dead jobs: list and show, as text or --json (tools/keel/dlq.cpp parses the
// flags and selects; this file renders). Payloads are shown in space linear in their size, a
// deferred request's credentials redacted.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "keel/db/database.hpp"
#include "keel/queue/queue.hpp"

namespace keel::cli {

/// Exit status for a job id that is not there.
inline constexpr int kExitNotFound = 3;

/// Prints "keel dlq: MESSAGE" and returns kExitNotFound.
int dlq_not_found(const std::string& message);

/// `dlq list`: the dead jobs of `queue` (all when empty) of `kind` (any when none), oldest
/// first, as a table or JSON.
int run_list(store::Connection& conn, bool has_schema, const std::string& queue,
             std::optional<store::DeadReason> kind, bool json);

/// `dlq show`: one job with its payload and full attempt history; kExitNotFound when absent.
int run_show(store::Connection& conn, bool has_schema, std::int64_t id, bool json);

}  // namespace keel::cli
