// The idempotency-key flow of a receiving HTTP server, independent of any server framework:
// IdempotentRequestFlow takes one request as plain values (method, path, the Idempotency-Key
// header, Content-Type, body, the authenticated principal) and a handler that writes through an
// open transaction, and returns what to answer: status, headers, body and the outcome. It
// validates the key and the JSON limits, claims the key (keel/idempotency/idempotency.hpp),
// runs the handler in a retried transaction, stores the response in that same transaction, releases
// the claim when nothing was stored, and answers repeats with the replay (Idempotent-Replayed:
// true), 409 + Retry-After or 422. Errors are application/problem+json (RFC 9457). The cpp-httplib
// middleware (keel/serve/httplib/idempotency_middleware.hpp) is a thin adapter over it; another
// framework needs only to copy its request into a FlowRequest and the FlowResponse into its answer.
//
// No exception or database text reaches a response: it goes to FlowOptions.log and to
// FlowResponse.error, for the server's own log.
//
// Thread-safety: run() is safe to call from many threads at once; each call takes its own
// connection from the pool. The options' store, pool, policy and hooks must outlive the flow and
// be safe for concurrent use.
//
// Example (any framework; `req` and `res` are its request and response, req.header() an
// std::optional<std::string_view> into the request):
//   keel::store::IdempotentRequestFlow flow({.store = &store, .pool = &pool});
//   const keel::store::FlowResponse out = flow.run(
//       {.method = req.method(),
//        .path = req.path(),
//        .idempotency_key = req.header("Idempotency-Key"),
//        .content_type = req.header("Content-Type").value_or(""),
//        .body = req.body(),
//        .principal = verified_user_id},
//       [&](keel::store::Connection& tx) {
//         tx.query("INSERT INTO charges ...", {...});
//         return keel::store::StoredResponse{201, {{"Content-Type", "application/json"}}, body};
//       });
//   res.status(out.status);
//   for (const auto& [name, value] : out.headers) res.add_header(name, value);
//   res.body(out.body);
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "keel/core/retry.hpp"
#include "keel/db/database.hpp"
#include "keel/db/transaction.hpp"
#include "keel/idempotency/idempotency.hpp"
#include "keel/json/json_check.hpp"

