// Waiting on an io_context for what only another thread shows (see support/waiting.hpp): polled
// every 5 ms by a timer, so the io_context keeps running the client under test meanwhile.
#pragma once

#include <gtest/gtest.h>

#include <asio/steady_timer.hpp>
#include <chrono>
#include <functional>
#include <system_error>
#include <utility>

#include "support/waiting.hpp"

namespace keel::test {

/// Runs `then` on `timer`'s executor once `ready()` holds, checked every 5 ms. After 10 s it
/// records a failure and runs `then` all the same, so that the test ends instead of hanging.
inline void when(::asio::steady_timer& timer, std::function<bool()> ready,
                 std::function<void()> then,
                 std::chrono::steady_clock::time_point give_up = std::chrono::steady_clock::now() +
                                                                 std::chrono::seconds(10)) {
  timer.expires_after(std::chrono::milliseconds(5));
  timer.async_wait([&timer, ready = std::move(ready), then = std::move(then),
                    give_up](std::error_code ec) mutable {
    if (ec) return;
    if (!ready()) {
      if (std::chrono::steady_clock::now() < give_up) {
        when(timer, std::move(ready), std::move(then), give_up);
        return;
      }
      ADD_FAILURE() << "what the test waited for did not happen within 10 s";
    }
    then();
  });
}

}  // namespace keel::test
