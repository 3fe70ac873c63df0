// keel::store::CommandHandler and keel::store::WebhookHandler in process: real /bin/sh children,
// and real HTTP over loopback to a cpp-httplib server in the test. Then each handler in a Worker
// on a SQLite queue, as `keel jobs work --exec/--deliver` runs them.
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "build_kind.hpp"
#include "keel/core/breaker.hpp"
#include "keel/core/text.hpp"
#include "keel/db/database.hpp"
#include "keel/handlers/command_handler.hpp"
#include "keel/handlers/webhook_handler.hpp"
#include "keel/http/client.hpp"
#include "keel/queue/queue.hpp"
#include "keel/queue/queue_worker.hpp"
#include "support/test_support.hpp"
#include "support/waiting.hpp"

namespace {

using namespace std::chrono_literals;
using keel::OutcomeKind;
using keel::store::AttemptReport;
using keel::store::CommandHandler;
using keel::store::LeasedJob;
using keel::store::WebhookHandler;

LeasedJob job(std::string payload = R"({"n":1})") {
  LeasedJob j;
  j.id = 42;
  j.queue = "emails";
  j.payload = std::move(payload);
  j.idempotency_key = "job-key-7";
  j.attempt = 3;
  j.max_attempts = 25;
  return j;
}

AttemptReport run(const std::string& command, const LeasedJob& j = job()) {
  const std::atomic<bool> cancel{false};
  return CommandHandler(command)(j, cancel);
}

using keel::test::kTimingAsserted;  // build_kind.hpp

// A command that starts a grandchild (a shell of its own, whose sleep is one generation further)
// that creates `effect` after `delay_s` seconds unless it is killed first, writes the
// grandchild's pid to `pid` once it has started, then runs `then` ("wait" for the grandchild,
// or "exit 0" to leave it running). With `ignore_term`, the grandchild and its sleep ignore
// SIGTERM.
struct Grandchild {
  keel::test::TempDir dir;
  std::filesystem::path effect = dir.path() / "effect";
  std::filesystem::path pid_file = dir.path() / "pid";

  [[nodiscard]] std::string command(const std::string& delay_s, bool ignore_term,
                                    const std::string& then) const {
    const std::string tmp = (dir.path() / "pid.tmp").string();
    return std::string("sh -c '") + (ignore_term ? "trap \"\" TERM; " : "") + "sleep " + delay_s +
           "; touch " + effect.string() + "' & echo $! > " + tmp + " && mv " + tmp + " " +
           pid_file.string() + "; " + then;
  }
  [[nodiscard]] bool started() const { return std::filesystem::exists(pid_file); }
  [[nodiscard]] pid_t pid() const {
    std::ifstream in(pid_file);
    pid_t p = -1;
    in >> p;
    return p;
  }
  // The grandchild has ended, and `effect` does not appear within `delay` and a margin counted
  // from `started`.
  void expect_dead_without_effect(std::chrono::steady_clock::time_point started,
                                  std::chrono::milliseconds delay) const {
    const pid_t p = pid();
    ASSERT_GT(p, 0);
    EXPECT_TRUE(keel::test::wait_until([&] { return keel::test::process_gone(p); }, 2s))
        << "grandchild " << p << " outlived the handler";
    const auto past_delay = std::chrono::duration_cast<std::chrono::milliseconds>(
        started + delay + 500ms - std::chrono::steady_clock::now());
    EXPECT_FALSE(keel::test::wait_until([&] { return std::filesystem::exists(effect); },
                                        std::max(past_delay, 0ms)))
        << "the grandchild applied its effect after the handler returned";
  }
};

// ---------------------------------------------------------------------------------------------
// CommandHandler

TEST(CommandHandler, ExitZeroIsSuccess) {
  const AttemptReport r = run("exit 0");
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kSuccess);
  EXPECT_EQ(r.error, "");
}

TEST(CommandHandler, ExitSeventyFiveIsTransient) {
  const AttemptReport r = run("echo 'try later' >&2; exit 75");
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kTransient);
  EXPECT_EQ(r.outcome.code, 75);
  EXPECT_EQ(r.error, "exit status 75 (EX_TEMPFAIL): try later");
}