namespace keel::store {

/// What happened to one request, for metrics (a counter per value).
/// FlowOutcome says the same more finely.
enum class IdempotencyOutcome : unsigned char {
  kExecuted,     // the handler ran and its response was stored
  kReplayed,     // a stored response was replayed
  kInProgress,   // 409: another request holds the key
  kMismatch,     // 422: the key was used with another request
  kInvalidKey,   // 400: missing or malformed key
  kNotStored,    // the handler answered an error (4xx/5xx): nothing stored, claim released
  kError,        // database trouble or a handler exception: 500/503, claim released
  kInvalidBody,  // 400: a JSON body over the JSON limits or with a duplicate member
  // 400: the caller's deadline (Keel-Deadline-Ms) passed before the work began
  kDeadlineExceeded,
};

/// How many IdempotencyOutcome values there are (for arrays of counters).
inline constexpr int kIdempotencyOutcomes = 9;

/// "executed", "replayed", "in_progress", "mismatch", "invalid_key", "not_stored", "error",
/// "invalid_body", "deadline_exceeded".
[[nodiscard]] std::string_view to_string(IdempotencyOutcome outcome) noexcept;

/// Which answer the flow gave, and why.
enum class FlowOutcome : unsigned char {
  kExecuted,             // the handler ran, its response was stored and committed
  kTookOver,             // the same, on a key whose previous claim's lock had expired
  kReplayed,             // the stored response, with Idempotent-Replayed: true
  kInProgress,           // 409 + Retry-After: another request holds the key (the lock's expiry
                         // plus 0..N-1 s, FlowOptions::retry_after_spread)
  kClaimLost,            // 409 + Retry-After 1..N s: this request's claim expired and was taken
                         // over while the handler ran; its writes were rolled back
  kMismatch,             // 422: the key was used with a different method, path or body
  kMissingKey,           // 400: no Idempotency-Key header
  kInvalidKey,           // 400: an empty, too long or malformed key, or two Idempotency-Key
                         // header fields
  kInvalidBody,          // 400: a JSON body over the JSON limits or with a duplicate member
  kNotStored,            // the handler's own 4xx/5xx: answered, not stored, claim released
  kHandlerError,         // 500: the handler threw; claim released
  kDatabaseUnavailable,  // 503 + Retry-After 1..N s: claiming or the transaction failed in a way
                         // a later retry may fix (DatabaseFailure kConflict, kBusy,
                         // kUnavailable, kWrongNode); claim released
  kCommitInDoubt,        // 500 + Retry-After 1..N s: the COMMIT's outcome is unknown
  kDeadlineExceeded,     // 400: FlowRequest::deadline had passed on arrival, or passed while the
                         // request waited for a connection or its claim; the handler did not
                         // run, nothing was stored, the claim (if taken) was released
  kDatabaseError,        // 500, no Retry-After: a database error no retry can fix (a constraint,
                         // a trigger's abort, a data error; DatabaseFailure::kPermanent) in the
                         // handler's transaction or keel's own statements; claim released
};

/// "executed", "took_over", "replayed", "in_progress", "claim_lost", "mismatch", "missing_key",
/// "invalid_key", "invalid_body", "not_stored", "handler_error", "database_unavailable",
/// "commit_in_doubt", "deadline_exceeded", "database_error".
[[nodiscard]] std::string_view to_string(FlowOutcome outcome) noexcept;

/// The metrics outcome of `outcome` (kTookOver is kExecuted, kClaimLost kInProgress, kMissingKey
/// kInvalidKey, the four failures kError, kDeadlineExceeded kDeadlineExceeded).
[[nodiscard]] IdempotencyOutcome metrics_outcome(FlowOutcome outcome) noexcept;

/// One incoming request, as the flow reads it. The views must stay valid during run().
struct FlowRequest {
  /// "POST", "PATCH"...; part of the fingerprint.
  std::string_view method;
  /// The path as it identifies the operation (with the query string only if that is part of
  /// it); part of the fingerprint and of log lines.
  std::string_view path;
  /// The Idempotency-Key header's value; nullopt when the header is absent.
  std::optional<std::string_view> idempotency_key;
  /// How many Idempotency-Key header fields the request carried (an adapter counts them; its
  /// framework usually hands over only the first). More than one is refused with 400
  /// kInvalidKey: an intermediary that reads the last field, or joins them, disagrees with one
  /// that reads the first about which key applies. Default 1.
  std::size_t idempotency_key_fields = 1;
  /// The Content-Type header's value, "" when absent (decides, with the body's first byte,
  /// whether the JSON limits apply; application/grpc and application/grpc+proto: never).
  std::string_view content_type;
  /// The request body.
  std::string_view body;
  /// Who the request authenticates as, verified by the server ("" for nobody); never stored:
  /// keys are scoped by principal_scope(principal, scope_secret).
  std::string_view principal;
  /// The caller's deadline, on FlowOptions::clock: the request's arrival plus its
  /// Keel-Deadline-Ms (request_deadline()). A request whose deadline has passed when the flow
  /// starts, once it has a connection, or once it holds the claim is answered kDeadlineExceeded
  /// without running the handler. While the handler runs, current_request_deadline() returns it.
  /// Default infinite: no header, or an invalid one (ignored), and the request runs as always.
  Deadline deadline = Deadline::infinite();
  /// Set (by the server adapter, from any thread) once nobody will read the answer: the client
  /// closed its connection, or the server's drain ran out of time. The flow then stops at its
  /// next step as it does for a passed deadline, and in particular never commits the handler's
  /// writes after it is set: the answer is kDeadlineExceeded and nothing is stored. Must outlive
  /// run(). Default none.
  const std::atomic<bool>* abandoned = nullptr;
};

/// The deadline of a request that arrived at `arrival` carrying Keel-Deadline-Ms `header`
/// (nullopt: absent): arrival + the budget (keel::parse_deadline_header). Infinite when the
/// header is absent or invalid: an invalid header is ignored, never a reason to fail the
/// request.
[[nodiscard]] Deadline request_deadline(std::optional<std::string_view> header, TimePoint arrival);

/// The deadline of the request whose handler is running on this thread inside
/// IdempotentRequestFlow::run (FlowRequest::deadline); infinite outside a handler. Give it to
/// the handler's own keel calls as their upper bound (keel::http::Request::ceiling,
/// keel::CallOptions::ceiling) so that their retries stop when the caller stops waiting.
[[nodiscard]] Deadline current_request_deadline() noexcept;

/// What to answer. Headers include Content-Type (application/octet-stream for a stored response
/// without one) and, in order, the stored response's own headers, Idempotent-Replayed or
/// Retry-After.
struct FlowResponse {
  FlowOutcome outcome = FlowOutcome::kExecuted;
  int status = 200;
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  /// For the server's log, never for the client: the handler's exception text or the database
  /// error of kHandlerError, kDatabaseUnavailable and kCommitInDoubt; "" otherwise.
  std::string error;

