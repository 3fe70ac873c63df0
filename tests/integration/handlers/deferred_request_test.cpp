// keel::store's queue-for-later pieces in process: the deferred request's job payload
// (encode_deferred_request / decode_deferred_request), QueuedWrites on a real SQLite file, and
// DeferredRequestHandler delivering a job to a keel::faults::FaultServer over loopback with the
// job's key, the stored header fields and body, and Keel-Attempt going on from the attempts made
// before the request was deferred.
#include "keel/handlers/deferred_request.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <vector>

#include "keel/faults/fault_server.hpp"
#include "keel/handlers/webhook_handler.hpp"
#include "keel/http/client.hpp"
#include "support/test_support.hpp"

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
  EXPECT_EQ(id->status, http::DeferralStatus::kQueued);
  const auto again = writes.defer(sample(), "k-1");
  ASSERT_TRUE(again);
  EXPECT_EQ(again->job_id, id->job_id);
  EXPECT_EQ(again->status, http::DeferralStatus::kAlreadyQueued);
  auto conn = pool.acquire();
  const auto job = queue.get(*conn, std::stoll(id->job_id));
  ASSERT_TRUE(job);
  EXPECT_EQ(job->queue, "deferred-http");
  EXPECT_EQ(job->idempotency_key, "k-1");
  EXPECT_EQ(job->max_attempts, 7);
  EXPECT_THROW(QueuedWrites(pool, queue, {.queue = "no spaces"}), std::invalid_argument);
}

TEST(QueuedWrites, ADifferentRequestUnderAKeyAlreadyQueuedIsAConflictAndNotStored) {
  test::TempDir dir;
  ConnectionPool pool(parse_database_url("sqlite:" + (dir.path() / "q.db").string()).value());
  JobQueue queue;
  QueuedWrites writes(pool, queue, {.secret_headers = {"X-Api-Key"}});
  http::Request first = sample();
  first.headers.emplace_back("Authorization", "Bearer old-token");
  first.headers.emplace_back("x-api-key", "old-key");
  const auto id = writes.defer(first, "k-1");
  ASSERT_TRUE(id) << id.error().message();
  ASSERT_EQ(id->status, http::DeferralStatus::kQueued);

  // The same request: credentials refreshed, header fields in another order and case, more
  // attempts made: still the same operation.
  http::Request same = sample();
  same.headers = {{"x-tenant", "acme"},
                  {"content-type", "application/json"},
                  {"Authorization", "Bearer new-token"},
                  {"X-Api-Key", "new-key"}};
  same.prior_attempts = 9;
  const auto again = writes.defer(same, "k-1");
  ASSERT_TRUE(again);
  EXPECT_EQ(again->status, http::DeferralStatus::kAlreadyQueued);
  EXPECT_EQ(again->job_id, id->job_id);

  const auto changed = [](auto&& change) {
    http::Request r = sample();
    change(r);
    return r;
  };
  for (const http::Request& other :
       {changed([](http::Request& r) { r.body = R"({"name":"Zoe"})"; }),
        changed([](http::Request& r) { r.method = "POST"; }),
        changed([](http::Request& r) { r.url += "?v=2"; }),
        changed([](http::Request& r) { r.headers[3].second = "other-tenant"; })}) {
    const auto conflict = writes.defer(other, "k-1");
    ASSERT_TRUE(conflict) << conflict.error().message();
    EXPECT_EQ(conflict->status, http::DeferralStatus::kKeyConflict) << other.method << other.url;
    EXPECT_EQ(conflict->job_id, id->job_id);
  }
  auto conn = pool.acquire();
  const auto job = queue.get(*conn, std::stoll(id->job_id));
  ASSERT_TRUE(job);
  const auto stored = decode_deferred_request(job->payload);
  ASSERT_TRUE(stored);
  EXPECT_EQ(stored->body, sample().body) << "the first request is the one kept";
  EXPECT_EQ(queue.stats(*conn).front().ready, 1) << "one job";
}