TEST(CommandHandler, OtherExitStatusIsPermanent) {
  const AttemptReport one = run("exit 1");
  EXPECT_EQ(one.outcome.kind, OutcomeKind::kPermanent);
  EXPECT_EQ(one.outcome.code, 1);
  EXPECT_EQ(one.error, "exit status 1");
  EXPECT_EQ(run("exit 3").outcome.kind, OutcomeKind::kPermanent);
}

TEST(CommandHandler, SetsTheJobsEnvironment) {
  const AttemptReport r =
      run(R"(printf '%s|%s|%s|%s' "$KEEL_IDEMPOTENCY_KEY" "$KEEL_ATTEMPT" "$KEEL_JOB_ID" )"
          R"("$KEEL_QUEUE" >&2; exit 1)");
  EXPECT_EQ(r.error, "exit status 1: job-key-7|3|42|emails");
}

TEST(CommandHandler, ReplacesInheritedJobVariables) {
  ::setenv("KEEL_JOB_ID", "999", 1);
  const AttemptReport r =
      run(R"(env | grep -c '^KEEL_JOB_ID=' >&2; echo "$KEEL_JOB_ID" >&2; exit 1)");
  ::unsetenv("KEEL_JOB_ID");
  EXPECT_EQ(r.error, "exit status 1: 1\n42");
}

TEST(CommandHandler, PayloadOnStdin) {
  const AttemptReport r = run("cat >&2; exit 1", job(R"({"to":"a@example.com"})"));
  EXPECT_EQ(r.error, R"(exit status 1: {"to":"a@example.com"})");
}

TEST(CommandHandler, ErrorEndsWithTheTailOfStderr) {
  // 20,000 bytes of stderr: the report keeps the last 500, trailing newlines trimmed.
  const AttemptReport r =
      run("i=0; while [ $i -lt 2000 ]; do printf 'line %05d\\n' $i >&2; i=$((i+1)); done; exit 2");
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kPermanent);
  ASSERT_TRUE(r.error.starts_with("exit status 2: ")) << r.error;
  const std::string tail = r.error.substr(std::string("exit status 2: ").size());
  EXPECT_EQ(tail.size(), 500u);
  EXPECT_TRUE(tail.ends_with("line 01998\nline 01999")) << tail;
}

// Stderr in other bytes than UTF-8, and a tail that starts inside a character: the report is text
// the queue can store, cut on a character boundary, what is not UTF-8 replaced and counted.
TEST(CommandHandler, AStderrTailThatIsNotUtf8IsStorableText) {
  const AttemptReport latin1 = run(R"(printf 'Fehler: ung\374ltig\n' >&2; exit 1)");
  EXPECT_EQ(latin1.error,
            "exit status 1: Fehler: ung\xEF\xBF\xBDltig [1 byte that was not UTF-8 text replaced]");
  // 601 bytes of "é" and "!": the last 500 start inside an "é", which is left out.
  const AttemptReport cut = run(
      R"(i=0; while [ $i -lt 300 ]; do printf '\303\251' >&2; i=$((i+1)); done; printf '!' >&2;)"
      " exit 1");
  std::string tail;
  for (int i = 0; i < 249; ++i) tail += "\xC3\xA9";
  EXPECT_EQ(cut.error, "exit status 1: " + tail + "!");
  EXPECT_TRUE(keel::is_storable_text(cut.error));
}

TEST(CommandHandler, CommandThatIgnoresALargePayload) {
  // The command exits without reading 4 MB of stdin: an EPIPE for the handler, never a SIGPIPE
  // for this process (whose SIGPIPE is at its default here).
  const AttemptReport r = run("exit 0", job(std::string(4 << 20, 'x')));
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kSuccess);
}

TEST(CommandHandler, CancellationKillsALongCommand) {
  std::atomic<bool> cancel{false};
  const LeasedJob j = job();
  std::thread raise([&] {
    std::this_thread::sleep_for(200ms);
    cancel.store(true);
  });
  const auto start = std::chrono::steady_clock::now();
  const AttemptReport r = CommandHandler("exec sleep 30")(j, cancel);
  const auto took = std::chrono::steady_clock::now() - start;
  raise.join();
  EXPECT_LT(took, 10s);
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kTransient);
  EXPECT_EQ(r.error, "cancelled");
}

