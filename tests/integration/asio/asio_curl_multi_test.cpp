// keel::asio's libcurl multi driver (src/asio/curl_multi.hpp, private to keel::asio): the
// backstop that ends a transfer whose libcurl timeout never fires. The transfers here have no
// libcurl timeout at all and go to a socket on 127.0.0.1 that listens and never answers (the
// kernel completes the handshake from its backlog), so only the backstop can end them.
#include <curl/curl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <asio/io_context.hpp>
#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "curl_multi.hpp"
#include "support/loopback_socket.hpp"

namespace {

using keel::asio::detail::CurlMulti;
using std::chrono::milliseconds;
using std::chrono::steady_clock;

using SilentListener = keel::test::LoopbackSocket;  // listens, never accepts

struct EasyDeleter {
  void operator()(CURL* h) const noexcept { curl_easy_cleanup(h); }
};
using Easy = std::unique_ptr<CURL, EasyDeleter>;

Easy easy_for(const std::string& url) {
  Easy e(curl_easy_init());
  curl_easy_setopt(e.get(), CURLOPT_URL, url.c_str());
  curl_easy_setopt(e.get(), CURLOPT_NOSIGNAL, 1L);
  return e;  // no CURLOPT_TIMEOUT: libcurl would wait for ever
}

struct Ended {
  std::optional<CURLcode> code;
  steady_clock::time_point at;
};

TEST(AsioCurlMulti, ATransferPastItsBackstopIsAbortedWhateverLibcurlDoes) {
  SilentListener silent;
  ::asio::io_context io;
  const auto multi = CurlMulti::create(io.get_executor(), 0, 0);
  const Easy easy = easy_for(silent.url());
  const auto began = steady_clock::now();
  Ended ended;
  keel::asio::detail::async_perform(multi, easy.get(), began + milliseconds(200),
                                    [&](CURLcode code) {
                                      ended.code = code;
                                      ended.at = steady_clock::now();
                                    });
  io.run_for(std::chrono::seconds(10));
  ASSERT_TRUE(ended.code.has_value()) << "the backstop did not end the transfer";
  EXPECT_EQ(*ended.code, CURLE_ABORTED_BY_CALLBACK);
  EXPECT_GE(ended.at - began, milliseconds(200));
  EXPECT_LT(ended.at - began, std::chrono::seconds(5));
  EXPECT_EQ(multi->in_flight(), 0u);
  EXPECT_TRUE(io.stopped()) << "nothing keeps the executor busy once no transfer is left";
}

TEST(AsioCurlMulti, ATransferWaitingForASlotIsAbortedAtItsBackstopToo) {
  SilentListener silent;
  ::asio::io_context io;
  const auto multi = CurlMulti::create(io.get_executor(), 0, /*max_transfers=*/1);
  const Easy first = easy_for(silent.url());
  const Easy second = easy_for(silent.url());
  const auto began = steady_clock::now();
  Ended a;
  Ended b;
  // The first holds the only slot and has no backstop; the second waits behind it.
  keel::asio::detail::async_perform(multi, first.get(), CurlMulti::kNoBackstop,
                                    [&](CURLcode code) { a.code = code; });
  keel::asio::detail::async_perform(multi, second.get(), began + milliseconds(100),
                                    [&](CURLcode code) {
                                      b.code = code;
                                      b.at = steady_clock::now();
                                    });
  while (!b.code && steady_clock::now() - began < std::chrono::seconds(10)) {
    io.run_one_for(milliseconds(100));
  }
  ASSERT_TRUE(b.code.has_value());
  EXPECT_EQ(*b.code, CURLE_ABORTED_BY_CALLBACK);
  EXPECT_GE(b.at - began, milliseconds(100));
  EXPECT_FALSE(a.code.has_value()) << "no backstop: only libcurl or the caller ends it";
  EXPECT_EQ(multi->in_flight(), 1u);
  multi->abort(first.get(), false);
  io.restart();
  io.run_for(std::chrono::seconds(5));
  ASSERT_TRUE(a.code.has_value());
  EXPECT_EQ(*a.code, CURLE_ABORTED_BY_CALLBACK);
  EXPECT_EQ(multi->in_flight(), 0u);
}

}  // namespace
