// Stored job keys under keel's one idempotency key rule (keel/core/idempotency_key.hpp): the jobs
// whose key the rule refuses (a key enqueued before the rule, with a space or a non-ASCII byte,
// that keel's clients refuse to send and keel's receiver refuses to read, so every attempt of the
// job fails), and the jobs whose key is read as another form ('"abc"', read as 'abc'; when a job
// with 'abc' is on the same queue, a receiver takes the two jobs for one request and the second
// is "done" by a replay of the first's answer). Nothing is rewritten: this reports, and an
// operator decides.
//
// Thread-safety: a free function over the Connection it is given (one thread per connection).
//
// Example:
//   for (const keel::store::StoredKeyProblem& p : keel::store::check_stored_keys(*conn)) {
//     std::printf("job %lld: the key %s\n", (long long)p.id, p.reason.c_str());
//   }
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/idempotency_key.hpp"
#include "keel/db/database.hpp"
#include "keel/queue/queue.hpp"

namespace keel::store {

enum class StoredKeyIssue : unsigned char {
  kInvalid,       // the rule refuses the key
  kNotCanonical,  // the key is read as another form (canonical), which no other job has
  kCollides,      // the key is read as the key of another job on the same queue (same_as)
};

/// "invalid", "not_canonical", "collides".
[[nodiscard]] std::string_view to_string(StoredKeyIssue issue) noexcept;

/// One job whose stored key does not follow the rule.
struct StoredKeyProblem {
  std::int64_t id = 0;
  std::string queue;
  /// The key as stored.
  std::string key;
  JobState state = JobState::kReady;
  StoredKeyIssue issue = StoredKeyIssue::kInvalid;
  /// kInvalid: why the rule refuses it (what check_idempotency_key says).
  IdempotencyKeyProblem problem = IdempotencyKeyProblem::kNone;
  /// kNotCanonical, kCollides: the key as clients send it and a receiver reads it.
  std::string canonical;
  /// kCollides: the job on the same queue whose key is `canonical`.
  std::optional<std::int64_t> same_as;
  /// What is wrong, as a verb phrase that follows "the key" (the rule's problem, "contains a
  /// space (...)", or "is read as 'abc', the key of job 7: ...").
  std::string reason;
};

/// The jobs (of `queue`, or of all queues when empty; every state) whose key the rule refuses or
/// reads as another form, by id. Reads in pages of 1000 jobs by id; writes nothing. Requires:
/// the queue's schema (JobQueue::migrate). Throws DatabaseError.
[[nodiscard]] std::vector<StoredKeyProblem> check_stored_keys(Connection& connection,
                                                              std::string_view queue = {});

}  // namespace keel::store
