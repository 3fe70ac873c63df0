// The idempotency middleware for cpp-httplib: key validation, claim, transactional handler run,
// completion, replay and the error answers (see keel/store/idempotency_middleware.hpp).
#include "keel/store/idempotency_middleware.hpp"

#include <nlohmann/json.hpp>
#include <stdexcept>

namespace keel::store {
namespace {

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c; };
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

void apply(const StoredResponse& stored, httplib::Response& response) {
  response.status = stored.status;
  std::string content_type = "application/octet-stream";
  for (const auto& [name, value] : stored.headers) {
    if (iequals(name, "Content-Type")) {
      content_type = value;
    } else {
      response.set_header(name, value);
    }
  }
  response.set_content(stored.body, content_type);
}

std::string seconds_header(Duration d) {
  return std::to_string(
      std::max<std::int64_t>(1, std::chrono::ceil<std::chrono::seconds>(d).count()));
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
  }
  return "unknown";
}

void write_problem(httplib::Response& response, int status, std::string_view title,
                   std::string_view detail) {
  const nlohmann::json problem = {{"type", "about:blank"},
                                  {"title", std::string(title)},
                                  {"status", status},
                                  {"detail", std::string(detail)}};
  response.status = status;
  response.set_content(problem.dump(), "application/problem+json");
}

std::string bearer_principal(const httplib::Request& request) {
  const std::string auth = request.get_header_value("Authorization");
  constexpr std::string_view kBearer = "Bearer ";
  if (auth.size() > kBearer.size() &&
      iequals(std::string_view(auth).substr(0, kBearer.size()), kBearer)) {
    std::string token = auth.substr(kBearer.size());
    while (!token.empty() && token.front() == ' ') token.erase(0, 1);
    while (!token.empty() && token.back() == ' ') token.pop_back();
    if (!token.empty()) return token;
  }
  return "anonymous";
}

IdempotencyMiddleware::IdempotencyMiddleware(MiddlewareOptions options)
    : options_(std::move(options)) {
  if (options_.store == nullptr) throw std::invalid_argument("MiddlewareOptions.store is null");
  if (options_.pool == nullptr) throw std::invalid_argument("MiddlewareOptions.pool is null");
  if (!options_.principal) options_.principal = bearer_principal;
  if (options_.transaction_policy == nullptr) {
    options_.transaction_policy = &default_transaction_retry_policy();
  }
}

httplib::Server::Handler IdempotencyMiddleware::wrap(TransactionalHandler handler) const {
  return [this, handler = std::move(handler)](const httplib::Request& request,
                                              httplib::Response& response) {
    handle(handler, request, response);
  };
}

void IdempotencyMiddleware::handle(const TransactionalHandler& handler,
                                   const httplib::Request& request,
                                   httplib::Response& response) const {
  std::optional<std::string_view> header;
  const std::string raw = request.get_header_value("Idempotency-Key");
  if (request.has_header("Idempotency-Key")) header = raw;
  const ParsedKey key = parse_idempotency_key(header);
  if (!key.key) {
    write_problem(response, 400, "Invalid Idempotency-Key", key.detail);
    report(IdempotencyOutcome::kInvalidKey);
    return;
  }
  const std::string scope = options_.principal(request);
  const std::string fingerprint = request_fingerprint(request.method, request.path, request.body);
  const IdempotencyStore& store = *options_.store;

  std::optional<ConnectionPool::Lease> lease;
  Claim claim;
  try {
    lease.emplace(options_.pool->acquire());
    claim = store.claim(**lease, scope, *key.key, fingerprint);
  } catch (const DatabaseError& e) {
    response.set_header("Retry-After", "1");
    write_problem(response, 503, "Database unavailable", e.what());
    report(IdempotencyOutcome::kError);
    return;
  }
  switch (claim.status) {
    case ClaimStatus::kReplay:
      apply(claim.response, response);
      response.set_header("Idempotent-Replayed", "true");
      report(IdempotencyOutcome::kReplayed);
      return;
    case ClaimStatus::kMismatch:
      write_problem(response, 422, "Idempotency-Key reused",
                    "this Idempotency-Key was used with a different request (method, path or "
                    "body); use a new key for a new request");
      report(IdempotencyOutcome::kMismatch);
      return;
    case ClaimStatus::kInProgress:
      response.set_header("Retry-After", seconds_header(claim.retry_after));
      write_problem(response, 409, "Request in progress",
                    "a request with this Idempotency-Key is still being processed; retry after "
                    "the delay in Retry-After");
      report(IdempotencyOutcome::kInProgress);
      return;
    case ClaimStatus::kClaimed:
      break;
  }

  Connection& conn = **lease;
  StoredResponse result;
  bool lost_claim = false;
  bool declined = false;
  TransactionResult tx;
  try {
    tx = with_transaction_retry(
        conn,
        [&](Connection& t) {
          lost_claim = false;
          declined = false;
          result = handler(request, t);
          if (result.status >= 400) {
            declined = true;
            return false;
          }
          if (!store.complete(t, scope, *key.key, claim.token, result)) {
            lost_claim = true;
            return false;
          }
          return true;
        },
        *options_.transaction_policy, options_.isolation);
  } catch (const std::exception& e) {
    try {
      store.release(conn, scope, *key.key, claim.token);
    } catch (const DatabaseError&) {
      // The lock expires on its own.
    }
    write_problem(response, 500, "Handler failed", e.what());
    report(IdempotencyOutcome::kError);
    return;
  }

  if (tx.committed()) {
    apply(result, response);
    report(IdempotencyOutcome::kExecuted);
    if (options_.after_commit) options_.after_commit(request, response);
    return;
  }
  if (tx.status == TransactionStatus::kRolledBack && lost_claim) {
    response.set_header("Retry-After", "1");
    write_problem(response, 409, "Request in progress",
                  "this request's claim on the Idempotency-Key expired and was taken over; "
                  "retry to receive the outcome");
    report(IdempotencyOutcome::kInProgress);
    return;
  }
  // Not stored: release the claim so that a retry runs afresh. After a commit in doubt the
  // release is harmless: it only deletes a record still in progress.
  try {
    if (conn.broken()) {
      auto fresh = options_.pool->acquire();
      store.release(*fresh, scope, *key.key, claim.token);
    } else {
      store.release(conn, scope, *key.key, claim.token);
    }
  } catch (const DatabaseError&) {
    // The lock expires on its own; a retry then takes over.
  }
  if (tx.status == TransactionStatus::kRolledBack && declined) {
    apply(result, response);
    report(IdempotencyOutcome::kNotStored);
    return;
  }
  response.set_header("Retry-After", "1");
  write_problem(
      response, tx.status == TransactionStatus::kCommitInDoubt ? 500 : 503,
      tx.status == TransactionStatus::kCommitInDoubt ? "Commit in doubt" : "Database unavailable",
      tx.error);
  report(IdempotencyOutcome::kError);
}

}  // namespace keel::store
