// Database URL parsing: sqlite:PATH and postgres:// / postgresql:// URIs (validated by libpq).
#include <libpq-fe.h>

#include <filesystem>
#include <memory>
#include <system_error>

#include "keel/store/db/database.hpp"

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

}  // namespace

std::string_view to_string(Backend backend) noexcept {
  return backend == Backend::kSqlite ? "sqlite" : "postgres";
}

Expected<DatabaseUrl> parse_database_url(std::string_view text) {
  // The value is quoted with any password redacted: a message may be logged.
  const auto fail = [text](std::string problem) {
    return Error{.field = "database URL",
                 .problem = std::move(problem),
                 .got = quote_value(redact_password(text), 200)};
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
    return DatabaseUrl{Backend::kSqlite, std::string(path), std::string(text)};
  }
  if (starts_with(text, "postgres://") || starts_with(text, "postgresql://")) {
    const std::string uri(text);
    char* message = nullptr;
    PQconninfoOption* options = PQconninfoParse(uri.c_str(), &message);
    if (options == nullptr) {
      std::string reason = message != nullptr ? message : "out of memory";
      PQfreemem(message);
      while (!reason.empty() && (reason.back() == '\n' || reason.back() == ' ')) reason.pop_back();
      return fail("is not a valid PostgreSQL URL: " + reason);
    }
    PQconninfoFree(options);
    return DatabaseUrl{Backend::kPostgres, uri, redact_password(text)};
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
