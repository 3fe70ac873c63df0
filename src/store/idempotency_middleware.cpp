// The idempotency middleware for cpp-httplib: key validation, claim, transactional handler run,
// completion, replay and the error answers (see keel/store/idempotency_middleware.hpp).
#include "keel/store/idempotency_middleware.hpp"

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstdio>
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

/// Whether the middleware must hold the body to the JSON limits: it says it is JSON, or looks
/// like it (a parser downstream would try it).
bool looks_like_json(const httplib::Request& request) {
  std::string type = request.get_header_value("Content-Type");
  type = type.substr(0, type.find(';'));
  while (!type.empty() && (type.back() == ' ' || type.back() == '\t')) type.pop_back();
  if (iequals(type, "application/json") ||
      (type.size() > 5 && iequals(std::string_view(type).substr(type.size() - 5), "+json"))) {
    return true;
  }
  for (const char c : request.body) {
    if (c == ' ' || c == '\t' || c == '\r' || c == '\n') continue;
    return c == '{' || c == '[';
  }
  return false;
}

void log_to_stderr(std::string_view message) {
  std::fprintf(stderr, "keel::store: %.*s\n", static_cast<int>(message.size()), message.data());
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
  if (!request.has_header("Authorization")) return "";
  const std::string auth = request.get_header_value("Authorization");
  constexpr std::string_view kBearer = "Bearer ";
  if (auth.size() > kBearer.size() &&
      iequals(std::string_view(auth).substr(0, kBearer.size()), kBearer)) {
    std::string token = auth.substr(kBearer.size());
    while (!token.empty() && token.front() == ' ') token.erase(0, 1);
    while (!token.empty() && token.back() == ' ') token.pop_back();
    if (!token.empty() && token.find_first_of(" \t") == std::string::npos) return token;
  }
  return "Authorization: " + auth;
}

std::string principal_scope(std::string_view principal, std::string_view secret) {
  if (secret.empty()) throw std::invalid_argument("principal_scope: the secret is empty");
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

std::string IdempotencyMiddleware::scope(const httplib::Request& request) const {
  return principal_scope(options_.principal(request), options_.scope_secret);
}

IdempotencyMiddleware::IdempotencyMiddleware(MiddlewareOptions options)
    : options_(std::move(options)) {
  if (options_.store == nullptr) throw std::invalid_argument("MiddlewareOptions.store is null");
  if (options_.pool == nullptr) throw std::invalid_argument("MiddlewareOptions.pool is null");
  if (!options_.principal) options_.principal = bearer_principal;
  if (!options_.log) options_.log = log_to_stderr;
  if (options_.scope_secret.empty()) {
    unsigned char bytes[32];
    if (RAND_bytes(bytes, sizeof bytes) != 1) throw std::runtime_error("RAND_bytes failed");
    options_.scope_secret.assign(reinterpret_cast<const char*>(bytes), sizeof bytes);
  } else if (options_.scope_secret.size() < 16) {
    throw std::invalid_argument("MiddlewareOptions.scope_secret must be at least 16 bytes (got " +
                                std::to_string(options_.scope_secret.size()) + ")");
  }
  validate(options_.json_limits);
  if (options_.max_key_bytes < 1) {
    throw std::invalid_argument("MiddlewareOptions.max_key_bytes must be >= 1 (got 0)");
  }
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
  const ParsedKey key = parse_idempotency_key(header, options_.max_key_bytes);
  if (!key.key) {
    write_problem(response, 400, "Invalid Idempotency-Key", key.detail);
    report(IdempotencyOutcome::kInvalidKey);
    return;
  }
  JsonCheck json;
  if (looks_like_json(request)) {
    json = check_json(request.body, options_.json_limits);
    if (json.status == JsonStatus::kTooDeep || json.status == JsonStatus::kDuplicateKey) {
      write_problem(
          response, 400,
          json.status == JsonStatus::kTooDeep ? "JSON nested too deeply" : "Duplicate JSON member",
          json.detail);
      report(IdempotencyOutcome::kInvalidBody);
      return;
    }
  } else {
    json.detail = "not JSON";
  }
  const std::string scope = this->scope(request);
  const std::string fingerprint =
      request_fingerprint(request.method, request.path, request.body, json);
  const IdempotencyStore& store = *options_.store;

  std::optional<ConnectionPool::Lease> lease;
  Claim claim;
  try {
    lease.emplace(options_.pool->acquire());
    claim = store.claim(**lease, scope, *key.key, fingerprint);
  } catch (const DatabaseError& e) {
    options_.log(std::string("claiming an Idempotency-Key failed: ") + e.what());
    response.set_header("Retry-After", "1");
    write_problem(response, 503, "Database unavailable",
                  "the idempotency store is unavailable; retry after the delay in Retry-After");
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
  } catch (...) {
    std::string what = "an exception not derived from std::exception";
    try {
      throw;
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    try {
      store.release(conn, scope, *key.key, claim.token);
    } catch (const DatabaseError&) {
      // The lock expires on its own.
    }
    options_.log(std::string("the handler of ") + request.method + " " + request.path +
                 " threw: " + what);
    write_problem(response, 500, "Handler failed",
                  "the request failed on the server; nothing was stored");
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
  options_.log(std::string("the transaction of ") + request.method + " " + request.path +
               " failed: " + tx.error);
  response.set_header("Retry-After", "1");
  const bool in_doubt = tx.status == TransactionStatus::kCommitInDoubt;
  write_problem(response, in_doubt ? 500 : 503,
                in_doubt ? "Commit in doubt" : "Database unavailable",
                in_doubt ? "the outcome of the commit is unknown; retry with the same "
                           "Idempotency-Key to receive it"
                         : "the database is unavailable; retry after the delay in Retry-After");
  report(IdempotencyOutcome::kError);
}

}  // namespace keel::store
