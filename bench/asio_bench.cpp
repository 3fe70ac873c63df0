// Retrying without holding a thread, measured: N concurrent operations, each failing once and
// retried once after a short fixed delay, driven (a) by keel::asio on one thread and (b) by
// blocking calls on a pool of 64 threads. Two workloads:
//
//   simulated  each attempt is a wait of --service-ms (a steady_timer in the async driver, a
//              sleep in the blocking one); the first attempt fails. keel::asio::retry versus
//              keel::retry.
//   http       each operation is a GET to a local upstream (a keep-alive HTTP server in a
//              separate process) that answers 503 to Keel-Attempt 1 and 200 to the retry.
//              keel::asio::HttpClient versus keel::http::Client; both limited to 64
//              connections.
//
// Each measurement runs in a forked child process, so its peak memory (ru_maxrss) is its own.
// Prints wall time and peak RSS per driver and the ratios blocking / async. It reports, it does
// not assert. Flags: --calls N (10000), --threads N (64), --delay-ms N (5), --service-ms N (5),
// --workload simulated|http|both (both).
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/read_until.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/write.hpp>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "keel/asio/http_client.hpp"
#include "keel/asio/retry.hpp"
#include "keel/http/client.hpp"

namespace {

using namespace std::chrono_literals;

struct Config {
  int calls = 10000;
  int threads = 64;
  int delay_ms = 5;
  int service_ms = 5;
  std::string workload = "both";
};

keel::RetryOptions retry_once(const Config& c) {
  keel::RetryOptions o;
  o.max_attempts = 2;
  o.per_try_timeout = 30s;
  o.overall_timeout = 120s;
  const auto d = std::chrono::milliseconds(c.delay_ms);
  o.backoff = {.base = d, .cap = d, .jitter = keel::Jitter::kNone};
  return o;
}

// Runs `fn` on a pool of `threads` threads until `calls` operations are done; returns how many
// succeeded.
template <class Fn>
int run_pool(int threads, int calls, Fn fn) {
  std::atomic<int> next{0};
  std::atomic<int> ok{0};
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(threads));
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (int i = next.fetch_add(1); i < calls; i = next.fetch_add(1)) {
        if (fn(i)) ok.fetch_add(1);
      }
    });
  }
  for (auto& t : pool) t.join();
  return ok.load();
}

int simulated_async(const Config& c) {
  const keel::RetryPolicy policy(retry_once(c));
  ::asio::io_context io(1);
  int ok = 0;
  const auto service = std::chrono::milliseconds(c.service_ms);
  for (int i = 0; i < c.calls; ++i) {
    auto op = [service](const keel::AttemptInfo& a) -> ::asio::awaitable<keel::Outcome> {
      ::asio::steady_timer t(co_await ::asio::this_coro::executor, service);
      co_await t.async_wait(::asio::use_awaitable);
      co_return a.number == 1 ? keel::Outcome::transient() : keel::Outcome::success();
    };
    ::asio::co_spawn(io, keel::asio::retry(io.get_executor(), policy, op),
                     [&ok](std::exception_ptr e, keel::RetryResult<keel::Outcome> r) {
                       if (!e && r.ok() && r.attempts == 2) ++ok;
                     });
  }
  io.run();
  return ok;
}

int simulated_blocking(const Config& c) {
  const keel::RetryPolicy policy(retry_once(c));
  const auto service = std::chrono::milliseconds(c.service_ms);
  return run_pool(c.threads, c.calls, [&](int) {
    auto r = keel::retry(policy, [&](const keel::AttemptInfo& a) {
      std::this_thread::sleep_for(service);
      return a.number == 1 ? keel::Outcome::transient() : keel::Outcome::success();
    });
    return r.ok() && r.attempts == 2;
  });
}

