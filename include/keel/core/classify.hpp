// Failure classification: the vocabulary every keel component uses to say what an attempt's
// result means for trying again, and built-in classifiers for HTTP statuses, network errors and
// PostgreSQL SQLSTATEs, plus a hook for APIs that hide an error inside a 200, and the rule that
// reads a retry's "already exists" as the success of the attempt before it.
//
// The taxonomy, and whether a retry may help (see docs/classification.md):
//   kSuccess    done; nothing to retry.
//   kTransient  a timing accident (reset, 502/503/504, deadlock); a retry may well succeed.
//   kThrottled  the server shed load (429, 503 with Retry-After); retry, after its delay.
//   kPermanent  deterministic (400, 401, 403, 404, 422); a retry fails identically. Never retry.
//   kAmbiguous  the request may have taken effect (timeout after sending, 500, commit in doubt);
//               retry only when the operation is idempotent or carries an idempotency key.
//   kNotAttempted  nothing was sent: a circuit breaker or a retry budget refused the attempt,
//               or the deadline had passed. Not a failure of the dependency, and not a success.
//               It is what a default-constructed Outcome says, so forgetting to classify an
//               attempt can never read as success.
//
// Thread-safety: values and pure functions; HttpClassifier and DuplicateSuccessRule are immutable
// after construction.
//
// Example:
//   keel::RequestTraits post{keel::Method::kPost, /*has_idempotency_key=*/true};
//   keel::Outcome o = keel::classify_http_status(503, post, std::chrono::seconds(2));
//   // o.kind == kThrottled, o.server_delay == 2 s
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/clock.hpp"

namespace keel {

enum class OutcomeKind : unsigned char {
  kNotAttempted,  // first, so that a default Outcome is "nothing ran", never success
  kSuccess,
  kTransient,
  kThrottled,
  kPermanent,
  kAmbiguous,
};

/// "not attempted", "success", "transient", "throttled", "permanent", "ambiguous".
[[nodiscard]] std::string_view to_string(OutcomeKind kind) noexcept;

/// Whether an outcome of this kind counts against the dependency's health (breakers, budgets):
/// transient, throttled and ambiguous do; success, permanent (the caller's fault) and not
/// attempted (nothing reached it) do not.
[[nodiscard]] constexpr bool is_dependency_failure(OutcomeKind kind) noexcept {
  return kind == OutcomeKind::kTransient || kind == OutcomeKind::kThrottled ||
         kind == OutcomeKind::kAmbiguous;
}

/// Where an outcome came from (for logs and metrics).
enum class OutcomeSource : unsigned char {
  kNone,
  kHttp,
  kNetwork,
  kSqlstate,
  kBody,
  kUser,
  kGrpc,  // a gRPC status code (keel/core/grpc_status.hpp)
};

/// The classified result of one attempt. Small and trivially copyable. A default-constructed
/// Outcome is kNotAttempted: build results with the named constructors or the classifiers.
struct Outcome {
  static constexpr Duration kNoServerDelay = Duration(-1);
  static constexpr std::uint8_t kNoRetryLimit = 255;

  OutcomeKind kind = OutcomeKind::kNotAttempted;
  OutcomeSource source = OutcomeSource::kNone;
  /// The attempt ended because it hit its timeout (the AWS token bucket charges such retries
  /// double).
  bool timed_out = false;
  /// A success that is the receiver's "already exists" answer to a retry after an ambiguous
  /// failure: the earlier attempt took effect (DuplicateSuccessRule). False for every other
  /// outcome.
  bool duplicate = false;
  /// kNotAttempted by a rate limit's line: the call's wait ended before its turn, server_delay
  /// away, and the limit admits a new call to its line now (keel::waits_in_line). A queue's worker
  /// defers just this job, to its turn, and goes on leasing. False for every other outcome.
  bool in_line = false;
  /// At most this many retries in one operation may be caused by outcomes carrying this limit
  /// (HTTP 500 carries 1 by default: retried at most once). kNoRetryLimit: no extra limit.
  std::uint8_t retry_limit = kNoRetryLimit;
  /// HTTP status, errno-like NetError value, gRPC status code, or 0.
  int code = 0;
  /// The delay the server asked for (Retry-After), uncapped; kNoServerDelay when none. For
  /// kNotAttempted: when the refusing brake expects to admit an attempt again (an open
  /// breaker's remaining break), or kNoServerDelay when it cannot say.
  Duration server_delay = kNoServerDelay;
  /// SQLSTATE when source is kSqlstate (five characters and a NUL), else empty.
  char sqlstate[6] = {};

  [[nodiscard]] bool has_server_delay() const noexcept { return server_delay >= Duration::zero(); }

