// Waiting in tests for what only another thread shows, such as a server having read a request:
// polled every 5 ms up to a bound, never a fixed sleep that assumes how fast the machine is.
#pragma once

#include <chrono>
#include <cstddef>
#include <thread>
#include <vector>

#include "keel/testing/fault_server.hpp"

namespace keel::test {

/// The server's arrivals once it has recorded at least `n` of them, or after 5 s. Each connection
/// has its own server thread, which records a request once it has read it: after a client gave up
/// on a request that got no answer, that thread may not have got that far yet.
inline std::vector<testing::Arrival> arrivals_at_least(const testing::FaultServer& server,
                                                       std::size_t n) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  std::vector<testing::Arrival> arrivals = server.arrivals();
  while (arrivals.size() < n && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    arrivals = server.arrivals();
  }
  return arrivals;
}

}  // namespace keel::test
