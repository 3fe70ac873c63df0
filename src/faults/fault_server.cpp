#include "keel/faults/fault_server.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <stdexcept>
#include <thread>

#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "keel/core/retry_after.hpp"

namespace keel::faults {
namespace {

constexpr int kPollMs = 50;
constexpr std::size_t kMaxHead = 64 * 1024;
constexpr std::size_t kMaxBody = 16 * 1024 * 1024;

std::string_view trim(std::string_view s) noexcept {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) {
    s.remove_suffix(1);
  }
  return s;
}

template <class Int>
bool parse_int(std::string_view text, Int& out) {
  if (text.empty()) return false;
  const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc() && p == text.data() + text.size();
}

std::string_view reason_phrase(int status) noexcept {
  switch (status) {
    case 200:
      return "OK";
    case 201:
      return "Created";
    case 202:
      return "Accepted";
    case 204:
      return "No Content";
    case 301:
      return "Moved Permanently";
    case 302:
      return "Found";
    case 304:
      return "Not Modified";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 403:
      return "Forbidden";
    case 404:
      return "Not Found";
    case 408:
      return "Request Timeout";
    case 409:
      return "Conflict";
    case 422:
      return "Unprocessable Content";
    case 429:
      return "Too Many Requests";
    case 500:
      return "Internal Server Error";
    case 501:
      return "Not Implemented";
    case 502:
      return "Bad Gateway";
    case 503:
      return "Service Unavailable";
    case 504:
      return "Gateway Timeout";
    default:
      return "Status";
  }
}

bool send_all(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data.remove_prefix(static_cast<std::size_t>(n));
  }
  return true;
}

// What a request's head says: the arrival as logged (all but its body) and how to read the rest.
struct RequestHead {
  Arrival arrival;
  std::size_t content_length = 0;
  bool wants_close = false;      // Connection: close
  bool expect_continue = false;  // Expect: 100-continue
  std::string_view malformed;    // non-empty: the head is refused, with this as the 400's body
};

// Parses a request's head (the request line and the header lines, without the blank line).
RequestHead parse_head(std::string_view head) {
  RequestHead r;
  std::size_t line_end = head.find("\r\n");
  const std::string_view request_line = head.substr(0, line_end);
  const std::size_t sp1 = request_line.find(' ');
  const std::size_t sp2 = request_line.rfind(' ');
  if (sp1 == std::string_view::npos || sp2 == sp1) {
    r.malformed = "bad request line\n";
    return r;
  }
  r.arrival.method = std::string(request_line.substr(0, sp1));
  r.arrival.target = std::string(request_line.substr(sp1 + 1, sp2 - sp1 - 1));
  while (line_end != std::string_view::npos && line_end < head.size()) {
    const std::size_t start = line_end + 2;
    line_end = head.find("\r\n", start);
    const std::string_view line = head.substr(
        start, line_end == std::string_view::npos ? std::string_view::npos : line_end - start);
    const std::size_t colon = line.find(':');
    if (colon == std::string_view::npos) continue;
    std::string name(line.substr(0, colon));
    std::string value(trim(line.substr(colon + 1)));
    std::string lower = name;
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (lower == "content-length" && !parse_int(std::string_view(value), r.content_length)) {
      r.malformed = "bad content-length\n";
      return r;
    }
    if (lower == "connection" && value == "close") r.wants_close = true;
    if (lower == "expect" && value == "100-continue") r.expect_continue = true;
    r.arrival.headers.emplace_back(std::move(name), std::move(value));
  }
  return r;
}

// The Retry-After header line a step answers with, or "" when it has none.
std::string step_retry_after(const FaultStep& step) {
  if (!step.retry_after_seconds) return "";
  std::string header = "Retry-After: ";
  if (step.retry_after_as_date) {
    header +=
        format_http_date(static_cast<std::int64_t>(std::time(nullptr)) + *step.retry_after_seconds);
  } else {
    header += std::to_string(*step.retry_after_seconds);
  }
  return header + "\r\n";
}

// The body a step answers with: its own, or "ok" / the reason phrase, and a newline.
std::string step_body(const FaultStep& step) {
  std::string body = step.body;
  if (body.empty()) body = step.status < 300 ? "ok" : std::string(reason_phrase(step.status));
  return body + "\n";
}

}  // namespace