int http_async(const Config& c, int port) {
  ::asio::io_context io(1);
  keel::asio::HttpClient client(
      io.get_executor(),
      {.retry = retry_once(c),
       .brakes = {.circuit_breakers = false, .retry_budget = false},
       .observability = {.log = [](std::string_view) {}},
       .limits = {.max_host_connections = c.threads, .max_transfers = c.threads}});
  const std::string url = "http://127.0.0.1:" + std::to_string(port) + "/op";
  int ok = 0;
  bool told = false;
  for (int i = 0; i < c.calls; ++i) {
    ::asio::co_spawn(io, client.send({.url = url}),
                     [&ok, &told](std::exception_ptr e, keel::http::Result r) {
                       if (!e && r.ok() && r.attempts == 2) {
                         ++ok;
                       } else if (!told) {
                         told = true;
                         std::fprintf(stderr, "asio_bench: async http: %s after %d attempts (%s)\n",
                                      std::string(keel::to_string(r.reason)).c_str(), r.attempts,
                                      r.error.c_str());
                       }
                     });
  }
  io.run();
  return ok;
}

int http_blocking(const Config& c, int port) {
  // Every first attempt fails by design: no breaker, no budget, for either client.
  keel::http::Client client({.retry = retry_once(c),
                             .brakes = {.circuit_breakers = false, .retry_budget = false},
                             .observability = {.log = [](std::string_view) {}}});
  const std::string url = "http://127.0.0.1:" + std::to_string(port) + "/op";
  std::atomic<bool> told{false};
  return run_pool(c.threads, c.calls, [&](int) {
    const keel::http::Result r = client.send({.url = url});
    if ((!r.ok() || r.attempts != 2) && !told.exchange(true)) {
      std::fprintf(stderr, "asio_bench: blocking http: %s after %d attempts (%s)\n",
                   std::string(keel::to_string(r.reason)).c_str(), r.attempts, r.error.c_str());
    }
    return r.ok() && r.attempts == 2;
  });
}

struct Measured {
  double wall_ms = 0;
  double peak_rss_mb = 0;
  int ok = 0;
  bool failed = false;
};

// Runs `fn` in a child process; reports its wall time, its peak RSS and its success count.
template <class Fn>
Measured in_child(Fn fn) {
  int fds[2];
  if (::pipe(fds) != 0) return {.failed = true};
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    const auto start = std::chrono::steady_clock::now();
    const int ok = fn();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    const double out[2] = {ms, static_cast<double>(ok)};
    (void)!::write(fds[1], out, sizeof out);
    ::_exit(0);
  }
  ::close(fds[1]);
  double in[2] = {0, 0};
  const bool got = ::read(fds[0], in, sizeof in) == static_cast<ssize_t>(sizeof in);
  ::close(fds[0]);
  int status = 0;
  rusage usage{};
  ::wait4(pid, &status, 0, &usage);
  Measured m;
  m.failed = !got || !WIFEXITED(status) || WEXITSTATUS(status) != 0;
  m.wall_ms = in[0];
  m.ok = static_cast<int>(in[1]);
  m.peak_rss_mb = static_cast<double>(usage.ru_maxrss) / 1024.0;  // KiB on Linux
  return m;
}

// The upstream: a small HTTP/1.1 keep-alive server on Asio, one thread, in a process of its own
// (cpp-httplib's listen backlog of 5 drops the SYNs of a burst of connections, which would
// measure the kernel's one-second SYN retry instead of the clients). It answers 503 to
// Keel-Attempt 1 and 200 to anything else.
class UpstreamConnection : public std::enable_shared_from_this<UpstreamConnection> {
 public:
  explicit UpstreamConnection(::asio::ip::tcp::socket socket) : socket_(std::move(socket)) {
    socket_.set_option(::asio::ip::tcp::no_delay(true));
  }
  void read() {
    ::asio::async_read_until(
        socket_, ::asio::dynamic_buffer(buffer_), "\r\n\r\n",
        [self = shared_from_this()](std::error_code ec, std::size_t n) {
          if (ec) return;
          const std::string_view head(self->buffer_.data(), n);
          const bool first = head.find("\r\nKeel-Attempt: 1\r\n") != std::string_view::npos;
          self->buffer_.erase(0, n);
          self->reply_ = first ? "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy"
                               : "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
          ::asio::async_write(self->socket_, ::asio::buffer(self->reply_),
                              [self](std::error_code wec, std::size_t) {
                                if (!wec) self->read();
                              });
        });
  }

 private:
  ::asio::ip::tcp::socket socket_;
  std::string buffer_;
  std::string reply_;
};

