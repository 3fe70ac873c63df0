// Retrying without holding a thread: keel::asio on one Asio event loop.
//
// 1. keel::asio::retry around any awaitable (here a simulated dependency that fails twice).
// 2. keel::asio::HttpClient: 50 concurrent POSTs to a flaky upstream, all on this one thread;
//    each operation keeps one Idempotency-Key across its attempts.
// 3. Cancelling an operation that is waiting out a 30 s Retry-After: it stops at once.
//
// The upstream is keel::faults::FaultServer on 127.0.0.1 (a port the kernel picks).
#include <asio/bind_cancellation_slot.hpp>
#include <asio/cancellation_signal.hpp>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>
#include <cstdio>
#include <exception>
#include <keel/asio/http_client.hpp>
#include <keel/asio/retry.hpp>
#include <keel/core/duration.hpp>
#include <keel/faults/fault_server.hpp>

using namespace std::chrono_literals;

// A dependency that answers after 2 ms and fails its first two calls.
::asio::awaitable<keel::Outcome> flaky_dependency(int& calls) {
  ::asio::steady_timer t(co_await ::asio::this_coro::executor, 2ms);
  co_await t.async_wait(::asio::use_awaitable);
  co_return ++calls <= 2 ? keel::Outcome::transient() : keel::Outcome::success();
}

int main() {
  ::asio::io_context io(1);
  int failures = 0;

  // 1. Any awaitable.
  const keel::RetryPolicy policy({.max_attempts = 4,
                                  .per_try_timeout = 1s,
                                  .overall_timeout = 5s,
                                  .backoff = {.base = 5ms, .cap = 50ms}});
  int calls = 0;
  ::asio::co_spawn(
      io,
      [&]() -> ::asio::awaitable<void> {
        auto ex = co_await ::asio::this_coro::executor;
        auto r = co_await keel::asio::retry(
            ex, policy, [&](const keel::AttemptInfo&) { return flaky_dependency(calls); },
            {.safe_to_repeat = true});
        std::printf("1. retry: %s after %d attempts\n",
                    std::string(keel::to_string(r.reason)).c_str(), r.attempts);
        if (!r.ok()) ++failures;
      },
      ::asio::detached);
  io.run();

  // 2. Many HTTP operations on one thread.
  keel::faults::FaultServer server({.script = "503*5,200"});
  server.start();
  keel::asio::HttpClient client(
      io.get_executor(),
      {.retry = {.max_attempts = 4, .overall_timeout = 60s, .backoff = {.base = 5ms, .cap = 20ms}},
       .observability = {.log = [](std::string_view line) {
         std::printf("   %.*s\n", static_cast<int>(line.size()), line.data());
       }}});
  int ok = 0;
  constexpr int kOperations = 50;
  for (int i = 0; i < kOperations; ++i) {
    ::asio::co_spawn(io,
                     client.send({.method = "POST", .url = server.url("/orders"), .body = "{}"}),
                     [&](std::exception_ptr e, keel::http::Result r) {
                       if (!e && r.ok()) ++ok;
                     });
  }
  io.restart();
  io.run();
  std::printf("2. http: %d of %d POSTs succeeded, %zu requests reached the upstream\n", ok,
              kOperations, server.arrivals().size());
  if (ok != kOperations) ++failures;

  // 3. Cancellation during a 30 s Retry-After.
  server.set_script("503/retry-after=30,200");
  ::asio::cancellation_signal cancel;
  keel::http::Result cancelled;
  ::asio::co_spawn(
      io, client.send({.url = server.url("/slow")}),
      ::asio::bind_cancellation_slot(cancel.slot(), [&](std::exception_ptr, keel::http::Result r) {
        cancelled = std::move(r);
      }));
  ::asio::steady_timer later(io, 100ms);
  later.async_wait([&](std::error_code) { cancel.emit(::asio::cancellation_type::terminal); });
  io.restart();
  io.run();
  std::printf("3. cancelled: reason \"%s\" after %s (not 30 s)\n",
              std::string(keel::to_string(cancelled.reason)).c_str(),
              keel::format_duration(cancelled.elapsed).c_str());
  if (cancelled.reason != keel::StopReason::kCancelled) ++failures;
  return failures == 0 ? 0 : 1;
}
