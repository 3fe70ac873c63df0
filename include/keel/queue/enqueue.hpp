// What a producer gives keel::store::JobQueue::enqueue (and enqueue_in, enqueue_many) and what
// it answers: the request's rules are checked at enqueue, on every backend, and a refused
// request writes nothing.
//
// Thread-safety: value types; distinct objects may be used concurrently.
#pragma once

#include <cstdint>
#include <string>

#include "keel/core/clock.hpp"

namespace keel::store {

struct EnqueueRequest {
  /// Requires: a valid queue name (check_queue_name).
  std::string queue;
  /// Requires: a JSON document in UTF-8 (no NUL byte; keel::is_storable_text) that a receiver's
  /// check_json (keel/json/json_check.hpp) accepts with the default JsonLimits: nested at
  /// most 64 levels deep, no member named twice. Other bytes are refused at enqueue, on every
  /// backend.
  std::string payload;
  /// The job's idempotency key; empty: a new UUID (new_job_key), unique by its randomness and
  /// kept out of the key index (given back later as `key`, it makes another job). Requires: a
  /// key under keel's one rule (keel::check_idempotency_key: 1 to 255 bytes of visible ASCII
  /// without '"', ',' or '%', bare or quoted); stored in its canonical form, so "k" and k are
  /// one job.
  std::string key;
  /// Attempts before the job is dead. 0: QueueOptions::max_attempts. Requires: >= 0.
  int max_attempts = 0;
  /// Not before now + delay. Requires: >= 0. Default 0.
  Duration delay{};
};

struct EnqueueResult {
  /// The new job, or the existing one with the same key on the same queue.
  std::int64_t id = 0;
  /// The key stored: the request's in its canonical form, or the UUID made for it.
  std::string idempotency_key;
  /// false: a job with this key already existed on this queue and nothing was written.
  bool created = true;
  /// When the request was refused (invalid queue, payload, key, attempts or delay; a payload
  /// nested deeper than 64 levels is refused naming that limit, one that is not UTF-8 saying
  /// so): the Error's message, naming the field and quoting the value, and nothing was written.
  /// Empty on success.
  std::string error;
  [[nodiscard]] bool ok() const noexcept { return error.empty(); }
};

}  // namespace keel::store
