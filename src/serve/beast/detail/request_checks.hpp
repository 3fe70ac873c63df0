// The checks of a server's options and of a request's Host that need no server
// (keel/serve/beast/server.hpp): pure functions, safe from any thread. Private to
// keel::store_beast.
#pragma once

#include <optional>
#include <string>

#include "keel/serve/beast/server.hpp"

namespace keel::store::beast::detail {

/// Throws std::invalid_argument naming the field when an option breaks its Requires line.
void validate(const ServerOptions& o);

/// Why `request`'s Host is refused (RFC 9112 section 3.2: 400 to an HTTP/1.1 request without
/// one, and to any request with more than one or an invalid one); nullopt when it is not.
std::optional<std::string> host_problem(const Request& request);

}  // namespace keel::store::beast::detail