TEST(CommandHandler, ATimeoutKillsTheCommandsGrandchildren) {
  const Grandchild g;
  const std::atomic<bool> cancel{false};
  const auto start = std::chrono::steady_clock::now();
  const AttemptReport r =
      CommandHandler(g.command("1", false, "wait"), {.timeout = 400ms})(job(), cancel);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kTransient);
  EXPECT_EQ(r.error, "timed out after 400ms");
  if (kTimingAsserted) {
    EXPECT_LT(took, 400ms + 1s);
  }
  ASSERT_TRUE(g.started()) << "the command did not start its grandchild within its timeout";
  g.expect_dead_without_effect(start, 1000ms);
}

TEST(CommandHandler, CancellationKillsGrandchildrenThatIgnoreSigterm) {
  const Grandchild g;
  std::atomic<bool> cancel{false};
  std::chrono::steady_clock::time_point raised;
  std::thread raise([&] {
    // Once the grandchild runs (or after the bound, failing below).
    (void)keel::test::wait_until([&] { return g.started(); }, 10s);
    raised = std::chrono::steady_clock::now();
    cancel.store(true);
  });
  const auto start = std::chrono::steady_clock::now();
  const AttemptReport r = CommandHandler(g.command("1", true, "wait"))(job(), cancel);
  const auto returned = std::chrono::steady_clock::now();
  raise.join();
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kTransient);
  EXPECT_EQ(r.error, "cancelled");
  if (kTimingAsserted) {
    EXPECT_LT(returned - raised, CommandHandler::kKillAfter + 1s);
  }
  ASSERT_TRUE(g.started());
  g.expect_dead_without_effect(start, 1000ms);
}

TEST(CommandHandler, WhatTheShellLeavesRunningIsKilledWhenItExits) {
  const Grandchild g;
  const auto start = std::chrono::steady_clock::now();
  const AttemptReport r = run(g.command("1", false, "exit 0"));
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kSuccess) << r.error;
  if (kTimingAsserted) {
    EXPECT_LT(std::chrono::steady_clock::now() - start, 1s);
  }
  g.expect_dead_without_effect(start, 1000ms);
}

TEST(CommandHandler, AQuickCommandIsNotCutByItsTimeout) {
  const std::atomic<bool> cancel{false};
  const AttemptReport r = CommandHandler("echo fine >&2; exit 3", {.timeout = 10s})(job(), cancel);
  EXPECT_EQ(r.error, "exit status 3: fine");
}

TEST(CommandHandler, RejectsAnEmptyCommandAndANonPositiveTimeout) {
  EXPECT_THROW(CommandHandler(""), std::invalid_argument);
  try {
    CommandHandler("true", {.timeout = 0ms});
    ADD_FAILURE() << "a zero timeout was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "keel::store::CommandHandler: timeout must be > 0 (got 0s)");
  }
}

// ---------------------------------------------------------------------------------------------
// WebhookHandler

/// A cpp-httplib server on 127.0.0.1 that answers POST /status/N with status N and records the
/// header fields of every request it gets.
class Receiver {
 public:
  Receiver() {
    server_.Post(R"(/status/(\d+))", [this](const httplib::Request& req, httplib::Response& res) {
      {
        std::lock_guard lock(mu_);
        requests_.push_back({req.get_header_value("Idempotency-Key"),
                             req.get_header_value("Keel-Attempt"),
                             req.get_header_value("Keel-Job-Attempt"), req.body});
      }
      res.status = std::stoi(req.matches[1]);
      res.set_content(res.status >= 400 ? "no thanks" : "ok", "text/plain");
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    for (int i = 0; i < 200 && !server_.is_running(); ++i) std::this_thread::sleep_for(5ms);
  }
  ~Receiver() {
    server_.stop();
    thread_.join();
  }
  Receiver(const Receiver&) = delete;
  Receiver& operator=(const Receiver&) = delete;

  struct Seen {
    std::string idempotency_key;
    std::string keel_attempt;
    std::string job_attempt;
    std::string body;
  };

  [[nodiscard]] std::string url(int status) const {
    return "http://127.0.0.1:" + std::to_string(port_) + "/status/" + std::to_string(status);
  }
  [[nodiscard]] std::string host() const { return "127.0.0.1:" + std::to_string(port_); }
  [[nodiscard]] std::vector<Seen> requests() const {
    std::lock_guard lock(mu_);
    return requests_;
  }

 private:
  httplib::Server server_;
  int port_ = -1;
  std::thread thread_;
  mutable std::mutex mu_;
  std::vector<Seen> requests_;  // guarded by mu_
};

AttemptReport deliver(keel::http::Client& client, const std::string& url,
                      const LeasedJob& j = job()) {
  const std::atomic<bool> cancel{false};
  return WebhookHandler(client, url)(j, cancel);
}

TEST(WebhookHandler, TwoHundredIsSuccess) {
  Receiver receiver;
  keel::http::Client client(keel::store::webhook_client_options(5s));
  const AttemptReport r = deliver(client, receiver.url(200));
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kSuccess);
  EXPECT_EQ(r.error, "");
  const auto seen = receiver.requests();
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].body, R"({"n":1})");
}