void accept_upstream(::asio::ip::tcp::acceptor& acceptor) {
  acceptor.async_accept([&acceptor](std::error_code ec, ::asio::ip::tcp::socket socket) {
    if (!ec) std::make_shared<UpstreamConnection>(std::move(socket))->read();
    accept_upstream(acceptor);
  });
}

pid_t start_upstream(int* port) {
  int fds[2];
  if (::pipe(fds) != 0) return -1;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    ::asio::io_context io(1);
    ::asio::ip::tcp::acceptor acceptor(
        io, ::asio::ip::tcp::endpoint(::asio::ip::make_address("127.0.0.1"), 0));
    const int p = acceptor.local_endpoint().port();
    (void)!::write(fds[1], &p, sizeof p);
    ::close(fds[1]);
    accept_upstream(acceptor);
    io.run();
    ::_exit(0);
  }
  ::close(fds[1]);
  const bool got = ::read(fds[0], port, sizeof *port) == static_cast<ssize_t>(sizeof *port);
  ::close(fds[0]);
  return got ? pid : -1;
}

void report(const char* workload, const Config& c, const Measured& async,
            const Measured& blocking) {
  std::printf("%-10s %-28s %7d %7d %10.1f %12.1f\n", workload, "keel::asio, 1 thread", c.calls,
              async.ok, async.wall_ms, async.peak_rss_mb);
  char name[64];
  std::snprintf(name, sizeof name, "blocking, %d threads", c.threads);
  std::printf("%-10s %-28s %7d %7d %10.1f %12.1f\n", workload, name, c.calls, blocking.ok,
              blocking.wall_ms, blocking.peak_rss_mb);
  std::printf("%-10s ratio blocking/async: wall %.2fx, peak RSS %.2fx\n", workload,
              blocking.wall_ms / async.wall_ms, blocking.peak_rss_mb / async.peak_rss_mb);
}

bool parse_int(const char* text, int* out) {
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || v < 1 || v > 1000000) return false;
  *out = static_cast<int>(v);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "asio_bench: %s needs a value\n", argv[i]);
      return 2;
    }
    const char* value = argv[++i];
    bool ok = true;
    if (flag == "--calls") {
      ok = parse_int(value, &c.calls);
    } else if (flag == "--threads") {
      ok = parse_int(value, &c.threads);
    } else if (flag == "--delay-ms") {
      ok = parse_int(value, &c.delay_ms);
    } else if (flag == "--service-ms") {
      ok = parse_int(value, &c.service_ms);
    } else if (flag == "--workload") {
      c.workload = value;
      ok = c.workload == "simulated" || c.workload == "http" || c.workload == "both";
    } else {
      std::fprintf(stderr, "asio_bench: unknown flag %s\n", argv[i - 1]);
      return 2;
    }
    if (!ok) {
      std::fprintf(stderr, "asio_bench: invalid value '%s' for %s\n", value, argv[i - 1]);
      return 2;
    }
  }
  std::printf("%d operations, each failing once and retried once after %d ms\n", c.calls,
              c.delay_ms);
  std::printf("%-10s %-28s %7s %7s %10s %12s\n", "workload", "driver", "calls", "ok", "wall ms",
              "peak RSS MB");
  bool all_ok = true;
  if (c.workload != "http") {
    const Measured a = in_child([&] { return simulated_async(c); });
    const Measured b = in_child([&] { return simulated_blocking(c); });
    report("simulated", c, a, b);
    all_ok = all_ok && !a.failed && !b.failed && a.ok == c.calls && b.ok == c.calls;
  }
  if (c.workload != "simulated") {
    int port = 0;
    const pid_t upstream = start_upstream(&port);
    if (upstream <= 0) {
      std::fprintf(stderr, "asio_bench: could not start the upstream\n");
      return 1;
    }
    const Measured a = in_child([&] { return http_async(c, port); });
    const Measured b = in_child([&] { return http_blocking(c, port); });
    ::kill(upstream, SIGKILL);
    ::waitpid(upstream, nullptr, 0);
    report("http", c, a, b);
    all_ok = all_ok && !a.failed && !b.failed && a.ok == c.calls && b.ok == c.calls;
  }
  if (!all_ok) std::fprintf(stderr, "asio_bench: some operations did not succeed\n");
  return all_ok ? 0 : 1;
}
