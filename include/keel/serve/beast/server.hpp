// A small HTTP/1.1 server on Boost.Beast for applications that have none: it listens on one
// address (127.0.0.1 by default; port 0 picks a free port, reported by port()), routes each request
// by method and path to a handler, and defends itself against hostile clients with deadlines per
// request rather than per read. Its guarantees (docs/beast.md has the reasoning):
//
//   - A new connection must send the first byte of its request within first_byte_timeout of the
//     accept, and each request's head must arrive within header_timeout of its first byte (of the
//     accept, for a connection's first request) and its body within body_timeout of the end of
//     the head: a client that trickles bytes is cut (the connection closed, no answer) when that
//     deadline passes, however often it sends. A connection that waits between requests is closed
//     after idle_timeout.
//   - Connection slots cannot be held by idle sockets: at max_connections, a new connection takes
//     the slot of the oldest connection that is not having a request handled (idle between
//     requests, or still sending its request), which is closed; only when every connection has a
//     request being handled is the new one closed at once. So a fresh request is answered however
//     many sockets sit open doing nothing. start() fits max_connections under the process's limit
//     of open files (RLIMIT_NOFILE, raising its soft limit when it must) and logs what it did.
//   - Limits apply to every request whatever its Content-Type: a head over max_header_bytes is
//     answered 431, a body over max_body_bytes 413 (form-urlencoded, JSON, text or anything).
//   - Framing is checked before the body is read: two Content-Length fields, Content-Length with
//     Transfer-Encoding, or a transfer coding other than chunked is answered 400 and the
//     connection closed, so no byte of it is ever read as another request. So is a request whose
//     Host is missing (HTTP/1.1), repeated or not a valid host[:port] (RFC 9112 section 3.2).
//   - Empty lines before a request line are ignored (RFC 9112 section 2.2), up to 16 of them in a
//     row (400 past that), within the deadline of the request's first byte.
//   - HEAD is answered on every GET route without a HEAD route of its own, as GET is but without
//     the body (RFC 9110 section 9.3.2). A 100 Continue is sent only to HTTP/1.1 clients.
//   - Pipelined requests (several in one packet) are answered, each one, in the order they came.
//     A connection handles one request at a time.
//   - A request is abandoned when its connection closes before it is answered (the client went
//     away, a write failed, or stop()'s drain ran out of time): Respond::abandoned() is set, which
//     IdempotentRequestFlow reads to stop and never commit (FlowRequest::abandoned).
//   - stop() is graceful and bounded: the listener is closed first (new connections are refused),
//     idle connections are closed, in-flight requests get their answers (with Connection: close),
//     and whatever is left at drain_timeout is closed (its requests abandoned). stop() returns
//     within drain_timeout plus kStopGrace even when a worker thread is still blocked in a
//     handler: that thread is left to finish on its own (stranded_workers()).
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
// be called from any thread, once each, even after the server is destroyed (they then do
// nothing). A handler still running on a worker thread that stop() left behind must find what it
// uses (the pool, the IdempotentHandler ...) alive: keep them until stranded_workers() is 0, or
// end the process.
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
//   server.stop();                  // graceful, bounded by drain_timeout + kStopGrace
#pragma once

#include <boost/beast/http/verb.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "keel/serve/beast/idempotent_handler.hpp"

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
  /// How long a new connection may wait before the first byte of its first request (empty lines
  /// do not count); it is closed without an answer after it. Requires: > 0. Default 2 s.
  std::chrono::milliseconds first_byte_timeout{2'000};
  /// Deadline of a request's head (request line and headers), from its first byte (from the
  /// accept for a connection's first request). Requires: > 0. Default 10 s.
  std::chrono::milliseconds header_timeout{10'000};
  /// Deadline of a request's body, from the end of its head. Requires: > 0. Default 30 s.
  std::chrono::milliseconds body_timeout{30'000};
  /// How long a keep-alive connection may wait for its next request. Requires: > 0. Default 5 s.
  std::chrono::milliseconds idle_timeout{5'000};
  /// Deadline of writing one response. Requires: > 0. Default 10 s.
  std::chrono::milliseconds write_timeout{10'000};
  /// Connections open at once. At the limit a new connection takes the slot of the oldest one not
  /// having a request handled (closed); when all are, the new one is accepted and closed at once.
  /// Lowered by start() when the process's limit of open files cannot hold it (see
  /// reserved_descriptors; connection_limit() says what is in force). Requires: >= 1.
  /// Default 1024.
  std::size_t max_connections = 1024;
  /// Descriptors kept for everything but connections (the listener, the event loop, database
  /// connections, files): start() raises the soft RLIMIT_NOFILE to max_connections plus this when
  /// it is lower (never past the hard limit), and where even the hard limit is too low, serves at
  /// most that limit minus this many connections. Requires: >= 16. Default 128.
  std::size_t reserved_descriptors = 128;
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
  /// How long stop() waits for in-flight requests before closing their connections (and so
  /// abandoning their requests). Requires: >= 0. Default 10 s.
  std::chrono::milliseconds drain_timeout{10'000};
  /// Where the server's own errors and notices go (a handler exception, a failed accept, the
  /// descriptor limit raised at start(), workers left blocked by stop()). Default: stderr.
  std::function<void(std::string_view message)> log;
};

/// How long stop() waits, after the drain, for the worker threads to return before it leaves the
/// ones still blocked (stranded_workers()).
inline constexpr std::chrono::milliseconds kStopGrace{250};

/// A handler run on the event loop: must not block. An exception is answered 500.
using LoopHandler = std::function<Response(const Request&)>;
/// A handler that answers later, through `respond` (keel/serve/beast/idempotent_handler.hpp),
/// from any thread (it is called on the event loop and must not block: post the work elsewhere).
/// Given no_answer(), `respond` closes the connection without sending anything.
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
  /// route registered that matches wins; a HEAD request with no HEAD route goes to the GET route
  /// (the handler sees method HEAD; the body it answers is not sent). Requires: before start().
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
  /// The executor of the worker threads (after start(), until stop()), for on_async() handlers
  /// whose work blocks (a database query): post it there and answer through the Respond.
  [[nodiscard]] boost::asio::any_io_executor worker_executor() const;
  /// The bound port (after start()); 0 before.
  [[nodiscard]] std::uint16_t port() const noexcept;
  /// Graceful shutdown (see the file comment); returns once every connection is closed, the
  /// event-loop threads are joined and the worker threads have returned, or kStopGrace after
  /// drain_timeout at most: work queued but not started is dropped (its requests unanswered), and
  /// a worker still blocked in a handler then is left running (stranded_workers()), its request
  /// abandoned. Idempotent.
  void stop();

  /// Connections open now (a closed one no longer counts, even while its request's handler runs).
  [[nodiscard]] std::size_t connections() const;
  /// The connection limit in force (after start(): max_connections, or lower when the process's
  /// limit of open files cannot hold it).
  [[nodiscard]] std::size_t connection_limit() const noexcept;
  /// Worker threads that stop() left blocked in a handler and that have not returned yet.
  [[nodiscard]] std::size_t stranded_workers() const;

 private:
  friend class detail::Session;
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace keel::store::beast
