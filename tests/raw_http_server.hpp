// A tiny HTTP/1.1 server on 127.0.0.1 for tests that need a response FaultServer cannot script:
// a response head given verbatim (huge or malformed header fields, odd Retry-After values) and
// a body of any size generated as it is sent (hundreds of megabytes without holding them).
// One connection at a time, one request per connection, then the connection is closed; the
// replies are used in order, the last repeating. Test-only: blocking sockets, one thread.
#pragma once

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace keel::test {

class RawHttpServer {
 public:
  struct Reply {
    /// Sent verbatim first; must end with the blank line ("...\r\n\r\n").
    std::string head;
    /// Then this many bytes of `fill`.
    std::uint64_t body_bytes = 0;
    char fill = 'x';
  };

  explicit RawHttpServer(std::vector<Reply> replies) : replies_(std::move(replies)) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::listen(listen_fd_, 16) != 0) {
      throw std::runtime_error("RawHttpServer: cannot listen");
    }
    socklen_t len = sizeof addr;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~RawHttpServer() {
    stop_ = true;
    thread_.join();
    ::close(listen_fd_);
  }
  RawHttpServer(const RawHttpServer&) = delete;
  RawHttpServer& operator=(const RawHttpServer&) = delete;

  [[nodiscard]] std::string url(const std::string& path = "/") const {
    return "http://127.0.0.1:" + std::to_string(port_) + path;
  }
  /// Requests read so far.
  [[nodiscard]] int requests() const { return requests_.load(); }
  /// The request heads read so far, in order.
  [[nodiscard]] std::vector<std::string> heads() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return heads_;
  }

 private:
  void serve() {
    while (!stop_) {
      pollfd p{listen_fd_, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      const int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) continue;
      handle(fd);
      ::close(fd);
    }
  }

  void handle(int fd) {
    std::string request;
    char buf[4096];
    std::size_t end = std::string::npos;
    while ((end = request.find("\r\n\r\n")) == std::string::npos) {
      pollfd p{fd, POLLIN, 0};
      if (stop_ || ::poll(&p, 1, 2000) <= 0) return;
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) return;
      request.append(buf, static_cast<std::size_t>(n));
    }
    std::string head = request.substr(0, end + 4);
    std::size_t body = 0;
    std::string lower = head;
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (auto cl = lower.find("\r\ncontent-length:"); cl != std::string::npos) {
      body = std::strtoull(lower.c_str() + cl + 17, nullptr, 10);
    }
    std::size_t have = request.size() - head.size();
    while (have < body) {
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) return;
      have += static_cast<std::size_t>(n);
    }
    const int index = requests_.fetch_add(1);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      heads_.push_back(head);
    }
    const Reply& reply = replies_[std::min(static_cast<std::size_t>(index), replies_.size() - 1)];
    if (!send_all(fd, reply.head.data(), reply.head.size())) return;
    const std::string chunk(std::size_t{1} << 16, reply.fill);
    std::uint64_t left = reply.body_bytes;
    while (left > 0 && !stop_) {
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(left, chunk.size()));
      if (!send_all(fd, chunk.data(), n)) return;
      left -= n;
    }
  }

  static bool send_all(int fd, const char* data, std::size_t size) {
    while (size > 0) {
      const ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL);
      if (n <= 0) return false;
      data += n;
      size -= static_cast<std::size_t>(n);
    }
    return true;
  }

  std::vector<Reply> replies_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> requests_{0};
  mutable std::mutex mutex_;
  std::vector<std::string> heads_;  // GUARDED_BY(mutex_)
  std::thread thread_;
};

/// A response head with a Content-Length for `body_bytes` and any extra header lines.
inline std::string response_head(int status, std::uint64_t body_bytes,
                                 const std::string& extra_lines = "") {
  return "HTTP/1.1 " + std::to_string(status) +
         " X\r\nContent-Length: " + std::to_string(body_bytes) + "\r\nConnection: close\r\n" +
         extra_lines + "\r\n";
}

}  // namespace keel::test
