// Hostile and careless input on the caller's side, for both HTTP clients (blocking
// keel::http::Client and keel::asio::HttpClient): the caller's own Idempotency-Key, requests
// refused before any attempt (invalid URLs, keys, header fields), and responses the client must
// not take (an oversized head, a body over max_response_bytes), with the body sink that streams
// a large body instead. Real loopback: FaultServer, or RawHttpServer for responses that
// FaultServer cannot script.
#include <gtest/gtest.h>

#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>
#include <chrono>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "http_drivers.hpp"
#include "keel/asio/http_client.hpp"
#include "keel/faults/fault_server.hpp"
#include "keel/http/client.hpp"
#include "raw_http_server.hpp"

namespace {

using keel::StopReason;
using keel::faults::Arrival;
using keel::faults::FaultServer;
using keel::http::ClientOptions;
using keel::http::Request;
using keel::http::Result;
using keel::test::RawHttpServer;
using keel::test::response_head;
using std::chrono::milliseconds;
using std::chrono::seconds;

// Fast retries and no give-up lines; the size limits at their defaults.
ClientOptions options() {
  return {.retry = {.max_attempts = 3,
                    .per_try_timeout = seconds(5),
                    .overall_timeout = seconds(20),
                    .backoff = {.base = milliseconds(1), .cap = milliseconds(5)}},
          .observability = {.log = [](std::string_view) {}}};
}

template <class Driver>
class HttpClientsInput : public ::testing::Test {};

TYPED_TEST_SUITE(HttpClientsInput, keel::test::HttpDrivers, keel::test::HttpDriverNames);

// Every Idempotency-Key field of an arrival, whatever the case of its name.
std::vector<std::string> keys_of(const Arrival& a) {
  std::vector<std::string> keys;
  for (const auto& [name, value] : a.headers) {
    if (keel::http::same_header_name(name, "Idempotency-Key")) keys.push_back(value);
  }
  return keys;
}

TYPED_TEST(HttpClientsInput, AKeyInTheHeadersIsTheRequestsKeySentOnceOnEveryAttempt) {
  for (const char* name :
       {"Idempotency-Key", "idempotency-key", "IDEMPOTENCY-KEY", "iDeMpOtEnCy-KeY"}) {
    for (const bool generate : {true, false}) {
      FaultServer server({.script = "drop,200"});
      server.start();
      TypeParam client(options());
      Request request{.method = "POST", .url = server.url("/pay"), .body = "{}"};
      request.headers = {{"X-Trace", "t"}, {name, "charge-7"}};
      request.generate_idempotency_key = generate;
      const Result r = client.send(request);
      // The key makes the POST safe to repeat: the ambiguous drop is retried.
      EXPECT_TRUE(r.ok()) << name << ": " << keel::to_string(r.reason);
      EXPECT_EQ(r.idempotency_key, "charge-7") << name;
      const auto arrivals = server.arrivals();
      ASSERT_EQ(arrivals.size(), 2u) << name;
      for (const Arrival& a : arrivals) {
        EXPECT_EQ(keys_of(a), std::vector<std::string>{"charge-7"}) << name;
      }
    }
  }
  // The same key in the field and a header, or twice in the headers, is one key.
  FaultServer server({.script = "200"});
  server.start();
  TypeParam client(options());
  Request request{.method = "POST", .url = server.url("/pay"), .idempotency_key = "k"};
  request.headers = {{"idempotency-key", "k"}, {"Idempotency-Key", "k"}};
  EXPECT_TRUE(client.send(request).ok());
  ASSERT_EQ(server.arrivals().size(), 1u);
  EXPECT_EQ(keys_of(server.arrivals()[0]), std::vector<std::string>{"k"});
}

TYPED_TEST(HttpClientsInput, InvalidRequestsAreRefusedBeforeAnyAttempt) {
  FaultServer server({.script = "200"});
  server.start();
  const std::string url = server.url("/x");
  std::vector<Request> bad;
  for (const char* u :
       {"http://", "http://:80/", "http://127.0.0.1:99999/", "http://[::1", "http://[::1]x/",
        "http://a b/", "http:///path", "ftp://127.0.0.1/", "127.0.0.1:80", "http://127.0.0.1:0/",
        "http://127.0.0.1:8o/", "http://host\r\nX: y/", "http://127.0.0.1:/"}) {
    bad.push_back({.url = u});
  }
  const std::string long_key(256, 'k');
  for (const std::string& key : {long_key, std::string("a\nb"), std::string("a\rb"),
                                 std::string("a\x01"), std::string("\x7f"), std::string(" k")}) {
    bad.push_back({.method = "POST", .url = url, .idempotency_key = key});
    Request in_header{.method = "POST", .url = url};
    in_header.headers = {{"Idempotency-Key", key}};
    bad.push_back(in_header);
  }
  Request conflict{.method = "POST", .url = url, .idempotency_key = "a"};
  conflict.headers = {{"idempotency-key", "b"}};
  bad.push_back(conflict);
  Request two{.method = "POST", .url = url};
  two.headers = {{"Idempotency-Key", "a"}, {"IDEMPOTENCY-KEY", "b"}};
  bad.push_back(two);
  for (const auto& [name, value] :
       std::vector<std::pair<std::string, std::string>>{{"X-A", "v\r\nX-Injected: 1"},
                                                        {"X-A", "v\nw"},
                                                        {"X-A", std::string("v\0w", 3)},
                                                        {"Bad Name", "v"},
                                                        {"", "v"},
                                                        {"X:Y", "v"}}) {
    Request r{.url = url};
    r.headers = {{name, value}};
    bad.push_back(r);
  }
  TypeParam client(options());
  for (const Request& r : bad) {
    const Result result = client.send(r);
    EXPECT_EQ(result.reason, StopReason::kPermanent) << r.url;
    EXPECT_EQ(result.outcome.kind, keel::OutcomeKind::kPermanent) << r.url;
    EXPECT_EQ(result.attempts, 0) << r.url;
    EXPECT_FALSE(result.error.empty()) << r.url;
  }
  EXPECT_EQ(server.arrivals().size(), 0u);
  // The longest key is accepted, and the scheme is case-insensitive.
  std::string upper = url;
  upper.replace(0, 4, "HTTP");
  EXPECT_TRUE(client.send({.url = upper}).ok());
  EXPECT_TRUE(
      client.send({.method = "POST", .url = url, .idempotency_key = std::string(255, 'k')}).ok());
  EXPECT_EQ(server.arrivals().size(), 2u);
}

TYPED_TEST(HttpClientsInput, AnOversizedResponseHeadIsALocalErrorNotRetried) {
  const std::string big_line = "X-Big: " + std::string(10 * 1024 * 1024, 'h') + "\r\n";
  const std::string big_retry_after = "Retry-After: " + std::string(10 * 1024 * 1024, '9') + "\r\n";
  std::string many;
  for (int i = 0; i < 2000; ++i)
    many += "X-Field-" + std::to_string(i) + ": " + std::string(40, 'v') + "\r\n";
  const std::string medium = "X-Medium: " + std::string(80 * 1024, 'm') + "\r\n";
  for (const std::string& extra : {big_line, big_retry_after, many, medium}) {
    RawHttpServer server({{response_head(503, 2, extra) + "ok"}});
    TypeParam client(options());
    const Result r = client.send({.url = server.url()});
    EXPECT_EQ(r.reason, StopReason::kPermanent) << extra.substr(0, 20);
    EXPECT_EQ(r.attempts, 1) << extra.substr(0, 20);
    EXPECT_EQ(server.requests(), 1) << extra.substr(0, 20);
    EXPECT_FALSE(r.response.has_value());
    EXPECT_NE(r.error.find("header"), std::string::npos) << r.error;
    EXPECT_EQ(r.error.find("Out of memory"), std::string::npos) << r.error;
  }
  // Just under the limit is taken.
  RawHttpServer server(
      {{response_head(200, 2, "X-Ok: " + std::string(60 * 1024, 'o') + "\r\n") + "ok"}});
  TypeParam client(options());
  const Result r = client.send({.url = server.url()});
  EXPECT_TRUE(r.ok()) << r.error;
}

TYPED_TEST(HttpClientsInput, AnAbsurdRetryAfterRunsIntoTheDeadlineInsteadOfABurst) {
  for (const char* value :
       {"9223372037", "99999999999999999999", "Fri, 31 Dec 9999 23:59:59 GMT"}) {
    RawHttpServer server(
        {{response_head(503, 2, std::string("Retry-After: ") + value + "\r\n") + "no"},
         {response_head(200, 2) + "ok"}});
    ClientOptions c = options();
    c.retry.overall_timeout = seconds(5);
    c.retry.retry_after_cap = seconds(60);
    TypeParam client(c);
    const Result r = client.send({.url = server.url()});
    EXPECT_EQ(r.reason, StopReason::kDeadline) << value;
    EXPECT_EQ(server.requests(), 1) << value;
  }
}

TYPED_TEST(HttpClientsInput, ABodyOverMaxResponseBytesIsALocalError) {
  for (const std::uint64_t size : {std::uint64_t{1} << 20 | 1, std::uint64_t{3} << 20}) {
    RawHttpServer server({{response_head(200, size), size}});
    ClientOptions c = options();
    c.limits.max_response_bytes = std::size_t{1} << 20;
    TypeParam client(c);
    const Result r = client.send({.url = server.url()});
    EXPECT_EQ(r.reason, StopReason::kPermanent) << size;
    EXPECT_EQ(server.requests(), 1);
    EXPECT_NE(r.error.find("max_response_bytes"), std::string::npos) << r.error;
  }
  RawHttpServer server({{response_head(200, std::size_t{1} << 20), std::size_t{1} << 20}});
  ClientOptions c = options();
  c.limits.max_response_bytes = std::size_t{1} << 20;
  TypeParam client(c);
  const Result r = client.send({.url = server.url()});
  EXPECT_TRUE(r.ok()) << r.error;
  ASSERT_TRUE(r.response.has_value());
  EXPECT_EQ(r.response->body.size(), std::size_t{1} << 20);
}

TYPED_TEST(HttpClientsInput, ABodySinkGetsOnlyTheFinalAttemptsBody) {
  RawHttpServer server({{response_head(503, 100000), 100000, 'a'},
                        {response_head(502, 3), 3, 'b'},
                        {response_head(200, 5000000), 5000000, 'c'}});
  ClientOptions c = options();
  c.limits.max_response_bytes = 1000;  // not applied to a sink
  TypeParam client(c);
  std::string got;
  int restarts = 0;
  Request request{.url = server.url()};
  request.body_sink.restart = [&] {
    ++restarts;
    got.clear();
    return true;
  };
  request.body_sink.write = [&](std::string_view data) {
    got.append(data);
    return true;
  };
  const Result r = client.send(request);
  EXPECT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(r.attempts, 3);
  EXPECT_EQ(restarts, 3);
  EXPECT_EQ(got, std::string(5000000, 'c'));
  ASSERT_TRUE(r.response.has_value());
  EXPECT_TRUE(r.response->body.empty());
  // A sink that fails ends the operation: a local error, not retried.
  RawHttpServer again({{response_head(200, 10), 10}});
  Request failing{.url = again.url()};
  failing.body_sink.write = [](std::string_view) { return false; };
  const Result f = client.send(failing);
  EXPECT_EQ(f.reason, StopReason::kPermanent);
  EXPECT_EQ(again.requests(), 1);
  EXPECT_NE(f.error.find("body"), std::string::npos) << f.error;
}

}  // namespace
