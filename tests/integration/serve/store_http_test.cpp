// keel::store_http in process: the idempotency middleware and apply_server_limits() on a real
// httplib::Server bound to 127.0.0.1 port 0, over a real SQLite file; raw sockets write hostile
// requests byte by byte. Also check_json(), the one JSON validation the middleware, the fingerprint
// and the payments handler share.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "keel/json/json_check.hpp"
#include "keel/serve/httplib/idempotency_middleware.hpp"
#include "keel/serve/httplib/rate_limiter.hpp"
#include "support/test_support.hpp"

#if defined(__SANITIZE_THREAD__)
// The server and client of this test run in Debian's uninstrumented cpp-httplib.
extern "C" const char* __tsan_default_suppressions() {
  return "called_from_lib:libcpp-httplib.so.0.11\nrace:libcpp-httplib.so.0.11\n";
}
#endif

namespace keel::store {
namespace {

using namespace std::chrono_literals;

std::string nested(std::size_t depth, char open, char close, const std::string& inner = "") {
  return std::string(depth, open) + inner + std::string(depth, close);
}

/// Objects nested `depth` deep: {"a":{"a":...{}...}}.
std::string nested_objects(std::size_t depth) {
  std::string out;
  for (std::size_t i = 1; i < depth; ++i) out += "{\"a\":";
  out += "{}";
  out += std::string(depth - 1, '}');
  return out;
}

/// Arrays and objects alternating, `depth` deep: [{"a":[{"a":...}]}].
std::string nested_mixed(std::size_t depth) {
  std::string open;
  std::string close;  // built backwards, then reversed: linear in the depth
  for (std::size_t i = 0; i < depth; ++i) {
    if (i % 2 == 0) {
      open += '[';
      close += ']';
    } else {
      open += "{\"a\":";
      close += '}';
    }
  }
  std::reverse(close.begin(), close.end());
  return open + "1" + close;
}

TEST(JsonCheck, DepthAtTheLimitPassesAndOneMoreIsRefusedForEveryShape) {
  for (const std::size_t limit : {1u, 2u, 64u, 200u}) {
    const JsonLimits limits{.max_depth = limit};
    for (const std::size_t depth : std::vector<std::size_t>{limit - 1, limit, limit + 1, 100000}) {
      if (depth == 0) continue;
      for (const std::string& body :
           {nested(depth, '[', ']'), nested_objects(depth), nested_mixed(depth)}) {
        const JsonCheck c = check_json(body, limits);
        if (depth <= limit) {
          EXPECT_EQ(c.status, JsonStatus::kValid) << limit << " " << depth << " " << c.detail;
        } else {
          EXPECT_EQ(c.status, JsonStatus::kTooDeep) << limit << " " << depth;
          EXPECT_NE(c.detail.find("limit of " + std::to_string(limit)), std::string::npos)
              << c.detail;
        }
      }
    }
  }
}

TEST(JsonCheck, UnclosedDeepNestingIsTooDeepNotAParserProblem) {
  // 100,000 opening brackets and nothing else: refused by the pre-scan, never parsed.
  EXPECT_EQ(check_json(std::string(100000, '[')).status, JsonStatus::kTooDeep);
  EXPECT_EQ(check_json(std::string(100000, '{')).status, JsonStatus::kTooDeep);
  EXPECT_EQ(json_nesting_depth(std::string(100000, '['), 64), 65u);
  EXPECT_EQ(json_nesting_depth("]]]][[", 64), 2u);
}

TEST(JsonCheck, BracketsInsideStringsAndEscapesDoNotCount) {
  const std::string deep_text = "\"" + std::string(1000, '[') + "\"";
  EXPECT_EQ(json_nesting_depth(deep_text, 64), 0u);
  EXPECT_TRUE(check_json("{\"a\":" + deep_text + "}").ok());
  // An escaped quote does not end the string; an escaped backslash does not escape the quote.
  EXPECT_EQ(json_nesting_depth(R"(["\"[[[[", "\\", [1]])", 64), 2u);
  EXPECT_TRUE(check_json(R"(["\"[[[[", "\\", [1]])", {.max_depth = 2}).ok());
  EXPECT_EQ(check_json(R"(["\\", [[1]]])", {.max_depth = 2}).status, JsonStatus::kTooDeep);
}

TEST(JsonCheck, DuplicateMembersAreRefusedAtAnyLevel) {
  for (const std::string body : {
           R"({"amount":5,"amount":500000})", R"({"a":1,"b":{"x":1,"x":2}})",
           R"([{"a":1},{"b":[{"c":1,"c":1}]}])", R"({"a":{"b":1},"a":{"b":1}})",
           R"({"am\u006funt":1,"amount":2})",  // the same name, escaped
       }) {
    const JsonCheck c = check_json(body);
    EXPECT_EQ(c.status, JsonStatus::kDuplicateKey) << body;
    EXPECT_NE(c.detail.find("more than once"), std::string::npos) << c.detail;
  }
  // The same name in sibling objects is fine.
  EXPECT_TRUE(check_json(R"([{"a":1},{"a":2}])").ok());
  EXPECT_TRUE(check_json(R"({"a":{"a":{"a":1}}})").ok());
}

TEST(JsonCheck, CanonicalFormSortsMembersAndFingerprintsAgree) {
  const JsonCheck c = check_json("{ \"b\": 1,\n \"a\": [true, null] }");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c.canonical, R"({"a":[true,null],"b":1})");
  EXPECT_EQ(check_json("not json").status, JsonStatus::kNotJson);
  EXPECT_EQ(request_fingerprint("POST", "/x", "{\"b\":1,\"a\":2}"),
            request_fingerprint("POST", "/x", "{\"a\":2,\"b\":1}"));
  // A refused body is fingerprinted byte for byte: never parsed, never crashing.
  const std::string deep = nested(100000, '[', ']');
  EXPECT_EQ(request_fingerprint("POST", "/x", deep).size(), 64u);
  EXPECT_NE(request_fingerprint("POST", "/x", R"({"a":1,"a":2})"),
            request_fingerprint("POST", "/x", R"({"a":2})"));
  EXPECT_THROW((void)check_json("[]", {.max_depth = 0}), std::invalid_argument);
}

TEST(IdempotencyKey, LengthLimitIsInBytesAndSaysSo) {
  const ParsedKey k = parse_idempotency_key(std::string(256, 'k'));
  ASSERT_FALSE(k.key);
  EXPECT_EQ(k.error, KeyError::kTooLong);
  EXPECT_NE(k.detail.find("256 bytes"), std::string::npos) << k.detail;
  EXPECT_NE(k.detail.find("255 bytes"), std::string::npos) << k.detail;
  EXPECT_TRUE(parse_idempotency_key(std::string(255, 'k')).key);
  // Quoted, the limit is on the key: 255 bytes between the quotes.
  EXPECT_TRUE(parse_idempotency_key('"' + std::string(255, 'k') + '"').key);
  // Letters outside ASCII are refused whatever their length (keel/core/idempotency_key.hpp).
  std::string cyrillic;
  for (int i = 0; i < 4; ++i) cyrillic += "\xd0\x96";
  EXPECT_EQ(parse_idempotency_key(cyrillic).error, KeyError::kMalformed);
  // max_bytes lowers the limit, and cannot raise it.
  const ParsedKey short_limit = parse_idempotency_key(std::string(17, 'k'), 16);
  EXPECT_EQ(short_limit.error, KeyError::kTooLong);
  EXPECT_NE(short_limit.detail.find("the limit is 16 bytes"), std::string::npos);
  EXPECT_EQ(parse_idempotency_key(std::string(256, 'k'), 1000).error, KeyError::kTooLong);
}

/// Raw HTTP over loopback: writes bytes as given, reads the answer until the server closes or
/// `timeout` passes.
struct RawAnswer {
  std::string text;
  bool closed = false;  // the server closed the connection
  std::chrono::milliseconds closed_after{0};
  [[nodiscard]] int status() const {
    return text.size() > 12 && text.rfind("HTTP/1.1 ", 0) == 0 ? std::stoi(text.substr(9, 3)) : -1;
  }
  [[nodiscard]] int answers() const {
    int n = 0;
    for (std::size_t at = text.find("HTTP/1.1 "); at != std::string::npos;
         at = text.find("HTTP/1.1 ", at + 1)) {
      ++n;
    }
    return n;
  }
};

RawAnswer raw_request(int port, const std::string& bytes, std::chrono::milliseconds timeout = 3s) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  RawAnswer out;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return out;
  }
  std::size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<std::size_t>(n);
  }
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    char buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) {
      out.closed = true;
      out.closed_after = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::steady_clock::now() - (until - timeout));
      break;
    }
    out.text.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return out;
}

