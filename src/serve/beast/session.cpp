// detail::Session's requests, one after the other on its strand: the empty lines before a request
// line skipped, the head and the body read by their deadlines and checked (framing, Host, size,
// Expect), the route found (404, or 405 with Allow; HEAD answered by the GET route), the handler
// called while the peer is watched, the answer written, and a closing connection's last bytes
// read and dropped.
#include <sys/socket.h>

#include <algorithm>
#include <boost/asio/dispatch.hpp>
#include <boost/beast/core/string.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/write.hpp>
#include <cerrno>
#include <exception>

#include "serve/beast/detail/request_checks.hpp"
#include "serve/beast/detail/server_impl.hpp"

namespace keel::store::beast::detail {
namespace {

/// Empty lines ignored before a request line (RFC 9112 section 2.2 asks for at least one); the
/// next one is answered 400.
constexpr std::size_t kMaxEmptyLines = 16;

}  // namespace

void Session::start() {
  boost::system::error_code ignored;
  if (options_.tcp_nodelay) stream_.socket().set_option(tcp::no_delay(true), ignored);
  net::dispatch(executor(), [self = shared_from_this()] { self->wait_for_request(); });
}

void Session::drain() {
  draining_ = true;
  if (state_ == State::kIdle) close();
}

void Session::close() {
  if (state_ == State::kClosed) return;
  state_ = State::kClosed;
  abandoned_->store(true, std::memory_order_release);
  server_->closed(*this);
  boost::system::error_code ignored;
  stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
  stream_.close();
}

void Session::respond(Response res) {
  server_->post_to(*this, [self = shared_from_this(), res = std::move(res)]() mutable {
    self->write(std::move(res), /*close_after=*/false);
  });
}

void Session::wait_for_request() {
  if (state_ == State::kClosed) return;
  state_ = State::kIdle;
  if (draining_ || server_->draining.load(std::memory_order_relaxed)) return close();
  if (!server_->wait(*this)) return close();
  // The first request's first byte is due first_byte_timeout after the accept (its head
  // header_timeout after it); a later one's first byte idle_timeout after the last answer.
  first_byte_due_ = first_
                        ? accepted_ + std::min(options_.first_byte_timeout, options_.header_timeout)
                        : std::chrono::steady_clock::now() + options_.idle_timeout;
  if (buffer_.size() > 0) return start_head();  // a pipelined request is already here
  read_more();
}

// Reads what comes before the request line, by the first byte's deadline.
void Session::read_more() {
  stream_.expires_at(first_byte_due_);
  stream_.async_read_some(buffer_.prepare(4096),
                          [self = shared_from_this()](boost::system::error_code ec, std::size_t n) {
                            self->buffer_.commit(n);
                            if (ec || n == 0) return self->close();
                            self->start_head();
                          });
}

// Bytes have come: skips the empty lines before a request line (RFC 9112 section 2.2), then
// reads the head.
void Session::start_head() {
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

void Session::read_head() {
  parser_.emplace();
  parser_->header_limit(static_cast<std::uint32_t>(options_.max_header_bytes));
  parser_->body_limit(options_.max_body_bytes);
  stream_.expires_at(head_started_ + options_.header_timeout);
  http::async_read_header(stream_, buffer_, *parser_,
                          [self = shared_from_this()](boost::system::error_code ec, std::size_t) {
                            self->on_head(ec);
                          });
}

void Session::on_head(boost::system::error_code ec) {
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
  if (const auto length = parser_->content_length(); length && *length > options_.max_body_bytes) {
    return refuse(413, "the request body is " + std::to_string(*length) + " bytes; the limit is " +
                           std::to_string(options_.max_body_bytes) + " bytes");
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

void Session::read_body() {
  if (parser_->is_done()) return dispatch();
  stream_.expires_after(options_.body_timeout);
  http::async_read(stream_, buffer_, *parser_,
                   [self = shared_from_this()](boost::system::error_code ec, std::size_t) {
                     if (ec) return self->read_failed(ec);
                     self->dispatch();
                   });
}

void Session::read_failed(boost::system::error_code ec) {
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

void Session::refuse(int status, const std::string& detail) {
  write(problem_response(status, problem_title(status), detail), /*close_after=*/true);
}

void Session::dispatch() {
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
      return write(problem_response(404, problem_title(404), "no resource at this path", version_),
                   false);
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
void Session::watch_peer() {
  watching_ = true;
  stream_.socket().async_wait(
      tcp::socket::wait_read,
      [self = shared_from_this(), generation = ++watch_generation_](boost::system::error_code ec) {
        self->on_peer_readable(ec, generation);
      });
}

void Session::on_peer_readable(boost::system::error_code ec, std::uint64_t generation) {
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

void Session::write(Response res, bool close_after) {
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
void Session::linger() {
  state_ = State::kWriting;
  if (!server_->wait(*this)) return close();
  boost::system::error_code ignored;
  stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
  stream_.expires_after(
      std::min<std::chrono::milliseconds>(options_.write_timeout, std::chrono::seconds(2)));
  discard();
}

void Session::discard() {
  stream_.async_read_some(net::buffer(scratch_),
                          [self = shared_from_this()](boost::system::error_code ec, std::size_t n) {
                            self->discarded_ += n;
                            if (ec || self->discarded_ > self->options_.max_body_bytes + 65536)
                              return self->close();
                            self->discard();
                          });
}

}  // namespace keel::store::beast::detail
