// The request `keel call`'s flags describe: the method, the -H header fields, the body (--data,
// or @FILE) and the Idempotency-Key (--idempotency-key with the -H one).
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "call_cli.hpp"
#include "keel/http/client.hpp"

namespace keel::cli::call_cli {
namespace {

// Reads --data @FILE; the Error names the flag, the file and why (a directory, unreadable, ...).
Expected<std::string> read_body_file(const std::string& path) {
  const auto fail = [&path](std::string why) {
    return Error{.field = "--data", .problem = "cannot be read: " + why, .got = quote_value(path)};
  };
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec) return fail(ec.message());
  if (std::filesystem::is_directory(status)) return fail("it is a directory");
  std::ifstream in(path, std::ios::binary);
  if (!in) return fail(std::strerror(errno));
  std::ostringstream content;
  content << in.rdbuf();
  if (in.bad()) return fail("read error");
  return content.str();
}

// The method: --request, or POST with a body and GET without; 0 or the exit status after
// printing a usage error.
int set_method(const CallArgs& a, http::Request& request) {
  request.method = !a.method.empty() ? a.method : (a.data ? "POST" : "GET");
  bool token = !request.method.empty() && request.method.size() <= 64;
  for (char c : request.method) {
    if (c <= ' ' || c >= 127 || c == ':' || c == '/') token = false;
  }
  if (!token) {
    return usage_error(Error{.field = "--request",
                             .problem = "must be a method token of 1 to 64 bytes",
                             .got = quote_value(a.method)}
                           .message());
  }
  return 0;
}

// The -H fields, and the Idempotency-Key one of them gives (canonical, in `header_key`): the
// caller's own key is always the one sent, exactly once. 0 or the exit status after a usage
// error.
int set_headers(const CallArgs& a, http::Request& request, std::string& header_key) {
  for (const std::string& h : a.headers) {
    auto field = http::parse_header_field(h);
    if (!field) return usage_error("--header: " + field.error().message());
    if (http::same_header_name(field->first, "Idempotency-Key")) {
      auto key = http::check_idempotency_key(field->second);  // canonical: "k" is k
      if (!key) {
        return usage_error("--header: " + key.error().message());
      }
      if (!header_key.empty() && header_key != *key) {
        return usage_error("--header: two different Idempotency-Key headers ('" + header_key +
                           "' and '" + field->second + "')");
      }
      header_key = std::move(*key);
      continue;  // sent once, as the request's key
    }
    request.headers.push_back(std::move(*field));
  }
  return 0;
}

// --idempotency-key (KEY, auto or off) with the -H key; 0 or the exit status after a usage error.
int set_key(const CallArgs& a, http::Request& request, const std::string& header_key) {
  if (a.idempotency_key == "off" || a.idempotency_key == "auto") {
    request.generate_idempotency_key = a.idempotency_key == "auto";
    request.idempotency_key = header_key;  // a key given with -H is sent even with off
  } else {
    auto key = http::check_idempotency_key(a.idempotency_key);
    if (!key) {
      Error e = key.error().in("--idempotency-key");
      e.problem += " (give a KEY, auto or off)";
      return usage_error(e.message());
    }
    if (!header_key.empty() && header_key != *key) {
      return usage_error("--idempotency-key: '" + a.idempotency_key +
                         "' conflicts with --header 'Idempotency-Key: " + header_key + "'");
    }
    request.idempotency_key = std::move(*key);
  }
  // With auto, make the key here (as the client would) so that -v can show it up front.
  if (request.idempotency_key.empty() && request.generate_idempotency_key &&
      (request.method == "POST" || request.method == "PATCH")) {
    request.idempotency_key = http::make_idempotency_key();
  }
  return 0;
}

}  // namespace

int build_request(const CallArgs& a, http::Request& request) {
  request.url = a.url;
  if (const int status = set_method(a, request); status != 0) return status;
  std::string header_key;
  if (const int status = set_headers(a, request, header_key); status != 0) return status;
  if (a.data) {
    if (a.data->starts_with("@")) {
      const std::string path = a.data->substr(1);
      auto body = read_body_file(path);
      if (!body) return usage_error(body.error().message());
      request.body = std::move(*body);
    } else {
      request.body = *a.data;
    }
  }
  return set_key(a, request, header_key);
}

}  // namespace keel::cli::call_cli