/// A real httplib::Server on 127.0.0.1:0 with keel's limits and the middleware in front of a
/// handler that inserts one row into `charges`.
class StoreHttp : public ::testing::Test {
 protected:
  void start(ServerLimits limits = {}, MiddlewareOptions extra = {}) {
    url_ = parse_database_url("sqlite:" + (dir_.path() / "db.sqlite").string()).value();
    pool_ = std::make_unique<ConnectionPool>(url_, PoolOptions{.max_connections = 8});
    {
      auto conn = pool_->acquire();
      IdempotencyStore::migrate(*conn);
      conn->execute("CREATE TABLE charges (id INTEGER PRIMARY KEY, body TEXT NOT NULL)");
    }
    extra.store = &store_;
    extra.pool = pool_.get();
    extra.log = [this](std::string_view m) {
      std::lock_guard lock(log_mu_);
      log_ += std::string(m) + "\n";
    };
    middleware_ = std::make_unique<IdempotencyMiddleware>(std::move(extra));
    if (limits.routes.empty()) limits.routes = {{"/v1/charges", "POST"}, {"/healthz", "GET"}};
    apply_server_limits(server_, std::move(limits));
    server_.Post("/v1/charges", middleware_->wrap([this](const httplib::Request& req,
                                                         Connection& tx) -> StoredResponse {
      ++handled_;
      if (req.body == "throw") throw std::runtime_error("secret database password in here");
      tx.query("INSERT INTO charges (body) VALUES ($1)", {req.body});
      return {201, {{"Content-Type", "application/json"}}, R"({"ok":true})"};
    }));
    server_.Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("ok\n", "text/plain");
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    ASSERT_GT(port_, 0);
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    for (int i = 0; i < 200 && !server_.is_running(); ++i) std::this_thread::sleep_for(5ms);
  }
  void TearDown() override {
    server_.stop();
    if (thread_.joinable()) thread_.join();
  }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(10);
    return c;
  }
  std::int64_t rows(const std::string& table) const {
    return pool_->acquire()->query("SELECT COUNT(*) FROM " + table).integer(0, 0);
  }
  void expect_healthy() {
    auto r = client().Get("/healthz");
    ASSERT_TRUE(r) << "the server does not answer /healthz";
    EXPECT_EQ(r->status, 200);
  }
  static httplib::Headers key(const std::string& k) {
    return {{"Idempotency-Key", k}, {"Authorization", "Bearer alice"}};
  }

  test::TempDir dir_;
  DatabaseUrl url_;
  std::unique_ptr<ConnectionPool> pool_;
  IdempotencyStore store_;
  std::unique_ptr<IdempotencyMiddleware> middleware_;
  httplib::Server server_;
  std::thread thread_;
  int port_ = 0;
  std::atomic<int> handled_{0};
  std::mutex log_mu_;
  std::string log_;  // guarded by log_mu_
};

