// keel::faults::FaultServer: a small HTTP/1.1 server on 127.0.0.1 that answers from a script of
// faults, for testing retrying clients over real loopback connections, and records every
// request it saw (arrival time, method, target, headers such as Idempotency-Key and
// Keel-Attempt).
//
// It works on raw sockets rather than cpp-httplib because several faults live below HTTP: a
// connection reset (RST) and "commit then drop" (read the request, then close without a
// response) need control of the socket that cpp-httplib does not expose.
//
// Script syntax (parse_fault_script): steps separated by commas, one per arrival, the last step
// repeating forever. A step is an action with optional "/"-separated modifiers and an optional
// "*N" repeat count:
//   200, 503, 429, ...        answer with this status (100 < status < 600)
//   hang                      read the request and never answer (until the client goes away)
//   reset                     read the request, then reset the connection (RST)
//   drop                      read the request ("commit"), then close without answering
//   /retry-after=SECONDS      add "Retry-After: SECONDS" (delta-seconds form)
//   /retry-after-date=SECONDS add Retry-After as an HTTP-date SECONDS from now (date form)
//   /delay=DURATION           wait this long (keel duration: 250ms, 1s) before acting
//   /body=TEXT                response body (no commas or slashes); default "ok\n" or the
//                             status's reason phrase
//   *N                        the step N times, for instance 503*2,200
// Requests to /_keel/... never consume a step: GET /_keel/log answers the recorded arrivals as
// JSON, POST /_keel/reset clears them and rewinds the script.
//
// Thread-safety: every public member is safe for concurrent use. Each connection has its own
// thread; arrivals are numbered in the order their requests were read.
//
// Example:
//   keel::faults::FaultServer server({.script = "503/retry-after=1,200"});
//   server.start();                                  // port 0: the kernel picks a free port
//   std::string url = server.url("/pay");            // "http://127.0.0.1:PORT/pay"
//   ... run a client ...
//   auto arrivals = server.arrivals();               // two, one second apart at least
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/clock.hpp"
#include "keel/core/expected.hpp"
#include "keel/http/client.hpp"

namespace keel::faults {

/// One step of a fault script.
struct FaultStep {
  enum class Action : unsigned char { kRespond, kHang, kReset, kDrop };
  Action action = Action::kRespond;
  /// Status for kRespond. Default 200.
  int status = 200;
  /// Seconds for the Retry-After header, when set.
  std::optional<std::int64_t> retry_after_seconds;
  /// Whether Retry-After is sent as an HTTP-date (now + retry_after_seconds). Default false.
  bool retry_after_as_date = false;
  /// Wait before acting. Default zero.
  Duration delay{};
  /// Response body; empty means a default text.
  std::string body;
  /// The step as written (for logs).
  std::string text;
};

/// Parses a script (syntax in the header comment). Returns an Error quoting the bad step when the
/// script is invalid (empty, unknown action, bad number, ...).
[[nodiscard]] Expected<std::vector<FaultStep>> parse_fault_script(std::string_view script);

/// One request the server read.
struct Arrival {
  int seq = 0;    // 1 for the first
  Duration at{};  // since the server started (steady time)
  std::string method;
  std::string target;  // path and query as sent
  http::Headers headers;
  std::string body;
  std::string step;    // the script step applied, as written
  int connection = 0;  // connections numbered from 1 in accept order
};

struct FaultServerOptions {
  /// The fault script. Requires: valid per parse_fault_script. Default "200".
  std::string script = "200";
  /// Port on 127.0.0.1; 0 lets the kernel choose (read it back with port()). Default 0.
  int port = 0;
};

class FaultServer {
 public:
  /// Throws std::invalid_argument naming the problem when the script or port is invalid.
  explicit FaultServer(FaultServerOptions options = {});
  /// Stops the server if it runs.
  ~FaultServer();
  FaultServer(const FaultServer&) = delete;
  FaultServer& operator=(const FaultServer&) = delete;

  /// Binds 127.0.0.1:port and starts accepting. Throws std::runtime_error with the system's
  /// reason when it cannot bind.
  void start();
  /// Closes the listener and every connection (hanging ones included) and joins the threads.
  /// Idempotent.
  void stop();

  /// The bound port (after start()).
  [[nodiscard]] int port() const noexcept;
  /// "http://127.0.0.1:PORT" + path.
  [[nodiscard]] std::string url(std::string_view path = "/") const;

  /// Replaces the script and rewinds it to its first step; keeps the recorded arrivals.
  /// Throws std::invalid_argument when the script is invalid.
  void set_script(std::string_view script);
  /// Forgets the recorded arrivals and rewinds the script.
  void reset();
  /// The arrivals so far, in order (requests to /_keel/ excluded).
  [[nodiscard]] std::vector<Arrival> arrivals() const;
  /// The arrivals as a JSON document: {"arrivals": [{"seq":1,"at_ms":0.4,"method":"GET",...}]}.
  [[nodiscard]] std::string log_json() const;
  /// Connections accepted so far.
  [[nodiscard]] int connections() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace keel::faults
