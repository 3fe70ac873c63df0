// A small HTTP/1.1 server on Boost.Beast for applications that have none: it listens on one
// address (127.0.0.1 by default; port 0 picks a free port, reported by port()), routes each request
// by method and path to a handler, and defends itself against hostile clients with deadlines per
// request rather than per read. Its guarantees (docs/beast.md has the reasoning):
//
//   - Each request's head must arrive within header_timeout of its first byte (of the accept, for
//     a connection's first request) and its body within body_timeout of the end of the head: a
//     client that trickles bytes is cut (the connection closed, no answer) when that deadline
//     passes, however often it sends. A connection that waits between requests is closed after
//     idle_timeout. So slow clients hold a connection for a bounded time, and with
//     max_connections bounded too, they cannot keep a fresh connection from being answered.
//   - Limits apply to every request whatever its Content-Type: a head over max_header_bytes is
//     answered 431, a body over max_body_bytes 413 (form-urlencoded, JSON, text or anything).
//   - Framing is checked before the body is read: two Content-Length fields, Content-Length with
//     Transfer-Encoding, or a transfer coding other than chunked is answered 400 and the
//     connection closed, so no byte of it is ever read as another request.
//   - Pipelined requests (several in one packet) are answered, each one, in the order they came.
//     A connection handles one request at a time.
//   - Past max_connections, a new connection is accepted and closed at once (the listening
//     socket's backlog never fills with connections nobody will serve).
//   - stop() is graceful: the listener is closed first (new connections are refused), idle
//     connections are closed, in-flight requests get their answers (with Connection: close), and
//     whatever is left at drain_timeout is closed.
//   - Errors are application/problem+json (RFC 9457), as IdempotentRequestFlow's.
//   - A handler may answer no_answer(): the connection is closed and nothing is sent (a
//     response lost after its work was done, as fault injection plays it).
//
// Handlers of on() run on an event-loop thread: they must not block (GET /healthz, metrics).
// Blocking work, the database above all, goes through on_idempotent() (the flow runs on the
// server's worker threads, after the deadline and admission checks) or on_async() (the handler
// posts its work where it likes, worker_executor() for instance, and answers through the Respond
// it is given).
//
// Thread-safety: register routes before start(); after it, port(), stop() and the destructor may
// be called from any thread but an event-loop or worker thread of the server. Respond objects may
// be called from any thread, once each.
//
// Example:
//   keel::store::beast::IdempotentHandler charges({.flow = {.store = &store, .pool = &pool}},
//                                                 create_charge);
//   keel::store::beast::Server server({.port = 8080, .max_body_bytes = 64 * 1024});
//   server.on(boost::beast::http::verb::get, "/healthz", [](const keel::store::beast::Request& r) {
//     keel::store::beast::Response res{boost::beast::http::status::ok, r.version()};
//     res.body() = "ok\n";
//     return res;
//   });
//   server.on_idempotent(boost::beast::http::verb::post, "/v1/charges", charges);
//   server.start();                 // returns once listening; server.port() is the bound port
//   ...
//   server.stop();                  // graceful, bounded by drain_timeout
#pragma once

#include <boost/beast/http/verb.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "keel/store/beast/idempotent_handler.hpp"