TEST_F(StoreHttp, DeepJsonIsRefusedBeforeAnythingIsStoredAndTheServerStaysUp) {
  start();
  auto c = client();
  int i = 0;
  for (const std::size_t depth : {65u, 100u, 100000u}) {
    for (const std::string& body :
         {nested(depth, '[', ']'), nested_objects(depth), nested_mixed(depth)}) {
      auto r = c.Post("/v1/charges", key("deep-" + std::to_string(i++)), body, "application/json");
      ASSERT_TRUE(r) << depth;
      EXPECT_EQ(r->status, 400) << depth;
      EXPECT_EQ(r->get_header_value("Content-Type"), "application/problem+json");
      EXPECT_NE(r->body.find("limit of 64 levels"), std::string::npos) << r->body;
    }
  }
  // Without a JSON Content-Type too: the body looks like JSON.
  auto r = c.Post("/v1/charges", key("deep-plain"), nested(100000, '[', ']'), "text/plain");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(handled_.load(), 0);
  EXPECT_EQ(rows("keel_idempotency"), 0);
  EXPECT_EQ(rows("charges"), 0);
  // At the limit the handler runs.
  for (const std::string& body : {nested(64, '[', ']'), nested_objects(64), nested_mixed(64)}) {
    auto ok = c.Post("/v1/charges", key("ok-" + std::to_string(i++)), body, "application/json");
    ASSERT_TRUE(ok);
    EXPECT_EQ(ok->status, 201) << ok->body;
  }
  EXPECT_EQ(rows("charges"), 3);
  expect_healthy();
}