  [[nodiscard]] bool attempted() const noexcept { return kind != OutcomeKind::kNotAttempted; }

  [[nodiscard]] static constexpr Outcome success() noexcept {
    Outcome o;
    o.kind = OutcomeKind::kSuccess;
    return o;
  }
  /// Nothing was sent; `retry_in` is when the refusing brake expects to admit an attempt.
  [[nodiscard]] static constexpr Outcome not_attempted(
      Duration retry_in = kNoServerDelay) noexcept {
    Outcome o;
    o.server_delay = retry_in;
    return o;
  }
  [[nodiscard]] static constexpr Outcome transient() noexcept {
    Outcome o;
    o.kind = OutcomeKind::kTransient;
    o.source = OutcomeSource::kUser;
    return o;
  }
  [[nodiscard]] static constexpr Outcome throttled(Duration delay = kNoServerDelay) noexcept {
    Outcome o;
    o.kind = OutcomeKind::kThrottled;
    o.source = OutcomeSource::kUser;
    o.server_delay = delay;
    return o;
  }
  [[nodiscard]] static constexpr Outcome permanent() noexcept {
    Outcome o;
    o.kind = OutcomeKind::kPermanent;
    o.source = OutcomeSource::kUser;
    return o;
  }
  [[nodiscard]] static constexpr Outcome ambiguous() noexcept {
    Outcome o;
    o.kind = OutcomeKind::kAmbiguous;
    o.source = OutcomeSource::kUser;
    return o;
  }
};

/// A short human description: "HTTP 503 (throttled, Retry-After 2s)", "network: connection
/// reset (ambiguous)", "SQLSTATE 40001 (transient)".
[[nodiscard]] std::string describe(const Outcome& outcome);

// ---------------------------------------------------------------------------------------------
// HTTP

enum class Method : unsigned char { kGet, kHead, kOptions, kPut, kDelete, kPost, kPatch, kOther };

/// Case-sensitive method token ("GET", "POST", ...); anything else is kOther.
[[nodiscard]] Method parse_method(std::string_view token) noexcept;
[[nodiscard]] std::string_view to_string(Method method) noexcept;
/// GET, HEAD, OPTIONS, PUT and DELETE are idempotent by definition (RFC 9110 9.2.2); POST, PATCH
/// and unknown methods are not.
[[nodiscard]] constexpr bool is_idempotent(Method m) noexcept {
  return m == Method::kGet || m == Method::kHead || m == Method::kOptions || m == Method::kPut ||
         m == Method::kDelete;
}

/// What the engine needs to know about an operation to decide whether repeating it is safe.
struct RequestTraits {
  Method method = Method::kGet;
  /// The request carries an Idempotency-Key stable across attempts.
  bool has_idempotency_key = false;
  /// Repeating it cannot cause a second effect: an idempotent method, or a key.
  [[nodiscard]] constexpr bool safe_to_repeat() const noexcept {
    return is_idempotent(method) || has_idempotency_key;
  }
};

/// Classifies an HTTP status.
///   1xx-3xx success; 408, 425, 502, 504 transient; 429 and 503 throttled (with server_delay
///   from `retry_after` when given); 409 throttled when the request carried an idempotency key
///   (the receiver says "in progress, back off"), permanent otherwise; 500 and unlisted 5xx
///   ambiguous with retry_limit = max_retries_on_500; 501, 505 and every other 4xx permanent.
[[nodiscard]] Outcome classify_http_status(int status, const RequestTraits& request,
                                           std::optional<Duration> retry_after = std::nullopt,
                                           int max_retries_on_500 = 1) noexcept;

/// A user hook that reads a response body, for APIs that answer 200 with an error inside.
/// Return an Outcome to override the status classification, or nullopt to keep it.
using BodyClassifier = std::function<std::optional<Outcome>(int status, std::string_view body)>;

struct HttpClassifierOptions {
  /// How many retries a 500 (or unlisted 5xx) may cause in one operation. Default 1.
  int max_retries_on_500 = 1;
  /// Consulted first for every response when set. Default none.
  BodyClassifier body;
};

/// classify_http_status plus the body hook. Immutable; safe for concurrent use.
class HttpClassifier {
 public:
  /// Throws std::invalid_argument when max_retries_on_500 is outside [0, 254].
  explicit HttpClassifier(HttpClassifierOptions options = {});
  [[nodiscard]] Outcome classify(int status, std::string_view body, const RequestTraits& request,
                                 std::optional<Duration> retry_after = std::nullopt) const;

