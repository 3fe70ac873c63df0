#include "curl_multi.hpp"

#include <poll.h>

#include <algorithm>
#include <asio/posix/stream_descriptor.hpp>
#include <chrono>
#include <stdexcept>
#include <system_error>
#include <vector>

namespace keel::asio::detail {

// One socket libcurl asked us to watch. The descriptor borrows libcurl's socket: it is released
// (never closed) when libcurl stops watching it, and libcurl closes it.
struct CurlMulti::Watch {
  Watch(const ::asio::any_io_executor& ex, curl_socket_t s) : fd(s), descriptor(ex, s) {}
  ~Watch() {
    if (!released) descriptor.release();
  }
  void release() {
    released = true;
    descriptor.release();  // cancels the pending waits (operation_aborted)
  }
  curl_socket_t fd;
  ::asio::posix::stream_descriptor descriptor;
  int what = 0;  // CURL_POLL_IN / OUT / INOUT
  bool reading = false;
  bool writing = false;
  bool released = false;
};

CurlMulti::CurlMulti(::asio::any_io_executor executor)
    : executor_(std::move(executor)), timer_(executor_), sweep_(executor_) {}

std::shared_ptr<CurlMulti> CurlMulti::create(::asio::any_io_executor executor,
                                             long max_host_connections, std::size_t max_transfers) {
  static const CURLcode global = curl_global_init(CURL_GLOBAL_DEFAULT);
  if (global != CURLE_OK) throw std::runtime_error("keel::asio: curl_global_init failed");
  std::shared_ptr<CurlMulti> self(new CurlMulti(std::move(executor)));
  self->max_transfers_ = max_transfers;
  self->multi_ = curl_multi_init();
  if (self->multi_ == nullptr) throw std::runtime_error("keel::asio: curl_multi_init failed");
  curl_multi_setopt(self->multi_, CURLMOPT_SOCKETFUNCTION, &CurlMulti::on_socket);
  curl_multi_setopt(self->multi_, CURLMOPT_SOCKETDATA, self.get());
  curl_multi_setopt(self->multi_, CURLMOPT_TIMERFUNCTION, &CurlMulti::on_timer);
  curl_multi_setopt(self->multi_, CURLMOPT_TIMERDATA, self.get());
  if (max_host_connections > 0) {
    curl_multi_setopt(self->multi_, CURLMOPT_MAX_HOST_CONNECTIONS, max_host_connections);
  }
  return self;
}

CurlMulti::~CurlMulti() {
  // Requires (documented on the client): nothing in flight. Handles still here are detached
  // without completing their handlers.
  for (auto& [easy, entry] : pending_) {
    if (entry.added) curl_multi_remove_handle(multi_, easy);
  }
  pending_.clear();
  waiting_.clear();
  // Closes the cached connections; the socket callback releases their watches.
  curl_multi_cleanup(multi_);
  for (auto& [fd, w] : watches_) w->release();
  watches_.clear();
}

void CurlMulti::start(CURL* easy, std::unique_ptr<PendingTransfer> pending, Backstop backstop) {
  pending_[easy] = Entry{std::move(pending), false, backstop};
  if (backstop != kNoBackstop && !sweeping_) arm_sweep();
  if (max_transfers_ == 0 || added_ < max_transfers_) {
    add(easy);
  } else {
    waiting_.push_back(easy);
  }
  // libcurl arms its timer (timeout 0) from add_handle; the transfer starts from on_timer.
}

void CurlMulti::add(CURL* easy) {
  auto it = pending_.find(easy);
  if (it == pending_.end()) return;
  if (curl_multi_add_handle(multi_, easy) != CURLM_OK) {
    auto pending = std::move(it->second.pending);
    pending_.erase(it);
    pending->complete(CURLE_FAILED_INIT, false);
    return;
  }
  it->second.added = true;
  ++added_;
}

void CurlMulti::finished(CURL* easy, CURLcode code, bool from_cancellation) {
  auto it = pending_.find(easy);
  if (it == pending_.end()) return;
  if (it->second.added) {
    curl_multi_remove_handle(multi_, easy);
    --added_;
  } else {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), easy));
  }
  auto pending = std::move(it->second.pending);
  pending_.erase(it);
  // Nothing left to sweep: do not keep the executor busy for it.
  if (pending_.empty() && sweeping_) {
    sweeping_ = false;
    sweep_.cancel();
  }
  pending->complete(code, from_cancellation);
}

void CurlMulti::promote() {
  while (!waiting_.empty() && (max_transfers_ == 0 || added_ < max_transfers_)) {
    CURL* next = waiting_.front();
    waiting_.pop_front();
    add(next);
  }
}

void CurlMulti::arm_sweep() {
  sweeping_ = true;
  sweep_.expires_after(kBackstopSweep);
  sweep_.async_wait([weak = weak_from_this()](const std::error_code& ec) {
    if (ec) return;
    if (auto alive = weak.lock()) alive->sweep();
  });
}

