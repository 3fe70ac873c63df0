// `keel call`: its flags (CallArgs, read by add_call in call_flags.cpp), the request they
// describe (call_request.cpp) and the call itself (call.cpp). Part of the keel command, not a
// library.
//
// Thread-safety: not thread-safe; one per call.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "call_hedge.hpp"
#include "keel/core/duration.hpp"
#include "keel/http/client.hpp"
#include "policy_flags.hpp"

namespace keel::cli::call_cli {

/// --duplicate-is-success STATUS[:TEXT]: the status, and the text the body must contain (empty:
/// any body).
struct DuplicateFlag {
  int status = 0;
  std::string text;
};

/// The flags of `keel call`, as read (checked values are typed; the rest is checked by
/// build_request and run_call).
struct CallArgs {
  std::string url;
  std::string method;
  std::optional<std::string> data;  // the body, or @FILE
  std::vector<std::string> headers;
  bool include = false;
  bool verbose = false;
  std::string output;
  PolicyFlags policy;
  Duration connect_timeout{};
  std::string idempotency_key = "auto";
  std::optional<DuplicateFlag> duplicate_is_success;
  std::string queue_on_failure;       // DB; empty: off
  std::string share_breakers;         // DB; empty: the call's own breakers
  std::optional<double> rate_limit;   // calls per second; none: no limit
  bool adaptive_concurrency = false;  // the host's calls in flight under an adaptive limit
  std::string defer_queue = "deferred-http";
  HedgeFlags hedge;
  // --secret-header NAME, repeatable: credentials besides Authorization, Cookie.
  std::vector<std::string> secret_headers;
};

/// Prints "keel call: MESSAGE" on stderr; returns kExitUsage.
int usage_error(const std::string& message);

/// The request the flags describe (method, header fields, body, Idempotency-Key); 0, or the exit
/// status after printing a usage error naming the flag.
int build_request(const CallArgs& a, http::Request& request);

/// Sends the call the flags describe and prints what it ended with; returns the exit status.
int run_call(const CallArgs& a);

}  // namespace keel::cli::call_cli