  /// The value of header `name` (case-insensitive), nullopt when absent.
  [[nodiscard]] std::optional<std::string_view> header(std::string_view name) const;
};

/// The handler: writes through `tx` (a transaction is open) and returns the response. A 2xx/3xx
/// response is stored and committed with the writes; anything else rolls the writes back and is
/// answered without being stored. It may run more than once (the transaction is retried on
/// serialization failures), so it must do nothing outside `tx`. An exception rolls back and is
/// answered 500 with a generic body.
using FlowHandler = std::function<StoredResponse(Connection& tx)>;

struct FlowOptions {
  /// The record store. Required (non-null).
  const IdempotencyStore* store = nullptr;
  /// Where connections come from. Required (non-null).
  ConnectionPool* pool = nullptr;
  /// Key of the HMAC-SHA-256 that turns a principal into its stored scope. Requires: empty or at
  /// least 16 bytes. Default (empty): 32 random bytes drawn when the flow is built, so the
  /// scopes, and so the replays, last only as long as the process; set the same secret on every
  /// process that shares the database and across restarts.
  std::string scope_secret;
  /// Retries of the handler's transaction. Default default_transaction_retry_policy().
  const RetryPolicy* transaction_policy = nullptr;
  /// Isolation of the handler's transaction. Default read committed.
  Isolation isolation = Isolation::kReadCommitted;
  /// Where FlowRequest::deadline is read against (now). Requires: the clock the deadline was
  /// made on. Default keel::steady_clock().
  Clock* clock = nullptr;
  /// How long a request may wait for the database (a free connection, a lock another
  /// transaction holds, its transaction's retries) when it carries no deadline of its own, or a
  /// later one: then it is answered 503 + Retry-After (kDatabaseUnavailable), its handler's
  /// writes rolled back. A request's Keel-Deadline-Ms bounds the same waits when it is earlier,
  /// and is answered 400 kDeadlineExceeded. Requires: > 0. Default 5 s (the store's lock
  /// timeout, ConnectOptions::busy_timeout).
  Duration max_wait = std::chrono::seconds(5);
  /// Called once per request with its outcome, before run() returns. Default none.
  std::function<void(IdempotencyOutcome)> on_outcome;
  /// Limits on JSON bodies: a body whose first non-blank byte is '{' or '[', or whose
  /// Content-Type is application/json or +json, must pass check_json()
  /// (keel/json/json_check.hpp) or is answered 400 problem+json naming the limit or the
  /// duplicated member, before anything is parsed, claimed or stored. A body not valid JSON is left
  /// to the handler. Default depth 64.
  JsonLimits json_limits;
  /// Longest Idempotency-Key, in bytes: lowers keel's limit of 255 (keel/core/idempotency_key.hpp),
  /// never raises it. Requires: >= 1. Default kMaxKeyLength (255).
  std::size_t max_key_bytes = kMaxKeyLength;
  /// N of the Retry-After sent when every waiting client meets the same failure (503 database
  /// unavailable, 500 commit in doubt, 409 claim lost): whole seconds uniform over 1..N
  /// (keel::spread_retry_after), so that those clients do not all come back in the same
  /// second; a 409 in progress answers the lock's expiry plus 0..N-1 s. Requires: 1 to 3600.
  /// Default 3.
  int retry_after_spread = 3;
  /// The random bits of that spread; called from every thread that runs the flow. Default
  /// (empty): the calling thread's keel::thread_rng(). Tests give a seeded generator.
  std::function<std::uint64_t()> random;
  /// Where the text of handler exceptions and database errors goes (also in
  /// FlowResponse.error): clients receive a generic detail only. Default: one line on stderr.
  std::function<void(std::string_view message)> log;
};

/// The scope stored for `principal`: kAnonymousScope for "", otherwise "p:" and the lower-case hex
/// HMAC-SHA-256 of the principal under `secret` (so stored scopes reveal no credential, and no
/// principal, "anonymous" included, maps to the unauthenticated scope). Requires: secret not
/// empty. Throws std::invalid_argument otherwise.
[[nodiscard]] std::string principal_scope(std::string_view principal, std::string_view secret);

/// The scope of unauthenticated requests: not of the "p:<64 hex>" form of any hashed principal.
inline constexpr std::string_view kAnonymousScope = "anonymous";

/// The credential as sent, from the Authorization header's value (nullopt: no header):
/// "Bearer <token>" gives <token> (a token without whitespace); any other value (Basic, an empty
/// or malformed Bearer) gives "Authorization: <value>", which contains a space and so equals no
/// token; no header gives "" (unauthenticated). No credential is verified here.
[[nodiscard]] std::string principal_from_authorization(
    std::optional<std::string_view> authorization);

/// The flow's answer to a request whose caller's deadline has passed: 400 problem+json "Deadline
/// exceeded", outcome kDeadlineExceeded, `when` saying when it passed ("before it arrived"). For a
/// server that checks the deadline before the flow runs (ahead of its rate limiter), so that both
/// refusals are the same answer.
[[nodiscard]] FlowResponse deadline_exceeded_response(std::string_view when);

/// The body of an RFC 9457 problem: {"type":"about:blank", "title", "status", "detail"}, to be
/// sent as application/problem+json.
[[nodiscard]] std::string problem_json(int status, std::string_view title, std::string_view detail);

/// The title of a problem a server adapter answers by itself (a refused frame, a missing route):
/// "Payload too large" for 413 and so on; "Client error" or "Server error" for a status it does
/// not name.
[[nodiscard]] std::string_view problem_title(int status) noexcept;

struct FlowDecision;  // keel/idempotency/flow_decision.hpp

class IdempotentRequestFlow {
 public:
  /// Throws std::invalid_argument naming the field when store or pool is null, or a limit breaks
  /// its Requires line.
  explicit IdempotentRequestFlow(FlowOptions options);

