// The scripted Payments service as a process of its own, for tests that kill the server
// mid-call: every call is answered OK after --delay-ms; each arrival appends a line
// "<idempotency-key> <grpc-previous-rpc-attempts or 0>" to --arrivals-file (flushed at once);
// the port it listens on is written to --port-file once it serves.
//
//   grpc_test_server --port N --port-file F --arrivals-file F [--delay-ms D]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <string_view>
#include <thread>

#include "scripted_payments.hpp"

int main(int argc, char** argv) {
  int port = 0;
  std::string port_file;
  std::string arrivals_file;
  long delay_ms = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view flag = argv[i];
    if (flag == "--port") {
      port = std::atoi(argv[i + 1]);
    } else if (flag == "--port-file") {
      port_file = argv[i + 1];
    } else if (flag == "--arrivals-file") {
      arrivals_file = argv[i + 1];
    } else if (flag == "--delay-ms") {
      delay_ms = std::atol(argv[i + 1]);
    } else {
      std::fprintf(stderr, "grpc_test_server: unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  if (port_file.empty() || arrivals_file.empty()) {
    std::fprintf(stderr, "usage: grpc_test_server --port N --port-file F --arrivals-file F\n");
    return 2;
  }
  keel::test::PaymentsServer server(port);
  if (!server.started()) {
    std::fprintf(stderr, "grpc_test_server: could not listen on port %d\n", port);
    return 1;
  }
  server.service().script({}, {.code = ::grpc::StatusCode::OK,
                               .trailers = {},
                               .delay = std::chrono::milliseconds(delay_ms)});
  server.service().on_arrival([&](const keel::test::Arrival& a) {
    const auto key = a.metadata.find("idempotency-key");
    const auto previous = a.metadata.find("grpc-previous-rpc-attempts");
    std::ofstream out(arrivals_file, std::ios::app);
    out << (key != a.metadata.end() ? key->second : "-") << ' '
        << (previous != a.metadata.end() ? previous->second : "0") << std::endl;
  });
  {
    const std::string tmp = port_file + ".tmp";
    std::ofstream(tmp) << server.port() << '\n';
    std::rename(tmp.c_str(), port_file.c_str());
  }
  server.server().Wait();
  return 0;
}
