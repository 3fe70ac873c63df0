// keel's recommended cpp-httplib server settings: limits, framing checks before the body is read,
// problem+json error answers, an exclusive port (see
// keel/serve/httplib/idempotency_middleware.hpp).
#include <dirent.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <cstdlib>
#include <memory>
#include <regex>
#include <stdexcept>

#include "db/detail/options_refusal.hpp"
#include "idempotency/detail/ascii.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "keel/idempotency/idempotency_flow.hpp"
#include "keel/serve/httplib/idempotency_middleware.hpp"
#include "serve/httplib/detail/close_after_answer.hpp"

namespace keel::store {
namespace {

using HandlerResponse = httplib::Server::HandlerResponse;

using detail::iequals;

bool all_digits(std::string_view s) {
  if (s.empty() || s.size() > 19) return false;
  for (const char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

bool method_listed(std::string_view allow, std::string_view method) {
  std::size_t at = 0;
  while (at < allow.size()) {
    std::size_t end = allow.find(',', at);
    if (end == std::string_view::npos) end = allow.size();
    std::string_view m = allow.substr(at, end - at);
    while (!m.empty() && m.front() == ' ') m.remove_prefix(1);
    while (!m.empty() && m.back() == ' ') m.remove_suffix(1);
    if (m == method) return true;
    at = end + 1;
  }
  return false;
}

}  // namespace

bool shutdown_connection(const httplib::Request& request) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return false;
  bool found = false;
  const auto port_of = [](const sockaddr_storage& a) -> int {
    if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port);
    if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
    return -1;
  };
  while (dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == dirfd(dir)) continue;
    sockaddr_storage local{};
    sockaddr_storage peer{};
    socklen_t len = sizeof local;
    if (getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &len) != 0) continue;
    len = sizeof peer;
    if (getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&peer), &len) != 0) continue;
    if (port_of(local) == request.local_port && port_of(peer) == request.remote_port) {
      ::shutdown(static_cast<int>(fd), SHUT_RDWR);
      found = true;
      break;
    }
  }
  closedir(dir);
  return found;
}

void validate(const ServerLimits& limits) {
  const detail::OptionsRefusal refuse("keel::store::ServerLimits");
  if (limits.max_body_bytes < 1) refuse.must_be("max_body_bytes", ">= 1", "0");
  if (limits.max_header_bytes < 1) refuse.must_be("max_header_bytes", ">= 1", "0");
  if (limits.read_timeout.count() <= 0) {
    refuse.must_be("read_timeout", "> 0", format_duration(limits.read_timeout));
  }
  if (limits.write_timeout.count() <= 0) {
    refuse.must_be("write_timeout", "> 0", format_duration(limits.write_timeout));
  }
  if (limits.keep_alive_max_count < 1) refuse.must_be("keep_alive_max_count", ">= 1", "0");
  if (limits.keep_alive_timeout.count() < 1) {
    refuse.must_be("keep_alive_timeout", ">= 1s", format_duration(limits.keep_alive_timeout));
  }
}

void detail::close_after_answer(httplib::Response& response) {
  // cpp-httplib keeps a connection open unless the request asked otherwise; a content provider
  // that reports failure after writing the whole body makes it close the connection once the
  // answer is out, so unread request bytes are never parsed as another request.
  auto body = std::make_shared<std::string>(std::move(response.body));
  const std::string content_type = response.get_header_value("Content-Type");
  response.body.clear();
  response.headers.erase("Content-Type");
  response.set_header("Connection", "close");
  response.set_content_provider(
      body->size(), content_type,
      [body](std::size_t offset, std::size_t length, httplib::DataSink& sink) {
        sink.write(body->data() + offset, length);
        return false;
      });
}

void write_problem_and_close(httplib::Response& response, int status, std::string_view title,
                             std::string_view detail) {
  write_problem(response, status, title, detail);
  detail::close_after_answer(response);
}