 private:
  HttpClassifierOptions options_;
};

// ---------------------------------------------------------------------------------------------
// Duplicate as success

/// Whether a response body says what a rule looks for.
using BodyPredicate = std::function<bool(std::string_view body)>;

/// A predicate that holds when the body contains `text` (bytes, case-sensitive); an empty text
/// is in every body.
[[nodiscard]] BodyPredicate body_contains(std::string text);

struct DuplicateSuccessOptions {
  /// The statuses a receiver answers a repeated create with. Requires: not empty, each in
  /// [400, 599] (a 2xx or 3xx is a success already). Default {409}.
  std::vector<int> statuses = {409};
  /// Must hold for the response body as well; none: any body. Default none (set it: a bare 409
  /// is also a receiver's "in progress" or a real conflict).
  BodyPredicate body;
};

/// "This name already exists" on a retry after an ambiguous failure means the first try worked:
/// the receiver acted on it and only its answer was lost. The rule maps such a response to
/// success, marked Outcome::duplicate, so the operation stops there instead of failing on the
/// effect it wanted. It applies ONLY to an attempt whose previous attempt of the same operation
/// was kAmbiguous (a timeout or reset after the request was sent, a 500): on a first attempt, or
/// after a failure that says the request had no effect (503, refused connection), the same
/// response keeps its classification, because then it is a real conflict. See
/// docs/classification.md. Immutable; safe for concurrent use.
///
/// Example:
///   keel::DuplicateSuccessRule rule(
///       {.statuses = {409}, .body = keel::body_contains("already exists")});
///   keel::RequestTraits post{keel::Method::kPost, /*has_idempotency_key=*/true};
///   keel::Outcome lost = keel::classify_network(keel::NetError::kTimedOut, true);  // ambiguous
///   keel::Outcome o = rule.apply(lost, keel::classify_http_status(409, post), body);
///   // body "name already exists": o.kind == kSuccess, o.duplicate, o.code == 409
///   // the same 409 with a default Outcome as `previous` (first attempt): unchanged
class DuplicateSuccessRule {
 public:
  /// Throws std::invalid_argument naming the field when statuses is empty or holds a status
  /// outside [400, 599].
  explicit DuplicateSuccessRule(DuplicateSuccessOptions options = {});

  /// Whether a response with `status` and `body` is the receiver's duplicate answer, whatever
  /// came before it.
  [[nodiscard]] bool matches(int status, std::string_view body) const;

  /// The outcome of a response, given the outcome of the operation's previous attempt
  /// (`previous`; a default Outcome, kNotAttempted, before the first). `current` is the
  /// response's classification (source kHttp or kBody, code its status) and `body` its body.
  /// Returns a kSuccess copy of `current` with duplicate set (no server delay, no retry limit)
  /// when `previous` is kAmbiguous and the response matches; `current` unchanged otherwise,
  /// including for an outcome that is not a response (a network failure).
  [[nodiscard]] Outcome apply(const Outcome& previous, const Outcome& current,
                              std::string_view body) const;

