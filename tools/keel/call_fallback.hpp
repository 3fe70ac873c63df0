// keel call's fallbacks: --queue-on-failure DB (a keel::store::QueuedWrites on that database,
// the client's ClientOptions::fallbacks.deferred_writes) and what the call prints for an answer
// that did not come from the server: the job id of a queued request, the Keel-Stale line of a stale
// one. Part of the keel command, not a library.
//
// Thread-safety: not thread-safe; one per call.
#pragma once

#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "keel/http/message.hpp"
#include "keel/http/request.hpp"

#if KEEL_CLI_JOBS
#include "keel/core/breaker.hpp"
#include "keel/db/database.hpp"
#include "keel/fleet/shared_breakers.hpp"
#include "keel/handlers/deferred_request.hpp"
#include "keel/queue/queue.hpp"
#endif

namespace keel::cli {

/// The head `keel call -i` prints before the body: the status line and header fields, and for
/// a stale answer (Result::stale: cached, served while the host's breaker was open) a
/// "Keel-Stale: age=1.5s" field after them. Empty when the result has no response.
inline std::string response_head(const http::Result& result) {
  if (!result.response) return {};
  std::string head = result.response->status_line + "\r\n";
  for (const auto& [name, value] : result.response->headers) head += name + ": " + value + "\r\n";
  if (result.stale) head += "Keel-Stale: age=" + format_duration(result.stale_age) + "\r\n";
  head += "\r\n";
  return head;
}

/// The note on stderr for a stale answer (with or without -i).
inline std::string stale_note(const http::Result& result) {
  return "keel call: the host's circuit breaker is open: this is a cached answer " +
         format_duration(result.stale_age) + " old";
}

#if KEEL_CLI_JOBS
/// The database and queue --queue-on-failure writes a deferred request to.
class QueueOnFailure {
 public:
  /// Opens nothing yet (the database is opened on the first deferral). `db` is a database URL
  /// as `keel jobs --db` takes it, or a plain SQLite path (no scheme); an Error naming the flag
  /// when it is malformed.
  /// `secret_headers`: --secret-header's names (QueuedWritesOptions::secret_headers).
  static Expected<std::unique_ptr<QueueOnFailure>> open(
      const std::string& db, const std::string& queue,
      const std::vector<std::string>& secret_headers = {}) {
    const std::string text = db.find(':') == std::string::npos ? "sqlite:" + db : db;
    auto url = store::parse_database_url(text);
    if (!url) return url.error().in("--queue-on-failure");
    if (auto checked = store::check_queue_name(queue); !checked) {
      return checked.error().in("--defer-queue");
    }
    for (const std::string& name : secret_headers) {
      if (auto checked = http::check_header_field(name, ""); !checked) {
        return checked.error().in("--secret-header");
      }
    }
    return std::unique_ptr<QueueOnFailure>(
        new QueueOnFailure(std::move(*url), queue, secret_headers));
  }

  [[nodiscard]] http::DeferredWrites& writes() noexcept { return writes_; }
  [[nodiscard]] const std::string& database() const noexcept { return pool_.url().redacted; }
  [[nodiscard]] const std::string& queue() const noexcept { return writes_.options().queue; }

 private:
  QueueOnFailure(store::DatabaseUrl url, const std::string& queue,
                 const std::vector<std::string>& secret_headers)
      : pool_(std::move(url), {.max_connections = 1}),
        writes_(pool_, queue_, {.queue = queue, .secret_headers = secret_headers}) {}

  store::ConnectionPool pool_;
  store::JobQueue queue_;
  store::QueuedWrites writes_;
};
/// --share-breakers DB: the call's breakers shared with a fleet on DB (keel::store::
/// SharedBreakers), so that a call to a dependency the fleet has found down is refused at once,
/// and a call that is the fleet's probe reports its result to everyone.
class SharedBreakersForCall {
 public:
  /// Reads the fleet's state before the call (waiting at most `wait` for the database), and
  /// shares `rates` (none: breakers only) with the fleet. Returns an Error naming --share-fleet
  /// for a bad URL or a database without notifications.
  static Expected<std::unique_ptr<SharedBreakersForCall>> open(const std::string& text,
                                                               Duration wait,
                                                               RateLimitRegistry* rates = nullptr) {
    auto url = store::parse_database_url(text);
    if (!url) return url.error().in("--share-fleet");
    auto self = std::unique_ptr<SharedBreakersForCall>(new SharedBreakersForCall());
    try {
      self->shared_ = std::make_unique<store::SharedBreakers>(
          self->registry_, std::move(*url), store::SharedBreakersOptions{.rate_limits = rates});
    } catch (const std::invalid_argument& e) {
      return Error{.field = "--share-fleet",
                   .problem = std::string("is refused: ") + e.what(),
                   .got = quote_value(text)};
    }
    (void)self->shared_->wait_until_sharing(wait);
    return self;
  }
  ~SharedBreakersForCall() {
    if (shared_) (void)shared_->flush(std::chrono::seconds(1));  // what the call taught it
  }
  [[nodiscard]] BreakerRegistry& registry() noexcept { return registry_; }

 private:
  SharedBreakersForCall() = default;
  BreakerRegistry registry_;
  std::unique_ptr<store::SharedBreakers> shared_;
};
#endif

}  // namespace keel::cli
