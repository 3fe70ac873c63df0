// Queue for later, end to end through the CLI (real processes, real SQLite files and a real
// PostgreSQL): `keel call --queue-on-failure DB -X POST ...` against a loopback API that is
// down (503, or connection refused) exits 8 and prints the job id; the API comes back;
// `keel jobs work --deferred` delivers the request. The API deduplicates by Idempotency-Key:
// it saw the same key on the original attempts and on the delivery, and applied it once.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "support/jobs_process_support.hpp"

namespace keel::store {
namespace {

using test_jobs::CmdResult;
using test_jobs::Receiver;

// A job id as printed on stdout, without its newline.
std::string trimmed(std::string text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  return text;
}

class DeferredCall : public test_jobs::JobsHarness<test::BackendTest> {
 protected:
  // keel call with fast retries: three attempts, a few milliseconds apart.
  CmdResult call(const std::string& db, const std::string& url,
                 std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"call",
                                     "--max-attempts",
                                     "3",
                                     "--backoff-base",
                                     "1ms",
                                     "--backoff-cap",
                                     "5ms",
                                     "--per-try-timeout",
                                     "2s",
                                     "--queue-on-failure",
                                     db,
                                     "-X",
                                     "POST",
                                     "-H",
                                     "Content-Type: application/json",
                                     "-d",
                                     R"({"amount":5})"};
    args.insert(args.end(), extra.begin(), extra.end());
    args.push_back(url);
    return keel(args);
  }
  CmdResult work() {
    return keel({"jobs", "--db", url_text(), "work", "--queue", "deferred-http", "--deferred",
                 "--backoff-base", "10ms", "--backoff-cap", "100ms", "--poll", "10ms",
                 "--exit-when-idle"});
  }
  // The database as keel call takes it: a plain SQLite path, or the PostgreSQL URL.
  [[nodiscard]] std::string call_db() const {
    const std::string& u = url_text();
    return u.starts_with("sqlite:") ? u.substr(7) : u;
  }