 private:
  DuplicateSuccessOptions options_;
};

// ---------------------------------------------------------------------------------------------
// Network

enum class NetError : unsigned char {
  kConnectionRefused,   // ECONNREFUSED
  kConnectionReset,     // ECONNRESET, EPIPE, ECONNABORTED
  kTimedOut,            // ETIMEDOUT, or the attempt's own timeout
  kHostUnreachable,     // EHOSTUNREACH
  kNetworkUnreachable,  // ENETUNREACH
  kDnsTemporary,        // EAI_AGAIN
  kDnsNotFound,         // EAI_NONAME: the name does not exist
  kOther,
  kUnusableUrl,  // the client cannot send to this URL at all (libcurl: malformed, an unsupported
                 // scheme, a host name it cannot read): nothing was sent, and never will be
};

[[nodiscard]] std::string_view to_string(NetError error) noexcept;
/// Maps an errno value; nullopt when it is not a network error keel knows.
[[nodiscard]] std::optional<NetError> net_error_from_errno(int errno_value) noexcept;

/// Before the request was sent every listed error is transient (nothing reached the server, so
/// even a POST is safe), except kDnsNotFound and kUnusableUrl, which are permanent (a retry
/// meets the same refusal; not a failure of the dependency, so no breaker counts them). After
/// the request was sent a reset, a timeout or kOther is ambiguous: the server may have acted on
/// it.
[[nodiscard]] Outcome classify_network(NetError error, bool request_sent) noexcept;

// ---------------------------------------------------------------------------------------------
// Databases

/// What a failed database operation means for the work that hit it: the one decision behind a
/// store's retry (the same connection, a new one, later or never) and behind the status a
/// receiver answers (503 + Retry-After, or 500). Both backends' errors map onto it
/// (classify_database_sqlstate, classify_database_sqlite); docs/classification.md has the table.
enum class DatabaseFailure : unsigned char {
  /// The transaction lost a race and was rolled back (PostgreSQL 40001 serialization_failure,
  /// 40P01 deadlock_detected): run the whole transaction again, after a jittered delay.
  kConflict,
  /// A wait ran out: a lock another transaction holds (PostgreSQL 55P03 lock_not_available,
  /// SQLite SQLITE_BUSY/SQLITE_LOCKED) or the statement's own time (57014 query_canceled, what
  /// statement_timeout raises). Nothing was applied; retry later, not at once.
  kBusy,
  /// The database cannot be reached or cannot take the work now: a connection that could not be
  /// opened or was lost before COMMIT (class 08), no answer within the round trip's bound,
  /// insufficient resources (class 53: too many connections, out of memory, disk full), a
  /// session ended by the server's idle timeouts (25P03, 57P05). Retry on a new connection, later.
  kUnavailable,
  /// The connection reaches a node that cannot serve it: a read-only transaction on a standby or
  /// a demoted primary (25006 read_only_sql_transaction), a server shutting down or starting
  /// (57P01 admin_shutdown, 57P02 crash_shutdown, 57P03 cannot_connect_now). Close the
  /// connection (never return it to a pool), reconnect through the URL's host list, retry with
  /// jitter; the failure is the infrastructure's, so no job attempt or request is charged for it.
  kWrongNode,
  /// The connection was lost, or gave no answer, during COMMIT: the transaction may or may not
  /// have been applied ("commit in doubt"). Never re-run blindly: settle it (read back what was
  /// written) or let an idempotency key make the second run harmless.
  kInDoubt,
  /// The statement or its data is wrong (a constraint, a trigger's abort, a data error, a missing
  /// table, a privilege): no retry can succeed.
  kPermanent,
};

/// "conflict", "busy", "unavailable", "wrong node", "commit in doubt", "permanent".
[[nodiscard]] std::string_view to_string(DatabaseFailure failure) noexcept;

/// A PostgreSQL SQLSTATE (five characters) as a DatabaseFailure. `during_commit`: the error came
/// from COMMIT (a lost connection or a server shutting down there is kInDoubt). A malformed
/// SQLSTATE is kPermanent.
[[nodiscard]] DatabaseFailure classify_database_sqlstate(std::string_view sqlstate,
                                                         bool during_commit) noexcept;

/// A SQLite (extended or primary) result code as a DatabaseFailure: SQLITE_BUSY_SNAPSHOT (517)
/// kConflict; SQLITE_BUSY and SQLITE_LOCKED kBusy (a busy COMMIT left the transaction open and
/// unapplied: not in doubt); any other error during COMMIT with the connection lost kInDoubt;
/// SQLITE_CANTOPEN, SQLITE_FULL, SQLITE_NOMEM and SQLITE_PROTOCOL kUnavailable (the file cannot
/// be opened or written now); everything else (a constraint, a trigger's RAISE(ABORT), an I/O
/// error, a corrupt file) kPermanent.
[[nodiscard]] DatabaseFailure classify_database_sqlite(int extended_code, bool during_commit,
                                                       bool connection_lost) noexcept;

/// The retry engine's view of a DatabaseFailure: kConflict, kBusy, kUnavailable and kWrongNode
/// transient, kInDoubt ambiguous, kPermanent permanent.
[[nodiscard]] OutcomeKind outcome_kind(DatabaseFailure failure) noexcept;

// ---------------------------------------------------------------------------------------------
// PostgreSQL

/// classify_database_sqlstate as an Outcome (kind outcome_kind(...), source kSqlstate, the
/// SQLSTATE copied): 40001/40P01, 55P03, 57014, class 08 and 53, 25006, 25P03, 57P01-57P03 and
/// 57P05 transient; class 08 and 57P01-57P03 during COMMIT ambiguous ("commit in doubt": never
/// retried blindly); everything else, and a malformed SQLSTATE, permanent.
[[nodiscard]] Outcome classify_sqlstate(std::string_view sqlstate, bool during_commit) noexcept;

// ---------------------------------------------------------------------------------------------
// SQLite

/// classify_database_sqlite as an Outcome: SQLITE_BUSY (5) and SQLITE_LOCKED (6), with their
/// extended codes, transient; any other error during COMMIT with the connection lost ambiguous;
/// everything else permanent. The Outcome's source is kUser, as Outcome::transient() and its
/// siblings give.
[[nodiscard]] Outcome classify_sqlite(int extended_code, bool during_commit,
                                      bool connection_lost) noexcept;

}  // namespace keel
