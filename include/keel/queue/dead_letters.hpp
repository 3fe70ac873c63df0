// Selecting, replaying and discarding dead-lettered jobs by filter (queue, dead reason, when they
// died), with replays paced: "make replaying or discarding a dead-lettered item a one-command
// operation" without recreating the storm that killed the jobs. Replaying ten thousand dead
// webhooks at once makes them all due in the same instant; with a pace of N per second the
// replayed jobs get run_at times spread N per second from now (oldest death first), written in
// one transaction, so the call returns at once and the workers pick the jobs up at that rate.
// (This is the velocity of Amazon SQS's dead-letter redrive, done with due times instead of a
// process that sleeps.)
//
// A replay is exactly JobQueue::replay's: state ready, attempts 0, a new fencing token (fence +
// 1), replays + 1, the dead reason, finished time, limited retries, previous delay and deferrals
// cleared; the idempotency key and the history are kept. Nothing here prunes dead jobs: they
// stay until replayed or discarded (keel has no retention for dead jobs).
//
// When a job died is its finished time (set when it moved to the dead-letter queue; its update
// time for a job that has none). Times are calendar milliseconds from the injected Clock's
// wall_now(), as in JobQueue.
//
// Thread-safety: free functions; each call uses the Connection it is given (one thread per
// connection). replay and discard run in one transaction each (retried on lost races): requires
// no transaction open on the connection.
//
// Example:
//   keel::store::DeadLetterFilter filter{.queue = "webhooks", .reason_contains = "HTTP 503"};
//   auto moved = keel::store::dead_letters::replay(*conn, filter, {.per_second = 50});
//   // moved[i].run_at_ms == now + i * 20 ms: 50 a second, the first one due now.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/clock.hpp"
#include "keel/core/expected.hpp"
#include "keel/db/database.hpp"
#include "keel/queue/queue.hpp"

namespace keel::store {

/// Which dead jobs an operation applies to. Every field narrows the selection; the default
/// selects every dead job.
struct DeadLetterFilter {
  /// Only this queue. Default empty: every queue.
  std::string queue;
  /// Only jobs whose dead reason contains this text (case-sensitive, no wildcards). Default
  /// empty: any reason.
  std::string reason_contains;
  /// Only jobs that died of this kind (the stored dead_kind: permanent, attempts exhausted, max
  /// age, crashed). Default none: any kind, and jobs whose kind is not known.
  std::optional<DeadReason> kind;
  /// Only jobs that died at or after this calendar millisecond. Default none.
  std::optional<std::int64_t> died_at_or_after_ms;
  /// Only jobs that died strictly before this calendar millisecond. Default none.
  std::optional<std::int64_t> died_before_ms;
  /// Only these job ids. Default empty: any id.
  std::vector<std::int64_t> ids;
};

/// How replayed jobs are spread over time.
struct ReplayPacing {
  /// Jobs made due per second: job i (0-based, oldest death first) is due at now + i / per_second.
  /// 0: all due now (JobQueue::replay). Requires: >= 0 and finite.
  double per_second = 0;
};

/// A dead job selected, or a job replayed (with the run_at it got, or would get).
struct DeadLetter {
  std::int64_t id = 0;
  std::string queue;
  std::string dead_reason;
  /// Why it died, as a kind; none for a job that died before kinds were stored and whose reason
  /// did not say (schema version 8's migration read it from the reason when it could).
  std::optional<DeadReason> kind;
  /// When it died (calendar ms).
  std::int64_t died_ms = 0;
  int attempts = 0;
  int max_attempts = 0;
  int replays = 0;
  /// For replay() and plan_replay(): when the replayed job is due. Zero from select().
  std::int64_t run_at_ms = 0;
};

namespace dead_letters {

/// The dead jobs the filter selects, oldest death first (then by id), at most `limit`. Only
/// reads. Requires: limit >= 1. Throws DatabaseError.
[[nodiscard]] std::vector<DeadLetter> select(Connection& connection, const DeadLetterFilter& filter,
                                             std::int64_t limit = INT64_MAX);

/// What replay() would do now, without changing anything (a dry run): the selected jobs with the
/// run_at each would get. Throws DatabaseError; std::invalid_argument for a bad pacing.
[[nodiscard]] std::vector<DeadLetter> plan_replay(Connection& connection,
                                                  const DeadLetterFilter& filter,
                                                  const ReplayPacing& pacing,
                                                  Clock& clock = steady_clock());

/// Replays the selected dead jobs in one transaction, due at the pacing's spread from now. Returns
/// the jobs replayed with their run_at (a job that stopped being dead meanwhile is skipped).
/// Throws DatabaseError; std::invalid_argument naming the field for a bad pacing.
std::vector<DeadLetter> replay(Connection& connection, const DeadLetterFilter& filter,
                               const ReplayPacing& pacing = {}, Clock& clock = steady_clock());

/// Deletes the selected dead jobs and their history in one transaction. Returns the ids deleted.
/// Throws DatabaseError.
std::vector<std::int64_t> discard(Connection& connection, const DeadLetterFilter& filter);

/// The offset from now of the i-th (0-based) replayed job at `per_second`: floor(i * 1000 /
/// per_second) ms; 0 when per_second is 0. Requires: per_second >= 0 and finite.
[[nodiscard]] std::int64_t replay_offset_ms(std::int64_t i, double per_second) noexcept;

/// Parses a bound of DeadLetterFilter's died_after/died_before: an RFC 3339 timestamp
/// ("2026-12-01T10:00:00Z", "2026-12-01T11:00:00.5+01:00"; a 'T', seconds and a zone required) or a
/// duration ago ("90m", "1h": now_ms minus it, keel::parse_duration). Returns calendar ms, or an
/// Error (field "time").
[[nodiscard]] Expected<std::int64_t> parse_time_bound(std::string_view text, std::int64_t now_ms);

}  // namespace dead_letters
}  // namespace keel::store
