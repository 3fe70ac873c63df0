// The framework-neutral idempotency flow: key validation, claim, transactional handler run,
// completion, replay and the error answers (see keel/idempotency/idempotency_flow.hpp).
#include "keel/idempotency/idempotency_flow.hpp"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "db/detail/commit.hpp"
#include "db/detail/options_refusal.hpp"
#include "db/detail/process.hpp"
#include "idempotency/detail/ascii.hpp"
#include "keel/core/deadline_header.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "keel/core/random.hpp"
#include "keel/core/retry_after.hpp"
#include "keel/idempotency/flow_decision.hpp"

namespace keel::store {
namespace {

using detail::iequals;

/// The stored response as an answer: its headers in order, Content-Type last (and
/// application/octet-stream when it has none).
FlowResponse stored_answer(FlowOutcome outcome, const StoredResponse& stored) {
  FlowResponse out{.outcome = outcome, .status = stored.status, .headers = {}, .body = stored.body};
  std::string content_type = "application/octet-stream";
  for (const auto& [name, value] : stored.headers) {
    if (iequals(name, "Content-Type")) {
      content_type = value;
    } else {
      out.headers.emplace_back(name, value);
    }
  }
  out.headers.emplace_back("Content-Type", std::move(content_type));
  return out;
}

// FlowOptions::random as a generator BitGenRef takes.
struct FunctionBits {
  using result_type = std::uint64_t;
  static constexpr result_type min() noexcept { return 0; }
  static constexpr result_type max() noexcept { return std::numeric_limits<result_type>::max(); }
  result_type operator()() const { return (*random)(); }
  const std::function<std::uint64_t()>* random;
};

FlowResponse problem(FlowOutcome outcome, int status, std::string_view title,
                     std::string_view detail, std::optional<std::string> retry_after = {}) {
  FlowResponse out{.outcome = outcome,
                   .status = status,
                   .headers = {},
                   .body = problem_json(status, title, detail)};
  if (retry_after) out.headers.emplace_back("Retry-After", std::move(*retry_after));
  out.headers.emplace_back("Content-Type", "application/problem+json");
  return out;
}

/// Whether the body must be held to the JSON limits: it says it is JSON, or looks like it (a
/// parser downstream would try it). A gRPC message in protobuf (application/grpc,
/// application/grpc+proto) never is, whatever its bytes: its parser is protobuf's.
bool looks_like_json(std::string_view content_type, std::string_view body) {
  std::string_view type = content_type.substr(0, content_type.find(';'));
  while (!type.empty() && (type.back() == ' ' || type.back() == '\t')) type.remove_suffix(1);
  if (iequals(type, "application/json") ||
      (type.size() > 5 && iequals(type.substr(type.size() - 5), "+json"))) {
    return true;
  }
  if (iequals(type, "application/grpc") || iequals(type, "application/grpc+proto")) return false;
  for (const char c : body) {
    if (c == ' ' || c == '\t' || c == '\r' || c == '\n') continue;
    return c == '{' || c == '[';
  }
  return false;
}

void log_to_stderr(std::string_view message) {
  std::fprintf(stderr, "keel::store: %.*s\n", static_cast<int>(message.size()), message.data());
}

thread_local Deadline current_deadline = Deadline::infinite();

/// While alive, current_request_deadline() on this thread returns `deadline`.
class DeadlineScope {
 public:
  explicit DeadlineScope(Deadline deadline) noexcept : saved_(current_deadline) {
    current_deadline = deadline;
  }
  ~DeadlineScope() { current_deadline = saved_; }
  DeadlineScope(const DeadlineScope&) = delete;
  DeadlineScope& operator=(const DeadlineScope&) = delete;

 private:
  Deadline saved_;
};

}  // namespace

// 400, not 504 or 503: keel's classifier (and Envoy's, and the common SDKs') retries 408, 425,
// 429, 502-504, a 500 once and a 409 with a key, and a retry of work nobody waits for is the
// waste this answer exists to prevent.
FlowResponse deadline_exceeded_response(std::string_view when) {
  return problem(FlowOutcome::kDeadlineExceeded, 400, "Deadline exceeded",
                 "the caller's deadline (Keel-Deadline-Ms) passed " + std::string(when) +
                     "; the request was not processed and nothing was stored");
}

namespace {

/// "METHOD PATH", for the log.
std::string what(const FlowRequest& request) {
  return std::string(request.method) + " " + std::string(request.path);
}

/// The text of the exception being handled (call inside a catch block).
std::string current_exception_text() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception not derived from std::exception";
  }
}

}  // namespace

