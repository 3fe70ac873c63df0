// Database URL parsing: sqlite:PATH and postgres:// / postgresql:// URIs (validated by libpq).
#include <libpq-fe.h>

#include <filesystem>
#include <memory>
#include <system_error>

#include "keel/db/database.hpp"

namespace keel::store {
namespace {

bool starts_with(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

// postgres://user:secret@host/db -> postgres://user:***@host/db
std::string redact_password(std::string_view uri) {
  const std::size_t scheme_end = uri.find("://");
  if (scheme_end == std::string_view::npos) return std::string(uri);
  const std::size_t authority_begin = scheme_end + 3;
  std::size_t authority_end = uri.find_first_of("/?", authority_begin);
  if (authority_end == std::string_view::npos) authority_end = uri.size();
  const std::string_view authority = uri.substr(authority_begin, authority_end - authority_begin);
  const std::size_t at = authority.rfind('@');
  if (at == std::string_view::npos) return std::string(uri);
  const std::size_t colon = authority.find(':');
  if (colon == std::string_view::npos || colon > at) return std::string(uri);
  std::string out(uri.substr(0, authority_begin + colon + 1));
  out += "***";
  out += uri.substr(authority_begin + at);
  return out;
}

// keel's own query parameter, taken out of a PostgreSQL URI before libpq sees it (libpq refuses
// parameters it does not know). Returns the URI without it, or an error text.
struct KeelParameters {
  std::string uri;
  bool transaction_pooler = false;
  std::string error;
};

KeelParameters take_keel_parameters(std::string_view uri) {
  KeelParameters out;
  const std::size_t question = uri.find('?');
  if (question == std::string_view::npos) {
    out.uri = std::string(uri);
    return out;
  }
  std::string kept;
  std::string_view query = uri.substr(question + 1);
  while (true) {
    const std::size_t amp = query.find('&');
    const std::string_view pair = query.substr(0, amp);
    const std::size_t eq = pair.find('=');
    const std::string_view name = pair.substr(0, eq);
    if (name == "keel_pooler") {
      const std::string_view value =
          eq == std::string_view::npos ? std::string_view() : pair.substr(eq + 1);
      if (value == "transaction") {
        out.transaction_pooler = true;
      } else if (value == "session" || value == "none") {
        out.transaction_pooler = false;
      } else {
        out.error =
            "has keel_pooler=" + std::string(value) + " (expected transaction, session or none)";
        return out;
      }
    } else if (!pair.empty()) {
      if (!kept.empty()) kept += '&';
      kept += pair;
    }
    if (amp == std::string_view::npos) break;
    query.remove_prefix(amp + 1);
  }
  out.uri = std::string(uri.substr(0, question));
  if (!kept.empty()) out.uri += "?" + kept;
  return out;
}

// A password given as a query parameter (?password=...) is redacted as well.
std::string redact(std::string_view uri) {
  std::string out = redact_password(uri);
  const std::size_t question = out.find('?');
  if (question == std::string::npos) return out;
  std::size_t at = question + 1;
  while (at < out.size()) {
    std::size_t end = out.find('&', at);
    if (end == std::string::npos) end = out.size();
    if (out.compare(at, 9, "password=") == 0 && end > at + 9) {
      out.replace(at + 9, end - (at + 9), "***");
      end = at + 12;
    }
    at = end + 1;
  }
  return out;
}

}  // namespace

std::string_view to_string(Backend backend) noexcept {
  return backend == Backend::kSqlite ? "sqlite" : "postgres";
}

Expected<DatabaseUrl> parse_database_url(std::string_view text) {
  // The value is quoted with any password redacted: a message may be logged.
  const auto fail = [text](std::string problem) {
    return Error{.field = "database URL",
                 .problem = std::move(problem),
                 .got = quote_value(redact(text), 200)};
  };
  for (const char c : text) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      return fail("contains a control character");
    }
  }
  if (text.empty()) return fail("is empty (expected sqlite:PATH or postgres://...)");
  if (starts_with(text, "sqlite:")) {
    std::string_view path = text.substr(7);
    if (starts_with(path, "//")) {
      // Accept sqlite:///abs/path and sqlite://rel as a courtesy: strip the authority slashes.
      path.remove_prefix(2);
    }
    if (path.empty()) return fail("has an empty path (expected sqlite:PATH, e.g. sqlite:keel.db)");
    return DatabaseUrl{
        .backend = Backend::kSqlite, .target = std::string(path), .redacted = std::string(text)};
  }
  if (starts_with(text, "postgres://") || starts_with(text, "postgresql://")) {
    KeelParameters keel = take_keel_parameters(text);
    if (!keel.error.empty()) return fail(keel.error);
    const std::string& uri = keel.uri;
    char* message = nullptr;
    PQconninfoOption* options = PQconninfoParse(uri.c_str(), &message);
    if (options == nullptr) {
      std::string reason = message != nullptr ? message : "out of memory";
      PQfreemem(message);
      while (!reason.empty() && (reason.back() == '\n' || reason.back() == ' ')) reason.pop_back();
      return fail("is not a valid PostgreSQL URL: " + reason);
    }
    PQconninfoFree(options);
    return DatabaseUrl{.backend = Backend::kPostgres,
                       .target = uri,
                       .redacted = redact(text),
                       .transaction_pooler = keel.transaction_pooler};
  }
  const std::size_t colon = text.find(':');
  if (colon == std::string_view::npos) {
    return fail("has no scheme (expected sqlite:PATH or postgres://...)");
  }
  return fail("has the scheme " + quote_value(text.substr(0, colon)) +
              ", which is not supported (expected sqlite or postgres/postgresql)");
}

bool database_exists(const DatabaseUrl& url) {
  if (url.backend != Backend::kSqlite || url.target == ":memory:") return true;
  std::error_code ec;
  return std::filesystem::exists(url.target, ec);
}

}  // namespace keel::store
