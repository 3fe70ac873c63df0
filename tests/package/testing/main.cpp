// A program that uses keel::testing through find_package(keel COMPONENTS testing): a scripted
// FaultServer on 127.0.0.1 that fails once, and keel::http::Client retrying through it.
#include <chrono>
#include <cstdio>
#include <keel/http/client.hpp>
#include <keel/testing/fault_server.hpp>

int main() {
  keel::testing::FaultServer server({.script = "503,200/body=up"});
  server.start();
  keel::http::Client client({.retry = {.max_attempts = 3,
                                       .backoff = {.base = std::chrono::milliseconds(1),
                                                   .cap = std::chrono::milliseconds(5)}}});
  const keel::http::Result r = client.send({.method = "GET", .url = server.url("/ping")});
  const std::size_t arrivals = server.arrivals().size();
  std::printf("HTTP %d after %d attempts, %zu arrivals\n", r.ok() ? r.response->status : 0,
              r.attempts, arrivals);
  return r.ok() && r.response->status == 200 && r.attempts == 2 && arrivals == 2 ? 0 : 1;
}
