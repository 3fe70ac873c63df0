// A program that uses keel::faults through find_package(keel COMPONENTS faults): a scripted
// FaultServer on 127.0.0.1 that fails once, keel::http::Client retrying through it, and a Chaos
// decision applied to a cpp-httplib response (keel::faults's cpp-httplib found from the install).
#include <chrono>
#include <cstdio>
#include <keel/faults/chaos.hpp>
#include <keel/faults/fault_server.hpp>
#include <keel/http/client.hpp>

int main() {
  keel::faults::FaultServer server({.script = "503,200/body=up"});
  server.start();
  keel::http::Client client({.retry = {.max_attempts = 3,
                                       .backoff = {.base = std::chrono::milliseconds(1),
                                                   .cap = std::chrono::milliseconds(5)}}});
  const keel::http::Result r = client.send({.method = "GET", .url = server.url("/ping")});
  const std::size_t arrivals = server.arrivals().size();
  keel::faults::Chaos chaos({.fraction_503 = 1, .seed = 42});
  httplib::Request request;
  httplib::Response response;
  const bool injected =
      chaos.pre_routing(request, response) == httplib::Server::HandlerResponse::Handled &&
      response.status == 503 && chaos.injected(keel::faults::ChaosFault::k503) == 1;
  std::printf("HTTP %d after %d attempts, %zu arrivals\n", r.ok() ? r.response->status : 0,
              r.attempts, arrivals);
  return r.ok() && r.response->status == 200 && r.attempts == 2 && arrivals == 2 && injected ? 0
                                                                                             : 1;
}
