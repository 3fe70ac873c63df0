// keel::http::detail::IdlePool: idle libcurl handles (easy or multi) kept for reuse, up to a
// bound; what the blocking client's attempts and its hedged operations draw their handles from.
//
// Thread-safety: acquire, release and clear are safe to call concurrently.
#pragma once

#include <cstddef>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace keel::http::detail {

template <typename Handle>
class IdlePool {
 public:
  using Make = Handle* (*)();
  using Free = void (*)(Handle*);

  /// Keeps up to `max_idle` handles; `make` creates one (nullptr: failed, reported with `what`),
  /// `free` destroys one.
  IdlePool(std::size_t max_idle, Make make, Free free, const char* what)
      : max_idle_(max_idle), make_(make), free_(free), what_(what) {}
  ~IdlePool() { clear(); }
  IdlePool(const IdlePool&) = delete;
  IdlePool& operator=(const IdlePool&) = delete;

  /// An idle handle, or a new one. Throws std::runtime_error when libcurl cannot make one.
  [[nodiscard]] Handle* acquire() {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      if (!idle_.empty()) {
        Handle* h = idle_.back();
        idle_.pop_back();
        return h;
      }
    }
    Handle* h = make_();
    if (h == nullptr) throw std::runtime_error(std::string("keel::http: ") + what_ + " failed");
    return h;
  }

  /// Keeps `h` (with no transfer in it) for reuse while fewer than max_idle are kept; frees it
  /// otherwise.
  void release(Handle* h) noexcept {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      if (idle_.size() < max_idle_) {
        idle_.push_back(h);
        return;
      }
    }
    free_(h);
  }

  /// Frees every idle handle (before what they share, such as a curl share handle, goes).
  void clear() noexcept {
    std::lock_guard<std::mutex> guard(mutex_);
    for (Handle* h : idle_) free_(h);
    idle_.clear();
  }

 private:
  const std::size_t max_idle_;
  const Make make_;
  const Free free_;
  const char* what_;
  std::mutex mutex_;
  std::vector<Handle*> idle_;  // GUARDED_BY(mutex_)
};

}  // namespace keel::http::detail