std::string_view to_string(IdempotencyOutcome outcome) noexcept {
  switch (outcome) {
    case IdempotencyOutcome::kExecuted:
      return "executed";
    case IdempotencyOutcome::kReplayed:
      return "replayed";
    case IdempotencyOutcome::kInProgress:
      return "in_progress";
    case IdempotencyOutcome::kMismatch:
      return "mismatch";
    case IdempotencyOutcome::kInvalidKey:
      return "invalid_key";
    case IdempotencyOutcome::kNotStored:
      return "not_stored";
    case IdempotencyOutcome::kError:
      return "error";
    case IdempotencyOutcome::kInvalidBody:
      return "invalid_body";
    case IdempotencyOutcome::kDeadlineExceeded:
      return "deadline_exceeded";
  }
  return "unknown";
}

std::string_view to_string(FlowOutcome outcome) noexcept {
  switch (outcome) {
    case FlowOutcome::kExecuted:
      return "executed";
    case FlowOutcome::kTookOver:
      return "took_over";
    case FlowOutcome::kReplayed:
      return "replayed";
    case FlowOutcome::kInProgress:
      return "in_progress";
    case FlowOutcome::kClaimLost:
      return "claim_lost";
    case FlowOutcome::kMismatch:
      return "mismatch";
    case FlowOutcome::kMissingKey:
      return "missing_key";
    case FlowOutcome::kInvalidKey:
      return "invalid_key";
    case FlowOutcome::kInvalidBody:
      return "invalid_body";
    case FlowOutcome::kNotStored:
      return "not_stored";
    case FlowOutcome::kHandlerError:
      return "handler_error";
    case FlowOutcome::kDatabaseUnavailable:
      return "database_unavailable";
    case FlowOutcome::kCommitInDoubt:
      return "commit_in_doubt";
    case FlowOutcome::kDeadlineExceeded:
      return "deadline_exceeded";
    case FlowOutcome::kDatabaseError:
      return "database_error";
  }
  return "unknown";
}

IdempotencyOutcome metrics_outcome(FlowOutcome outcome) noexcept {
  switch (outcome) {
    case FlowOutcome::kExecuted:
    case FlowOutcome::kTookOver:
      return IdempotencyOutcome::kExecuted;
    case FlowOutcome::kReplayed:
      return IdempotencyOutcome::kReplayed;
    case FlowOutcome::kInProgress:
    case FlowOutcome::kClaimLost:
      return IdempotencyOutcome::kInProgress;
    case FlowOutcome::kMismatch:
      return IdempotencyOutcome::kMismatch;
    case FlowOutcome::kMissingKey:
    case FlowOutcome::kInvalidKey:
      return IdempotencyOutcome::kInvalidKey;
    case FlowOutcome::kInvalidBody:
      return IdempotencyOutcome::kInvalidBody;
    case FlowOutcome::kNotStored:
      return IdempotencyOutcome::kNotStored;
    case FlowOutcome::kHandlerError:
    case FlowOutcome::kDatabaseUnavailable:
    case FlowOutcome::kCommitInDoubt:
    case FlowOutcome::kDatabaseError:
      return IdempotencyOutcome::kError;
    case FlowOutcome::kDeadlineExceeded:
      return IdempotencyOutcome::kDeadlineExceeded;
  }
  return IdempotencyOutcome::kError;
}

Deadline request_deadline(std::optional<std::string_view> header, TimePoint arrival) {
  if (!header) return Deadline::infinite();
  const Expected<Duration> budget = parse_deadline_header(*header);
  if (!budget) return Deadline::infinite();
  return Deadline::at(saturating_add(arrival, *budget));
}

Deadline current_request_deadline() noexcept { return current_deadline; }

std::optional<std::string_view> FlowResponse::header(std::string_view name) const {
  for (const auto& [n, v] : headers) {
    if (iequals(n, name)) return std::string_view(v);
  }
  return std::nullopt;
}