  /// Runs the flow for one request (see the file comment); never throws for a database or
  /// handler failure (those are answers), only std::bad_alloc and the like.
  [[nodiscard]] FlowResponse run(const FlowRequest& request, const FlowHandler& handler) const;

  /// The stored scope of `principal` under this flow's secret (for the application's own
  /// per-principal rows, so that they hold no credential either).
  [[nodiscard]] std::string scope(std::string_view principal) const;

  [[nodiscard]] const FlowOptions& options() const noexcept { return options_; }

 private:
  struct Keyed;
  struct Ended;
  [[nodiscard]] FlowResponse run_keyed(const FlowRequest& request, const Keyed& keyed,
                                       const FlowHandler& handler) const;
  /// Runs the handler's transaction on `conn` (the key claimed already where BEGIN is
  /// pipelined), then decides and answers.
  [[nodiscard]] FlowResponse transact(const FlowRequest& request, const Keyed& keyed,
                                      Connection& conn, Ended& ended, Deadline bound,
                                      const FlowHandler& handler) const;
  /// Acts on decide_flow_answer (keel/idempotency/flow_decision.hpp).
  [[nodiscard]] FlowResponse answer(const FlowRequest& request, const Keyed& keyed,
                                    const Ended& ended, const FlowDecision& decision,
                                    Deadline bound) const;
  /// Frees a claim that committed on its own (not `held`), so that a retry runs afresh.
  void release_claim(Connection& connection, bool held, const Keyed& keyed,
                     const Claim& claim) const;
  /// The answer to a database failure (kCommitInDoubt, kDatabaseError or
  /// kDatabaseUnavailable), `error` logged.
  [[nodiscard]] FlowResponse database_failure(FlowOutcome outcome, std::string error) const;
  [[nodiscard]] FlowResponse finish(FlowResponse response) const;
  // A Retry-After of max(wait, 1 s) plus a draw from 0..retry_after_spread-1 seconds.
  [[nodiscard]] std::string spread_retry_after_value(Duration wait) const;
  /// The answer to a claim that did not win: the replay, 422 or 409.
  [[nodiscard]] FlowResponse claimed_elsewhere(const Claim& claim) const;
  /// After a COMMIT whose answer was lost: the key's record read on a new connection until
  /// `bound` says whether it applied (this request's stored answer) or not (503 + Retry-After,
  /// nothing stored); nullopt when the database did not say by then.
  [[nodiscard]] std::optional<FlowResponse> settle_in_doubt(
      const FlowRequest& request, const std::string& scope, const std::string& key,
      const std::string& fingerprint, Deadline bound, const std::string& error) const;

  FlowOptions options_;
};

}  // namespace keel::store
