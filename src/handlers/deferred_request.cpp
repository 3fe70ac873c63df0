// QueuedWrites and DeferredRequestHandler: a write deferred by an HTTP client as a job, and its
// delivery (see keel/handlers/deferred_request.hpp).
#include "keel/handlers/deferred_request.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <exception>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "keel/core/text.hpp"
#include "keel/handlers/webhook_handler.hpp"
#include "keel/http/message.hpp"
#include "keel/json/json_check.hpp"

namespace keel::store {
namespace {

constexpr std::string_view kVersionField = "keel_deferred_request";
constexpr char kBase64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string base64_encode(std::string_view in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  std::size_t i = 0;
  for (; i + 3 <= in.size(); i += 3) {
    const std::uint32_t v = (static_cast<std::uint8_t>(in[i]) << 16) |
                            (static_cast<std::uint8_t>(in[i + 1]) << 8) |
                            static_cast<std::uint8_t>(in[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out += kBase64[(v >> s) & 63];
  }
  if (const std::size_t rest = in.size() - i; rest > 0) {
    std::uint32_t v = static_cast<std::uint8_t>(in[i]) << 16;
    if (rest == 2) v |= static_cast<std::uint8_t>(in[i + 1]) << 8;
    out += kBase64[(v >> 18) & 63];
    out += kBase64[(v >> 12) & 63];
    out += rest == 2 ? kBase64[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

std::optional<std::string> base64_decode(std::string_view in) {
  std::array<int, 256> value{};
  value.fill(-1);
  for (int i = 0; i < 64; ++i) value[static_cast<unsigned char>(kBase64[i])] = i;
  if (in.size() % 4 != 0) return std::nullopt;
  std::string out;
  out.reserve(in.size() / 4 * 3);
  for (std::size_t i = 0; i < in.size(); i += 4) {
    std::uint32_t v = 0;
    int pad = 0;
    for (std::size_t j = 0; j < 4; ++j) {
      const char c = in[i + j];
      if (c == '=' && i + 4 == in.size() && j >= 2) {
        ++pad;
        v <<= 6;
        continue;
      }
      const int d = value[static_cast<unsigned char>(c)];
      if (d < 0 || pad > 0) return std::nullopt;
      v = (v << 6) | static_cast<std::uint32_t>(d);
    }
    out += static_cast<char>((v >> 16) & 0xff);
    if (pad < 2) out += static_cast<char>((v >> 8) & 0xff);
    if (pad < 1) out += static_cast<char>(v & 0xff);
  }
  return out;
}

// The client sets these on every attempt itself; a stored copy would conflict or lie.
bool is_client_header(std::string_view name) {
  return http::same_header_name(name, "Idempotency-Key") ||
         http::same_header_name(name, "Keel-Attempt") ||
         http::same_header_name(name, "Keel-Deadline-Ms") ||
         http::same_header_name(name, "Keel-Job-Attempt");
}

std::string lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

// The names in a payload's "secret_headers" (strings only; anything else is ignored).
std::vector<std::string> secret_names_of(const nlohmann::json& doc) {
  std::vector<std::string> names;
  const auto it = doc.find("secret_headers");
  if (it == doc.end() || !it->is_array()) return names;
  for (const auto& name : *it) {
    if (name.is_string()) names.push_back(name.get<std::string>());
  }
  return names;
}

// A deferred request nests three deep ({"headers": [[...]]}); a payload nested deeper is not
// one, and is never handed to the (recursive) parser.
constexpr std::size_t kDeferredRequestDepth = 3;

Error bad_payload(std::string problem) {
  return Error{.context = "keel::store::decode_deferred_request",
               .field = "payload",
               .problem = std::move(problem)};
}

}  // namespace

bool is_credential_header(std::string_view name, std::span<const std::string> also) {
  if (http::same_header_name(name, "Authorization") ||
      http::same_header_name(name, "Proxy-Authorization") ||
      http::same_header_name(name, "Cookie")) {
    return true;
  }
  return std::any_of(also.begin(), also.end(),
                     [name](const std::string& n) { return http::same_header_name(name, n); });
}

std::string deferred_request_fingerprint(const http::Request& request,
                                         std::span<const std::string> secret_headers) {
  std::vector<std::pair<std::string, std::string>> headers;
  for (const auto& [name, value] : request.headers) {
    if (is_client_header(name) || is_credential_header(name, secret_headers)) continue;
    headers.emplace_back(lower(name), value);
  }
  std::stable_sort(headers.begin(), headers.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  nlohmann::json doc = nlohmann::json::array();
  doc.push_back(request.method);
  doc.push_back(request.url);
  nlohmann::json fields = nlohmann::json::array();
  for (auto& [name, value] : headers) fields.push_back({std::move(name), std::move(value)});
  doc.push_back(std::move(fields));
  doc.push_back(base64_encode(request.body));  // any bytes
  return doc.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string redact_deferred_request(std::string_view payload) {
  if (payload.find(kVersionField) == std::string_view::npos ||
      json_nesting_depth(payload, kDeferredRequestDepth) > kDeferredRequestDepth) {
    return std::string(payload);
  }
  nlohmann::json doc = nlohmann::json::parse(payload, nullptr, false);
  if (doc.is_discarded() || !doc.is_object() || !doc.contains(kVersionField)) {
    return std::string(payload);
  }
  const std::vector<std::string> also = secret_names_of(doc);
  const auto headers = doc.find("headers");
  if (headers == doc.end() || !headers->is_array()) return std::string(payload);
  bool redacted = false;
  for (auto& h : *headers) {
    if (h.is_array() && h.size() == 2 && h[0].is_string() &&
        is_credential_header(h[0].get<std::string>(), also)) {
      h[1] = kRedacted;
      redacted = true;
    }
  }
  if (!redacted) return std::string(payload);
  return doc.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string encode_deferred_request(const http::Request& request,
                                    std::span<const std::string> secret_headers) {
  nlohmann::json doc;
  doc[std::string(kVersionField)] = 1;
  doc["method"] = request.method;
  doc["url"] = request.url;
  nlohmann::json headers = nlohmann::json::array();
  for (const auto& [name, value] : request.headers) {
    if (!is_client_header(name)) headers.push_back({name, value});
  }
  doc["headers"] = std::move(headers);
  doc["prior_attempts"] = request.prior_attempts;
  if (!secret_headers.empty()) {
    nlohmann::json names = nlohmann::json::array();
    for (const std::string& name : secret_headers) names.push_back(name);
    doc["secret_headers"] = std::move(names);
  }
  doc["body"] = request.body;
  try {
    return doc.dump();
  } catch (const nlohmann::json::type_error&) {  // not UTF-8 (in the body, or a header value)
  }
  doc.erase("body");
  doc["body_base64"] = base64_encode(request.body);
  return doc.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

Expected<http::Request> decode_deferred_request(std::string_view payload) {
  const nlohmann::json doc = nlohmann::json::parse(payload, nullptr, false);
  if (doc.is_discarded() || !doc.is_object()) return bad_payload("must be a JSON object");
  if (!doc.contains(kVersionField) || doc[std::string(kVersionField)] != 1) {
    return bad_payload("must have \"keel_deferred_request\": 1");
  }
  http::Request request;
  request.generate_idempotency_key = false;
  const auto text = [&doc](const char* field) -> std::optional<std::string> {
    const auto it = doc.find(field);
    if (it == doc.end() || !it->is_string()) return std::nullopt;
    return it->get<std::string>();
  };
  auto method = text("method");
  auto url = text("url");
  if (!method || method->empty()) return bad_payload("must have a \"method\" string");
  if (!url || url->empty()) return bad_payload("must have a \"url\" string");
  request.method = std::move(*method);
  request.url = std::move(*url);
  if (const auto it = doc.find("headers"); it != doc.end()) {
    if (!it->is_array()) return bad_payload("\"headers\" must be an array of [name, value]");
    for (const auto& h : *it) {
      if (!h.is_array() || h.size() != 2 || !h[0].is_string() || !h[1].is_string()) {
        return bad_payload("\"headers\" must be an array of [name, value]");
      }
      request.headers.emplace_back(h[0].get<std::string>(), h[1].get<std::string>());
    }
  }
  if (auto body = text("body")) {
    request.body = std::move(*body);
  } else if (auto encoded = text("body_base64")) {
    auto decoded = base64_decode(*encoded);
    if (!decoded) return bad_payload("\"body_base64\" must be base64");
    request.body = std::move(*decoded);
  }
  if (const auto it = doc.find("prior_attempts"); it != doc.end()) {
    if (!it->is_number_integer() || it->get<std::int64_t>() < 0 ||
        it->get<std::int64_t>() > 1'000'000) {
      return bad_payload("\"prior_attempts\" must be a whole number from 0 to 1000000");
    }
    request.prior_attempts = it->get<int>();
  }
  return request;
}

QueuedWrites::QueuedWrites(ConnectionPool& pool, const JobQueue& queue, QueuedWritesOptions options)
    : pool_(&pool), queue_(&queue), options_(std::move(options)) {
  if (auto checked = check_queue_name(options_.queue); !checked) {
    throw_invalid(checked.error().in("queue", "keel::store::QueuedWritesOptions"));
  }
  for (const std::string& name : options_.secret_headers) {
    if (auto checked = http::check_header_field(name, ""); !checked) {
      throw_invalid(checked.error().in("secret_headers", "keel::store::QueuedWritesOptions"));
    }
  }
  if (options_.max_attempts < 0) {
    throw_invalid({.context = "keel::store::QueuedWritesOptions",
                   .field = "max_attempts",
                   .problem = "must be >= 0",
                   .got = std::to_string(options_.max_attempts)});
  }
}

Expected<http::Deferral> QueuedWrites::defer(const http::Request& request,
                                             std::string_view idempotency_key) {
  // The payload is JSON, whose strings are UTF-8: a URL or header value in other bytes could only
  // be stored altered, and the delivery would send something else. Refused, not queued.
  if (!is_storable_text(request.url)) {
    return Error{.context = "keel::store::QueuedWrites",
                 .field = "URL",
                 .problem = "is not UTF-8 text, which a deferred request cannot store"};
  }
  for (const auto& [name, value] : request.headers) {
    if (!is_storable_text(value)) {
      // The value is not quoted: it may be a credential.
      return Error{.context = "keel::store::QueuedWrites",
                   .field = "header " + quote_value(name),
                   .problem =
                       "has a value that is not UTF-8 text, which a deferred request "
                       "cannot store"};
    }
  }
  try {
    auto conn = pool_->acquire();
    JobQueue::migrate(*conn);
    const EnqueueResult r = queue_->enqueue(
        *conn, {.queue = options_.queue,
                .payload = encode_deferred_request(request, options_.secret_headers),
                .key = std::string(idempotency_key),
                .max_attempts = options_.max_attempts});
    if (!r.ok()) {
      return Error{.context = "keel::store::QueuedWrites",
                   .field = "enqueue",
                   .problem = "refused: " + r.error};
    }
    http::Deferral out{.status = http::DeferralStatus::kQueued, .job_id = std::to_string(r.id)};
    if (r.created) return out;
    // The key is queued already: the same request, or another one under the same key.
    out.status = http::DeferralStatus::kAlreadyQueued;
    const std::optional<Job> existing = queue_->get(*conn, r.id);
    if (!existing) return out;  // delivered and pruned since: nothing to compare with
    auto stored = decode_deferred_request(existing->payload);
    std::vector<std::string> secret = options_.secret_headers;
    if (stored &&
        json_nesting_depth(existing->payload, kDeferredRequestDepth) <= kDeferredRequestDepth) {
      const auto doc = nlohmann::json::parse(existing->payload, nullptr, false);
      if (doc.is_object()) {
        for (std::string& name : secret_names_of(doc)) secret.push_back(std::move(name));
      }
    }
    if (!stored || deferred_request_fingerprint(*stored, secret) !=
                       deferred_request_fingerprint(request, secret)) {
      out.status = http::DeferralStatus::kKeyConflict;
    }
    return out;
  } catch (const std::exception& e) {
    return Error{.context = "keel::store::QueuedWrites",
                 .field = "enqueue",
                 .problem = std::string("failed: database error: ") + e.what()};
  }
}

AttemptReport DeferredRequestHandler::operator()(const LeasedJob& job,
                                                 const std::atomic<bool>&) const {
  auto decoded = decode_deferred_request(job.payload);
  if (!decoded) {
    return {.outcome = Outcome::permanent(), .error = decoded.error().message()};
  }
  http::Request request = std::move(*decoded);
  request.idempotency_key = job.idempotency_key;
  request.prior_attempts += job.attempt - 1;
  request.headers.emplace_back("Keel-Job-Attempt", std::to_string(job.attempt));
  const std::string dependency = http::breaker_key(request.url).value_or(request.url);
  return report_of(client_->send(request), dependency);
}

}  // namespace keel::store