Expected<std::vector<FaultStep>> parse_fault_script(std::string_view script) {
  const auto fail = [](std::string_view step, const std::string& why) {
    return Error{.field = "script step", .problem = "is invalid: " + why, .got = quote_value(step)};
  };
  std::vector<FaultStep> steps;
  if (trim(script).empty()) {
    return Error{.field = "script", .problem = "is empty", .got = quote_value(script)};
  }
  while (true) {
    const std::size_t comma = script.find(',');
    const std::string_view raw = trim(script.substr(0, comma));
    std::string_view text = raw;
    if (text.empty()) return fail(raw, "empty step");
    int repeat = 1;
    if (const auto star = text.rfind('*'); star != std::string_view::npos) {
      if (!parse_int(text.substr(star + 1), repeat) || repeat < 1 || repeat > 10000) {
        return fail(raw, "repeat count after '*' must be an integer in [1, 10000]");
      }
      text = text.substr(0, star);
    }
    FaultStep step;
    step.text = std::string(text);
    const std::size_t slash = text.find('/');
    const std::string_view action = text.substr(0, slash);
    if (action == "hang") {
      step.action = FaultStep::Action::kHang;
    } else if (action == "reset") {
      step.action = FaultStep::Action::kReset;
    } else if (action == "drop") {
      step.action = FaultStep::Action::kDrop;
    } else if (!parse_int(action, step.status) || step.status <= 100 || step.status >= 600) {
      return fail(raw, "action must be a status in (100, 600), hang, reset or drop");
    }
    std::string_view rest = slash == std::string_view::npos ? "" : text.substr(slash + 1);
    while (slash != std::string_view::npos) {
      const std::size_t next = rest.find('/');
      const std::string_view mod = rest.substr(0, next);
      const std::size_t eq = mod.find('=');
      const std::string_view key = mod.substr(0, eq);
      const std::string_view value = eq == std::string_view::npos ? "" : mod.substr(eq + 1);
      if (eq == std::string_view::npos)
        return fail(raw, "modifier '" + std::string(mod) + "' needs =VALUE");
      if (key == "retry-after" || key == "retry-after-date") {
        std::int64_t seconds = 0;
        if (!parse_int(value, seconds) || seconds < 0 || seconds > 100000000) {
          return fail(raw, std::string(key) + " must be a whole number of seconds >= 0");
        }
        step.retry_after_seconds = seconds;
        step.retry_after_as_date = key == "retry-after-date";
      } else if (key == "delay") {
        auto d = parse_duration(value);
        if (!d) return fail(raw, d.error().in("delay").message());
        step.delay = *d;
      } else if (key == "body") {
        step.body = std::string(value);
      } else {
        return fail(raw, "unknown modifier '" + std::string(key) +
                             "' (expected retry-after, retry-after-date, delay or body)");
      }
      if (next == std::string_view::npos) break;
      rest = rest.substr(next + 1);
    }
    for (int i = 0; i < repeat; ++i) steps.push_back(step);
    if (comma == std::string_view::npos) break;
    script = script.substr(comma + 1);
  }
  return steps;
}

struct FaultServer::Impl {
  std::vector<FaultStep> steps;                 // GUARDED_BY(mutex)
  std::size_t next_step = 0;                    // GUARDED_BY(mutex)
  std::vector<Arrival> log;                     // GUARDED_BY(mutex)
  std::set<int> open_fds;                       // GUARDED_BY(mutex)
  std::vector<std::thread> connection_threads;  // GUARDED_BY(mutex)
  mutable std::mutex mutex;
  std::condition_variable stop_cv;  // waits for stopping (delays), with mutex

  int requested_port = 0;
  std::atomic<int> port{0};
  std::atomic<int> connection_count{0};
  std::atomic<bool> stopping{false};
  int listen_fd = -1;
  bool running = false;
  std::thread acceptor;
  TimePoint started{};

  FaultStep take_step() {
    // Caller holds mutex.
    const FaultStep& s = steps[std::min(next_step, steps.size() - 1)];
    if (next_step < steps.size()) ++next_step;
    return s;
  }

  // Waits d, or less when the server stops. Returns false when stopping.
  bool wait_for(Duration d) {
    std::unique_lock<std::mutex> lock(mutex);
    // wait: scripted: a fault script's step, cut short by a stop
    return !stop_cv.wait_for(lock, d, [&] { return stopping.load(); });
  }

  // Reads more bytes into buf. False on EOF, error or stop.
  bool read_some(int fd, std::string& buf) {
    char chunk[16384];
    while (!stopping.load()) {
      pollfd p{fd, POLLIN, 0};
      const int r = ::poll(&p, 1, kPollMs);
      if (r < 0 && errno != EINTR) return false;
      if (r <= 0) continue;
      const ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      buf.append(chunk, static_cast<std::size_t>(n));
      return true;
    }
    return false;
  }

  void close_fd(int fd) {
    {
      std::lock_guard<std::mutex> guard(mutex);
      open_fds.erase(fd);
    }
    ::close(fd);
  }

