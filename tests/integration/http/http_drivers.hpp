// The two HTTP clients behind one synchronous face, so a typed test suite runs each case through
// both: BlockingDriver wraps keel::http::Client, AsyncDriver runs keel::asio::HttpClient's
// coroutine on its own io_context until it completes. Used as
//   TYPED_TEST_SUITE(Suite, keel::test::HttpDrivers, keel::test::HttpDriverNames);
#pragma once

#include <gtest/gtest.h>

#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>
#include <chrono>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "keel/asio/http_client.hpp"
#include "keel/faults/fault_server.hpp"
#include "keel/http/client.hpp"

namespace keel::test {

class BlockingDriver {
 public:
  static constexpr const char* kName = "blocking";
  explicit BlockingDriver(http::ClientOptions o) : client_(std::move(o)) {}
  http::Result send(const http::Request& r) { return client_.send(r); }

 private:
  http::Client client_;
};

class AsyncDriver {
 public:
  static constexpr const char* kName = "async";
  explicit AsyncDriver(http::ClientOptions o) : client_(io_.get_executor(), std::move(o)) {}
  // Runs one send to completion (at most 30 s) and checks nothing is left in flight.
  http::Result send(const http::Request& r) {
    std::optional<http::Result> out;
    std::exception_ptr error;
    ::asio::co_spawn(io_, client_.send(r), [&](std::exception_ptr e, http::Result v) {
      error = e;
      if (!e) out = std::move(v);
    });
    io_.restart();
    io_.run_for(std::chrono::seconds(30));
    if (error) std::rethrow_exception(error);
    EXPECT_TRUE(out.has_value()) << "the operation did not complete";
    EXPECT_EQ(client_.transfers_in_flight(), 0u);
    return out.value_or(http::Result{});
  }

 private:
  ::asio::io_context io_;
  asio::HttpClient client_;
};

using HttpDrivers = ::testing::Types<BlockingDriver, AsyncDriver>;

struct HttpDriverNames {
  template <class T>
  static std::string GetName(int) {
    return T::kName;
  }
};

/// The value of header `name` as the FaultServer received it, or "" when absent.
inline std::string header(const faults::Arrival& a, std::string_view name) {
  auto v = http::find_header(a.headers, name);
  return v ? std::string(*v) : std::string();
}

}  // namespace keel::test
