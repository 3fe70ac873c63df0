// Private to keel::asio: libcurl's multi interface driven by an Asio executor. libcurl tells us
// which sockets to watch (CURLMOPT_SOCKETFUNCTION) and when to wake it (CURLMOPT_TIMERFUNCTION);
// the watches are async_wait()s on posix::stream_descriptors that borrow libcurl's sockets, the
// wake-up is one steady_timer, and readiness is reported back with curl_multi_socket_action. No
// thread is ever blocked: a transfer in flight is a registration in the reactor.
//
// The backstop: a transfer may carry a time by which it must have ended whatever libcurl does
// (its attempt's timeout plus a grace; libcurl's own transfer timeout normally ends it first).
// One sweep timer, armed every kBackstopSweep while such a transfer is in flight, aborts those
// past their time. It costs nothing per transfer beyond storing the time, where a timer raced
// against every transfer costs a coroutine, a parallel group and several allocations.
//
// Thread-safety: not thread-safe. Every member, and every async_perform, runs on the executor
// given at creation (one thread, or a strand).
#pragma once

#include <curl/curl.h>

#include <asio/any_io_executor.hpp>
#include <asio/associated_cancellation_slot.hpp>
#include <asio/associated_executor.hpp>
#include <asio/async_result.hpp>
#include <asio/executor_work_guard.hpp>
#include <asio/post.hpp>
#include <asio/steady_timer.hpp>
#include <chrono>
#include <deque>
#include <memory>
#include <type_traits>
#include <unordered_map>
#include <utility>

namespace keel::asio::detail {

/// A completion waiting for a transfer, type-erased (completion handlers are move-only).
class PendingTransfer {
 public:
  virtual ~PendingTransfer() = default;
  /// Posts the completion with `code`. `from_cancellation`: called from inside the cancellation
  /// slot's handler (which must then not be cleared).
  virtual void complete(CURLcode code, bool from_cancellation) = 0;
};

class CurlMulti : public std::enable_shared_from_this<CurlMulti> {
 public:
  using Backstop = std::chrono::steady_clock::time_point;
  /// No backstop.
  static constexpr Backstop kNoBackstop = Backstop::max();
  /// How often transfers are checked against their backstop while one is in flight: a transfer
  /// is aborted at most this long after its backstop.
  static constexpr std::chrono::milliseconds kBackstopSweep{50};

  /// Throws std::runtime_error when libcurl cannot create a multi handle.
  /// `max_transfers` > 0: at most that many transfers in libcurl at once, the others wait in
  /// a FIFO here (libcurl's own queue re-examines every waiting transfer whenever a connection
  /// frees, which is quadratic in its length).
  static std::shared_ptr<CurlMulti> create(::asio::any_io_executor executor,
                                           long max_host_connections, std::size_t max_transfers);
  ~CurlMulti();
  CurlMulti(const CurlMulti&) = delete;
  CurlMulti& operator=(const CurlMulti&) = delete;

  [[nodiscard]] const ::asio::any_io_executor& executor() const noexcept { return executor_; }
  /// Adds the easy handle; `pending` is completed once when the transfer ends or is aborted
  /// (with CURLE_ABORTED_BY_CALLBACK once `backstop` has passed, waiting for a slot included).
  void start(CURL* easy, std::unique_ptr<PendingTransfer> pending, Backstop backstop);
  /// Removes a transfer in flight and completes it with CURLE_ABORTED_BY_CALLBACK. No-op for a
  /// handle that is not in flight.
  void abort(CURL* easy, bool from_cancellation);
  /// Transfers started and not completed (in libcurl or waiting for a slot).
  [[nodiscard]] std::size_t in_flight() const noexcept { return pending_.size(); }

 private:
  struct Watch;
  explicit CurlMulti(::asio::any_io_executor executor);
  static int on_socket(CURL* easy, curl_socket_t s, int what, void* self, void* socketp);
  static int on_timer(CURLM* multi, long timeout_ms, void* self);
  void watch(curl_socket_t s, int what);
  void arm(const std::shared_ptr<Watch>& w, bool fresh);
  bool arm_direction(const std::shared_ptr<Watch>& w, bool in);
  void act(curl_socket_t s, int events);
  void drain();
  void add(CURL* easy);
  void finished(CURL* easy, CURLcode code, bool from_cancellation);
  void promote();
  void arm_sweep();
  void sweep();

  struct Entry {
    std::unique_ptr<PendingTransfer> pending;
    bool added = false;  // in libcurl (else waiting in waiting_)
    Backstop backstop = kNoBackstop;
  };

  ::asio::any_io_executor executor_;
  CURLM* multi_ = nullptr;
  ::asio::steady_timer timer_;
  ::asio::steady_timer sweep_;
  bool sweeping_ = false;  // sweep_ is armed
  std::unordered_map<curl_socket_t, std::shared_ptr<Watch>> watches_;
  std::unordered_map<CURL*, Entry> pending_;
  std::deque<CURL*> waiting_;
  std::size_t max_transfers_ = 0;
  std::size_t added_ = 0;
};

/// The PendingTransfer of one async_perform: its handler and the work that keeps its executor
/// alive until the completion is posted.
template <class Handler, class Work>
class PendingHandler final : public PendingTransfer {
 public:
  PendingHandler(Handler h, Work w, ::asio::cancellation_slot s)
      : handler_(std::move(h)), work_(std::move(w)), slot_(s) {}
  void complete(CURLcode code, bool from_cancellation) override {
    if (!from_cancellation && slot_.is_connected()) slot_.clear();
    auto ex = work_.get_executor();
    ::asio::post(ex, [h = std::move(handler_), code]() mutable { std::move(h)(code); });
    work_.reset();
  }

 private:
  Handler handler_;
  Work work_;
  ::asio::cancellation_slot slot_;
};

/// Runs `easy` to completion on `multi`; completes with the transfer's CURLcode
/// (CURLE_ABORTED_BY_CALLBACK when cancelled through the token's cancellation slot, or once
/// `backstop` has passed).
template <class Token>
auto async_perform(const std::shared_ptr<CurlMulti>& multi, CURL* easy,
                   CurlMulti::Backstop backstop, Token&& token) {
  return ::asio::async_initiate<Token, void(CURLcode)>(
      [backstop](auto handler, std::shared_ptr<CurlMulti> m, CURL* e) {
        using Handler = std::decay_t<decltype(handler)>;
        auto slot = ::asio::get_associated_cancellation_slot(handler);
        auto work =
            ::asio::make_work_guard(::asio::get_associated_executor(handler, m->executor()));
        if (slot.is_connected()) {
          slot.assign([weak = std::weak_ptr<CurlMulti>(m), e](::asio::cancellation_type) {
            if (auto alive = weak.lock()) alive->abort(e, /*from_cancellation=*/true);
          });
        }
        m->start(e,
                 std::make_unique<PendingHandler<Handler, decltype(work)>>(std::move(handler),
                                                                           std::move(work), slot),
                 backstop);
      },
      token, multi, easy);
}

}  // namespace keel::asio::detail
