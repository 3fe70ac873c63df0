// keel::store::beast::Server: one Session per connection, on a strand of the event loop; each
// request read with deadlines per request (the head from its first byte, the body from the end of
// the head), checked, routed, answered, then the next one (see keel/store/beast/server.hpp).
#include "keel/store/beast/server.hpp"

#include <algorithm>
#include <array>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/empty_body.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/write.hpp>
#include <condition_variable>
#include <exception>
#include <future>
#include <iostream>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "keel/backoff.hpp"
#include "keel/duration.hpp"
#include "keel/expected.hpp"
#include "keel/store/idempotency/idempotency_flow.hpp"

namespace keel::store::beast {
namespace {

namespace net = boost::asio;
namespace http = boost::beast::http;
using tcp = net::ip::tcp;
using SteadyTime = std::chrono::steady_clock::time_point;

void validate(const ServerOptions& o) {
  const auto fail = [](std::string_view field, std::string_view requirement, std::string got) {
    throw_invalid({.context = "keel::store::beast::ServerOptions",
                   .field = std::string(field),
                   .problem = "must be " + std::string(requirement),
                   .got = std::move(got)});
  };
  if (o.event_loop_threads < 1) {
    fail("event_loop_threads", ">= 1", std::to_string(o.event_loop_threads));
  }
  if (o.worker_threads < 1) fail("worker_threads", ">= 1", std::to_string(o.worker_threads));
  const auto positive = [&](std::string_view field, std::chrono::milliseconds d) {
    if (d.count() <= 0) fail(field, "> 0", format_duration(d));
  };
  positive("header_timeout", o.header_timeout);
  positive("body_timeout", o.body_timeout);
  positive("idle_timeout", o.idle_timeout);
  positive("write_timeout", o.write_timeout);
  if (o.drain_timeout.count() < 0) fail("drain_timeout", ">= 0", format_duration(o.drain_timeout));
  if (o.max_connections < 1) fail("max_connections", ">= 1", "0");
  if (o.max_header_bytes < 64 || o.max_header_bytes > 0xffffffffu) {
    fail("max_header_bytes", "in [64, 2^32)", std::to_string(o.max_header_bytes));
  }
  if (o.max_body_bytes < 1) fail("max_body_bytes", ">= 1", "0");
}

/// What a connection does when stop() tells it to drain: close when waiting for a request,
/// otherwise answer the request in hand and close.
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

struct Server::Impl {
  explicit Impl(ServerOptions o) : options(std::move(o)) {
    validate(options);
    if (!options.log) {
      options.log = [](std::string_view m) { std::cerr << "keel beast server: " << m << "\n"; };
    }
  }

  void accept();
  void start();
  void stop();
  void closed(std::uint64_t id);

  ServerOptions options;
  std::vector<Route> routes;  // written before start(), read-only after
  std::atomic<std::uint16_t> port{0};
  std::atomic<bool> draining{false};

  std::mutex mu;
  std::condition_variable all_closed;
  bool starting = false;      // guarded by mu: start() is binding
  bool started = false;       // guarded by mu
  bool stopped = false;       // guarded by mu
  bool stopping = false;      // guarded by mu: no new session once set
  std::uint64_t next_id = 0;  // guarded by mu
  std::unordered_map<std::uint64_t, std::weak_ptr<Session>> sessions;  // guarded by mu