  void down_queued_then_delivered_once(bool refused) {
    Receiver api;
    const std::string hook = api.url("/hook");
    if (refused) {
      api.stop_listening();
    } else {
      api.set_outage(Receiver::kDown503);
    }
    const CmdResult queued = call(call_db(), hook);
    ASSERT_EQ(queued.status, 8) << queued.err;
    EXPECT_NE(queued.err.find("queued for later as job"), std::string::npos) << queued.err;
    const std::set<std::string> keys = this->keys("deferred-http");
    ASSERT_EQ(keys.size(), 1u);
    const std::string key = *keys.begin();
    EXPECT_EQ(
        queued.out,
        std::to_string(count("SELECT id FROM keel_jobs WHERE queue = 'deferred-http'")) + "\n")
        << "stdout is the job id";
    {
      std::lock_guard lock(api.mu);
      EXPECT_EQ(api.requests[key], refused ? 0 : 3) << "the original attempts carried the key";
      EXPECT_TRUE(api.applied.empty());
    }

    // Back.
    if (refused) api.listen_again();
    api.set_outage(Receiver::kNone);
    const CmdResult worked = work();
    ASSERT_EQ(worked.status, 0) << worked.err;
    EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'"), 1) << worked.err;
    std::lock_guard lock(api.mu);
    EXPECT_EQ(api.requests[key], refused ? 1 : 4) << "the delivery carried the same key";
    EXPECT_EQ(api.applied.size(), 1u);
    EXPECT_EQ(api.applied[key], 1) << "one logical operation: applied once";
    EXPECT_EQ(api.missing_key, 0);
  }
};

TEST_P(DeferredCall, A503OutageQueuesTheCallAndTheWorkerDeliversItOnceWithTheSameKey) {
  down_queued_then_delivered_once(/*refused=*/false);
}

TEST_P(DeferredCall, ARefusedConnectionQueuesTheCallAndTheWorkerDeliversIt) {
  down_queued_then_delivered_once(/*refused=*/true);
}

TEST_P(DeferredCall, TheSameKeyQueuedTwiceIsOneJob) {
  Receiver api;
  api.set_outage(Receiver::kDown503);
  const std::string hook = api.url("/hook");
  const CmdResult first = call(call_db(), hook, {"--idempotency-key", "charge-42"});
  const CmdResult second = call(call_db(), hook, {"--idempotency-key", "charge-42"});
  ASSERT_EQ(first.status, 8) << first.err;
  ASSERT_EQ(second.status, 8) << second.err;
  EXPECT_EQ(first.out, second.out) << "the queue deduplicates by key";
  EXPECT_NE(second.err.find("already queued as job " + trimmed(first.out)), std::string::npos)
      << second.err;
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs"), 1);
}

TEST_P(DeferredCall, AnotherRequestUnderAKeyAlreadyQueuedIsRefusedWithExit9) {
  Receiver api;
  api.set_outage(Receiver::kDown503);
  const std::string hook = api.url("/hook");
  const CmdResult first = call(call_db(), hook, {"--idempotency-key", "charge-42"});
  ASSERT_EQ(first.status, 8) << first.err;
  const std::vector<std::string> fast = {
      "call", "--max-attempts",     "2",       "--backoff-base",    "1ms",       "--backoff-cap",
      "5ms",  "--queue-on-failure", call_db(), "--idempotency-key", "charge-42", "-X"};
  const auto with = [&](std::vector<std::string> tail) {
    std::vector<std::string> args = fast;
    args.insert(args.end(), tail.begin(), tail.end());
    return keel(args);
  };
  for (const auto& tail : std::vector<std::vector<std::string>>{
           {"POST", "-H", "Content-Type: application/json", "-d", R"({"amount":500})", hook},
           {"POST", "-H", "Content-Type: application/json", "-H", "X-Tenant: other", "-d",
            R"({"amount":5})", hook},
           {"POST", "-H", "Content-Type: application/json", "-d", R"({"amount":5})",
            api.url("/always503")}}) {
    const CmdResult other = with(tail);
    EXPECT_EQ(other.status, 9) << tail[0] << " " << tail.back() << ": " << other.err;
    EXPECT_NE(
        other.err.find("already queued as job " + trimmed(first.out) + " with a different request"),
        std::string::npos)
        << other.err;
    EXPECT_TRUE(other.out.empty() || other.out == "busy") << "no job id on stdout: " << other.out;
  }
  // The same request again, with a fresh credential: still the one job.
  const CmdResult same = with({"POST", "-H", "Content-Type: application/json", "-H",
                               "Authorization: Bearer fresh", "-d", R"({"amount":5})", hook});
  EXPECT_EQ(same.status, 8) << same.err;
  EXPECT_EQ(same.out, first.out);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs"), 1);
  auto conn = open_database(url());
  const Rows payload = conn->query("SELECT payload FROM keel_jobs");
  EXPECT_NE(payload.text(0, 0).find(R"({\"amount\":5})"), std::string::npos)
      << "the first request is the one kept: " << payload.text(0, 0);
  const CmdResult help = keel({"call", "--help"});
  EXPECT_NE(help.out.find("  9  --queue-on-failure"), std::string::npos) << help.out;
}

TEST_P(DeferredCall, CredentialsOfAQueuedRequestAreNeverShownByTheDeadLetterViews) {
  Receiver api;
  api.set_outage(Receiver::kDown503);
  const CmdResult queued =
      call(call_db(), api.url("/hook"),
           {"-H", "Authorization: Bearer tok-s3cret", "-H", "Cookie: session=cookie-s3cret", "-H",
            "X-Api-Key: key-s3cret", "--secret-header", "x-api-key", "-H", "X-Tenant: acme"});
  ASSERT_EQ(queued.status, 8) << queued.err;
  const std::string id = trimmed(queued.out);
  {
    auto conn = open_database(url());
    const Rows payload = conn->query("SELECT payload FROM keel_jobs");
    EXPECT_NE(payload.text(0, 0).find("tok-s3cret"), std::string::npos)
        << "stored, for the delivery (the docs say so)";
    (void)conn->query("UPDATE keel_jobs SET state = 'dead', dead_reason = 'permanent: test'");
  }
  for (const std::vector<std::string>& view :
       std::vector<std::vector<std::string>>{{"dlq", "--db", url_text(), "show", id},
                                             {"dlq", "--db", url_text(), "show", id, "--json"},
                                             {"dlq", "--db", url_text(), "list"},
                                             {"dlq", "--db", url_text(), "list", "--json"}}) {
    const CmdResult r = keel(view);
    ASSERT_EQ(r.status, 0) << view[3] << ": " << r.err;
    EXPECT_EQ(r.out.find("s3cret"), std::string::npos) << view[3] << ": " << r.out;
    if (view[3] == "show" || view.back() == "--json") {
      EXPECT_NE(r.out.find("[redacted]"), std::string::npos) << view[3] << ": " << r.out;
      EXPECT_NE(r.out.find("acme"), std::string::npos) << "other fields are shown: " << r.out;
    }
  }
}

// Bytes that are not UTF-8 in what would be queued are refused at the door on both backends
// (PostgreSQL's TEXT could not hold them, and altered they would be another request): a header
// value at the deferral, a URL before any attempt. Nothing is queued either way.
TEST_P(DeferredCall, ARequestWithBytesThatAreNotUtf8IsNeverQueued) {
  Receiver api;
  api.set_outage(Receiver::kDown503);
  const CmdResult header = call(call_db(), api.url("/hook"), {"-H", "X-Name: M\xFCller"});
  EXPECT_EQ(header.status, 4) << "exits as the failure would: " << header.err;
  EXPECT_NE(header.err.find("queueing the request for later failed: keel::store::QueuedWrites: "
                            "header 'X-Name' has a value that is not UTF-8 text"),
            std::string::npos)
      << header.err;
  const CmdResult url = call(call_db(), api.url("/hook\xFC"));
  EXPECT_EQ(url.status, 2) << url.err;
  EXPECT_NE(url.err.find("URL has a byte 0xfc"), std::string::npos) << url.err;
  if (store::database_exists(this->url())) {
    auto conn = open_database(this->url());
    EXPECT_EQ(schema_version(*conn, "queue"), 0) << "nothing was queued, not even the schema";
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, DeferredCall,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

// What is never queued, and a queue that cannot be written: SQLite only.
class DeferredCallRefusals : public test_jobs::JobsHarness<test::BackendTest> {};

TEST_P(DeferredCallRefusals, AWriteWithoutKeyIsNeverQueued) {
  Receiver api;
  api.set_outage(Receiver::kDown503);
  const std::string db = (dir().path() / "never.db").string();
  const CmdResult r = keel({"call", "--max-attempts", "2", "--backoff-base", "1ms", "--backoff-cap",
                            "5ms", "--idempotency-key", "off", "--queue-on-failure", db, "-X",
                            "POST", "-d", "{}", api.url("/hook")});
  EXPECT_EQ(r.status, 4) << r.err;
  EXPECT_FALSE(std::filesystem::exists(db)) << "nothing was written, not even the database";
}

TEST_P(DeferredCallRefusals, AFailedEnqueueExitsAsTheFailureWouldAndSaysWhy) {
  Receiver api;
  api.set_outage(Receiver::kDown503);
  const std::string db = (dir().path() / "no-such-dir" / "q.db").string();
  const CmdResult r =
      keel({"call", "--max-attempts", "2", "--backoff-base", "1ms", "--backoff-cap", "5ms",
            "--queue-on-failure", db, "-X", "POST", "-d", "{}", api.url("/hook")});
  EXPECT_EQ(r.status, 4) << r.err;
  EXPECT_NE(r.err.find("queueing the request for later failed"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("busy"), 0u) << "the last response is printed, as without the flag";
}

TEST_P(DeferredCallRefusals, InvalidFlagsExit2NamingTheFlag) {
  const CmdResult bad_db = keel({"call", "--queue-on-failure", "mysql://x", "http://127.0.0.1:1/"});
  EXPECT_EQ(bad_db.status, 2);
  EXPECT_NE(bad_db.err.find("--queue-on-failure"), std::string::npos) << bad_db.err;
  const CmdResult bad_queue =
      keel({"call", "--queue-on-failure", "q.db", "--defer-queue", "no spaces", "http://x/"});
  EXPECT_EQ(bad_queue.status, 2);
  EXPECT_NE(bad_queue.err.find("--defer-queue"), std::string::npos) << bad_queue.err;
  const CmdResult two =
      keel({"jobs", "--db", url_text(), "work", "--queue", "q", "--deferred", "--exec", "true"});
  EXPECT_EQ(two.status, 2);
  EXPECT_NE(two.err.find("mutually exclusive"), std::string::npos) << two.err;
}

INSTANTIATE_TEST_SUITE_P(Sqlite, DeferredCallRefusals, ::testing::Values(Backend::kSqlite),
                         test::backend_name);

}  // namespace
}  // namespace keel::store