HandlerResponse refuse_unsafe_request(const httplib::Request& request, httplib::Response& response,
                                      const ServerLimits& limits) {
  const auto refuse = [&](int status, std::string_view detail) {
    write_problem_and_close(response, status, problem_title(status), detail);
    return HandlerResponse::Handled;
  };
  std::size_t header_bytes = 0;
  for (const auto& [name, value] : request.headers) {
    header_bytes += name.size() + value.size();
    if (name.empty() || name.find_first_of(" \t") != std::string::npos) {
      return refuse(400, "a header name contains whitespace (obs-fold is not accepted)");
    }
  }
  if (header_bytes > limits.max_header_bytes) {
    return refuse(431, "the request headers total " + std::to_string(header_bytes) +
                           " bytes; the limit is " + std::to_string(limits.max_header_bytes) +
                           " bytes");
  }
  const std::size_t lengths = request.get_header_value_count("Content-Length");
  const std::size_t codings = request.get_header_value_count("Transfer-Encoding");
  if (lengths > 1) return refuse(400, "the request has more than one Content-Length header");
  if (lengths == 1 && codings > 0) {
    return refuse(400, "the request has both Content-Length and Transfer-Encoding");
  }
  if (codings > 1) return refuse(400, "the request has more than one Transfer-Encoding header");
  // cpp-httplib reads a body for POST, PUT, PATCH and DELETE only; any other method's body would
  // be parsed as the next request.
  const bool body_method =
      request.method == "POST" || request.method == "PUT" || request.method == "PATCH";
  const bool reads_body = body_method || request.method == "DELETE";
  if (codings == 1) {
    if (!iequals(request.get_header_value("Transfer-Encoding"), "chunked")) {
      return refuse(400, "the only Transfer-Encoding accepted is chunked");
    }
    if (!reads_body) return refuse(400, "a " + request.method + " request carries no body");
    if (!limits.allow_chunked) {
      return refuse(411,
                    "send the request body with a Content-Length (chunked bodies are not "
                    "accepted)");
    }
    return HandlerResponse::Unhandled;
  }
  if (lengths == 1) {
    const std::string value = request.get_header_value("Content-Length");
    if (!all_digits(value)) return refuse(400, "Content-Length is not a decimal number of bytes");
    const unsigned long long length = std::stoull(value);
    if (length > limits.max_body_bytes) {
      return refuse(413, "the request body is " + value + " bytes; the limit is " +
                             std::to_string(limits.max_body_bytes) + " bytes");
    }
    if (!reads_body && length > 0) {
      return refuse(400, "a " + request.method + " request carries no body");
    }
  } else if (body_method) {
    return refuse(411, "a " + request.method + " request needs a Content-Length header");
  }
  return HandlerResponse::Unhandled;
}

httplib::Server::HandlerWithContentReader read_whole_body(httplib::Server::Handler handler) {
  return [handler = std::move(handler)](const httplib::Request& request,
                                        httplib::Response& response,
                                        const httplib::ContentReader& reader) {
    // A copy whose body this handler reads: cpp-httplib reads it the same way (its payload limit
    // included) but skips its own form-urlencoded limit, which is read_content()'s alone.
    httplib::Request copy = request;
    bool read = false;
    if (request.is_multipart_form_data()) {
      httplib::MultipartFormDataItems items;
      read = reader(
          [&](const httplib::MultipartFormData& file) {
            items.push_back(file);
            return true;
          },
          [&](const char* data, std::size_t length) {
            items.back().content.append(data, length);
            return true;
          });
      for (auto& item : items) copy.files.emplace(item.name, std::move(item));
    } else {
      read = reader([&](const char* data, std::size_t length) {
        copy.body.append(data, length);
        return true;
      });
      if (request.get_header_value("Content-Type").rfind("application/x-www-form-urlencoded", 0) ==
          0) {
        httplib::detail::parse_query_text(copy.body, copy.params);
      }
    }
    if (!read) {
      const int status = response.status == 413 ? 413 : 400;
      write_problem_and_close(response, status, problem_title(status),
                              status == 413 ? "the request body is over the server's limit"
                                            : "the request body could not be read");
      return;
    }
    handler(copy, response);
  };
}