std::string problem_json(int status, std::string_view title, std::string_view detail) {
  const nlohmann::json problem = {{"type", "about:blank"},
                                  {"title", std::string(title)},
                                  {"status", status},
                                  {"detail", std::string(detail)}};
  return problem.dump();
}

std::string_view problem_title(int status) noexcept {
  switch (status) {
    case 400:
      return "Bad request";
    case 404:
      return "Not found";
    case 405:
      return "Method not allowed";
    case 411:
      return "Length required";
    case 413:
      return "Payload too large";
    case 414:
      return "URI too long";
    case 415:
      return "Unsupported media type";
    case 416:
      return "Range not satisfiable";
    case 431:
      return "Request header fields too large";
    case 500:
      return "Internal error";
    case 503:
      return "Service unavailable";
    default:
      return status < 500 ? "Client error" : "Server error";
  }
}

std::string principal_from_authorization(std::optional<std::string_view> authorization) {
  if (!authorization) return "";
  const std::string_view auth = *authorization;
  constexpr std::string_view kBearer = "Bearer ";
  if (auth.size() > kBearer.size() && iequals(auth.substr(0, kBearer.size()), kBearer)) {
    std::string_view token = auth.substr(kBearer.size());
    while (!token.empty() && token.front() == ' ') token.remove_prefix(1);
    while (!token.empty() && token.back() == ' ') token.remove_suffix(1);
    if (!token.empty() && token.find_first_of(" \t") == std::string_view::npos) {
      return std::string(token);
    }
  }
  return "Authorization: " + std::string(auth);
}

std::string principal_scope(std::string_view principal, std::string_view secret) {
  if (secret.empty()) {
    throw_invalid({.context = "keel::store::principal_scope",
                   .field = "secret",
                   .problem = "must not be empty"});
  }
  if (principal.empty()) return std::string(kAnonymousScope);
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
           reinterpret_cast<const unsigned char*>(principal.data()), principal.size(), mac,
           &len) == nullptr) {
    throw std::runtime_error("HMAC-SHA-256 failed");
  }
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out = "p:";
  for (unsigned int i = 0; i < len; ++i) {
    out += kDigits[mac[i] >> 4];
    out += kDigits[mac[i] & 0xf];
  }
  return out;
}

IdempotentRequestFlow::IdempotentRequestFlow(FlowOptions options) : options_(std::move(options)) {
  constexpr std::string_view kOptions = "keel::store::FlowOptions";
  const detail::OptionsRefusal reject(kOptions);
  if (options_.store == nullptr) reject("store", "must be set", "null");
  if (options_.pool == nullptr) reject("pool", "must be set", "null");
  if (!options_.log) options_.log = log_to_stderr;
  if (options_.scope_secret.empty()) {
    unsigned char bytes[32];
    detail::secure_random_bytes(bytes, sizeof bytes);
    options_.scope_secret.assign(reinterpret_cast<const char*>(bytes), sizeof bytes);
  } else if (options_.scope_secret.size() < 16) {
    reject("scope_secret", "must be at least 16 bytes",
           std::to_string(options_.scope_secret.size()) + " bytes");
  }
  validate(options_.json_limits);
  if (options_.max_key_bytes < 1) {
    reject("max_key_bytes", "must be >= 1", "0");
  }
  if (options_.retry_after_spread < 1 || options_.retry_after_spread > kMaxRetryAfterSpread) {
    reject("retry_after_spread", "must be from 1 to 3600 (seconds)",
           std::to_string(options_.retry_after_spread));
  }
  if (options_.max_wait <= Duration::zero()) {
    reject("max_wait", "must be > 0", format_duration(options_.max_wait));
  }
  if (options_.transaction_policy == nullptr) {
    options_.transaction_policy = &default_transaction_retry_policy();
  }
  if (options_.clock == nullptr) options_.clock = &steady_clock();
}

std::string IdempotentRequestFlow::scope(std::string_view principal) const {
  return principal_scope(principal, options_.scope_secret);
}

