// Waiting in tests for what only another thread or process shows, such as a server having read a
// request or a file having appeared: polled every 5 ms up to a bound, never a fixed sleep that
// assumes how fast the machine is.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "keel/faults/fault_server.hpp"

namespace keel::test {

/// Whether `done()` holds within `bound`: polled every 5 ms, true as soon as it does.
template <class Predicate>
bool wait_until(Predicate done, std::chrono::milliseconds bound) {
  const auto give_up = std::chrono::steady_clock::now() + bound;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= give_up) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

/// Whether process `pid` has ended: gone from /proc, or a zombie (its parent, perhaps init after
/// its own parent died, has not reaped it yet; it runs no more code).
inline bool process_gone(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return true;
  const std::size_t end_of_name = stat.rfind(')');
  if (end_of_name == std::string::npos || end_of_name + 2 >= stat.size()) return true;
  const char state = stat[end_of_name + 2];
  return state == 'Z' || state == 'X';
}

/// The server's arrivals once it has recorded at least `n` of them, or after 5 s. Each connection
/// has its own server thread, which records a request once it has read it: after a client gave up
/// on a request that got no answer, that thread may not have got that far yet.
inline std::vector<faults::Arrival> arrivals_at_least(const faults::FaultServer& server,
                                                      std::size_t n) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  std::vector<faults::Arrival> arrivals = server.arrivals();
  while (arrivals.size() < n && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    arrivals = server.arrivals();
  }
  return arrivals;
}

}  // namespace keel::test
