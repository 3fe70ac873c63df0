// keel::store's queue-for-later pieces in process: the deferred request's job payload
// (encode_deferred_request / decode_deferred_request), QueuedWrites on a real SQLite file, and
// DeferredRequestHandler delivering a job to a keel::testing::FaultServer over loopback with the
// job's key, the stored header fields and body, and Keel-Attempt going on from the attempts made
// before the request was deferred.
#include "keel/store/deferred_request.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <string>

#include "keel/http/client.hpp"
#include "keel/store/webhook_handler.hpp"
#include "keel/testing/fault_server.hpp"
#include "test_support.hpp"

namespace keel::store {
namespace {

using namespace std::chrono_literals;

http::Request sample() {
  return http::Request{.method = "PUT",
                       .url = "http://127.0.0.1:9/accounts/7",
                       .headers = {{"Content-Type", "application/json"},
                                   {"Idempotency-Key", "k-1"},
                                   {"Keel-Attempt", "3"},
                                   {"X-Tenant", "acme"}},
                       .body = R"({"name":"Zoë"})",
                       .prior_attempts = 3};
}

TEST(DeferredRequestPayload, RoundTripsWithoutTheClientsOwnHeaderFields) {
  const auto decoded = decode_deferred_request(encode_deferred_request(sample()));
  ASSERT_TRUE(decoded) << decoded.error().message();
  EXPECT_EQ(decoded->method, "PUT");
  EXPECT_EQ(decoded->url, "http://127.0.0.1:9/accounts/7");
  EXPECT_EQ(decoded->body, R"({"name":"Zoë"})");
  EXPECT_EQ(decoded->prior_attempts, 3);
  EXPECT_EQ(decoded->headers,
            (http::Headers{{"Content-Type", "application/json"}, {"X-Tenant", "acme"}}));
  EXPECT_FALSE(decoded->generate_idempotency_key) << "the job's key is the one sent";
}

TEST(DeferredRequestPayload, ABodyThatIsNotUtf8IsStoredInBase64) {
  for (const std::string& body : {std::string("\xff\x00\x01", 3), std::string("\x80"),
                                  std::string("ab\xc3"), std::string()}) {
    http::Request r = sample();
    r.body = body;
    const std::string payload = encode_deferred_request(r);
    const auto decoded = decode_deferred_request(payload);
    ASSERT_TRUE(decoded) << decoded.error().message();
    EXPECT_EQ(decoded->body, body);
  }
  http::Request r = sample();
  r.body = std::string("\xff\xfe", 2);
  EXPECT_NE(encode_deferred_request(r).find("\"body_base64\":\"//4=\""), std::string::npos);
}

TEST(DeferredRequestPayload, AnythingElseIsRefusedNamingWhatIsWrong) {
  for (const char* bad :
       {"not json", "[]", R"({"method":"GET","url":"http://a/"})",
        R"({"keel_deferred_request":2,"method":"GET","url":"http://a/"})",
        R"({"keel_deferred_request":1,"url":"http://a/"})",
        R"({"keel_deferred_request":1,"method":"GET","url":"http://a/","headers":[["a"]]})",
        R"({"keel_deferred_request":1,"method":"GET","url":"http://a/","body_base64":"***"})",
        R"({"keel_deferred_request":1,"method":"GET","url":"http://a/","prior_attempts":-1})"}) {
    const auto decoded = decode_deferred_request(bad);
    ASSERT_FALSE(decoded) << bad;
    EXPECT_NE(decoded.error().message().find("keel::store::decode_deferred_request: payload"),
              std::string::npos)
        << decoded.error().message();
  }
}

TEST(QueuedWrites, EnqueuesUnderTheKeyMigratingTheSchemaAndDeduplicates) {
  test::TempDir dir;
  ConnectionPool pool(parse_database_url("sqlite:" + (dir.path() / "q.db").string()).value());
  JobQueue queue;
  QueuedWrites writes(pool, queue, {.max_attempts = 7});
  const auto id = writes.defer(sample(), "k-1");
  ASSERT_TRUE(id) << id.error().message();
  const auto again = writes.defer(sample(), "k-1");
  ASSERT_TRUE(again);
  EXPECT_EQ(*again, *id);
  auto conn = pool.acquire();
  const auto job = queue.get(*conn, std::stoll(*id));
  ASSERT_TRUE(job);
  EXPECT_EQ(job->queue, "deferred-http");
  EXPECT_EQ(job->idempotency_key, "k-1");
  EXPECT_EQ(job->max_attempts, 7);
  EXPECT_THROW(QueuedWrites(pool, queue, {.queue = "no spaces"}), std::invalid_argument);
}

TEST(QueuedWrites, ADatabaseThatCannotBeOpenedIsAnErrorNotAnException) {
  test::TempDir dir;
  ConnectionPool pool(
      parse_database_url("sqlite:" + (dir.path() / "missing" / "q.db").string()).value());
  JobQueue queue;
  QueuedWrites writes(pool, queue);
  const auto id = writes.defer(sample(), "k-1");
  ASSERT_FALSE(id);
  EXPECT_NE(id.error().message().find("keel::store::QueuedWrites: enqueue failed"),
            std::string::npos)
      << id.error().message();
}

TEST(DeferredRequestHandler, SendsTheStoredRequestWithTheJobsKeyAndCountsOnTheAttempts) {
  testing::FaultServer server({.script = "503,200"});
  server.start();
  http::Client client(webhook_client_options(5s));
  const DeferredRequestHandler handler(client);
  http::Request r = sample();
  r.url = server.url("/accounts/7");
  LeasedJob job{.id = 1,
                .queue = "deferred-http",
                .payload = encode_deferred_request(r),
                .idempotency_key = "k-1",
                .attempt = 1};
  const std::atomic<bool> cancel{false};
  const AttemptReport first = handler(job, cancel);
  EXPECT_EQ(first.outcome.kind, OutcomeKind::kThrottled) << first.error;
  job.attempt = 2;
  const AttemptReport second = handler(job, cancel);
  EXPECT_EQ(second.outcome.kind, OutcomeKind::kSuccess) << second.error;
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 2u);
  for (std::size_t i = 0; i < arrivals.size(); ++i) {
    const auto& a = arrivals[i];
    EXPECT_EQ(a.method, "PUT");
    EXPECT_EQ(a.target, "/accounts/7");
    EXPECT_EQ(a.body, R"({"name":"Zoë"})");
    EXPECT_EQ(http::find_header(a.headers, "Idempotency-Key").value_or(""), "k-1");
    EXPECT_EQ(http::find_header(a.headers, "X-Tenant").value_or(""), "acme");
    EXPECT_EQ(http::find_header(a.headers, "Keel-Attempt").value_or(""), std::to_string(4 + i))
        << "three attempts before the request was deferred";
    EXPECT_EQ(http::find_header(a.headers, "Keel-Job-Attempt").value_or(""), std::to_string(1 + i));
  }
  job.payload = "{}";
  const AttemptReport poison = handler(job, cancel);
  EXPECT_EQ(poison.outcome.kind, OutcomeKind::kPermanent);
  EXPECT_NE(poison.error.find("keel_deferred_request"), std::string::npos) << poison.error;
}

}  // namespace
}  // namespace keel::store
