// The upstream of the HTTP benchmarks: one keel::faults::FaultServer on 127.0.0.1 answering 200
// to everything, started on first use and never stopped (it serves the whole run).
#pragma once

#include "keel/faults/fault_server.hpp"

namespace keel::bench {

inline faults::FaultServer& server() {
  static auto* s = [] {
    auto* srv = new faults::FaultServer({.script = "200"});
    srv->start();
    return srv;
  }();
  return *s;
}

}  // namespace keel::bench