TEST(DeferredRequestPayload, CredentialsAreStoredForTheDeliveryAndRedactedForOperators) {
  http::Request r = sample();
  r.headers.emplace_back("authorization", "Bearer s3cret-token");
  r.headers.emplace_back("Proxy-Authorization", "Basic cHJveHk=");
  r.headers.emplace_back("Cookie", "session=s3cret-cookie");
  r.headers.emplace_back("X-Api-Key", "s3cret-key");
  const std::vector<std::string> secret = {"x-api-key"};
  const std::string payload = encode_deferred_request(r, secret);
  const auto decoded = decode_deferred_request(payload);
  ASSERT_TRUE(decoded);
  EXPECT_EQ(http::find_header(decoded->headers, "Authorization").value_or(""),
            "Bearer s3cret-token")
      << "the delivery needs it";
  EXPECT_EQ(http::find_header(decoded->headers, "X-Api-Key").value_or(""), "s3cret-key");

  const std::string shown = redact_deferred_request(payload);
  for (const char* secret_text : {"s3cret", "cHJveHk="}) {
    EXPECT_EQ(shown.find(secret_text), std::string::npos) << shown;
  }
  const auto redacted = decode_deferred_request(shown);
  ASSERT_TRUE(redacted) << "still a deferred request";
  EXPECT_EQ(http::find_header(redacted->headers, "Cookie").value_or(""), kRedacted);
  EXPECT_EQ(http::find_header(redacted->headers, "X-Tenant").value_or(""), "acme");
  EXPECT_EQ(redacted->body, r.body);

  // Anything else is shown as it is, however it is nested.
  for (const std::string& other : {std::string("not json"), std::string(R"({"a":1})"),
                                   std::string(100000, '[') + "\"keel_deferred_request\""}) {
    EXPECT_EQ(redact_deferred_request(other), other);
  }
}

// A deferred request is stored as JSON, whose strings are UTF-8: a header value (or URL) in other
// bytes could only be stored altered and delivered as something else, so it is refused, never
// queued, and the value (maybe a credential) is not quoted.
TEST(QueuedWrites, AUrlOrHeaderValueThatIsNotUtf8IsRefusedAndNothingIsQueued) {
  test::TempDir dir;
  const std::string path = (dir.path() / "q.db").string();
  ConnectionPool pool(parse_database_url("sqlite:" + path).value());
  JobQueue queue;
  QueuedWrites writes(pool, queue);
  http::Request latin1 = sample();
  latin1.headers.emplace_back("Authorization", "Bearer M\xFCller-s3cret");
  const auto header = writes.defer(latin1, "k-1");
  ASSERT_FALSE(header);
  EXPECT_EQ(header.error().message(),
            "keel::store::QueuedWrites: header 'Authorization' has a value that is not UTF-8 "
            "text, which a deferred request cannot store");
  http::Request url = sample();
  url.url = "http://127.0.0.1:9/M\xFCller";
  const auto bad_url = writes.defer(url, "k-2");
  ASSERT_FALSE(bad_url);
  EXPECT_NE(bad_url.error().message().find("URL is not UTF-8 text"), std::string::npos)
      << bad_url.error().message();
  EXPECT_FALSE(std::filesystem::exists(path)) << "nothing was written, not even the schema";
  // UTF-8 in a header value is stored and delivered as it was.
  http::Request utf8 = sample();
  utf8.headers.emplace_back("X-Name", "M\xC3\xBCller");
  ASSERT_TRUE(writes.defer(utf8, "k-3"));
  auto conn = pool.acquire();
  const auto leased = queue.lease(*conn, "deferred-http", "w", 1);
  ASSERT_EQ(leased.size(), 1u);
  const auto decoded = decode_deferred_request(leased[0].payload);
  ASSERT_TRUE(decoded) << decoded.error().message();
  EXPECT_EQ(http::find_header(decoded->headers, "X-Name").value_or(""), "M\xC3\xBCller");
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
  faults::FaultServer server({.script = "503,200"});
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