std::string IdempotentRequestFlow::spread_retry_after_value(Duration wait) const {
  FunctionBits bits{&options_.random};
  const std::chrono::seconds extra =
      options_.random ? keel::spread_retry_after(options_.retry_after_spread, bits)
                      : keel::spread_retry_after(options_.retry_after_spread, thread_rng());
  // The floor is `wait`, at least the one second a Retry-After can say; the draw goes above it.
  const Duration floor = std::max<Duration>(wait, std::chrono::seconds(1));
  return format_retry_after(saturating_add(floor, extra - std::chrono::seconds(1)));
}

FlowResponse IdempotentRequestFlow::finish(FlowResponse response) const {
  if (options_.on_outcome) options_.on_outcome(metrics_outcome(response.outcome));
  return response;
}

namespace {

/// The caller has gone (the server saw it leave) or its deadline has passed.
bool gone(const FlowRequest& request, const Clock& clock) {
  return (request.abandoned != nullptr && request.abandoned->load(std::memory_order_acquire)) ||
         request.deadline.expired(clock.now());
}

/// The request's own refusals, before any database work: the Idempotency-Key's fields and form,
/// and a JSON body's limits. Sets the key and the request's fingerprint when it refuses nothing.
std::optional<FlowResponse> check_request(const FlowRequest& request, const FlowOptions& options,
                                          std::string& key, std::string& fingerprint) {
  if (request.idempotency_key && request.idempotency_key_fields > 1) {
    return problem(FlowOutcome::kInvalidKey, 400, "Invalid Idempotency-Key",
                   "the request has " + std::to_string(request.idempotency_key_fields) +
                       " Idempotency-Key header fields; send exactly one (servers and "
                       "intermediaries disagree about which of several applies)");
  }
  ParsedKey parsed = parse_idempotency_key(request.idempotency_key, options.max_key_bytes);
  if (!parsed.key) {
    return problem(
        parsed.error == KeyError::kMissing ? FlowOutcome::kMissingKey : FlowOutcome::kInvalidKey,
        400, "Invalid Idempotency-Key", parsed.detail);
  }
  JsonCheck json;
  if (looks_like_json(request.content_type, request.body)) {
    json = check_json(request.body, options.json_limits);
    if (json.status == JsonStatus::kTooDeep || json.status == JsonStatus::kDuplicateKey) {
      return problem(
          FlowOutcome::kInvalidBody, 400,
          json.status == JsonStatus::kTooDeep ? "JSON nested too deeply" : "Duplicate JSON member",
          json.detail);
    }
  } else {
    json.detail = "not JSON";
  }
  key = std::move(*parsed.key);
  fingerprint = request_fingerprint(request.method, request.path, request.body, json);
  return std::nullopt;
}

}  // namespace

/// A request that passed its own checks: the stored scope of its principal, its key and the
/// fingerprint a repeat must match.
struct IdempotentRequestFlow::Keyed {
  std::string scope;
  std::string key;
  std::string fingerprint;
};

/// How the handler's transaction ended: what decide_flow_answer reads, and what the answer is
/// made of.
struct IdempotentRequestFlow::Ended {
  FlowFacts facts;
  Claim claim;
  StoredResponse result;
  std::string error;   // the transaction's last database error
  std::string thrown;  // what the handler threw
};

FlowResponse IdempotentRequestFlow::run(const FlowRequest& request,
                                        const FlowHandler& handler) const {
  if (gone(request, *options_.clock))
    return finish(deadline_exceeded_response("before it arrived"));
  Keyed keyed;
  if (std::optional<FlowResponse> refused =
          check_request(request, options_, keyed.key, keyed.fingerprint)) {
    return finish(std::move(*refused));
  }
  keyed.scope = scope(request.principal);
  return run_keyed(request, keyed, handler);
}

