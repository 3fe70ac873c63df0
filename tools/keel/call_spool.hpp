// keel call's response spool: where the body goes while the call runs, so that it never sits in
// memory and a file named by --output is never left half-written. Part of the keel command, not
// a library.
//
// Thread-safety: not thread-safe; one per call.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/expected.hpp"

namespace keel::cli {

// The response body's destination while the call runs: a temporary file (next to --output's
// file, so that a rename publishes it, or in TMPDIR for stdout), emptied before each attempt so
// that only the final attempt's body remains. The body never sits in memory.
class Spool {
 public:
  Spool() = default;
  Spool(const Spool&) = delete;
  Spool& operator=(const Spool&) = delete;
  ~Spool() {
    if (fd_ >= 0) ::close(fd_);
    if (!path_.empty()) ::unlink(path_.c_str());
  }

  // Creates the file in `dir` (empty: TMPDIR or /tmp); the Error says why it could not.
  Expected<void> open(std::string dir) {
    if (dir.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      dir = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
    }
    path_ = dir + "/.keel-call.XXXXXX";
    fd_ = ::mkstemp(path_.data());
    if (fd_ < 0) {
      Error e{.field = "temporary file",
              .problem = std::string("cannot be created: ") + std::strerror(errno),
              .got = quote_value(path_)};
      path_.clear();
      return e;
    }
    return {};
  }
  bool restart() {
    if (::ftruncate(fd_, 0) != 0 || ::lseek(fd_, 0, SEEK_SET) != 0) return fail();
    return true;
  }
  bool write(std::string_view data) { return write_all(fd_, data) || fail(); }
  // Whether the first kSearchBytes of what was written since the last restart contain `text`.
  bool contains(std::string_view text) const {
    constexpr std::size_t kSearchBytes = 64 * 1024;
    std::string head(kSearchBytes, '\0');
    std::size_t got = 0;
    while (got < head.size()) {
      const ssize_t n = ::pread(fd_, head.data() + got, head.size() - got, static_cast<off_t>(got));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += static_cast<std::size_t>(n);
    }
    head.resize(got);
    return head.find(text) != std::string::npos;
  }
  [[nodiscard]] const std::string& error() const { return error_; }

  // Copies the spooled body to `out_fd` after `prefix`.
  bool copy_to(int out_fd, std::string_view prefix) {
    if (!write_all(out_fd, prefix)) return fail();
    if (::lseek(fd_, 0, SEEK_SET) != 0) return fail();
    std::vector<char> buf(1 << 16);
    for (;;) {
      const ssize_t n = ::read(fd_, buf.data(), buf.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return fail();
      if (n == 0) return true;
      if (!write_all(out_fd, std::string_view(buf.data(), static_cast<std::size_t>(n)))) {
        return fail();
      }
    }
  }

  // Publishes the spool as `target` (same directory): prefix then body, by a rename when there
  // is no prefix. Never a partial target file.
  bool publish(const std::string& target, std::string_view prefix) {
    if (!prefix.empty()) {
      Spool with_head;
      if (auto opened = with_head.open(directory_of(target)); !opened) {
        error_ = opened.error().message();
        return false;
      }
      if (!copy_to(with_head.fd_, prefix)) return false;
      return with_head.publish(target, {});
    }
    ::fchmod(fd_, 0644);
    if (::fsync(fd_) != 0 || ::close(fd_) != 0) {
      fd_ = -1;
      return fail();
    }
    fd_ = -1;
    if (std::rename(path_.c_str(), target.c_str()) != 0) return fail();
    path_.clear();
    return true;
  }

  static std::string directory_of(const std::string& path) {
    const std::filesystem::path p(path);
    return p.has_parent_path() ? p.parent_path().string() : ".";
  }

 private:
  static bool write_all(int fd, std::string_view data) {
    while (!data.empty()) {
      const ssize_t n = ::write(fd, data.data(), data.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      data.remove_prefix(static_cast<std::size_t>(n));
    }
    return true;
  }
  bool fail() {
    if (error_.empty()) error_ = std::strerror(errno);
    return false;
  }

  int fd_ = -1;
  std::string path_;
  std::string error_;
};

}  // namespace keel::cli