  // Destroyed in reverse order: the worker pool first (work it dropped may hold sessions, whose
  // sockets need the io_context), then the io_context (its pending handlers may hold sessions,
  // which unregister themselves from `sessions`).
  net::io_context ioc;
  std::optional<net::executor_work_guard<net::io_context::executor_type>> guard;
  std::optional<tcp::acceptor> acceptor;
  std::optional<net::steady_timer> accept_backoff;  // after a failed accept (EMFILE ...)
  // The wait after failed accepts in a row: core's full jitter under ceilings from 10 ms up to
  // 1 s, so a server out of descriptors neither spins nor waits long once one is free. Touched
  // only by the one accept in flight at a time.
  Backoff accept_policy{{.base = std::chrono::milliseconds(10), .cap = std::chrono::seconds(1)}};
  Rng accept_rng{(std::uint64_t{std::random_device{}()} << 32) ^ std::random_device{}()};
  int accept_failures = 0;
  Duration accept_delay = Duration::zero();
  std::vector<std::thread> loop_threads;
  std::unique_ptr<net::thread_pool> workers;
};

namespace detail {

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(Server::Impl& server, tcp::socket socket, std::uint64_t id)
      : server_(server),
        options_(server.options),
        stream_(std::move(socket)),
        id_(id),
        head_started_(std::chrono::steady_clock::now()) {}
  ~Session() { server_.closed(id_); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  [[nodiscard]] auto executor() { return stream_.get_executor(); }

  void start() {
    boost::system::error_code ignored;
    if (options_.tcp_nodelay) stream_.socket().set_option(tcp::no_delay(true), ignored);
    net::dispatch(executor(), [self = shared_from_this()] { self->wait_for_request(); });
  }

  // On the strand: stop() has begun.
  void drain() {
    draining_ = true;
    if (state_ == State::kIdle) stream_.cancel();
  }

  // On the strand: the drain timeout passed.
  void close() {
    if (state_ == State::kClosed) return;
    state_ = State::kClosed;
    boost::system::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
  }

  // From any thread: the answer to the request in hand.
  void respond(Response res) {
    net::post(executor(), [self = shared_from_this(), res = std::move(res)]() mutable {
      self->write(std::move(res), /*close_after=*/false);
    });
  }

 private:
  void wait_for_request() {
    if (state_ == State::kClosed) return;
    state_ = State::kIdle;
    if (draining_ || server_.draining.load(std::memory_order_relaxed)) return close();
    if (buffer_.size() > 0) {  // a pipelined request is already here
      if (!first_) head_started_ = std::chrono::steady_clock::now();
      return read_head();
    }
    // The first request's head deadline runs from the accept; a later one waits idle_timeout for
    // its first byte, then has header_timeout for its head.
    if (first_) {
      stream_.expires_at(head_started_ + options_.header_timeout);
    } else {
      stream_.expires_after(options_.idle_timeout);
    }
    stream_.async_read_some(
        buffer_.prepare(4096),
        [self = shared_from_this()](boost::system::error_code ec, std::size_t n) {
          self->buffer_.commit(n);
          if (ec || n == 0) return self->close();
          if (!self->first_) self->head_started_ = std::chrono::steady_clock::now();
          self->read_head();
        });
  }

  void read_head() {
    state_ = State::kReading;
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
    if (const auto length = parser_->content_length();
        length && *length > options_.max_body_bytes) {
      return refuse(413, "the request body is " + std::to_string(*length) +
                             " bytes; the limit is " + std::to_string(options_.max_body_bytes) +
                             " bytes");
    }
    if (boost::beast::iequals(req[http::field::expect], "100-continue") && !parser_->is_done()) {
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
    // cancel from stop().
    if (ec == boost::beast::error::timeout || ec == http::error::end_of_stream ||
        ec == http::error::partial_message || ec == net::error::eof ||
        ec == net::error::operation_aborted || ec == net::error::connection_reset) {
      return close();
    }
    refuse(400, "the request could not be parsed: " + ec.message());
  }

  void refuse(int status, const std::string& detail) {
    write(problem_response(status, problem_title(status), detail), /*close_after=*/true);
  }

  void dispatch() {
    state_ = State::kHandling;
    Request req = parser_->release();
    parser_.reset();
    version_ = req.version();
    keep_alive_ = req.keep_alive();
    head_request_ = req.method() == http::verb::head;
    const std::string_view target(req.target().data(), req.target().size());
    const std::string_view path = target.substr(0, target.find('?'));
    const Route* route = nullptr;
    std::string allow;
    for (const Route& r : server_.routes) {
      if (!r.matches(path)) continue;
      if (r.method == req.method()) {
        route = &r;
        break;
      }
      if (!allow.empty()) allow += ", ";
      allow += std::string(http::to_string(r.method));
    }
    if (route == nullptr) {
      if (allow.empty()) {
        return write(
            problem_response(404, problem_title(404), "no resource at this path", version_), false);
      }
      Response res = problem_response(
          405, problem_title(405),
          std::string(req.method_string()) + " is not allowed on this path; allowed: " + allow,
          version_);
      res.set(http::field::allow, allow);
      return write(std::move(res), false);
    }
    try {
      route->handler(std::move(req),
                     [self = shared_from_this()](Response res) { self->respond(std::move(res)); });
    } catch (const std::exception& e) {
      server_.options.log(std::string("a handler threw: ") + e.what());
      write(problem_response(500, problem_title(500), "the server failed to handle the request",
                             version_),
            false);
    }
  }

  void write(Response res, bool close_after) {
    if (state_ == State::kClosed || state_ == State::kWriting) return;
    if (res.result_int() == 0) return close();  // no_answer(): nothing is sent
    state_ = State::kWriting;
    const bool keep = !close_after && options_.keep_alive && keep_alive_ && !draining_ &&
                      !server_.draining.load(std::memory_order_relaxed);
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
          self->wait_for_request();
        });
  }

