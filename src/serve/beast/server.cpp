// keel::store::beast::Server: one Session per connection, on a strand of the event loop; each
// request read with deadlines per request (the first byte from the accept, the head from its first
// byte, the body from the end of the head), checked, routed, answered, then the next one (see
// keel/store/beast/server.hpp). Sessions not having a request handled wait in one list, oldest
// first, from which a new connection at the limit takes its slot.
#include "keel/store/beast/server.hpp"

#include <sys/resource.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/empty_body.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/write.hpp>
#include <cerrno>
#include <condition_variable>
#include <exception>
#include <future>
#include <iostream>
#include <list>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "keel/backoff.hpp"
#include "keel/duration.hpp"
#include "keel/expected.hpp"
#include "keel/random.hpp"
#include "keel/store/idempotency/idempotency_flow.hpp"
#include "serve/beast/detail/request_checks.hpp"

namespace keel::store::beast {
namespace {

namespace net = boost::asio;
namespace http = boost::beast::http;
using tcp = net::ip::tcp;
using SteadyTime = std::chrono::steady_clock::time_point;

/// Empty lines ignored before a request line (RFC 9112 section 2.2 asks for at least one); the
/// next one is answered 400.
constexpr std::size_t kMaxEmptyLines = 16;

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

}  // namespace

using detail::Session;

struct Server::Impl : std::enable_shared_from_this<Server::Impl> {
  explicit Impl(ServerOptions o) : options(std::move(o)) {
    detail::validate(options);
    if (!options.log) {
      options.log = [](std::string_view m) { std::cerr << "keel beast server: " << m << "\n"; };
    }
    limit = options.max_connections;
  }

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

  void start() {
    boost::system::error_code ignored;
    if (options_.tcp_nodelay) stream_.socket().set_option(tcp::no_delay(true), ignored);
    net::dispatch(executor(), [self = shared_from_this()] { self->wait_for_request(); });
  }

  // On the strand: stop() has begun.
  void drain() {
    draining_ = true;
    if (state_ == State::kIdle) close();
  }

  // On the strand: the drain timeout passed, the connection was evicted, or it failed. Whatever
  // request it had is abandoned.
  void close() {
    if (state_ == State::kClosed) return;
    state_ = State::kClosed;
    abandoned_->store(true, std::memory_order_release);
    server_->closed(*this);
    boost::system::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
  }

  // From any thread: the answer to the request in hand.
  void respond(Response res) {
    server_->post_to(*this, [self = shared_from_this(), res = std::move(res)]() mutable {
      self->write(std::move(res), /*close_after=*/false);
    });
  }

  // The registry's fields of this session (Server::Impl's, guarded by its mu).
  std::list<Session*>::iterator waiting_at;
  bool registered = true;
  bool waiting = false;
  bool evicted = false;

 private:
  void wait_for_request() {
    if (state_ == State::kClosed) return;
    state_ = State::kIdle;
    if (draining_ || server_->draining.load(std::memory_order_relaxed)) return close();
    if (!server_->wait(*this)) return close();
    // The first request's first byte is due first_byte_timeout after the accept (its head
    // header_timeout after it); a later one's first byte idle_timeout after the last answer.
    first_byte_due_ =
        first_ ? accepted_ + std::min(options_.first_byte_timeout, options_.header_timeout)
               : std::chrono::steady_clock::now() + options_.idle_timeout;
    if (buffer_.size() > 0) return start_head();  // a pipelined request is already here
    read_more();
  }

  // Reads what comes before the request line, by the first byte's deadline.
  void read_more() {
    stream_.expires_at(first_byte_due_);
    stream_.async_read_some(
        buffer_.prepare(4096),
        [self = shared_from_this()](boost::system::error_code ec, std::size_t n) {
          self->buffer_.commit(n);
          if (ec || n == 0) return self->close();
          self->start_head();
        });
  }