namespace keel::store::beast {

struct ServerOptions {
  /// The IPv4 or IPv6 address to listen on. Default "127.0.0.1".
  std::string address = "127.0.0.1";
  /// The port; 0 picks a free one (port() says which). Default 0.
  std::uint16_t port = 0;
  /// Threads running the event loop (accepting, reading, writing, on() handlers). Requires:
  /// >= 1. Default 1.
  int event_loop_threads = 1;
  /// Threads running on_idempotent() flows (each holds a database connection while it runs; size
  /// it with the connection pool). Requires: >= 1. Default 4.
  int worker_threads = 4;
  /// Deadline of a request's head (request line and headers), from its first byte (from the
  /// accept for a connection's first request). Requires: > 0. Default 10 s.
  std::chrono::milliseconds header_timeout{10'000};
  /// Deadline of a request's body, from the end of its head. Requires: > 0. Default 30 s.
  std::chrono::milliseconds body_timeout{30'000};
  /// How long a keep-alive connection may wait for its next request. Requires: > 0. Default 5 s.
  std::chrono::milliseconds idle_timeout{5'000};
  /// Deadline of writing one response. Requires: > 0. Default 10 s.
  std::chrono::milliseconds write_timeout{10'000};
  /// Connections open at once; one more is accepted and closed at once. Requires: >= 1.
  /// Default 1024.
  std::size_t max_connections = 1024;
  /// Largest request head (request line and header fields, in bytes); 431 past it.
  /// Requires: >= 64. Default 8 KiB.
  std::size_t max_header_bytes = std::size_t{8} * 1024;
  /// Largest request body, whatever its Content-Type (chunked bodies included); 413 past it.
  /// Requires: >= 1. Default 1 MiB.
  std::size_t max_body_bytes = std::size_t{1024} * 1024;
  /// SO_REUSEPORT on the listening socket: other processes (each with it set) may listen on the
  /// same port and the kernel spreads connections among them. Without it a port in use is an
  /// error of start(). Default false.
  bool reuse_port = false;
  /// TCP_NODELAY on accepted connections. Default true.
  bool tcp_nodelay = true;
  /// Keep connections open between requests (HTTP/1.1 persistent connections; a request's own
  /// Connection: close is honoured). false: every answer closes. Default true.
  bool keep_alive = true;
  /// How long stop() waits for in-flight requests before closing their connections.
  /// Requires: >= 0. Default 10 s.
  std::chrono::milliseconds drain_timeout{10'000};
  /// Where the server's own errors go (a handler exception, a failed accept). Default: stderr.
  std::function<void(std::string_view message)> log;
};

/// Answers a request; callable from any thread, once. Calling it after the server stopped
/// does nothing. Given no_answer(), it closes the connection without sending anything.
using Respond = std::function<void(Response)>;
/// A handler run on the event loop: must not block. An exception is answered 500.
using LoopHandler = std::function<Response(const Request&)>;
/// A handler that answers later, through `respond`, from any thread (it is called on the event
/// loop and must not block: post the work elsewhere).
using AsyncHandler = std::function<void(Request request, Respond respond)>;

/// The answer that is never sent: a handler that returns it (or a Respond given it) has its
/// connection closed at once, as if the server had died after doing the work. For fault
/// injection (a commit whose response is lost) and for requests a handler gives up on. It is a
/// response of status 0 (boost::beast::http::status::unknown), which no server sends.
[[nodiscard]] Response no_answer();

namespace detail {
class Session;
}  // namespace detail

class Server {
 public:
  /// Throws std::invalid_argument naming the field when an option breaks its Requires line.
  explicit Server(ServerOptions options = {});
  /// stop(), if started.
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  /// Routes `method` on `path` (the request target without its query string, compared exactly;
  /// a `path` ending in "/*" matches every path under it, "/v1/charges/*" matches
  /// "/v1/charges/ch_1" but not "/v1/charges") to `handler`, run on the event loop. The first
  /// route registered that matches wins. Requires: before start().
  void on(boost::beast::http::verb method, std::string path, LoopHandler handler);
  /// The same for a handler that answers through `respond`.
  void on_async(boost::beast::http::verb method, std::string path, AsyncHandler handler);
  /// Routes to `handler`'s flow, run on the worker threads (the deadline and admission checks on
  /// the event loop first). `handler` must outlive the server.
  void on_idempotent(boost::beast::http::verb method, std::string path,
                     const IdempotentHandler& handler);

  /// Binds, listens and starts the threads. Throws boost::system::system_error when the address
  /// cannot be bound, std::logic_error when called twice.
  void start();
  /// The executor of the worker threads (after start()), for on_async() handlers whose work
  /// blocks (a database query): post it there and answer through the Respond.
  [[nodiscard]] boost::asio::any_io_executor worker_executor() const;
  /// The bound port (after start()); 0 before.
  [[nodiscard]] std::uint16_t port() const noexcept;
  /// Graceful shutdown (see the file comment); returns once every connection is closed and the
  /// threads are joined: after at most drain_timeout plus the time the flows already running
  /// take to return (flows not started yet are dropped, their requests unanswered). Idempotent.
  void stop();

  /// Connections open now.
  [[nodiscard]] std::size_t connections() const;

 private:
  friend class detail::Session;
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace keel::store::beast