TEST_F(StoreHttp, ConfiguredDepthLimitIsTheOneApplied) {
  start({}, {.json_limits = {.max_depth = 3}});
  auto c = client();
  auto ok = c.Post("/v1/charges", key("d3"), "[[[1]]]", "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 201);
  auto deep = c.Post("/v1/charges", key("d4"), "[[[[1]]]]", "application/json");
  ASSERT_TRUE(deep);
  EXPECT_EQ(deep->status, 400);
  EXPECT_NE(deep->body.find("limit of 3 levels"), std::string::npos) << deep->body;
}

TEST_F(StoreHttp, DuplicateMembersAreRefusedAndNotStored) {
  start();
  auto c = client();
  int i = 0;
  for (const std::string body :
       {R"({"amount":5,"amount":500000})", R"({"a":{"b":1,"b":2}})", R"([{"x":1,"x":1}])"}) {
    auto r = c.Post("/v1/charges", key("dup-" + std::to_string(i++)), body, "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << body;
    EXPECT_EQ(r->get_header_value("Content-Type"), "application/problem+json");
  }
  EXPECT_EQ(handled_.load(), 0);
  EXPECT_EQ(rows("keel_idempotency"), 0);
  expect_healthy();
}

TEST_F(StoreHttp, BodiesJustUnderAndOverTheLimit) {
  start({.max_body_bytes = 1024});
  auto c = client();
  for (const std::size_t size : {1u, 1023u, 1024u}) {
    auto r = c.Post("/v1/charges", key("size-" + std::to_string(size)), std::string(size, 'x'),
                    "application/octet-stream");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 201) << size;
  }
  for (const std::size_t size : {1025u, 4096u, 10u << 20}) {
    auto r = c.Post("/v1/charges", key("big-" + std::to_string(size)), std::string(size, 'x'),
                    "application/octet-stream");
    if (r) {  // the server may close before a 10 MB upload is finished
      EXPECT_EQ(r->status, 413) << size;
      EXPECT_EQ(r->get_header_value("Content-Type"), "application/problem+json");
      EXPECT_NE(r->body.find("limit is 1024 bytes"), std::string::npos) << r->body;
    }
  }
  EXPECT_EQ(rows("charges"), 3);
  EXPECT_EQ(rows("keel_idempotency"), 3);
  // A declared length over the limit is refused before a byte of the body is sent.
  const RawAnswer a = raw_request(
      port_, "POST /v1/charges HTTP/1.1\r\nHost: x\r\nContent-Length: 200000000\r\n\r\n");
  EXPECT_EQ(a.status(), 413) << a.text;
  EXPECT_TRUE(a.closed);
  // With Expect: 100-continue the refusal comes instead of 100 Continue; within the limit the
  // client is told to go on.
  const RawAnswer expect =
      raw_request(port_,
                  "POST /v1/charges HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                  "Content-Length: 200000000\r\n\r\n");
  EXPECT_EQ(expect.status(), 413) << expect.text;
  EXPECT_EQ(expect.text.find("100 Continue"), std::string::npos) << expect.text;
  EXPECT_NE(expect.text.find("application/problem+json"), std::string::npos) << expect.text;
  EXPECT_TRUE(expect.closed);
  const RawAnswer go_on = raw_request(port_,
                                      "POST /v1/charges HTTP/1.1\r\nHost: x\r\n"
                                      "Idempotency-Key: e\r\nExpect: 100-continue\r\n"
                                      "Content-Length: 3\r\n\r\n",
                                      300ms);
  EXPECT_EQ(go_on.status(), 100) << go_on.text;
  expect_healthy();
}

TEST_F(StoreHttp, AmbiguousFramingIsRefusedAndTheConnectionClosed) {
  // Read and keep-alive timeouts far beyond the time a refusal takes even on a slow machine, so
  // that "closed at once" cannot be mistaken for "closed when a timeout ran out".
  start({.max_header_bytes = 4096, .read_timeout = 30s, .keep_alive_timeout = 30s});
  const std::string post = "POST /v1/charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: f\r\n";
  const std::string smuggled = "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
  const std::vector<std::pair<std::string, int>> cases = {
      {post + "Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!", 400},
      {post + "Content-Length: 5\r\nContent-Length: 5\r\n\r\nhello", 400},
      {post + "Content-Length: 5, 5\r\n\r\nhello", 400},
      {post + "Content-Length: +5\r\n\r\nhello", 400},
      {post + "Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400},
      {post + "Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\n", 400},
      {post + "Transfer-Encoding: gzip\r\n\r\n0\r\n\r\n", 400},
      {post + "Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n", 400},
      {post + "Transfer-Encoding: identity\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400},
      {post + "Transfer-Encoding: chunked\r\n \r\n\r\n0\r\n\r\n", 411},
      {post + "Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 411},
      {post + "X-Folded: a\r\n Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400},
      {post + "\r\n" + smuggled, 411},  // no length at all
      {"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(smuggled.size()) +
           "\r\n\r\n" + smuggled,
       400},
      {"GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400},
      {"HEAD /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(smuggled.size()) +
           "\r\n\r\n" + smuggled,
       400},
      {"OPTIONS /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx", 400},
      {post + "X-Big: " + std::string(4000, 'a') + "\r\nX-Big2: " + std::string(4000, 'b') +
           "\r\nContent-Length: 0\r\n\r\n",
       431},
  };
  for (const auto& [bytes, status] : cases) {
    const RawAnswer a = raw_request(port_, bytes, 15s);
    EXPECT_EQ(a.status(), status) << bytes.substr(0, 200) << "\n-> " << a.text;
    EXPECT_NE(a.text.find("application/problem+json"), std::string::npos) << a.text;
    EXPECT_NE(a.text.find("Connection: close"), std::string::npos) << a.text;
    // Closed at once, not at the read or keep-alive timeout (30 s).
    EXPECT_TRUE(a.closed) << bytes.substr(0, 200);
    EXPECT_LT(a.closed_after, 10s) << bytes.substr(0, 200);
    EXPECT_EQ(a.answers(), 1) << "a smuggled request was answered: " << a.text;
  }
  EXPECT_EQ(handled_.load(), 0);
  EXPECT_EQ(rows("keel_idempotency"), 0);
  expect_healthy();
}

TEST_F(StoreHttp, LibraryErrorsAreProblemJsonAndAWrongMethodIs405WithAllow) {
  start();
  auto c = client();
  auto missing = c.Get("/nope");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
  EXPECT_EQ(missing->get_header_value("Content-Type"), "application/problem+json");
  auto wrong = c.Put("/v1/charges", "", "application/json");
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong->status, 405);
  EXPECT_EQ(wrong->get_header_value("Allow"), "POST");
  EXPECT_EQ(wrong->get_header_value("Content-Type"), "application/problem+json");
  auto get = c.Get("/v1/charges");
  ASSERT_TRUE(get);
  EXPECT_EQ(get->status, 405);
  // cpp-httplib's own 413: a form body over its fixed 8192-byte limit for form parsing.
  auto form = c.Post("/v1/charges", key("form"), std::string(9000, 'a'),
                     "application/x-www-form-urlencoded");
  ASSERT_TRUE(form);
  EXPECT_EQ(form->status, 413);
  EXPECT_EQ(form->get_header_value("Content-Type"), "application/problem+json");
  EXPECT_EQ(handled_.load(), 0);
  // An unparsable request line and an oversized header line (cpp-httplib's own 400s).
  for (const std::string& bytes :
       {std::string("BREW /pot HTTP/1.1\r\nHost: x\r\n\r\n"),
        "GET /healthz HTTP/1.1\r\nX-Long: " + std::string(9000, 'a') + "\r\n\r\n",
        "GET /" + std::string(9000, 'a') + " HTTP/1.1\r\nHost: x\r\n\r\n"}) {
    const RawAnswer a = raw_request(port_, bytes);
    EXPECT_TRUE(a.status() == 400 || a.status() == 414) << a.text;
    EXPECT_NE(a.text.find("application/problem+json"), std::string::npos) << a.text;
  }
  expect_healthy();
}

TEST_F(StoreHttp, HandlerExceptionTextIsLoggedNotSent) {
  start();
  auto r = client().Post("/v1/charges", key("boom"), "throw", "text/plain");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 500);
  EXPECT_EQ(r->body.find("secret"), std::string::npos) << r->body;
  std::lock_guard lock(log_mu_);
  EXPECT_NE(log_.find("secret database password"), std::string::npos) << log_;
  EXPECT_EQ(rows("keel_idempotency"), 0);
}

TEST_F(StoreHttp, AcceptedConnectionsHaveTcpNodelay) {
  start();
  // Keep one connection open and find its accepted socket in this process.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port_));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  sockaddr_in mine{};
  socklen_t len = sizeof mine;
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &len), 0);
  // The server accepts on its own thread: poll (bounded) until the socket shows up.
  int found = -1;
  for (int attempt = 0; attempt < 400 && found < 0; ++attempt) {
    for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
      const int other = std::stoi(entry.path().filename().string());
      sockaddr_in peer{};
      socklen_t plen = sizeof peer;
      if (other == fd || ::getpeername(other, reinterpret_cast<sockaddr*>(&peer), &plen) != 0) {
        continue;
      }
      if (peer.sin_family == AF_INET && peer.sin_port == mine.sin_port) found = other;
    }
    if (found < 0) std::this_thread::sleep_for(5ms);
  }
  ASSERT_GE(found, 0);
  int nodelay = 0;
  len = sizeof nodelay;
  ASSERT_EQ(::getsockopt(found, IPPROTO_TCP, TCP_NODELAY, &nodelay, &len), 0);
  EXPECT_NE(nodelay, 0);
  ::close(fd);
}

TEST(PrincipalScope, NoCredentialIsTheOnlyWayIntoTheAnonymousScope) {
  const std::string secret(32, 's');
  EXPECT_EQ(principal_scope("", secret), kAnonymousScope);
  for (const std::string principal :
       {"anonymous", "Authorization: Bearer", "Authorization: Basic YWxpY2U6cHc=", "alice"}) {
    const std::string scope = principal_scope(principal, secret);
    EXPECT_NE(scope, kAnonymousScope) << principal;
    EXPECT_EQ(scope.size(), 66u);
    EXPECT_EQ(scope.rfind("p:", 0), 0u);
    EXPECT_EQ(scope.find(principal), std::string::npos);
    EXPECT_NE(scope, principal_scope(principal, std::string(32, 't')));  // keyed
  }
  const auto principal_of = [](std::optional<std::string> auth) {
    httplib::Request r;
    if (auth) r.set_header("Authorization", *auth);
    return bearer_principal(r);
  };
  EXPECT_EQ(principal_of(std::nullopt), "");
  EXPECT_EQ(principal_of("Bearer anonymous"), "anonymous");
  EXPECT_EQ(principal_of("bearer tok"), "tok");
  EXPECT_EQ(principal_of("Bearer "), "Authorization: Bearer ");
  EXPECT_EQ(principal_of("Basic YWxpY2U6cHc="), "Authorization: Basic YWxpY2U6cHc=");
  EXPECT_EQ(principal_of("Bearer a b"), "Authorization: Bearer a b");
  EXPECT_THROW((void)principal_scope("x", ""), std::invalid_argument);
}

TEST_F(StoreHttp, OnlyUnauthenticatedRequestsShareTheAnonymousScopeAndNoCredentialIsStored) {
  start({}, {.scope_secret = std::string(32, 'k')});
  auto c = client();
  auto first = c.Post("/v1/charges", {{"Idempotency-Key", "shared-key"}}, "one", "text/plain");
  ASSERT_TRUE(first);
  EXPECT_EQ(first->status, 201);
  auto again = c.Post("/v1/charges", {{"Idempotency-Key", "shared-key"}}, "one", "text/plain");
  ASSERT_TRUE(again);
  EXPECT_EQ(again->get_header_value("Idempotent-Replayed"), "true");
  // None of these may receive the unauthenticated request's replay, nor each other's.
  const std::vector<std::string> credentials = {
      "Bearer anonymous", "Bearer ", "Basic YWxpY2U6cHc=", "Bearer secret-token-123", "bearer  x"};
  for (const std::string& auth : credentials) {
    auto r = c.Post("/v1/charges", {{"Idempotency-Key", "shared-key"}, {"Authorization", auth}},
                    "one", "text/plain");
    ASSERT_TRUE(r) << auth;
    EXPECT_EQ(r->status, 201) << auth;
    EXPECT_FALSE(r->has_header("Idempotent-Replayed")) << auth;
  }
  EXPECT_EQ(rows("keel_idempotency"), 1 + static_cast<std::int64_t>(credentials.size()));
  const Rows scopes = pool_->acquire()->query("SELECT scope FROM keel_idempotency");
  for (std::size_t i = 0; i < scopes.size(); ++i) {
    const std::string& scope = scopes.text(i, 0);
    EXPECT_TRUE(scope == kAnonymousScope || (scope.size() == 66 && scope.rfind("p:", 0) == 0))
        << scope;
    EXPECT_EQ(scope.find("secret-token"), std::string::npos);
    EXPECT_EQ(scope.find("YWxp"), std::string::npos);
  }
  EXPECT_EQ(middleware_->scope(httplib::Request{}), kAnonymousScope);
}

TEST_F(StoreHttp, ACustomPrincipalIsHashedToo) {
  start({}, {.principal = [](const httplib::Request& r) { return r.get_header_value("X-Tenant"); },
             .scope_secret = std::string(16, 'q')});
  auto a = client().Post("/v1/charges", {{"Idempotency-Key", "k"}, {"X-Tenant", "acme"}}, "x",
                         "text/plain");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->status, 201);
  const Rows scopes = pool_->acquire()->query("SELECT scope FROM keel_idempotency");
  ASSERT_EQ(scopes.size(), 1u);
  EXPECT_EQ(scopes.text(0, 0), principal_scope("acme", std::string(16, 'q')));
}

TEST(PrincipalScope, AShortSecretIsRefusedByName) {
  test::TempDir dir;
  ConnectionPool pool(parse_database_url("sqlite:" + (dir.path() / "x.db").string()).value());
  IdempotencyStore store;
  try {
    IdempotencyMiddleware m({.store = &store, .pool = &pool, .scope_secret = "short"});
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("scope_secret"), std::string::npos);
  }
}