TEST(WebhookHandler, FiveHundredThreeIsRetriedWithTheJobsKeyAndAttempt) {
  Receiver receiver;
  keel::http::Client client(keel::store::webhook_client_options(5s));
  const AttemptReport r = deliver(client, receiver.url(503));
  // A 503 is throttling: retryable, so the queue schedules another attempt (never dead).
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kThrottled);
  EXPECT_EQ(r.outcome.code, 503);
  EXPECT_NE(r.error.find("no thanks"), std::string::npos) << r.error;
  const auto seen = receiver.requests();
  ASSERT_EQ(seen.size(), 1u) << "one HTTP request per job attempt";
  EXPECT_EQ(seen[0].idempotency_key, "job-key-7");
  // Attempt 3 of the job: two prior attempts, so Keel-Attempt counts on to 3.
  EXPECT_EQ(seen[0].keel_attempt, "3");
  EXPECT_EQ(seen[0].job_attempt, "3");
}

TEST(WebhookHandler, FiveHundredTwoIsTransient) {
  Receiver receiver;
  keel::http::Client client(keel::store::webhook_client_options(5s));
  EXPECT_EQ(deliver(client, receiver.url(502)).outcome.kind, OutcomeKind::kTransient);
}

TEST(WebhookHandler, FourHundredIsPermanent) {
  Receiver receiver;
  keel::http::Client client(keel::store::webhook_client_options(5s));
  const AttemptReport r = deliver(client, receiver.url(400));
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kPermanent);
  EXPECT_EQ(r.outcome.code, 400);
  EXPECT_NE(r.error.find("no thanks"), std::string::npos) << r.error;
  EXPECT_EQ(receiver.requests().size(), 1u);
}

TEST(WebhookHandler, OpenBreakerDefersWithoutSending) {
  Receiver receiver;
  keel::BreakerRegistryOptions breaker_options;
  breaker_options.breaker = keel::BreakerOptions::more_than_half_failed(30s, 1);
  breaker_options.breaker.break_duration = 60s;
  keel::BreakerRegistry breakers(breaker_options);
  keel::http::ClientOptions options = keel::store::webhook_client_options(5s);
  options.brakes.breakers = &breakers;
  keel::http::Client client(options);

  // One 503 trips a breaker that opens on the first failure; the next job is not sent.
  EXPECT_EQ(deliver(client, receiver.url(503)).outcome.kind, OutcomeKind::kThrottled);
  ASSERT_EQ(breakers.state(receiver.host()), keel::BreakerState::kOpen);
  const AttemptReport r = deliver(client, receiver.url(200));
  EXPECT_EQ(r.outcome.kind, OutcomeKind::kNotAttempted);
  EXPECT_FALSE(r.outcome.attempted());
  ASSERT_TRUE(r.outcome.has_server_delay());
  EXPECT_GT(r.outcome.server_delay, 50s);
  EXPECT_TRUE(r.error.starts_with("circuit open for " + receiver.host() + ", next probe in "))
      << r.error;
  EXPECT_EQ(receiver.requests().size(), 1u);
}

TEST(WebhookHandler, NamesItsDependencyAndRejectsANonHttpUrl) {
  keel::http::Client client(keel::store::webhook_client_options(5s));
  EXPECT_EQ(WebhookHandler(client, "http://127.0.0.1:9/hooks").dependency(), "127.0.0.1:9");
  EXPECT_THROW(WebhookHandler(client, "ftp://example.com/"), std::invalid_argument);
  // What the client would refuse on every attempt is refused once, naming the field.
  for (const std::string url :
       {"http://127.0.0.1:9/M\xFCller", "http://a!b.test/", "http://127.0.0.1:99999/"}) {
    try {
      WebhookHandler handler(client, url);
      ADD_FAILURE() << url;
    } catch (const std::invalid_argument& e) {
      EXPECT_TRUE(std::string(e.what()).starts_with("keel::store::WebhookHandler: url "))
          << e.what();
    }
  }
  // An internationalised host's breaker is its ASCII form's.
  EXPECT_EQ(WebhookHandler(client,
                           "http://b\xC3\xBC"
                           "cher.example/")
                .dependency(),
            "xn--bcher-kva.example:80");
}