// A database failure's answer, from core's classification (the table in docs/idempotency.md):
// one a later retry may fix is 503 with a spread Retry-After; one no retry can fix is 500 without
// it, so that well-behaved clients stop; a commit in doubt is 500 with Retry-After (a retry with
// the same key receives the outcome).
FlowResponse IdempotentRequestFlow::database_failure(FlowOutcome outcome, std::string error) const {
  FlowResponse out;
  switch (outcome) {
    case FlowOutcome::kCommitInDoubt:
      out = problem(FlowOutcome::kCommitInDoubt, 500, "Commit in doubt",
                    "the outcome of the commit is unknown; retry with the same "
                    "Idempotency-Key to receive it",
                    spread_retry_after_value(Duration::zero()));
      break;
    case FlowOutcome::kDatabaseError:
      out = problem(FlowOutcome::kDatabaseError, 500, "Request failed",
                    "the database refused the request's work (a constraint or a check failed); "
                    "nothing was stored, and retrying the same request will fail the same way");
      break;
    default:
      out = problem(FlowOutcome::kDatabaseUnavailable, 503, "Database unavailable",
                    "the database is unavailable or busy; retry after the delay in Retry-After",
                    spread_retry_after_value(Duration::zero()));
      break;
  }
  out.error = std::move(error);
  options_.log(out.error);
  return finish(std::move(out));
}

FlowResponse IdempotentRequestFlow::run_keyed(const FlowRequest& request, const Keyed& keyed,
                                              const FlowHandler& handler) const {
  const auto expired = [&] { return gone(request, *options_.clock); };
  const auto unavailable = [&](const DatabaseError& e) {
    return database_failure(database_failure_outcome(e.failure()),
                            std::string("claiming an Idempotency-Key failed: ") + e.what());
  };
  const IdempotencyStore& store = *options_.store;
  // Every wait on the database ends by the caller's deadline or the server's own bound,
  // whichever is first: the wait for a connection, each statement's lock wait and run (the
  // connection's deadline), the transaction's retries.
  const Deadline bound = request.deadline.min(Deadline::after(*options_.clock, options_.max_wait));
  std::optional<ConnectionPool::Lease> lease;
  try {
    lease.emplace(options_.pool->acquire(
        Deadline::after(steady_clock(), bound.remaining(options_.clock->now()))));
  } catch (const DatabaseError& e) {
    if (!expired()) return unavailable(e);
  }
  if (expired()) {
    return finish(deadline_exceeded_response("while it waited for a database connection"));
  }
  Connection& conn = **lease;
  // Held: the handler's transaction holds the key (SQLite's write lock; PostgreSQL's advisory
  // lock, taken without waiting, so that a concurrent duplicate is answered 409 at once) and
  // reads its record; the completed record is written once, with the COMMIT. No claim is
  // committed before the handler runs, nothing is left to release after a failure, and on
  // PostgreSQL BEGIN, the lock and the read go in one round trip and the record with the COMMIT
  // in another. At SERIALIZABLE on PostgreSQL the transaction's snapshot would predate the lock,
  // so there the claim commits on its own first (sent with the handler's BEGIN) and the
  // completion goes with the COMMIT. docs/idempotency.md, "Round trips per request".
  // Where BEGIN goes with the first statements (PostgreSQL), this request's first transaction
  // opens before the handler's loop, and the loop's retries open their own.
  const bool pipelined_begin = conn.dialect().row_level_locks();
  Ended ended;
  FlowFacts& facts = ended.facts;
  Claim& claim = ended.claim;
  facts.held = !pipelined_begin || options_.isolation == Isolation::kReadCommitted;
  if (pipelined_begin) {
    try {
      claim = facts.held
                  ? store.hold(conn, keyed.scope, keyed.key, keyed.fingerprint, options_.isolation)
                  : store.claim_then_begin(conn, keyed.scope, keyed.key, keyed.fingerprint,
                                           options_.isolation);
    } catch (const DatabaseError& e) {
      return unavailable(e);
    }
    if (claim.status != ClaimStatus::kClaimed) {
      conn.rollback();
      return finish(claimed_elsewhere(claim));
    }
    if (expired()) {
      conn.rollback();
      release_claim(conn, facts.held, keyed, claim);
      return finish(deadline_exceeded_response("while it claimed its Idempotency-Key"));
    }
  }
  return transact(request, keyed, conn, ended, bound, handler);
}

