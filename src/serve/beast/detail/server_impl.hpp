// Server::Impl, a server's state (its routes, the session registry, the event loop and the worker
// threads), and detail::Session, one connection. Private to keel::store_beast: Impl's start, stop
// and accept loop are server_lifecycle.cpp, its session registry session_registry.cpp, a
// Session's requests session.cpp.
#pragma once

#include <array>
#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/empty_body.hpp>
#include <boost/beast/http/parser.hpp>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "keel/core/backoff.hpp"
#include "keel/core/random.hpp"
#include "keel/serve/beast/server.hpp"

namespace keel::store::beast {

// Names for the files of this server only: the header is private to the target.
namespace net = boost::asio;
namespace http = boost::beast::http;
using tcp = net::ip::tcp;
using SteadyTime = std::chrono::steady_clock::time_point;

namespace detail {

/// Where a connection is: waiting for a request's first byte, reading it, having it handled,
/// writing the answer, or closed. stop() closes the idle ones at once and lets the others answer.
enum class State : unsigned char { kIdle, kReading, kHandling, kWriting, kClosed };

struct Route {
  http::verb method;
  std::string path;
  AsyncHandler handler;

  // `path` exactly, or under it when the route's path ends in "/*".
  [[nodiscard]] bool matches(std::string_view target_path) const {
    const std::string_view p(path);
    if (p.size() >= 2 && p.substr(p.size() - 2) == "/*") {
      const std::string_view prefix = p.substr(0, p.size() - 1);
      return target_path.size() > prefix.size() && target_path.substr(0, prefix.size()) == prefix;
    }
    return p == target_path;
  }
};

}  // namespace detail

using detail::Route;
using detail::Session;

struct Server::Impl : std::enable_shared_from_this<Server::Impl> {
  explicit Impl(ServerOptions o);

  void accept();
  void accept_failed(boost::system::error_code ec);
  void fit_descriptors();
  void start();
  void stop();

  // The session registry, each under mu: a session joins `waiting` (at its end) when it starts to
  // wait for a request, leaves it when its request is handed to its handler, and a session taken
  // from it to make room is marked evicted, which it finds at its next step.
  /// A new session, registered and waiting; nullptr past the limit with nobody to evict (then
  /// `victim` is unset too) or while stopping.
  [[nodiscard]] std::shared_ptr<Session> admit(tcp::socket& socket,
                                               std::shared_ptr<Session>& victim);
  /// The oldest waiting session, marked evicted and taken out of `waiting`; nullptr when none.
  /// Requires: mu held.
  [[nodiscard]] std::shared_ptr<Session> evict_oldest_locked();
  /// `s` waits for a request (joins the end of `waiting` unless it is there); false when it was
  /// evicted (it must close).
  [[nodiscard]] bool wait(Session& s);
  /// `s`'s request is handled (it leaves `waiting`); false when it was evicted.
  [[nodiscard]] bool handle(Session& s);
  /// `s` closed (or is destroyed): it leaves the registry, its slot free (a Respond may keep the
  /// object a while longer).
  void closed(Session& s);
  /// Posts `fn` to `s`'s strand unless stop() has finished (then nothing is posted: nothing would
  /// ever run it).
  template <class Fn>
  void post_to(Session& s, Fn&& fn);
  /// The worker thread `index`'s body.
  void run_worker(std::size_t index);

  ServerOptions options;
  std::vector<Route> routes;  // written before start(), read-only after
  std::atomic<std::uint16_t> port{0};
  std::atomic<bool> draining{false};
  std::atomic<bool> closing{false};   // stop() closes every connection: no handler runs any more
  std::atomic<std::size_t> limit{0};  // the connection limit in force (set by start())

  mutable std::mutex mu;
  std::condition_variable all_closed;
  std::condition_variable workers_done;
  bool starting = false;      // guarded by mu: start() is binding
  bool started = false;       // guarded by mu
  bool stopped = false;       // guarded by mu
  bool stopping = false;      // guarded by mu: no new session once set
  bool finished = false;      // guarded by mu: stop() is done, nothing more is posted to a session
  std::uint64_t next_id = 0;  // guarded by mu
  std::unordered_map<std::uint64_t, std::weak_ptr<Session>> sessions;  // guarded by mu
  std::list<Session*> waiting;  // guarded by mu: oldest first; each erases itself when destroyed
  std::size_t evicting = 0;     // guarded by mu: evicted sessions not destroyed yet
  std::size_t workers_running = 0;        // guarded by mu
  std::vector<char> worker_returned;      // guarded by mu
  std::size_t stranded = 0;               // guarded by mu: left running by stop()
  bool drop_work_on_last_return = false;  // guarded by mu