// The report of a failed response carries the start of its body as text the queue can store: at
// most 200 bytes, cut on a character boundary, what is not UTF-8 replaced and counted.
TEST(WebhookHandler, AResponseExcerptIsStorableTextWhateverTheBody) {
  const auto report = [](std::string body) {
    keel::http::Result r;
    r.outcome = keel::classify_http_status(400, {keel::Method::kPost, true});
    r.reason = keel::StopReason::kPermanent;
    r.attempts = 1;
    r.response = keel::http::Response{.status = 400, .body = std::move(body)};
    return keel::store::report_of(r, "h:80").error;
  };
  EXPECT_EQ(report(std::string(199, 'x') + "\xC3\xA9"),
            "HTTP 400 (permanent): " + std::string(199, 'x'));
  EXPECT_EQ(report(std::string(200, 'x') + "tail"),
            "HTTP 400 (permanent): " + std::string(200, 'x'));
  EXPECT_EQ(report("ung\xFCltig"),
            "HTTP 400 (permanent): ung\xEF\xBF\xBDltig [1 byte that was not UTF-8 text replaced]");
  for (const std::string& body :
       {std::string("a\0b", 3), std::string(300, '\xFF'), std::string("\xED\xA0\x80")}) {
    const std::string error = report(body);
    EXPECT_TRUE(keel::is_storable_text(error)) << error;
    EXPECT_LE(error.size(), std::string("HTTP 400 (permanent): ").size() + 200);
  }
}

// ---------------------------------------------------------------------------------------------
// In a Worker, on a SQLite queue

struct SqliteQueue {
  keel::test::TempDir dir;
  keel::store::DatabaseUrl url =
      keel::store::parse_database_url("sqlite:" + (dir.path() / "q.db").string()).value();
  keel::store::ConnectionPool pool{url, {.max_connections = 4}};
  keel::store::JobQueue queue{{.max_attempts = 3}};

  SqliteQueue() {
    auto conn = pool.acquire();
    keel::store::JobQueue::migrate(*conn);
  }
  std::int64_t enqueue(const std::string& payload) {
    auto conn = pool.acquire();
    return queue.enqueue(*conn, {.queue = "jobs", .payload = payload}).id;
  }
  keel::store::Job get(std::int64_t id) {
    auto conn = pool.acquire();
    return queue.get(*conn, id).value();
  }
  std::int64_t work(keel::store::JobHandler handler) {
    keel::store::Worker worker(pool, queue, {.queue = "jobs", .exit_when_idle = true},
                               std::move(handler));
    return worker.run();
  }
};

TEST(JobHandlersInAWorker, CommandHandler) {
  SqliteQueue q;
  const std::int64_t ok = q.enqueue(R"({"ok":true})");
  const std::int64_t bad = q.enqueue(R"({"ok":false})");
  EXPECT_EQ(q.work(CommandHandler(R"(grep -q '"ok":true' || { echo refused >&2; exit 1; })")), 2);
  EXPECT_EQ(q.get(ok).state, keel::store::JobState::kDone);
  const keel::store::Job dead = q.get(bad);
  EXPECT_EQ(dead.state, keel::store::JobState::kDead);
  EXPECT_NE(dead.dead_reason.find("exit status 1: refused"), std::string::npos) << dead.dead_reason;
}

TEST(JobHandlersInAWorker, WebhookHandler) {
  Receiver receiver;
  SqliteQueue q;
  const std::int64_t id = q.enqueue(R"({"n":2})");
  keel::http::Client client(keel::store::webhook_client_options(5s));
  EXPECT_EQ(q.work(WebhookHandler(client, receiver.url(200))), 1);
  EXPECT_EQ(q.get(id).state, keel::store::JobState::kDone);
  const auto seen = receiver.requests();
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].idempotency_key, q.get(id).idempotency_key);
  EXPECT_EQ(seen[0].keel_attempt, "1");
}

}  // namespace