FlowResponse IdempotentRequestFlow::transact(const FlowRequest& request, const Keyed& keyed,
                                             Connection& conn, Ended& ended, Deadline bound,
                                             const FlowHandler& handler) const {
  const auto expired = [&] { return gone(request, *options_.clock); };
  const IdempotencyStore& store = *options_.store;
  const bool pipelined_begin = conn.dialect().row_level_locks();
  FlowFacts& facts = ended.facts;
  Claim& claim = ended.claim;
  bool first_attempt = true;
  const auto body = [&](Connection& t) {
    facts.lost_claim = false;
    facts.declined = false;
    if (facts.held && !(pipelined_begin && first_attempt)) {
      claim = store.hold(t, keyed.scope, keyed.key, keyed.fingerprint);
      if (claim.status != ClaimStatus::kClaimed) return false;
      if (expired()) {
        facts.expired_after_claim = true;
        return false;
      }
    }
    first_attempt = false;
    ended.result = handler(t);
    facts.declined = ended.result.status >= 400;
    return !facts.declined;
  };
  detail::TransactionEnds ends;
  ends.begun = pipelined_begin;
  ends.commit = [&](Connection& t) {
    // The last check before the effect commits: a caller who stopped waiting (or a server that
    // stopped answering) gets nothing committed behind its back.
    if (expired()) {
      facts.expired_before_commit = true;
      return false;
    }
    facts.lost_claim =
        facts.held
            ? !store.complete_held_then_commit(t, keyed.scope, keyed.key, keyed.fingerprint, claim,
                                               ended.result)
            : !store.complete_then_commit(t, keyed.scope, keyed.key, claim.token, ended.result);
    return !facts.lost_claim;
  };
  TransactionResult tx;
  try {
    const DeadlineScope deadline_scope(request.deadline);
    tx = detail::with_transaction_retry(
        conn, body, ends, *options_.transaction_policy, options_.isolation,
        // The bound holds the transaction's statements and retries too: nobody waits past it.
        {.clock = options_.clock, .ceiling = bound});
  } catch (...) {
    facts.handler_threw = true;
    ended.thrown = current_exception_text();
  }
  facts.transaction = tx.status;
  facts.claim = claim.status;
  facts.took_over = claim.took_over;
  facts.failure = tx.status == TransactionStatus::kCommitInDoubt
                      ? DatabaseFailure::kInDoubt
                      : tx.failure.value_or(DatabaseFailure::kUnavailable);
  facts.expired_now = expired();
  ended.error = std::move(tx.error);
  const FlowDecision decision = decide_flow_answer(facts);
  if (decision.release_claim) {
    // After a lost connection the release goes on a new one.
    if (conn.broken()) {
      try {
        auto fresh = options_.pool->acquire();
        release_claim(*fresh, facts.held, keyed, claim);
      } catch (const DatabaseError&) {
        // The lock expires on its own; a retry then takes over.
      }
    } else {
      release_claim(conn, facts.held, keyed, claim);
    }
  }
  return answer(request, keyed, ended, decision, bound);
}

void IdempotentRequestFlow::release_claim(Connection& connection, bool held, const Keyed& keyed,
                                          const Claim& claim) const {
  if (held) return;  // nothing was written
  try {
    options_.store->release(connection, keyed.scope, keyed.key, claim.token);
  } catch (const DatabaseError&) {
    // The lock expires on its own; a retry then takes over.
  }
}

FlowResponse IdempotentRequestFlow::answer(const FlowRequest& request, const Keyed& keyed,
                                           const Ended& ended, const FlowDecision& decision,
                                           Deadline bound) const {
  switch (decision.outcome) {
    case FlowOutcome::kExecuted:
    case FlowOutcome::kTookOver:
    case FlowOutcome::kNotStored:
      return finish(stored_answer(decision.outcome, ended.result));
    case FlowOutcome::kReplayed:
    case FlowOutcome::kMismatch:
    case FlowOutcome::kInProgress:
      return finish(claimed_elsewhere(ended.claim));
    case FlowOutcome::kClaimLost:
      return finish(problem(FlowOutcome::kClaimLost, 409, "Request in progress",
                            "another request claimed this Idempotency-Key while this one ran "
                            "(its claim had expired, or it claimed without holding the key); "
                            "nothing was stored; retry to receive the outcome",
                            spread_retry_after_value(Duration::zero())));
    case FlowOutcome::kDeadlineExceeded:
      if (ended.facts.transaction == TransactionStatus::kFailed) {
        options_.log("the transaction of " + what(request) + " failed: " + ended.error);
      }
      return finish(deadline_exceeded_response(decision.when));
    case FlowOutcome::kHandlerError: {
      FlowResponse out = problem(FlowOutcome::kHandlerError, 500, "Handler failed",
                                 "the request failed on the server; nothing was stored");
      out.error = "the handler of " + what(request) + " threw: " + ended.thrown;
      options_.log(out.error);
      return finish(std::move(out));
    }
    default:
      break;
  }
  if (decision.settle_first) {
    // The COMMIT's answer was lost (a failover, a connection cut): the key's record, read on a
    // new connection, says whether it applied.
    if (std::optional<FlowResponse> settled = settle_in_doubt(
            request, keyed.scope, keyed.key, keyed.fingerprint, bound, ended.error)) {
      return finish(std::move(*settled));
    }
  }
  return database_failure(decision.outcome,
                          "the transaction of " + what(request) + " failed: " + ended.error);
}