  // Bytes have come: skips the empty lines before a request line (RFC 9112 section 2.2), then
  // reads the head.
  void start_head() {
    while (buffer_.size() > 0) {
      const auto* bytes = static_cast<const char*>(buffer_.data().data());
      std::size_t line = 0;
      if (bytes[0] == '\n') {
        line = 1;
      } else if (bytes[0] == '\r' && buffer_.size() >= 2 && bytes[1] == '\n') {
        line = 2;
      } else {
        break;
      }
      buffer_.consume(line);
      if (++empty_lines_ > kMaxEmptyLines) {
        return refuse(400, "the request line is preceded by more than " +
                               std::to_string(kMaxEmptyLines) + " empty lines");
      }
    }
    const bool only_empty_lines =
        buffer_.size() == 0 ||
        (buffer_.size() == 1 && *static_cast<const char*>(buffer_.data().data()) == '\r');
    if (only_empty_lines) return read_more();
    empty_lines_ = 0;
    state_ = State::kReading;
    if (!first_) head_started_ = std::chrono::steady_clock::now();
    read_head();
  }

  void read_head() {
    parser_.emplace();
    parser_->header_limit(static_cast<std::uint32_t>(options_.max_header_bytes));
    parser_->body_limit(options_.max_body_bytes);
    stream_.expires_at(head_started_ + options_.header_timeout);
    http::async_read_header(stream_, buffer_, *parser_,
                            [self = shared_from_this()](boost::system::error_code ec, std::size_t) {
                              self->on_head(ec);
                            });
  }

  void on_head(boost::system::error_code ec) {
    if (ec) return read_failed(ec);
    const Request& req = parser_->get();
    version_ = req.version();  // a refusal answers in the request's version, without a body to HEAD
    head_request_ = req.method() == http::verb::head;
    const std::size_t lengths = req.count(http::field::content_length);
    const std::size_t codings = req.count(http::field::transfer_encoding);
    if (lengths > 1) return refuse(400, "the request has more than one Content-Length header");
    if (lengths == 1 && codings > 0) {
      return refuse(400, "the request has both Content-Length and Transfer-Encoding");
    }
    if (codings > 1) return refuse(400, "the request has more than one Transfer-Encoding header");
    if (codings == 1 && !boost::beast::iequals(req[http::field::transfer_encoding], "chunked")) {
      return refuse(400, "the only Transfer-Encoding accepted is chunked");
    }
    if (auto problem = host_problem(req)) return refuse(400, *problem);
    if (const auto length = parser_->content_length();
        length && *length > options_.max_body_bytes) {
      return refuse(413, "the request body is " + std::to_string(*length) +
                             " bytes; the limit is " + std::to_string(options_.max_body_bytes) +
                             " bytes");
    }
    // An HTTP/1.0 client's expectation is ignored (RFC 9110 section 10.1.1): it may not know 1xx.
    if (req.version() >= 11 && boost::beast::iequals(req[http::field::expect], "100-continue") &&
        !parser_->is_done()) {
      continue_.emplace(http::status::continue_, req.version());
      stream_.expires_after(options_.write_timeout);
      http::async_write(stream_, *continue_,
                        [self = shared_from_this()](boost::system::error_code failed, std::size_t) {
                          if (failed) return self->close();
                          self->read_body();
                        });
      return;
    }
    read_body();
  }