void apply_server_limits(httplib::Server& server, ServerLimits limits) {
  validate(limits);
  server.set_payload_max_length(limits.max_body_bytes);
  const auto split = [](std::chrono::milliseconds d, auto set) {
    set(static_cast<time_t>(d.count() / 1000), static_cast<time_t>(d.count() % 1000 * 1000));
  };
  split(limits.read_timeout, [&](time_t s, time_t us) { server.set_read_timeout(s, us); });
  split(limits.write_timeout, [&](time_t s, time_t us) { server.set_write_timeout(s, us); });
  server.set_keep_alive_max_count(limits.keep_alive_max_count);
  server.set_keep_alive_timeout(static_cast<time_t>(limits.keep_alive_timeout.count()));
  server.set_tcp_nodelay(limits.tcp_nodelay);
  const bool reuse_port = limits.reuse_port;
  server.set_socket_options([reuse_port](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    if (reuse_port) setsockopt(sock, SOL_SOCKET, SO_REUSEPORT, &yes, sizeof yes);
  });

  auto shared = std::make_shared<const ServerLimits>(std::move(limits));
  server.set_pre_routing_handler(
      [shared](const httplib::Request& request, httplib::Response& response) {
        if (refuse_unsafe_request(request, response, *shared) == HandlerResponse::Handled) {
          return HandlerResponse::Handled;
        }
        return shared->pre_routing ? shared->pre_routing(request, response)
                                   : HandlerResponse::Unhandled;
      });

  // cpp-httplib answers "Expect: 100-continue" before routing: refuse there, so that a client
  // that waits for 100 Continue never starts sending a body that would be refused.
  server.set_expect_100_continue_handler(
      [shared](const httplib::Request& request, httplib::Response& response) {
        if (refuse_unsafe_request(request, response, *shared) == HandlerResponse::Handled) {
          return response.status;
        }
        return 100;
      });

  server.set_logger([shared](const httplib::Request& request, const httplib::Response& response) {
    // A HEAD answer has no body, so write_problem_and_close() cannot close it: do it here.
    if (request.method == "HEAD" && response.status >= 400 &&
        response.get_header_value("Connection") == "close") {
      (void)shutdown_connection(request);
    }
    if (shared->logger) shared->logger(request, response);
  });

  auto routes = std::make_shared<std::vector<std::pair<std::regex, std::string>>>();
  for (const auto& [pattern, allow] : shared->routes)
    routes->emplace_back(std::regex(pattern), allow);
  server.set_error_handler(httplib::Server::HandlerWithResponse(
      [routes](const httplib::Request& request, httplib::Response& response) {
        // Answers a handler already wrote as problem+json stay as they are.
        if (response.get_header_value("Content-Type").rfind("application/problem+json", 0) == 0) {
          return HandlerResponse::Unhandled;
        }
        // An answer with a body is the application's own (cpp-httplib's errors have none).
        if (!response.body.empty()) return HandlerResponse::Unhandled;
        if (response.status == 404) {
          for (const auto& [pattern, allow] : *routes) {
            if (std::regex_match(request.path, pattern) && !method_listed(allow, request.method)) {
              response.set_header("Allow", allow);
              write_problem(response, 405, problem_title(405),
                            request.method + " is not allowed on this path; allowed: " + allow);
              return HandlerResponse::Handled;
            }
          }
        }
        const int status = response.status;
        std::string detail;
        switch (status) {
          case 404:
            detail = "no resource at this path";
            break;
          case 413:
            detail = "the request body is over the server's limit";
            break;
          case 414:
            detail = "the request target is over the server's limit of 8192 bytes";
            break;
          case 400:
            detail =
                "the request could not be parsed (a header line over 8192 bytes, a malformed "
                "request line or header, or a malformed body)";
            break;
          default:
            detail = std::string(problem_title(status));
            break;
        }
        if (status == 404) {
          write_problem(response, status, problem_title(status), detail);
        } else {
          // cpp-httplib answered on its own, possibly mid-request: do not read on.
          write_problem_and_close(response, status, problem_title(status), detail);
        }
        return HandlerResponse::Handled;
      }));
}

}  // namespace keel::store