  // Destroyed in reverse order: the worker io_context first (work it dropped may hold sessions,
  // whose sockets need the event loop's io_context), then the io_context (its pending handlers
  // may hold sessions, which unregister themselves from `sessions`).
  net::io_context ioc;
  std::optional<net::executor_work_guard<net::io_context::executor_type>> guard;
  std::optional<tcp::acceptor> acceptor;
  std::optional<net::steady_timer> accept_backoff;  // after a failed accept (EMFILE ...)
  // The wait after failed accepts in a row with no connection to close instead: core's full
  // jitter under ceilings from 10 ms up to 1 s, so a server out of descriptors neither spins nor
  // waits long once one is free. Touched only by the one accept in flight at a time.
  BackoffSequence accept_backoff_delays{
      {.base = std::chrono::milliseconds(10), .cap = std::chrono::seconds(1)}, random_seed()};
  SteadyTime accept_logged{};  // the last "accept failed" line: at most one a second
  std::vector<std::thread> loop_threads;
  // The worker threads run their own io_context, so that stop() can leave one blocked in a
  // handler behind (std::thread::detach) and still return.
  std::optional<net::io_context> work;
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work_guard;
  std::vector<std::thread> worker_threads;
};

namespace detail {

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(std::shared_ptr<Server::Impl> server, tcp::socket socket, std::uint64_t id)
      : server_(std::move(server)),
        options_(server_->options),
        stream_(std::move(socket)),
        id_(id),
        accepted_(std::chrono::steady_clock::now()),
        head_started_(accepted_) {}
  ~Session() { server_->closed(*this); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  [[nodiscard]] auto executor() { return stream_.get_executor(); }
  [[nodiscard]] std::uint64_t id() const noexcept { return id_; }

  void start();
  // On the strand: stop() has begun.
  void drain();
  // On the strand: the drain timeout passed, the connection was evicted, or it failed. Whatever
  // request it had is abandoned.
  void close();
  // From any thread: the answer to the request in hand.
  void respond(Response res);

  // The registry's fields of this session (Server::Impl's, guarded by its mu).
  std::list<Session*>::iterator waiting_at;
  bool registered = true;
  bool waiting = false;
  bool evicted = false;

 private:
  // A request's steps (session.cpp): waited for, its head and body read and checked, routed to
  // its handler while the peer is watched, its answer written; then the next request, or the
  // connection closed.
  void wait_for_request();
  void read_more();
  void start_head();
  void read_head();
  void on_head(boost::system::error_code ec);
  void read_body();
  void read_failed(boost::system::error_code ec);
  void refuse(int status, const std::string& detail);
  void dispatch();
  void watch_peer();
  void on_peer_readable(boost::system::error_code ec, std::uint64_t generation);
  void write(Response res, bool close_after);
  void linger();
  void discard();

  std::shared_ptr<Server::Impl> server_;  // the sockets need its io_context: it outlives them
  const ServerOptions& options_;
  boost::beast::tcp_stream stream_;
  boost::beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::optional<http::response<http::empty_body>> continue_;
  std::array<char, 8192> scratch_{};
  std::size_t discarded_ = 0;
  std::uint64_t id_;
  SteadyTime accepted_;
  SteadyTime head_started_;
  SteadyTime first_byte_due_;
  // Set when the connection closes; shared with each request's Respond (Respond::abandoned()).
  std::shared_ptr<std::atomic<bool>> abandoned_ = std::make_shared<std::atomic<bool>>(false);
  std::size_t empty_lines_ = 0;
  std::uint64_t watch_generation_ = 0;
  State state_ = State::kIdle;
  bool first_ = true;
  bool draining_ = false;
  bool keep_alive_ = true;
  bool head_request_ = false;
  bool watching_ = false;
  unsigned version_ = 11;
};

}  // namespace detail

template <class Fn>
void Server::Impl::post_to(Session& s, Fn&& fn) {
  std::lock_guard lock(mu);
  if (!finished) net::post(s.executor(), std::forward<Fn>(fn));
}

}  // namespace keel::store::beast