  void reset_fd(int fd) {
    linger l{1, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    close_fd(fd);
  }

  void respond(int fd, int status, std::string_view content_type, std::string_view body,
               std::string_view extra_headers, bool close) {
    std::string out =
        "HTTP/1.1 " + std::to_string(status) + " " + std::string(reason_phrase(status)) + "\r\n";
    out += "Content-Type: ";
    out += content_type;
    out += "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
    out += extra_headers;
    if (close) out += "Connection: close\r\n";
    out += "\r\n";
    out += body;
    (void)send_all(fd, out);
  }

  // Reads the next request off the connection: `buf` holds what was read past the previous one
  // and keeps what follows this one. nullopt when the connection is to close: the peer closed it,
  // the server stops, or the request was refused with an answer already sent.
  std::optional<RequestHead> read_request(int fd, std::string& buf) {
    std::size_t head_end;
    while ((head_end = buf.find("\r\n\r\n")) == std::string::npos) {
      if (buf.size() > kMaxHead || !read_some(fd, buf)) return std::nullopt;
    }
    RequestHead request = parse_head(std::string_view(buf.data(), head_end));
    if (!request.malformed.empty()) {
      respond(fd, 400, "text/plain", request.malformed, "", true);
      return std::nullopt;
    }
    if (request.content_length > kMaxBody) {
      respond(fd, 413, "text/plain", "body too large\n", "", true);
      return std::nullopt;
    }
    buf.erase(0, head_end + 4);
    if (request.expect_continue && buf.size() < request.content_length) {
      (void)send_all(fd, "HTTP/1.1 100 Continue\r\n\r\n");
    }
    while (buf.size() < request.content_length) {
      if (!read_some(fd, buf)) return std::nullopt;
    }
    request.arrival.body = buf.substr(0, request.content_length);
    buf.erase(0, request.content_length);
    return request;
  }

  // Logs the arrival `a` with the script's next step, and returns that step.
  FaultStep take_step_for(Arrival a) {
    std::lock_guard<std::mutex> guard(mutex);
    FaultStep step = take_step();
    a.seq = static_cast<int>(log.size()) + 1;
    a.at = steady_clock().now() - started;
    a.step = step.text;
    log.push_back(std::move(a));
    return step;
  }

  // What becomes of a connection after a step.
  enum class Then { kNextRequest, kClose, kReset };

  // Plays `step` on the connection: its delay, then its answer, or none.
  Then play(int fd, std::string& buf, const FaultStep& step, bool wants_close) {
    // wait: scripted: a fault script's step delay
    if (step.delay > Duration::zero() && !wait_for(step.delay)) return Then::kClose;
    switch (step.action) {
      case FaultStep::Action::kRespond:
        respond(fd, step.status, "text/plain", step_body(step), step_retry_after(step),
                wants_close);
        return wants_close ? Then::kClose : Then::kNextRequest;
      case FaultStep::Action::kHang:
        while (read_some(fd, buf)) {
        }
        return Then::kClose;
      case FaultStep::Action::kReset:
        return Then::kReset;
      case FaultStep::Action::kDrop:
        return Then::kClose;
    }
    return Then::kClose;
  }

  void serve(int fd, int connection) {
    std::string buf;
    while (!stopping.load()) {
      std::optional<RequestHead> request = read_request(fd, buf);
      if (!request) return close_fd(fd);
      request->arrival.connection = connection;
      if (request->arrival.target.starts_with("/_keel/")) {
        if (!control(fd, request->arrival, request->wants_close)) return close_fd(fd);
        continue;
      }
      const FaultStep step = take_step_for(std::move(request->arrival));
      switch (play(fd, buf, step, request->wants_close)) {
        case Then::kNextRequest:
          break;
        case Then::kClose:
          return close_fd(fd);
        case Then::kReset:
          return reset_fd(fd);
      }
    }
    close_fd(fd);
  }

  // Handles /_keel/ requests. Returns false when the connection should close.
  bool control(int fd, const Arrival& a, bool wants_close) {
    if (a.method == "GET" && a.target == "/_keel/log") {
      respond(fd, 200, "application/json", log_json() + "\n", "", wants_close);
    } else if (a.method == "POST" && a.target == "/_keel/reset") {
      reset_log();
      respond(fd, 200, "text/plain", "reset\n", "", wants_close);
    } else if (a.method == "POST" && a.target == "/_keel/script") {
      auto parsed = parse_fault_script(a.body);
      if (!parsed) {
        respond(fd, 400, "text/plain", parsed.error().message() + "\n", "", wants_close);
      } else {
        std::lock_guard<std::mutex> guard(mutex);
        steps = std::move(*parsed);
        next_step = 0;
      }
      if (parsed) respond(fd, 200, "text/plain", "script set\n", "", wants_close);
    } else {
      respond(fd, 404, "text/plain", "unknown control endpoint\n", "", wants_close);
    }
    return !wants_close;
  }

  void reset_log() {
    std::lock_guard<std::mutex> guard(mutex);
    log.clear();
    next_step = 0;
  }

  std::string log_json() const {
    nlohmann::json arrivals = nlohmann::json::array();
    std::lock_guard<std::mutex> guard(mutex);
    for (const Arrival& a : log) {
      nlohmann::json headers = nlohmann::json::object();
      for (const auto& [k, v] : a.headers) headers[k] = v;
      nlohmann::json item = {
          {"seq", a.seq},       {"at_ms", std::chrono::duration<double, std::milli>(a.at).count()},
          {"method", a.method}, {"target", a.target},
          {"step", a.step},     {"connection", a.connection},
          {"headers", headers}, {"body_bytes", a.body.size()},
      };
      const auto key = http::find_header(a.headers, "Idempotency-Key");
      item["idempotency_key"] = key ? nlohmann::json(std::string(*key)) : nlohmann::json();
      int attempt = 0;
      const auto attempt_header = http::find_header(a.headers, "Keel-Attempt");
      if (attempt_header && parse_int(*attempt_header, attempt)) {
        item["keel_attempt"] = attempt;
      } else {
        item["keel_attempt"] = nullptr;
      }
      arrivals.push_back(std::move(item));
    }
    return nlohmann::json{{"arrivals", arrivals}}.dump();
  }

  void accept_loop() {
    while (!stopping.load()) {
      pollfd p{listen_fd, POLLIN, 0};
      const int r = ::poll(&p, 1, kPollMs);
      if (r <= 0) continue;
      const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      const int id = connection_count.fetch_add(1) + 1;
      std::lock_guard<std::mutex> guard(mutex);
      if (stopping.load()) {
        ::close(fd);
        break;
      }
      open_fds.insert(fd);
      connection_threads.emplace_back([this, fd, id] { serve(fd, id); });
    }
  }
};

FaultServer::FaultServer(FaultServerOptions options) : impl_(std::make_unique<Impl>()) {
  auto steps = parse_fault_script(options.script);
  if (!steps) {
    throw_invalid(steps.error().in(steps.error().field, "keel::faults::FaultServerOptions"));
  }
  if (options.port < 0 || options.port > 65535) {
    throw_invalid({.context = "keel::faults::FaultServerOptions",
                   .field = "port",
                   .problem = "must be in [0, 65535]",
                   .got = std::to_string(options.port)});
  }
  impl_->steps = std::move(*steps);
  impl_->requested_port = options.port;
}

FaultServer::~FaultServer() { stop(); }

void FaultServer::start() {
  Impl& s = *impl_;
  if (s.running) return;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    throw std::runtime_error(std::string("keel-demo upstream: socket: ") + std::strerror(errno));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(s.requested_port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, 128) != 0) {
    const int err = errno;
    ::close(fd);
    throw std::runtime_error("keel-demo upstream: cannot listen on 127.0.0.1:" +
                             std::to_string(s.requested_port) + ": " + std::strerror(err));
  }
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  s.port.store(ntohs(addr.sin_port));
  s.listen_fd = fd;
  s.started = steady_clock().now();
  s.stopping.store(false);
  s.running = true;
  s.acceptor = std::thread([&s] { s.accept_loop(); });
}