std::optional<FlowResponse> IdempotentRequestFlow::settle_in_doubt(
    const FlowRequest& request, const std::string& scope, const std::string& key,
    const std::string& fingerprint, Deadline bound, const std::string& error) const {
  const IdempotencyStore& store = *options_.store;
  // Tries until the request's bound, waiting core's full jitter between them: the database may
  // take a moment to be back (a promotion).
  static const RetryPolicy kSettle(
      {.max_attempts = 10,
       .backoff = {.base = std::chrono::milliseconds(50), .cap = std::chrono::seconds(1)}});
  RetryState state(kSettle, {.clock = options_.clock, .ceiling = bound, .safe_to_repeat = true});
  for (AttemptStart start = state.start_attempt(); start.proceed; start = state.start_attempt()) {
    Outcome outcome = Outcome::transient();
    try {
      auto lease = options_.pool->acquire(Deadline::after(steady_clock(), start.attempt.timeout));
      Connection& c = *lease;
      const bool pipelined = c.dialect().row_level_locks();
      if (!pipelined) c.begin();
      const Claim found = pipelined
                              ? store.hold(c, scope, key, fingerprint, Isolation::kReadCommitted)
                              : store.hold(c, scope, key, fingerprint);
      c.rollback();  // only read: a key not stored stays free for the client's retry
      switch (found.status) {
        case ClaimStatus::kReplay: {
          options_.log("the commit of " + what(request) + " was in doubt (" + error +
                       "); it applied");
          return stored_answer(FlowOutcome::kExecuted, found.response);
        }
        case ClaimStatus::kClaimed: {
          FlowResponse out =
              problem(FlowOutcome::kDatabaseUnavailable, 503, "Database unavailable",
                      "the database failed as the request committed, and nothing was stored; retry "
                      "with the same Idempotency-Key after the delay in Retry-After",
                      spread_retry_after_value(Duration::zero()));
          out.error =
              "the commit of " + what(request) + " was in doubt (" + error + "); it did not apply";
          options_.log(out.error);
          return out;
        }
        case ClaimStatus::kInProgress:
        case ClaimStatus::kMismatch:
          return claimed_elsewhere(found);  // the client retried meanwhile, or another request
      }
    } catch (const DatabaseError& e) {
      outcome = e.outcome();
    }
    const Decision decision = state.next(outcome);
    if (!decision.retry) break;
    // wait: core: the transaction retry's decision
    state.clock().sleep_for(decision.delay);
  }
  return std::nullopt;  // unknown by the bound: answered as in doubt
}

FlowResponse IdempotentRequestFlow::claimed_elsewhere(const Claim& claim) const {
  switch (claim.status) {
    case ClaimStatus::kReplay: {
      FlowResponse out = stored_answer(FlowOutcome::kReplayed, claim.response);
      out.headers.insert(out.headers.end() - 1, {"Idempotent-Replayed", "true"});
      return out;
    }
    case ClaimStatus::kMismatch:
      return problem(FlowOutcome::kMismatch, 422, "Idempotency-Key reused",
                     "this Idempotency-Key was used with a different request (method, path "
                     "or body); use a new key for a new request");
    case ClaimStatus::kInProgress:
    case ClaimStatus::kClaimed:
      break;
  }
  return problem(FlowOutcome::kInProgress, 409, "Request in progress",
                 "a request with this Idempotency-Key is still being processed; retry "
                 "after the delay in Retry-After",
                 spread_retry_after_value(claim.retry_after));
}

}  // namespace keel::store