TEST(ServerLimitsPort, APortInUseFailsUnlessSharingIsAsked) {
  httplib::Server one;
  apply_server_limits(one, {});
  const int port = one.bind_to_any_port("127.0.0.1");
  ASSERT_GT(port, 0);
  httplib::Server two;
  apply_server_limits(two, {});
  EXPECT_FALSE(two.bind_to_port("127.0.0.1", port));
  // Both sides must ask for sharing.
  httplib::Server a;
  httplib::Server b;
  apply_server_limits(a, {.reuse_port = true});
  apply_server_limits(b, {.reuse_port = true});
  const int shared = a.bind_to_any_port("127.0.0.1");
  ASSERT_GT(shared, 0);
  EXPECT_TRUE(b.bind_to_port("127.0.0.1", shared));
  httplib::Server c;
  apply_server_limits(c, {});
  EXPECT_FALSE(c.bind_to_port("127.0.0.1", shared));
}

TEST(ServerLimitsPort, InvalidLimitsNameTheField) {
  httplib::Server s;
  try {
    apply_server_limits(s, {.max_body_bytes = 0});
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("max_body_bytes"), std::string::npos);
  }
  EXPECT_THROW(apply_server_limits(s, {.keep_alive_timeout = 0s}), std::invalid_argument);
}

TEST(RateLimiterOptions, InvalidOptionsNameTheField) {
  // A capacity of 0 used to evict from an empty table on the first new principal.
  for (const auto& [rate, capacity, field] :
       std::vector<std::tuple<double, std::size_t, std::string>>{
           {0.0, 10, "rate"}, {-1.0, 10, "rate"}, {1.0, 0, "capacity"}}) {
    try {
      RateLimiter limiter(rate, capacity);
      ADD_FAILURE() << field;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  }
  RateLimiter one(1.0, 1);
  EXPECT_EQ(one.admit("p:a"), Duration::zero());
}

}  // namespace
}  // namespace keel::store