void FaultServer::stop() {
  Impl& s = *impl_;
  if (!s.running) return;
  {
    std::lock_guard<std::mutex> guard(s.mutex);
    s.stopping.store(true);
    for (int fd : s.open_fds) ::shutdown(fd, SHUT_RDWR);
  }
  s.stop_cv.notify_all();
  s.acceptor.join();
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> guard(s.mutex);
    threads.swap(s.connection_threads);
  }
  for (auto& t : threads) t.join();
  ::close(s.listen_fd);
  s.listen_fd = -1;
  s.running = false;
}

int FaultServer::port() const noexcept { return impl_->port.load(); }

std::string FaultServer::url(std::string_view path) const {
  return "http://127.0.0.1:" + std::to_string(port()) + std::string(path);
}

void FaultServer::set_script(std::string_view script) {
  auto steps = parse_fault_script(script);
  if (!steps) {
    throw_invalid(steps.error().in(steps.error().field, "keel::faults::FaultServer::set_script"));
  }
  std::lock_guard<std::mutex> guard(impl_->mutex);
  impl_->steps = std::move(*steps);
  impl_->next_step = 0;
}

void FaultServer::reset() { impl_->reset_log(); }

std::vector<Arrival> FaultServer::arrivals() const {
  std::lock_guard<std::mutex> guard(impl_->mutex);
  return impl_->log;
}

std::string FaultServer::log_json() const { return impl_->log_json(); }

int FaultServer::connections() const noexcept { return impl_->connection_count.load(); }

}  // namespace keel::faults