  void read_body() {
    if (parser_->is_done()) return dispatch();
    stream_.expires_after(options_.body_timeout);
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](boost::system::error_code ec, std::size_t) {
                       if (ec) return self->read_failed(ec);
                       self->dispatch();
                     });
  }

  void read_failed(boost::system::error_code ec) {
    if (ec == http::error::header_limit) {
      return refuse(431, "the request head is over the server's limit of " +
                             std::to_string(options_.max_header_bytes) + " bytes");
    }
    if (ec == http::error::body_limit) {
      return refuse(413, "the request body is over the server's limit of " +
                             std::to_string(options_.max_body_bytes) + " bytes");
    }
    // A deadline that passed (the slow client is cut without an answer), the peer gone, or a
    // cancel from stop() or an eviction.
    if (ec == boost::beast::error::timeout || ec == http::error::end_of_stream ||
        ec == http::error::partial_message || ec == net::error::eof ||
        ec == net::error::operation_aborted || ec == net::error::connection_reset ||
        ec == net::error::bad_descriptor) {
      return close();
    }
    refuse(400, "the request could not be parsed: " + ec.message());
  }

  void refuse(int status, const std::string& detail) {
    write(problem_response(status, problem_title(status), detail), /*close_after=*/true);
  }

  void dispatch() {
    // Evicted while its request was read, or stop() is closing every connection.
    if (server_->closing.load(std::memory_order_acquire) || !server_->handle(*this)) return close();
    state_ = State::kHandling;
    Request req = parser_->release();
    parser_.reset();
    version_ = req.version();
    keep_alive_ = req.keep_alive();
    head_request_ = req.method() == http::verb::head;
    const std::string_view target(req.target().data(), req.target().size());
    const std::string_view path = target.substr(0, target.find('?'));
    const Route* route = nullptr;
    const Route* get_route = nullptr;  // what a HEAD without a route of its own is answered by
    std::vector<http::verb> methods;
    for (const Route& r : server_->routes) {
      if (!r.matches(path)) continue;
      if (r.method == req.method()) {
        route = &r;
        break;
      }
      if (r.method == http::verb::get && get_route == nullptr) get_route = &r;
      if (std::find(methods.begin(), methods.end(), r.method) == methods.end()) {
        methods.push_back(r.method);
      }
    }
    if (route == nullptr && head_request_) route = get_route;
    if (route == nullptr) {
      if (methods.empty()) {
        return write(
            problem_response(404, problem_title(404), "no resource at this path", version_), false);
      }
      // A GET route answers HEAD too: Allow says so, after GET.
      const auto get = std::find(methods.begin(), methods.end(), http::verb::get);
      if (get != methods.end() &&
          std::find(methods.begin(), methods.end(), http::verb::head) == methods.end()) {
        methods.insert(get + 1, http::verb::head);
      }
      std::string allow;
      for (const http::verb m : methods) {
        if (!allow.empty()) allow += ", ";
        allow += std::string(http::to_string(m));
      }
      Response res = problem_response(
          405, problem_title(405),
          std::string(req.method_string()) + " is not allowed on this path; allowed: " + allow,
          version_);
      res.set(http::field::allow, allow);
      return write(std::move(res), false);
    }
    watch_peer();
    try {
      route->handler(
          std::move(req),
          Respond([self = shared_from_this()](Response res) { self->respond(std::move(res)); },
                  abandoned_));
    } catch (const std::exception& e) {
      server_->options.log(std::string("a handler threw: ") + e.what());
      write(problem_response(500, problem_title(500), "the server failed to handle the request",
                             version_),
            false);
    }
  }

  // While its request is handled, the connection is watched for the client going away: an end of
  // stream or an error closes it, which abandons the request. Bytes that come (the next pipelined
  // request) end the watch, and are read after the answer.
  void watch_peer() {
    watching_ = true;
    stream_.socket().async_wait(
        tcp::socket::wait_read,
        [self = shared_from_this(), generation = ++watch_generation_](
            boost::system::error_code ec) { self->on_peer_readable(ec, generation); });
  }

  void on_peer_readable(boost::system::error_code ec, std::uint64_t generation) {
    if (ec || !watching_ || generation != watch_generation_ || state_ != State::kHandling) return;
    char byte = 0;
    const ssize_t n = ::recv(stream_.socket().native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0) {
      watching_ = false;
      return;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return watch_peer();
    close();  // end of stream or a reset: nobody will read the answer
  }

  void write(Response res, bool close_after) {
    if (state_ == State::kClosed || state_ == State::kWriting) return;
    if (watching_) {
      watching_ = false;
      boost::system::error_code ignored;
      stream_.socket().cancel(ignored);  // the watch is the only operation pending now
    }
    if (res.result_int() == 0) return close();  // no_answer(): nothing is sent
    state_ = State::kWriting;
    const bool keep = !close_after && options_.keep_alive && keep_alive_ && !draining_ &&
                      !server_->draining.load(std::memory_order_relaxed);
    res.version(version_);
    res.keep_alive(keep);
    res.prepare_payload();
    if (head_request_) res.body().clear();  // Content-Length stays that of the GET answer
    auto message = std::make_shared<Response>(std::move(res));
    stream_.expires_after(options_.write_timeout);
    http::async_write(
        stream_, *message,
        [self = shared_from_this(), message, keep](boost::system::error_code ec, std::size_t) {
          if (ec) return self->close();
          if (!keep) return self->linger();
          self->first_ = false;
          self->head_request_ = false;
          self->wait_for_request();
        });
  }

  // Closes after an answer without losing it: shut down our side, then read and drop what the
  // client still sends (the rest of a refused body) for a short while, so that the kernel does
  // not answer those bytes with a reset that could discard the answer before the client reads it.
  // The connection may be evicted meanwhile: it holds no request.
  void linger() {
    state_ = State::kWriting;
    if (!server_->wait(*this)) return close();
    boost::system::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    stream_.expires_after(
        std::min<std::chrono::milliseconds>(options_.write_timeout, std::chrono::seconds(2)));
    discard();
  }

  void discard() {
    stream_.async_read_some(
        net::buffer(scratch_),
        [self = shared_from_this()](boost::system::error_code ec, std::size_t n) {
          self->discarded_ += n;
          if (ec || self->discarded_ > self->options_.max_body_bytes + 65536) return self->close();
          self->discard();
        });
  }

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

std::shared_ptr<Session> Server::Impl::admit(tcp::socket& socket,
                                             std::shared_ptr<Session>& victim) {
  std::lock_guard lock(mu);
  if (stopping) return nullptr;
  const std::size_t in_force = limit.load(std::memory_order_relaxed);
  if (sessions.size() - evicting >= in_force) victim = evict_oldest_locked();
  if (sessions.size() - evicting >= in_force) return nullptr;
  const std::uint64_t id = next_id++;
  auto session = std::make_shared<Session>(shared_from_this(), std::move(socket), id);
  sessions.emplace(id, session);
  session->waiting_at = waiting.insert(waiting.end(), session.get());
  session->waiting = true;
  return session;
}

std::shared_ptr<Session> Server::Impl::evict_oldest_locked() {
  for (auto it = waiting.begin(); it != waiting.end(); ++it) {
    Session* s = *it;
    // A session being destroyed (its destructor waits for mu) leaves by itself.
    std::shared_ptr<Session> alive = s->weak_from_this().lock();
    if (!alive) continue;
    waiting.erase(it);
    s->waiting = false;
    s->evicted = true;
    ++evicting;
    return alive;
  }
  return nullptr;
}

bool Server::Impl::wait(Session& s) {
  std::lock_guard lock(mu);
  if (s.evicted) return false;
  if (!s.waiting) {
    s.waiting_at = waiting.insert(waiting.end(), &s);
    s.waiting = true;
  }
  return true;
}

bool Server::Impl::handle(Session& s) {
  std::lock_guard lock(mu);
  if (s.evicted) return false;
  if (s.waiting) {
    waiting.erase(s.waiting_at);
    s.waiting = false;
  }
  return true;
}

void Server::Impl::closed(Session& s) {
  {
    std::lock_guard lock(mu);
    if (!s.registered) return;
    s.registered = false;
    sessions.erase(s.id());
    if (s.waiting) waiting.erase(s.waiting_at);
    s.waiting = false;
    if (s.evicted) --evicting;
  }
  all_closed.notify_all();
}

template <class Fn>
void Server::Impl::post_to(Session& s, Fn&& fn) {
  std::lock_guard lock(mu);
  if (!finished) net::post(s.executor(), std::forward<Fn>(fn));
}

void Server::Impl::accept() {
  acceptor->async_accept(
      net::make_strand(ioc), [this](boost::system::error_code ec, tcp::socket socket) {
        if (ec == net::error::operation_aborted || !acceptor->is_open()) return;
        if (ec) return accept_failed(ec);
        accept_backoff_delays.reset();
        // Sessions are only added here, on the acceptor's strand, so the count checked is the
        // count the new session joins (it can only have dropped meanwhile).
        std::shared_ptr<Session> victim;
        std::shared_ptr<Session> session = admit(socket, victim);
        if (victim) net::post(victim->executor(), [victim] { victim->close(); });
        if (session) {
          session->start();
        } else {
          boost::system::error_code ignored;
          socket.close(ignored);  // every connection has a request handled: closed at once
        }
        accept();
      });
}

void Server::Impl::accept_failed(boost::system::error_code ec) {
  const auto now = std::chrono::steady_clock::now();
  const bool log_now = now - accept_logged >= std::chrono::seconds(1);
  if (log_now) accept_logged = now;
  // Out of descriptors: the oldest connection that is not having a request handled gives its
  // descriptor to the one waiting in the backlog, and the accept is tried again once it is
  // closed.
  if (ec == net::error::no_descriptors ||
      ec == boost::system::errc::too_many_files_open_in_system) {
    std::shared_ptr<Session> victim;
    {
      std::lock_guard lock(mu);
      if (!stopping) victim = evict_oldest_locked();
    }
    if (victim) {
      if (log_now) {
        options.log("accept failed: " + ec.message() + "; closing the oldest idle connection");
      }
      net::post(victim->executor(), [this, victim] {
        victim->close();
        net::post(acceptor->get_executor(), [this] {
          if (acceptor->is_open()) accept();
        });
      });
      return;
    }
  }
  // Nothing to close, or another failure (memory): wait, jittered and growing while it lasts,
  // rather than spin on the same error.
  if (log_now) options.log("accept failed: " + ec.message());
  accept_backoff->expires_after(accept_backoff_delays.next());
  accept_backoff->async_wait([this](boost::system::error_code) {
    if (acceptor->is_open()) accept();
  });
}

void Server::Impl::fit_descriptors() {
  rlimit limits{};
  if (getrlimit(RLIMIT_NOFILE, &limits) != 0) return;
  const rlim_t wanted = static_cast<rlim_t>(options.max_connections) +
                        static_cast<rlim_t>(options.reserved_descriptors);
  if (limits.rlim_cur == RLIM_INFINITY || limits.rlim_cur >= wanted) return;
  const rlim_t before = limits.rlim_cur;
  const rlim_t raised =
      limits.rlim_max == RLIM_INFINITY ? wanted : std::min(limits.rlim_max, wanted);
  if (raised > before) {
    limits.rlim_cur = raised;
    if (setrlimit(RLIMIT_NOFILE, &limits) != 0) limits.rlim_cur = before;
  }
  const rlim_t have = limits.rlim_cur;
  std::string line = "open files: ";
  if (have > before) {
    line += "raised the soft limit (RLIMIT_NOFILE) from " + std::to_string(before) + " to " +
            std::to_string(have);
  } else {
    line += "the limit (RLIMIT_NOFILE) is " + std::to_string(have);
  }
  if (have < wanted) {
    const std::size_t reserve = options.reserved_descriptors;
    const std::size_t fits = have > 2 * reserve ? static_cast<std::size_t>(have) - reserve
                                                : std::max<std::size_t>(1, have / 2);
    limit.store(std::min(options.max_connections, fits));
    line += " (hard limit " + std::to_string(limits.rlim_max) + "): serving at most " +
            std::to_string(limit.load()) + " connections, not max_connections " +
            std::to_string(options.max_connections);
  } else {
    line += ", enough for max_connections " + std::to_string(options.max_connections) + " and " +
            std::to_string(options.reserved_descriptors) + " other descriptors";
  }
  options.log(line);
}

void Server::Impl::run_worker(std::size_t index) {
  for (;;) {
    try {
      work->run();
      break;
    } catch (const std::exception& e) {
      options.log(std::string("worker: ") + e.what());
    }
  }
  bool drop_work = false;
  {
    std::lock_guard lock(mu);
    worker_returned[index] = 1;
    --workers_running;
    if (stranded > 0) --stranded;
    // The last worker stop() left behind drops the work never started (outside the lock: its
    // handlers hold sessions, whose destructors take it).
    drop_work = drop_work_on_last_return && workers_running == 0;
  }
  workers_done.notify_all();
  if (drop_work) work.reset();
}

void Server::Impl::start() {
  {
    std::lock_guard lock(mu);
    if (started || starting)
      throw std::logic_error("keel::store::beast::Server::start: called twice");
    starting = true;
  }
  try {
    const tcp::endpoint endpoint(net::ip::make_address(options.address), options.port);
    acceptor.emplace(net::make_strand(ioc));
    acceptor->open(endpoint.protocol());
    acceptor->set_option(net::socket_base::reuse_address(true));
    if (options.reuse_port) {
      acceptor->set_option(net::detail::socket_option::boolean<SOL_SOCKET, SO_REUSEPORT>(true));
    }
    acceptor->bind(endpoint);
    acceptor->listen(net::socket_base::max_listen_connections);
    port.store(acceptor->local_endpoint().port());
  } catch (...) {
    acceptor.reset();
    std::lock_guard lock(mu);
    starting = false;
    throw;
  }
  fit_descriptors();
  accept_backoff.emplace(acceptor->get_executor());
  guard.emplace(net::make_work_guard(ioc));
  work.emplace(options.worker_threads);
  work_guard.emplace(net::make_work_guard(*work));
  {
    std::lock_guard lock(mu);
    worker_returned.assign(static_cast<std::size_t>(options.worker_threads), 0);
    workers_running = static_cast<std::size_t>(options.worker_threads);
  }
  for (int i = 0; i < options.worker_threads; ++i) {
    // A worker holds the server's state: one left running by stop() may outlive the Server.
    worker_threads.emplace_back(
        [self = shared_from_this(), i] { self->run_worker(static_cast<std::size_t>(i)); });
  }
  net::post(acceptor->get_executor(), [this] { accept(); });
  for (int i = 0; i < options.event_loop_threads; ++i) {
    loop_threads.emplace_back([this] {
      for (;;) {
        try {
          ioc.run();
          return;
        } catch (const std::exception& e) {
          options.log(std::string("event loop: ") + e.what());
        }
      }
    });
  }
  std::lock_guard lock(mu);
  started = true;
}

void Server::Impl::stop() {
  {
    std::lock_guard lock(mu);
    if (!started || stopped) return;
    stopped = true;
  }
  // 1. No new connection: close the listener (on its strand) and wait until it is closed.
  std::promise<void> listener_closed;
  net::post(acceptor->get_executor(), [this, &listener_closed] {
    boost::system::error_code ignored;
    acceptor->close(ignored);
    accept_backoff->cancel();
    listener_closed.set_value();
  });
  listener_closed.get_future().wait();
  draining.store(true);

  // Posts `what` to every open session's strand; the shared_ptrs are dropped outside the lock
  // (a session's destructor takes it).
  const auto each_session = [this](auto what) {
    std::vector<std::shared_ptr<Session>> open;
    {
      std::lock_guard lock(mu);
      stopping = true;
      for (const auto& [id, weak] : sessions) {
        if (auto s = weak.lock()) open.push_back(std::move(s));
      }
    }
    for (auto& s : open) net::post(s->executor(), [s, what] { what(*s); });
  };

  // 2. Idle connections close, busy ones answer and close; wait for them up to drain_timeout.
  each_session([](Session& s) { s.drain(); });
  {
    std::unique_lock lock(mu);
    // wait: bound: the drain, at most drain_timeout
    all_closed.wait_for(lock, options.drain_timeout, [this] { return sessions.empty(); });
  }
  // 3. Whatever is left is closed, its request abandoned (a flow still running stops at its next
  // step and commits nothing). Work not started is dropped; the workers get kStopGrace to return,
  // and one still blocked in a handler after it is left behind.
  closing.store(true, std::memory_order_release);
  each_session([](Session& s) { s.close(); });
  work_guard.reset();
  work->stop();
  std::vector<std::thread> returned;
  std::size_t left = 0;
  {
    std::unique_lock lock(mu);
    // wait: bound: the handlers still running, at most kStopGrace
    workers_done.wait_for(lock, kStopGrace, [this] { return workers_running == 0; });
    for (std::size_t i = 0; i < worker_threads.size(); ++i) {
      if (worker_returned[i] != 0) {
        returned.push_back(std::move(worker_threads[i]));
      } else {
        worker_threads[i].detach();
        ++left;
      }
    }
    worker_threads.clear();
    stranded = left;
    drop_work_on_last_return = left > 0;
  }
  for (std::thread& t : returned) t.join();
  if (left > 0) {
    options.log("stop: " + std::to_string(left) +
                " worker thread(s) still blocked in a handler after the drain; their requests are "
                "abandoned and they are left to return on their own");
  }

  // 4. The event loop ends. What it still had queued runs here once (the sessions are closed:
  // it only lets them go), and from now on nothing more is posted to a session.
  guard.reset();
  ioc.stop();
  for (std::thread& t : loop_threads) t.join();
  loop_threads.clear();
  {
    std::lock_guard lock(mu);
    finished = true;
  }
  ioc.restart();
  for (int i = 0; i < 100 && ioc.poll() > 0; ++i) {
  }
  // 5. The work never started is dropped (its handlers hold sessions), unless a worker left
  // behind is still in that io_context: the last of them drops it.
  if (left == 0) work.reset();
}

Server::Server(ServerOptions options) : impl_(std::make_shared<Impl>(std::move(options))) {}

Server::~Server() { stop(); }

void Server::on(http::verb method, std::string path, LoopHandler handler) {
  Impl* impl = impl_.get();
  impl_->routes.push_back(
      {method, std::move(path),
       [impl, handler = std::move(handler)](const Request& request, const Respond& respond) {
         Response res;
         try {
           res = handler(request);
         } catch (const std::exception& e) {
           impl->options.log(std::string("a handler threw: ") + e.what());
           res = problem_response(500, problem_title(500),
                                  "the server failed to handle the request", request.version());
         }
         respond(std::move(res));
       }});
}

void Server::on_async(http::verb method, std::string path, AsyncHandler handler) {
  impl_->routes.push_back({method, std::move(path), std::move(handler)});
}

void Server::on_idempotent(http::verb method, std::string path, const IdempotentHandler& handler) {
  Impl* impl = impl_.get();
  impl_->routes.push_back(
      {method, std::move(path), [impl, &handler](Request request, Respond respond) {
         std::string principal = handler.principal(request);
         handler.async_handle(std::move(request), std::move(principal), handler.clock().now(),
                              impl->work->get_executor(), std::move(respond));
       }});
}

void Server::start() { impl_->start(); }

void Server::stop() { impl_->stop(); }

std::uint16_t Server::port() const noexcept { return impl_->port.load(); }

boost::asio::any_io_executor Server::worker_executor() const { return impl_->work->get_executor(); }

Response no_answer() {
  Response res;
  res.result(0);
  return res;
}

std::size_t Server::connections() const {
  std::lock_guard lock(impl_->mu);
  return impl_->sessions.size();
}

std::size_t Server::connection_limit() const noexcept { return impl_->limit.load(); }

std::size_t Server::stranded_workers() const {
  std::lock_guard lock(impl_->mu);
  return impl_->stranded;
}

}  // namespace keel::store::beast
