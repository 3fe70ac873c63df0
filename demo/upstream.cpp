// `keel-demo upstream`: a flaky HTTP server on 127.0.0.1 that answers from a script of faults
// (keel::faults::FaultServer), to try retrying clients (keel call, curl, your service) against.
#include <signal.h>

#include <cstdio>
#include <ctime>
#include <memory>
#include <string>

#include "commands.hpp"
#include "keel/core/duration.hpp"
#include "keel/faults/fault_server.hpp"
#include "stop_signals.hpp"

namespace keel::cli {
namespace {

constexpr const char* kUpstreamFooter =
    R"(Script: steps separated by commas, one per request, the last one repeating forever.
A step is an action, optional /modifiers and an optional *N repeat:
  200, 503, 429, ...         answer with this status
  hang                       read the request and never answer
  reset                      read the request, then reset the connection (RST)
  drop                       read the request ("commit"), then close without answering
  /retry-after=SECONDS       add Retry-After: SECONDS
  /retry-after-date=SECONDS  add Retry-After as an HTTP-date SECONDS from now
  /delay=DURATION            wait before acting (250ms, 1s, ...)
  /body=TEXT                 response body (no commas or slashes)
  *N                         repeat the step N times

Examples:
  --script '503*2,200'                   two 503s, then 200 forever
  --script '429/retry-after=1,200'       throttle once for a second
  --script 'drop,200'                    commit the first request, drop its response

Control endpoints (they do not consume steps):
  GET  /_keel/log      the requests seen, as JSON (seq, at_ms, method, target, step,
                       idempotency_key, keel_attempt, headers)
  POST /_keel/reset    forget them and rewind the script
  POST /_keel/script   replace the script with the request body

Prints "listening on http://127.0.0.1:PORT" on stdout, then serves until SIGINT, SIGTERM or SIGHUP
(or --for elapses). Exit status: 0 after a clean stop, 2 invalid arguments, 1 cannot listen.)";

struct UpstreamArgs {
  int port = 0;
  std::string script = "200";
  std::string run_for;
  bool log_on_exit = false;
};

int run_upstream(const UpstreamArgs& a) {
  std::optional<Duration> run_for;
  if (!a.run_for.empty()) {
    const auto d = parse_duration_flag("--for", a.run_for, false);
    if (!d) {
      std::fprintf(stderr, "keel-demo upstream: %s\n", d.error().message().c_str());
      return kExitUsage;
    }
    run_for = *d;
  }
  if (const auto script = faults::parse_fault_script(a.script); !script) {
    std::fprintf(stderr, "keel-demo upstream: --script: %s\n", script.error().message().c_str());
    return kExitUsage;
  }
  // Block the stop signals in every thread (the server's threads inherit the mask) and wait for
  // them here.
  sigset_t stop_signals = block_stop_signals();

  faults::FaultServer server({.script = a.script, .port = a.port});
  server.start();
  std::printf("keel-demo upstream: listening on http://127.0.0.1:%d (script %s)\n", server.port(),
              a.script.c_str());
  std::fflush(stdout);
  if (run_for) {
    const auto secs = std::chrono::duration_cast<std::chrono::seconds>(*run_for);
    timespec timeout{static_cast<time_t>(secs.count()),
                     static_cast<long>((*run_for - secs).count())};
    (void)sigtimedwait(&stop_signals, nullptr, &timeout);
  } else {
    int sig = 0;
    (void)sigwait(&stop_signals, &sig);
  }
  server.stop();
  if (a.log_on_exit) {
    std::printf("%s\n", server.log_json().c_str());
    std::fflush(stdout);
  }
  return 0;
}

void add_upstream_flags(CLI::App* sub, UpstreamArgs& a) {
  sub->add_option("--port", a.port, "Port on 127.0.0.1 (0: any free port)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  sub->add_option("--script", a.script, "The fault script (see below)")->capture_default_str();
  sub->add_option("--for", a.run_for,
                  "Stop after this long (default: until SIGINT/SIGTERM/SIGHUP)");
  sub->add_flag("--log-on-exit", a.log_on_exit, "Print the JSON log of requests when stopping");
}

}  // namespace

Runner add_upstream(CLI::App& app) {
  return add_command<UpstreamArgs>(
      app, "upstream", "Run a fault-injecting HTTP server on 127.0.0.1 that answers from a script",
      kUpstreamFooter, add_upstream_flags, run_upstream);
}

}  // namespace keel::cli
