#include "keel/core/classify.hpp"

#include <cerrno>
#include <stdexcept>
#include <string>
#include <utility>

#include "detail/invalid.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/grpc_status.hpp"

namespace keel {

std::string_view to_string(OutcomeKind kind) noexcept {
  switch (kind) {
    case OutcomeKind::kNotAttempted:
      return "not attempted";
    case OutcomeKind::kSuccess:
      return "success";
    case OutcomeKind::kTransient:
      return "transient";
    case OutcomeKind::kThrottled:
      return "throttled";
    case OutcomeKind::kPermanent:
      return "permanent";
    case OutcomeKind::kAmbiguous:
      return "ambiguous";
  }
  return "unknown";
}

std::string_view to_string(Method method) noexcept {
  switch (method) {
    case Method::kGet:
      return "GET";
    case Method::kHead:
      return "HEAD";
    case Method::kOptions:
      return "OPTIONS";
    case Method::kPut:
      return "PUT";
    case Method::kDelete:
      return "DELETE";
    case Method::kPost:
      return "POST";
    case Method::kPatch:
      return "PATCH";
    case Method::kOther:
      return "OTHER";
  }
  return "OTHER";
}

Method parse_method(std::string_view token) noexcept {
  for (Method m : {Method::kGet, Method::kHead, Method::kOptions, Method::kPut, Method::kDelete,
                   Method::kPost, Method::kPatch}) {
    if (token == to_string(m)) return m;
  }
  return Method::kOther;
}

std::string_view to_string(NetError error) noexcept {
  switch (error) {
    case NetError::kConnectionRefused:
      return "connection refused";
    case NetError::kConnectionReset:
      return "connection reset";
    case NetError::kTimedOut:
      return "timed out";
    case NetError::kHostUnreachable:
      return "host unreachable";
    case NetError::kNetworkUnreachable:
      return "network unreachable";
    case NetError::kDnsTemporary:
      return "temporary DNS failure";
    case NetError::kDnsNotFound:
      return "host not found";
    case NetError::kOther:
      return "network error";
    case NetError::kUnusableUrl:
      return "unusable URL";
  }
  return "network error";
}

std::string describe(const Outcome& o) {
  std::string out;
  switch (o.source) {
    case OutcomeSource::kHttp:
      out = "HTTP " + std::to_string(o.code);
      break;
    case OutcomeSource::kBody:
      out = "HTTP " + std::to_string(o.code) + " body";
      break;
    case OutcomeSource::kNetwork:
      out = "network: " + std::string(to_string(static_cast<NetError>(o.code)));
      break;
    case OutcomeSource::kSqlstate:
      out = "SQLSTATE " + std::string(o.sqlstate);
      break;
    case OutcomeSource::kGrpc:
      out = "gRPC " + std::string(grpc_code_name(o.code));
      break;
    case OutcomeSource::kUser:
    case OutcomeSource::kNone:
      out = std::string(to_string(o.kind));
      if (o.kind == OutcomeKind::kNotAttempted) {
        return o.has_server_delay() ? out + " (retry in " + format_duration(o.server_delay) + ")"
                                    : out;
      }
      return o.has_server_delay() ? out + " (server delay " + format_duration(o.server_delay) + ")"
                                  : out;
  }
  out += " (";
  out += to_string(o.kind);
  if (o.timed_out && o.source != OutcomeSource::kNetwork) out += ", timed out";
  if (o.duplicate) out += ", duplicate of an earlier attempt";
  if (o.has_server_delay()) {
    out += (o.source == OutcomeSource::kGrpc ? ", pushback " : ", Retry-After ") +
           format_duration(o.server_delay);
  }
  out += ")";
  return out;
}

Outcome classify_http_status(int status, const RequestTraits& request,
                             std::optional<Duration> retry_after, int max_retries_on_500) noexcept {
  Outcome o;
  o.source = OutcomeSource::kHttp;
  o.code = status;
  const auto throttled = [&] {
    o.kind = OutcomeKind::kThrottled;
    if (retry_after && *retry_after >= Duration::zero()) o.server_delay = *retry_after;
  };
  if (status >= 100 && status < 400) {
    o.kind = OutcomeKind::kSuccess;
    return o;
  }
  switch (status) {
    case 408:
    case 425:
    case 502:
    case 504:
      o.kind = OutcomeKind::kTransient;
      return o;
    case 429:
    case 503:
      throttled();
      return o;
    case 409:
      if (request.has_idempotency_key) {
        throttled();
      } else {
        o.kind = OutcomeKind::kPermanent;
      }
      return o;
    case 501:
    case 505:
      o.kind = OutcomeKind::kPermanent;
      return o;
    default:
      break;
  }
  if (status >= 500 && status < 600) {
    o.kind = OutcomeKind::kAmbiguous;
    o.retry_limit = static_cast<std::uint8_t>(
        max_retries_on_500 < 0 ? 0 : (max_retries_on_500 > 254 ? 254 : max_retries_on_500));
    return o;
  }
  o.kind = OutcomeKind::kPermanent;  // every other 4xx, and nonsense statuses
  return o;
}

HttpClassifier::HttpClassifier(HttpClassifierOptions options) : options_(std::move(options)) {
  if (options_.max_retries_on_500 < 0 || options_.max_retries_on_500 > 254) {
    detail::reject("HttpClassifier", "max_retries_on_500", "in [0, 254]",
                   std::to_string(options_.max_retries_on_500));
  }
}

Outcome HttpClassifier::classify(int status, std::string_view body, const RequestTraits& request,
                                 std::optional<Duration> retry_after) const {
  if (options_.body) {
    if (auto hooked = options_.body(status, body)) {
      hooked->source = OutcomeSource::kBody;
      hooked->code = status;
      if (hooked->kind == OutcomeKind::kThrottled && !hooked->has_server_delay() && retry_after) {
        hooked->server_delay = *retry_after;
      }
      return *hooked;
    }
  }
  return classify_http_status(status, request, retry_after, options_.max_retries_on_500);
}

BodyPredicate body_contains(std::string text) {
  return [text = std::move(text)](std::string_view body) {
    return body.find(text) != std::string_view::npos;
  };
}

DuplicateSuccessRule::DuplicateSuccessRule(DuplicateSuccessOptions options)
    : options_(std::move(options)) {
  if (options_.statuses.empty()) {
    detail::reject("DuplicateSuccessRule", "statuses", "at least one status", "none");
  }
  for (int status : options_.statuses) {
    if (status < 400 || status > 599) {
      detail::reject("DuplicateSuccessRule", "statuses", "in [400, 599]", std::to_string(status));
    }
  }
}

bool DuplicateSuccessRule::matches(int status, std::string_view body) const {
  for (int s : options_.statuses) {
    if (s == status) return !options_.body || options_.body(body);
  }
  return false;
}

Outcome DuplicateSuccessRule::apply(const Outcome& previous, const Outcome& current,
                                    std::string_view body) const {
  // Only a retry after an attempt that may have taken effect; a first attempt, or one after a
  // failure that says nothing happened, gets a real conflict.
  if (previous.kind != OutcomeKind::kAmbiguous) return current;
  if (current.source != OutcomeSource::kHttp && current.source != OutcomeSource::kBody) {
    return current;
  }
  if (!matches(current.code, body)) return current;
  Outcome o = current;
  o.kind = OutcomeKind::kSuccess;
  o.duplicate = true;
  o.server_delay = Outcome::kNoServerDelay;
  o.retry_limit = Outcome::kNoRetryLimit;
  return o;
}

std::optional<NetError> net_error_from_errno(int e) noexcept {
  switch (e) {
    case ECONNREFUSED:
      return NetError::kConnectionRefused;
    case ECONNRESET:
    case EPIPE:
    case ECONNABORTED:
      return NetError::kConnectionReset;
    case ETIMEDOUT:
      return NetError::kTimedOut;
    case EHOSTUNREACH:
      return NetError::kHostUnreachable;
    case ENETUNREACH:
    case ENETDOWN:
      return NetError::kNetworkUnreachable;
    default:
      return std::nullopt;
  }
}

Outcome classify_network(NetError error, bool request_sent) noexcept {
  Outcome o;
  o.source = OutcomeSource::kNetwork;
  o.code = static_cast<int>(error);
  o.timed_out = error == NetError::kTimedOut;
  if (error == NetError::kDnsNotFound || error == NetError::kUnusableUrl) {
    o.kind = OutcomeKind::kPermanent;
    return o;
  }
  const bool could_have_acted = error == NetError::kConnectionReset ||
                                error == NetError::kTimedOut || error == NetError::kOther;
  o.kind = request_sent && could_have_acted ? OutcomeKind::kAmbiguous : OutcomeKind::kTransient;
  return o;
}

std::string_view to_string(DatabaseFailure failure) noexcept {
  switch (failure) {
    case DatabaseFailure::kConflict:
      return "conflict";
    case DatabaseFailure::kBusy:
      return "busy";
    case DatabaseFailure::kUnavailable:
      return "unavailable";
    case DatabaseFailure::kWrongNode:
      return "wrong node";
    case DatabaseFailure::kInDoubt:
      return "commit in doubt";
    case DatabaseFailure::kPermanent:
      return "permanent";
  }
  return "unknown";
}

namespace {

bool well_formed_sqlstate(std::string_view state) noexcept {
  if (state.size() != 5) return false;
  for (char c : state) {
    if (!((c >= '0' && c <= '9') || (c >= 'A' && c <= 'Z'))) return false;
  }
  return true;
}

}  // namespace

DatabaseFailure classify_database_sqlstate(std::string_view state, bool during_commit) noexcept {
  if (!well_formed_sqlstate(state)) return DatabaseFailure::kPermanent;
  const std::string_view cls = state.substr(0, 2);
  // The transaction was rolled back by the server: definite, even when COMMIT reported it.
  if (state == "40001" || state == "40P01") return DatabaseFailure::kConflict;
  // The connection went away (or the server is going away) with the transaction's end unknown.
  const bool node_going = state == "57P01" || state == "57P02" || state == "57P03";
  if (during_commit && (cls == "08" || node_going)) return DatabaseFailure::kInDoubt;
  if (node_going || state == "25006") return DatabaseFailure::kWrongNode;
  if (cls == "08" || cls == "53" || state == "25P03" || state == "57P05") {
    return DatabaseFailure::kUnavailable;
  }
  if (state == "55P03" || state == "57014") return DatabaseFailure::kBusy;
  return DatabaseFailure::kPermanent;
}

DatabaseFailure classify_database_sqlite(int extended_code, bool during_commit,
                                         bool connection_lost) noexcept {
  const int primary = extended_code & 0xff;
  // SQLITE_BUSY_SNAPSHOT: a read transaction's snapshot went stale before it could write (another
  // connection committed): a lost race, not a wait.
  if (extended_code == 517) return DatabaseFailure::kConflict;
  if (primary == 5 /* SQLITE_BUSY */ || primary == 6 /* SQLITE_LOCKED */) {
    // A busy COMMIT in SQLite left the transaction open and unapplied; it is not in doubt.
    return DatabaseFailure::kBusy;
  }
  if (during_commit && connection_lost) return DatabaseFailure::kInDoubt;
  // The file cannot be opened or written now: a missing directory, a full disk, no memory. Not
  // the statement's fault; another try may find it fixed.
  if (primary == 14 /* SQLITE_CANTOPEN */ || primary == 13 /* SQLITE_FULL */ ||
      primary == 7 /* SQLITE_NOMEM */ || primary == 15 /* SQLITE_PROTOCOL */) {
    return DatabaseFailure::kUnavailable;
  }
  return DatabaseFailure::kPermanent;
}

OutcomeKind outcome_kind(DatabaseFailure failure) noexcept {
  switch (failure) {
    case DatabaseFailure::kConflict:
    case DatabaseFailure::kBusy:
    case DatabaseFailure::kUnavailable:
    case DatabaseFailure::kWrongNode:
      return OutcomeKind::kTransient;
    case DatabaseFailure::kInDoubt:
      return OutcomeKind::kAmbiguous;
    case DatabaseFailure::kPermanent:
      return OutcomeKind::kPermanent;
  }
  return OutcomeKind::kPermanent;
}

Outcome classify_sqlstate(std::string_view state, bool during_commit) noexcept {
  Outcome o;
  o.source = OutcomeSource::kSqlstate;
  o.kind = OutcomeKind::kPermanent;
  if (!well_formed_sqlstate(state)) return o;
  for (std::size_t i = 0; i < 5; ++i) o.sqlstate[i] = state[i];
  o.kind = outcome_kind(classify_database_sqlstate(state, during_commit));
  return o;
}

Outcome classify_sqlite(int extended_code, bool during_commit, bool connection_lost) noexcept {
  switch (outcome_kind(classify_database_sqlite(extended_code, during_commit, connection_lost))) {
    case OutcomeKind::kTransient:
      return Outcome::transient();
    case OutcomeKind::kAmbiguous:
      return Outcome::ambiguous();
    default:
      return Outcome::permanent();
  }
}

}  // namespace keel
