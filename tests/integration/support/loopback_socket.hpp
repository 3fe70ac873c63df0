// A TCP socket of the test's own on an ephemeral port of 127.0.0.1, for what a server cannot
// show: a port that refuses connections (ClosedPort), a port held by another listener, or a
// peer that never answers (the kernel completes handshakes from the backlog; nobody accepts).
#pragma once

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

namespace keel::test {

class LoopbackSocket {
 public:
  /// Bound to 127.0.0.1:0; listening (with `backlog`) when `listen`.
  explicit LoopbackSocket(bool listen = true, int backlog = 16)
      : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    if (listen) {
      EXPECT_EQ(::listen(fd_, backlog), 0);
    }
    socklen_t len = sizeof addr;
    EXPECT_EQ(::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len), 0);
    port_ = ntohs(addr.sin_port);
  }
  ~LoopbackSocket() { close(); }
  LoopbackSocket(const LoopbackSocket&) = delete;
  LoopbackSocket& operator=(const LoopbackSocket&) = delete;

  [[nodiscard]] int port() const noexcept { return port_; }
  /// "127.0.0.1:PORT".
  [[nodiscard]] std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  [[nodiscard]] std::string url(const std::string& path = "/") const {
    return "http://" + address() + path;
  }
  void close() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
  int port_ = 0;
};

/// A port on 127.0.0.1 that refuses connections for as long as this object lives: a socket bound
/// to it that never listens. Linux answers a SYN to such a port with a RST (connection refused),
/// and the bound socket keeps the port reserved: no other socket (a server of a test running in
/// parallel, a client's ephemeral port) can take it meanwhile, as one could once a probe socket
/// had been closed.
class ClosedPort {
 public:
  [[nodiscard]] int port() const noexcept { return socket_.port(); }
  /// "http://127.0.0.1:PORT" + `path`.
  [[nodiscard]] std::string url(const std::string& path = "/") const { return socket_.url(path); }

 private:
  LoopbackSocket socket_{/*listen=*/false};
};

}  // namespace keel::test