  // Closes after an answer without losing it: shut down our side, then read and drop what the
  // client still sends (the rest of a refused body) for a short while, so that the kernel does
  // not answer those bytes with a reset that could discard the answer before the client reads it.
  void linger() {
    state_ = State::kWriting;
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

  Server::Impl& server_;
  const ServerOptions& options_;
  boost::beast::tcp_stream stream_;
  boost::beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::optional<http::response<http::empty_body>> continue_;
  std::array<char, 8192> scratch_{};
  std::size_t discarded_ = 0;
  std::uint64_t id_;
  SteadyTime head_started_;
  State state_ = State::kIdle;
  bool first_ = true;
  bool draining_ = false;
  bool keep_alive_ = true;
  bool head_request_ = false;
  unsigned version_ = 11;
};

}  // namespace detail

void Server::Impl::closed(std::uint64_t id) {
  {
    std::lock_guard lock(mu);
    sessions.erase(id);
  }
  all_closed.notify_all();
}

void Server::Impl::accept() {
  acceptor->async_accept(
      net::make_strand(ioc), [this](boost::system::error_code ec, tcp::socket socket) {
        if (ec == net::error::operation_aborted || !acceptor->is_open()) return;
        if (ec) {
          // Out of descriptors or memory: wait, jittered and growing while it lasts, rather
          // than spin on the same error.
          options.log("accept failed: " + ec.message());
          accept_delay = accept_policy.delay(accept_failures, accept_delay, accept_rng);
          accept_failures = std::min(accept_failures + 1, 30);
          accept_backoff->expires_after(accept_delay);
          accept_backoff->async_wait([this](boost::system::error_code) {
            if (acceptor->is_open()) accept();
          });
          return;
        }
        accept_failures = 0;
        accept_delay = Duration::zero();
        // Sessions are only added here, on the acceptor's strand, so the count checked is the
        // count the new session joins (it can only have dropped meanwhile).
        std::uint64_t id = 0;
        bool admitted = false;
        {
          std::lock_guard lock(mu);
          admitted = !stopping && sessions.size() < options.max_connections;
          if (admitted) id = next_id++;
        }
        if (!admitted) {
          boost::system::error_code ignored;
          socket.close(ignored);  // over max_connections: accepted and closed at once
        } else {
          auto session = std::make_shared<Session>(*this, std::move(socket), id);
          {
            std::lock_guard lock(mu);
            sessions.emplace(id, session);
          }
          session->start();
        }
        accept();
      });
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
  accept_backoff.emplace(acceptor->get_executor());
  guard.emplace(net::make_work_guard(ioc));
  workers = std::make_unique<net::thread_pool>(static_cast<std::size_t>(options.worker_threads));
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
    all_closed.wait_for(lock, options.drain_timeout, [this] { return sessions.empty(); });
  }
  // 3. Whatever is left is closed; flows already running finish, queued ones are dropped.
  each_session([](Session& s) { s.close(); });
  workers->stop();
  workers->join();
  {
    std::unique_lock lock(mu);
    all_closed.wait_for(lock, std::chrono::seconds(1), [this] { return sessions.empty(); });
  }
  guard.reset();
  ioc.stop();
  for (std::thread& t : loop_threads) t.join();
  loop_threads.clear();
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
                              impl->workers->get_executor(), std::move(respond));
       }});
}

void Server::start() { impl_->start(); }

void Server::stop() { impl_->stop(); }

std::uint16_t Server::port() const noexcept { return impl_->port.load(); }

boost::asio::any_io_executor Server::worker_executor() const {
  return impl_->workers->get_executor();
}

Response no_answer() {
  Response res;
  res.result(0);
  return res;
}

std::size_t Server::connections() const {
  std::lock_guard lock(impl_->mu);
  return impl_->sessions.size();
}

}  // namespace keel::store::beast