void CurlMulti::sweep() {
  sweeping_ = false;
  const Backstop now = std::chrono::steady_clock::now();
  std::vector<CURL*> late;
  bool more = false;
  for (const auto& [easy, entry] : pending_) {
    if (entry.backstop <= now) {
      late.push_back(easy);
    } else if (entry.backstop != kNoBackstop) {
      more = true;
    }
  }
  for (CURL* easy : late) finished(easy, CURLE_ABORTED_BY_CALLBACK, false);
  if (!late.empty()) promote();
  if (more) arm_sweep();
}

void CurlMulti::abort(CURL* easy, bool from_cancellation) {
  finished(easy, CURLE_ABORTED_BY_CALLBACK, from_cancellation);
  promote();
}

int CurlMulti::on_socket(CURL* /*easy*/, curl_socket_t s, int what, void* self, void* /*socketp*/) {
  static_cast<CurlMulti*>(self)->watch(s, what);
  return 0;
}

int CurlMulti::on_timer(CURLM* /*multi*/, long timeout_ms, void* self_ptr) {
  auto* self = static_cast<CurlMulti*>(self_ptr);
  if (timeout_ms < 0) {
    self->timer_.cancel();
    return 0;
  }
  // Never call socket_action from inside this callback: wake up from the event loop instead.
  self->timer_.expires_after(std::chrono::milliseconds(timeout_ms));
  self->timer_.async_wait([weak = self->weak_from_this()](const std::error_code& ec) {
    if (ec) return;
    if (auto alive = weak.lock()) alive->act(CURL_SOCKET_TIMEOUT, 0);
  });
  return 0;
}

void CurlMulti::watch(curl_socket_t s, int what) {
  if (what == CURL_POLL_REMOVE) {
    auto it = watches_.find(s);
    if (it != watches_.end()) {
      it->second->release();
      watches_.erase(it);
    }
    return;
  }
  auto& slot = watches_[s];
  if (!slot) slot = std::make_shared<Watch>(executor_, s);
  slot->what = what;
  arm(slot, /*fresh=*/true);
}

void CurlMulti::arm(const std::shared_ptr<Watch>& w, bool fresh) {
  if (w->released) return;
  short missed = 0;
  if (arm_direction(w, /*in=*/true)) missed |= POLLIN;
  (void)arm_direction(w, /*in=*/false);
  // The reactor watches edges: readiness that arrived while nobody waited for it (a response
  // that came in while libcurl was still writing) would never be reported. When libcurl starts
  // reading a socket, look once whether it is already readable.
  if (fresh && missed != 0) {
    pollfd p{w->fd, missed, 0};
    if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLERR | POLLHUP)) != 0) {
      ::asio::post(executor_, [weak = weak_from_this(), w] {
        auto self = weak.lock();
        if (!self || w->released || (w->what & CURL_POLL_IN) == 0) return;
        self->act(w->fd, CURL_CSELECT_IN);
      });
    }
  }
}

// Waits for the socket to be readable (`in`) or writable when libcurl asks for that and no such
// wait is pending; when it is, tells libcurl and arms again. Returns whether it began a wait.
bool CurlMulti::arm_direction(const std::shared_ptr<Watch>& w, bool in) {
  const int wanted = in ? CURL_POLL_IN : CURL_POLL_OUT;
  bool Watch::*const waiting = in ? &Watch::reading : &Watch::writing;
  if ((w->what & wanted) == 0 || (*w).*waiting) return false;
  (*w).*waiting = true;
  w->descriptor.async_wait(
      in ? ::asio::posix::stream_descriptor::wait_read
         : ::asio::posix::stream_descriptor::wait_write,
      [weak = weak_from_this(), w, in, wanted, waiting](const std::error_code& ec) {
        (*w).*waiting = false;
        if (ec || w->released) return;
        auto self = weak.lock();
        if (!self) return;
        if ((w->what & wanted) != 0) self->act(w->fd, in ? CURL_CSELECT_IN : CURL_CSELECT_OUT);
        self->arm(w, false);
      });
  return true;
}

void CurlMulti::act(curl_socket_t s, int events) {
  int running = 0;
  curl_multi_socket_action(multi_, s, events, &running);
  drain();
}

void CurlMulti::drain() {
  int left = 0;
  while (CURLMsg* msg = curl_multi_info_read(multi_, &left)) {
    if (msg->msg != CURLMSG_DONE) continue;
    CURL* easy = msg->easy_handle;
    const CURLcode code = msg->data.result;
    if (pending_.count(easy) == 0) {
      curl_multi_remove_handle(multi_, easy);
      continue;
    }
    finished(easy, code, false);
  }
  promote();
}

}  // namespace keel::asio::detail
