// The server's options validated, and a request's Host checked against RFC 9112 section 3.2
// (detail/request_checks.hpp). A Session refuses a request with a bad Host before it is routed.
#include "serve/beast/detail/request_checks.hpp"

#include <boost/beast/http/field.hpp>
#include <cstddef>
#include <string_view>
#include <utility>

#include "db/detail/options_refusal.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"

namespace keel::store::beast::detail {
namespace {

namespace http = boost::beast::http;

// RFC 3986's unreserved and sub-delims, the bytes of a reg-name besides pct-encoded ones.
bool host_byte(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
         std::string_view("-._~!$&'()*+,;=").find(c) != std::string_view::npos;
}

bool hex_byte(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/// Whether `value` is a Host field value: uri-host [ ":" port ] (RFC 9110 section 7.2, RFC 3986
/// section 3.2), or empty (a target without an authority, RFC 9112 section 3.2).
bool valid_host(std::string_view value) {
  std::string_view port;
  if (!value.empty() && value.front() == '[') {  // IP-literal: IPv6address or IPvFuture
    const std::size_t close = value.find(']');
    if (close == std::string_view::npos || close == 1) return false;
    for (const char c : value.substr(1, close - 1)) {
      if (!host_byte(c) && c != ':') return false;
    }
    const std::string_view rest = value.substr(close + 1);
    if (!rest.empty() && rest.front() != ':') return false;
    if (!rest.empty()) port = rest.substr(1);
  } else {  // IPv4address or reg-name: no ':' but the port's
    const std::size_t colon = value.rfind(':');
    const std::string_view host = value.substr(0, colon);
    if (colon != std::string_view::npos) port = value.substr(colon + 1);
    for (std::size_t i = 0; i < host.size(); ++i) {
      if (host[i] == '%') {
        if (i + 2 >= host.size() || !hex_byte(host[i + 1]) || !hex_byte(host[i + 2])) return false;
        i += 2;
      } else if (!host_byte(host[i])) {
        return false;
      }
    }
  }
  return port.find_first_not_of("0123456789") == std::string_view::npos;
}

}  // namespace

void validate(const ServerOptions& o) {
  const store::detail::OptionsRefusal refuse("keel::store::beast::ServerOptions");
  if (o.event_loop_threads < 1) {
    refuse.must_be("event_loop_threads", ">= 1", std::to_string(o.event_loop_threads));
  }
  if (o.worker_threads < 1)
    refuse.must_be("worker_threads", ">= 1", std::to_string(o.worker_threads));
  const auto positive = [&](std::string_view field, std::chrono::milliseconds d) {
    if (d.count() <= 0) refuse.must_be(field, "> 0", format_duration(d));
  };
  positive("first_byte_timeout", o.first_byte_timeout);
  positive("header_timeout", o.header_timeout);
  positive("body_timeout", o.body_timeout);
  positive("idle_timeout", o.idle_timeout);
  positive("write_timeout", o.write_timeout);
  if (o.drain_timeout.count() < 0)
    refuse.must_be("drain_timeout", ">= 0", format_duration(o.drain_timeout));
  if (o.max_connections < 1) refuse.must_be("max_connections", ">= 1", "0");
  if (o.reserved_descriptors < 16) {
    refuse.must_be("reserved_descriptors", ">= 16", std::to_string(o.reserved_descriptors));
  }
  if (o.max_header_bytes < 64 || o.max_header_bytes > 0xffffffffu) {
    refuse.must_be("max_header_bytes", "in [64, 2^32)", std::to_string(o.max_header_bytes));
  }
  if (o.max_body_bytes < 1) refuse.must_be("max_body_bytes", ">= 1", "0");
}

std::optional<std::string> host_problem(const Request& request) {
  const std::size_t hosts = request.count(http::field::host);
  if (hosts > 1) return "the request has more than one Host header";
  if (hosts == 0) {
    if (request.version() >= 11) return "an HTTP/1.1 request must have a Host header";
    return std::nullopt;
  }
  const auto value = request[http::field::host];
  if (!valid_host(std::string_view(value.data(), value.size()))) {
    return "the Host header is not a host with an optional port";
  }
  return std::nullopt;
}

}  // namespace keel::store::beast::detail
