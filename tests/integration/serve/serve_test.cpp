// `keel-demo serve` end to end: real processes, real HTTP over 127.0.0.1, a real SQLite file or the
// test PostgreSQL server. Each test starts its own server(s) on a free port (--listen :0).
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>
#include <tuple>

#include "build_kind.hpp"
#include "keel/db/database.hpp"
#include "support/loopback_socket.hpp"
#include "support/test_support.hpp"

extern char** environ;

#if defined(__SANITIZE_THREAD__)
// This test program's own httplib::Client runs in Debian's uninstrumented cpp-httplib too.
extern "C" const char* __tsan_default_suppressions() {
  return "called_from_lib:libcpp-httplib.so.0.11\nrace:libcpp-httplib.so.0.11\n";
}
#endif

namespace keel::store {
namespace {

using namespace std::chrono_literals;

/// A `keel-demo serve` child process. Destroying it kills it (SIGKILL) if still running.
class ServeProcess {
 public:
  explicit ServeProcess(std::vector<std::string> args) {
    int out[2];
    if (pipe(out) != 0) throw std::runtime_error("pipe");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    posix_spawn_file_actions_addclose(&actions, out[0]);
    std::vector<std::string> argv_s = {KEEL_DEMO_BINARY, "serve"};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    // Under ThreadSanitizer, the child reads the same suppressions file as the tests (empty of
    // entries now that cpp-httplib is compiled instrumented).
    std::vector<std::string> env_s;
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::string_view(*e).substr(0, 13) != "TSAN_OPTIONS=") env_s.emplace_back(*e);
    }
#if defined(__SANITIZE_THREAD__)
    const char* tsan = std::getenv("TSAN_OPTIONS");
    env_s.push_back(std::string("TSAN_OPTIONS=") + (tsan != nullptr ? tsan : "") +
                    ":suppressions=" + KEEL_TSAN_SUPPRESSIONS);
#else
    if (const char* tsan = std::getenv("TSAN_OPTIONS"))
      env_s.push_back(std::string("TSAN_OPTIONS=") + tsan);
#endif
    std::vector<char*> envp;
    for (auto& e : env_s) envp.push_back(e.data());
    envp.push_back(nullptr);
    if (posix_spawn(&pid_, KEEL_DEMO_BINARY, &actions, nullptr, argv.data(), envp.data()) != 0) {
      throw std::runtime_error("posix_spawn failed");
    }
    posix_spawn_file_actions_destroy(&actions);
    close(out[1]);
    out_ = out[0];
    // Wait (bounded) for "listening on http://127.0.0.1:PORT".
    std::string text;
    const auto until = std::chrono::steady_clock::now() + 30s;
    while (std::chrono::steady_clock::now() < until) {
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      char buf[512];
      const ssize_t n = read(out_, buf, sizeof buf);
      if (n <= 0) break;
      text.append(buf, static_cast<std::size_t>(n));
      const auto at = text.find("127.0.0.1:");
      const auto nl = text.find('\n', at == std::string::npos ? 0 : at);
      if (at != std::string::npos && nl != std::string::npos) {
        port_ = std::stoi(text.substr(at + 10));
        return;
      }
    }
    throw std::runtime_error("keel-demo serve did not start: " + text);
  }
  ~ServeProcess() {
    if (pid_ > 0) kill9();
    if (out_ >= 0) close(out_);
  }
  ServeProcess(const ServeProcess&) = delete;
  ServeProcess& operator=(const ServeProcess&) = delete;

  [[nodiscard]] int port() const { return port_; }
  [[nodiscard]] pid_t pid() const { return pid_; }
  [[nodiscard]] httplib::Client client() const {
    httplib::Client c("127.0.0.1", port_);
    c.set_connection_timeout(5);
    c.set_read_timeout(20);
    return c;
  }
  void kill9() {
    ::kill(pid_, SIGKILL);
    (void)wait();
  }
  /// Sends a signal and waits for the exit status.
  int terminate(int sig = SIGTERM) {
    ::kill(pid_, sig);
    return wait();
  }

 private:
  int wait() {
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }

  pid_t pid_ = -1;
  int out_ = -1;
  int port_ = 0;
};

/// Runs `keel-demo serve` with arguments that must be refused; returns {exit status, stderr}.
std::pair<int, std::string> run_refused(const std::string& args) {
  const std::string cmd = std::string(KEEL_DEMO_BINARY) + " serve " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[256];
  while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

httplib::Headers headers(const std::string& key, const std::string& principal = "alice") {
  httplib::Headers h = {{"Authorization", "Bearer " + principal}};
  if (!key.empty()) h.emplace("Idempotency-Key", key);
  return h;
}

const std::string kCharge = R"({"amount": 1250, "currency": "eur", "customer": "cus_1"})";

std::string charge_id(const httplib::Result& r) {
  return nlohmann::json::parse(r->body).at("id").get<std::string>();
}

class Serve : public test::BackendTest {
 protected:
  std::vector<std::string> args(std::vector<std::string> extra = {}) const {
    std::vector<std::string> a = {"--listen", "127.0.0.1:0", "--db", url_text()};
    if (std::find(extra.begin(), extra.end(), "--threads") == extra.end()) {
      a.insert(a.end(), {"--threads", "8"});
    }
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }
  std::int64_t charges() const {
    return open_database(url())->query("SELECT COUNT(*) FROM charges").integer(0, 0);
  }
};

TEST_P(Serve, FiftyConcurrentRequestsWithOneKeyMakeOneCharge) {
  ServeProcess server(args());
  constexpr int kRequests = 50;
  std::mutex mu;
  std::map<int, int> statuses;
  std::set<std::string> ids;
  std::vector<std::thread> threads;
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([&] {
      auto c = server.client();
      auto r = c.Post("/v1/charges", headers("one-key"), kCharge, "application/json");
      std::lock_guard lock(mu);
      if (!r) {
        ++statuses[-100 - static_cast<int>(r.error())];
        return;
      }
      ++statuses[r->status];
      if (r->status == 201) ids.insert(charge_id(r));
      if (r->status == 409) {
        EXPECT_TRUE(r->has_header("Retry-After"));
      }
    });
  }
  for (auto& t : threads) t.join();
  std::string seen;
  for (const auto& [status, n] : statuses)
    seen += std::to_string(status) + "x" + std::to_string(n) + " ";
  EXPECT_EQ(statuses[201] + statuses[409], kRequests) << "answers (-1: no response): " << seen;
  EXPECT_GE(statuses[201], 1);
  EXPECT_EQ(ids.size(), 1u);  // every 201 is the same charge (the original or its replay)
  EXPECT_EQ(charges(), 1);
  auto c = server.client();
  for (int i = 0; i < 3; ++i) {
    auto r = c.Post("/v1/charges", headers("one-key"), kCharge, "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 201);
    EXPECT_EQ(r->get_header_value("Idempotent-Replayed"), "true");
    EXPECT_EQ(charge_id(r), *ids.begin());
  }
  EXPECT_EQ(charges(), 1);
}

TEST_P(Serve, CommitThenDropThenRetryGivesOneChargeAndTheRetryReceivesIt) {
  ServeProcess server(args({"--chaos-drop-after-commit", "1"}));
  auto c = server.client();
  auto lost = c.Post("/v1/charges", headers("drop-1"), kCharge, "application/json");
  EXPECT_FALSE(lost) << "the response should have been dropped, got " << lost->status;
  EXPECT_EQ(charges(), 1);  // ... but the charge was committed
  auto retry = server.client().Post("/v1/charges", headers("drop-1"), kCharge, "application/json");
  ASSERT_TRUE(retry);
  EXPECT_EQ(retry->status, 201);
  EXPECT_EQ(retry->get_header_value("Idempotent-Replayed"), "true");
  EXPECT_EQ(charges(), 1);
  auto get = server.client().Get("/v1/charges/" + charge_id(retry), headers(""));
  ASSERT_TRUE(get);
  EXPECT_EQ(get->status, 200);
}

TEST_P(Serve, MismatchIs422AndAnotherPrincipalGetsItsOwnCharge) {
  ServeProcess server(args());
  auto c = server.client();
  auto first = c.Post("/v1/charges", headers("k"), kCharge, "application/json");
  ASSERT_TRUE(first);
  ASSERT_EQ(first->status, 201);
  auto other_body =
      c.Post("/v1/charges", headers("k"),
             R"({"amount": 9999, "currency": "eur", "customer": "cus_1"})", "application/json");
  ASSERT_TRUE(other_body);
  EXPECT_EQ(other_body->status, 422);
  EXPECT_EQ(other_body->get_header_value("Content-Type"), "application/problem+json");
  // Same JSON, other key order and spacing: the same request.
  auto reordered =
      c.Post("/v1/charges", headers("k"), R"({"customer":"cus_1","currency":"eur","amount":1250})",
             "application/json");
  ASSERT_TRUE(reordered);
  EXPECT_EQ(reordered->status, 201);
  EXPECT_EQ(charge_id(reordered), charge_id(first));
  auto bob = c.Post("/v1/charges", headers("k", "bob"), kCharge, "application/json");
  ASSERT_TRUE(bob);
  EXPECT_EQ(bob->status, 201);
  EXPECT_FALSE(bob->has_header("Idempotent-Replayed"));
  EXPECT_NE(charge_id(bob), charge_id(first));
  EXPECT_EQ(charges(), 2);
  // Bob cannot read Alice's charge.
  auto peek = c.Get("/v1/charges/" + charge_id(first), headers("", "bob"));
  ASSERT_TRUE(peek);
  EXPECT_EQ(peek->status, 404);
}

TEST_P(Serve, BadKeysAndBadChargesAre400AndNotStored) {
  ServeProcess server(args());
  auto c = server.client();
  for (const std::string& key : {std::string(), std::string(256, 'x'), std::string("\"open")}) {
    httplib::Headers h = {{"Authorization", "Bearer alice"}};
    if (!key.empty()) h.emplace("Idempotency-Key", key);
    auto r = c.Post("/v1/charges", h, kCharge, "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << key;
    EXPECT_EQ(r->get_header_value("Content-Type"), "application/problem+json");
  }
  auto quoted = c.Post("/v1/charges", headers("\"sf-key\""), kCharge, "application/json");
  ASSERT_TRUE(quoted);
  EXPECT_EQ(quoted->status, 201);
  auto bad = c.Post("/v1/charges", headers("bad-body"), R"({"amount": -5, "currency": "eur"})",
                    "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
  // Not stored: the same key with a valid body runs (no 422).
  auto fixed = c.Post("/v1/charges", headers("bad-body"), kCharge, "application/json");
  ASSERT_TRUE(fixed);
  EXPECT_EQ(fixed->status, 201);
  EXPECT_FALSE(fixed->has_header("Idempotent-Replayed"));
  EXPECT_EQ(charges(), 2);
  auto metrics = c.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("keel_idempotency_requests_total{outcome=\"invalid_key\"} 3"),
            std::string::npos)
      << metrics->body;
  EXPECT_NE(metrics->body.find("keel_charges_created_total 2"), std::string::npos);
}

TEST_P(Serve, AnExpiredKeelDeadlineIsRefusedWith400AndAnInvalidOneIsIgnored) {
  ServeProcess server(args());
  auto c = server.client();
  httplib::Headers late = headers("late-1");
  late.emplace("Keel-Deadline-Ms", "0");
  auto refused = c.Post("/v1/charges", late, kCharge, "application/json");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 400);
  EXPECT_EQ(refused->get_header_value("Content-Type"), "application/problem+json");
  EXPECT_NE(refused->body.find("Deadline exceeded"), std::string::npos) << refused->body;
  EXPECT_EQ(charges(), 0);
  httplib::Headers odd = headers("late-1");  // the same key: nothing was stored
  odd.emplace("Keel-Deadline-Ms", "-5");
  auto ran = c.Post("/v1/charges", odd, kCharge, "application/json");
  ASSERT_TRUE(ran);
  EXPECT_EQ(ran->status, 201);
  httplib::Headers soon = headers("soon-1");
  soon.emplace("Keel-Deadline-Ms", "30000");
  auto in_time = c.Post("/v1/charges", soon, kCharge, "application/json");
  ASSERT_TRUE(in_time);
  EXPECT_EQ(in_time->status, 201);
  EXPECT_EQ(charges(), 2);
  auto metrics = c.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("keel_idempotency_requests_total{outcome=\"deadline_exceeded\"} 1"),
            std::string::npos)
      << metrics->body;
}

TEST_P(Serve, TwoIdempotencyKeysOrACommaInOneAre400AndNotStored) {
  ServeProcess server(args());
  auto c = server.client();
  httplib::Headers two = headers("first-key");
  two.emplace("Idempotency-Key", "second-key");
  auto both = c.Post("/v1/charges", two, kCharge, "application/json");
  ASSERT_TRUE(both);
  EXPECT_EQ(both->status, 400);
  EXPECT_EQ(both->get_header_value("Content-Type"), "application/problem+json");
  EXPECT_NE(both->body.find("2 Idempotency-Key header fields"), std::string::npos) << both->body;
  auto comma = c.Post("/v1/charges", headers("first-key, second-key"), kCharge, "application/json");
  ASSERT_TRUE(comma);
  EXPECT_EQ(comma->status, 400);
  EXPECT_EQ(comma->get_header_value("Content-Type"), "application/problem+json");
  EXPECT_EQ(charges(), 0);
  // Nothing was stored under either key: each runs afresh on its own.
  for (const std::string key : {"first-key", "second-key"}) {
    auto one = c.Post("/v1/charges", headers(key), kCharge, "application/json");
    ASSERT_TRUE(one);
    EXPECT_EQ(one->status, 201) << key;
    EXPECT_FALSE(one->has_header("Idempotent-Replayed")) << key;
  }
  EXPECT_EQ(charges(), 2);
}

TEST_P(Serve, PassedDeadlinesAre400BeforeTheRateLimitAndSpendNoToken) {
  // 1/s: a burst of 1. Before, the second passed-deadline request got a retryable 429.
  ServeProcess server(args({"--rate-limit", "1/s"}));
  auto c = server.client();
  for (int i = 0; i < 5; ++i) {
    httplib::Headers late = headers("late-" + std::to_string(i));
    late.emplace("Keel-Deadline-Ms", "0");
    auto r = c.Post("/v1/charges", late, kCharge, "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << i;
    EXPECT_FALSE(r->has_header("Retry-After")) << i;
    EXPECT_NE(r->body.find("Deadline exceeded"), std::string::npos) << r->body;
  }
  // The bucket's one token is still there.
  auto good = c.Post("/v1/charges", headers("on-time"), kCharge, "application/json");
  ASSERT_TRUE(good);
  EXPECT_EQ(good->status, 201) << good->body;
  EXPECT_EQ(charges(), 1);
  auto metrics = c.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("keel_idempotency_requests_total{outcome=\"deadline_exceeded\"} 5"),
            std::string::npos)
      << metrics->body;
  EXPECT_NE(metrics->body.find("keel_rate_limited_total 0"), std::string::npos) << metrics->body;
}

TEST_P(Serve, KillNineMidFlightThenRetryEverythingLosesAndDuplicatesNothing) {
  constexpr int kKeys = 40;
  std::map<std::string, std::string> answered;  // key -> charge id seen before the kill
  std::mutex mu;
  {
    // Some requests are slowed down so that the kill always finds requests in flight.
    ServeProcess server(
        args({"--lock-timeout", "1s", "--chaos-delay-fraction", "0.3", "--chaos-delay", "300ms"}));
    std::atomic<int> next{0};
    std::atomic<int> ok{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&] {
        auto c = server.client();
        for (int i = next++; i < kKeys; i = next++) {
          const std::string key = "kill-" + std::to_string(i);
          auto r = c.Post("/v1/charges", headers(key), kCharge, "application/json");
          if (r && r->status == 201) {
            std::lock_guard lock(mu);
            answered[key] = charge_id(r);
            ++ok;
          }
        }
      });
    }
    while (ok.load() < kKeys / 4) std::this_thread::sleep_for(1ms);
    server.kill9();  // mid-flight: the other requests are being sent or processed
    for (auto& t : threads) t.join();
  }
  EXPECT_LT(answered.size(), static_cast<std::size_t>(kKeys)) << "the kill came too late";
  ServeProcess restarted(args({"--lock-timeout", "1s"}));
  auto c = restarted.client();
  std::set<std::string> final_ids;
  for (int i = 0; i < kKeys; ++i) {
    const std::string key = "kill-" + std::to_string(i);
    std::string id;
    for (int attempt = 0; attempt < 50 && id.empty(); ++attempt) {
      auto r = c.Post("/v1/charges", headers(key), kCharge, "application/json");
      ASSERT_TRUE(r);
      if (r->status == 409) {
        // A claim of the killed server: honour Retry-After (its lock is 1 s).
        std::this_thread::sleep_for(
            std::chrono::seconds(std::stoi(r->get_header_value("Retry-After"))));
        continue;
      }
      ASSERT_EQ(r->status, 201) << key;
      id = charge_id(r);
    }
    ASSERT_FALSE(id.empty()) << key;
    final_ids.insert(id);
    if (auto it = answered.find(key); it != answered.end()) {
      EXPECT_EQ(id, it->second) << "a committed charge was lost or redone for " << key;
    }
  }
  EXPECT_EQ(final_ids.size(), static_cast<std::size_t>(kKeys));
  EXPECT_EQ(charges(), kKeys);  // no duplicates
}

TEST_P(Serve, RateLimitAnswers429WithRetryAfter) {
  // 2/s, so bursts of 2. Of alice's eight requests, sent at once, at most 2 + 2 x (seconds from
  // the first to arrive to the last) are admitted: at least one is refused unless they arrive
  // over 3 s apart. (Sent one after another, none would be refused on a machine where each took
  // half a second.) A lower rate would not do: a principal's first request draws from one bucket
  // that all new principals share, of the same burst, and bob needs the token alice leaves in it.
  ServeProcess server(args({"--rate-limit", "2/s"}));
  constexpr int kRequests = 8;  // no more than the server's threads
  struct Answer {
    int status = 0;
    std::string retry_after;
  };
  std::vector<Answer> answers(kRequests);
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([&, i] {
      auto c = server.client();
      ++ready;
      while (ready.load() < kRequests) std::this_thread::yield();
      auto r =
          c.Post("/v1/charges", headers("rl-" + std::to_string(i)), kCharge, "application/json");
      if (!r) return;
      answers[i].status = r->status;
      answers[i].retry_after = r->get_header_value("Retry-After");
    });
  }
  for (auto& t : threads) t.join();
  int limited = 0;
  for (const Answer& a : answers) {
    ASSERT_TRUE(a.status == 201 || a.status == 429) << a.status;
    if (a.status == 429) {
      ++limited;
      EXPECT_GE(std::stoi(a.retry_after), 1);
    }
  }
  EXPECT_GE(limited, 1);
  // Another principal has its own bucket.
  auto c = server.client();
  auto bob = c.Post("/v1/charges", headers("rl-bob", "bob"), kCharge, "application/json");
  ASSERT_TRUE(bob);
  EXPECT_EQ(bob->status, 201);
}

TEST_P(Serve, Chaos503CarriesRetryAfterWhenAsked) {
  ServeProcess server(args({"--chaos-503", "1", "--chaos-503-retry-after", "3s"}));
  auto r = server.client().Post("/v1/charges", headers("c"), kCharge, "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503);
  EXPECT_EQ(r->get_header_value("Retry-After"), "3");
  EXPECT_EQ(charges(), 0);
  auto health = server.client().Get("/healthz");  // outside /v1: never injected
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

TEST_P(Serve, SigtermStopsCleanly) {
  ServeProcess server(args());
  auto r = server.client().Post("/v1/charges", headers("t"), kCharge, "application/json");
  ASSERT_TRUE(r);
  const int status = server.terminate(SIGTERM);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST_P(Serve, SigtermLetsInFlightRequestsFinish) {
  // The delay is long enough that the request is still in it when SIGTERM follows the scrape
  // that saw it start, even on a slow machine.
  ServeProcess server(args({"--chaos-delay-fraction", "1", "--chaos-delay", "2s"}));
  std::optional<int> status;
  std::thread request([&] {
    auto r = server.client().Post("/v1/charges", headers("inflight"), kCharge, "application/json");
    if (r) status = r->status;
  });
  // Wait (bounded) until the request is inside the server (its injected delay has started).
  auto c = server.client();
  bool inside = false;
  for (const auto until = std::chrono::steady_clock::now() + 20s;
       !inside && std::chrono::steady_clock::now() < until;) {
    auto m = c.Get("/metrics");
    inside = m && m->body.find("keel_chaos_injected_total{fault=\"delay\"} 1") != std::string::npos;
    if (!inside) std::this_thread::sleep_for(2ms);
  }
  const int exit_status = server.terminate(SIGTERM);
  request.join();
  ASSERT_TRUE(inside) << "the request was never seen inside the server before SIGTERM";
  ASSERT_TRUE(status.has_value()) << "the in-flight request was cut off";
  EXPECT_EQ(*status, 201);
  EXPECT_TRUE(WIFEXITED(exit_status));
  EXPECT_EQ(WEXITSTATUS(exit_status), 0);
  EXPECT_EQ(charges(), 1);
}

TEST_P(Serve, MaxConcurrencyShedsRetriesBeforeAnyFirstAttempt) {
  // Every request takes 2 s. Two first attempts and six retries arrive together. Retries are
  // admitted only while fewer than 2 requests are in flight, first attempts while fewer than
  // 2 + 2: at most two retries can ever be in flight, so no first attempt is ever refused, and
  // of the retries all but at most two are. "Together" means within those 2 s of the first
  // admitted ones: a retry arriving after they finished would be admitted, so the delay is long
  // enough to hold a slow machine's spread of arrivals.
  ServeProcess server(args({"--max-concurrency", "2", "--admission-queue", "2",
                            "--chaos-delay-fraction", "1", "--chaos-delay", "2s"}));
  constexpr int kFirst = 2;
  constexpr int kRetries = 6;
  struct Answer {
    int attempt = 0;
    int status = 0;
    std::string retry_after;
    std::string content_type;
  };
  std::vector<Answer> answers(kFirst + kRetries);
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kFirst + kRetries; ++i) {
    threads.emplace_back([&, i] {
      auto c = server.client();
      answers[i].attempt = i < kFirst ? 1 : 2 + i % 3;
      httplib::Headers h = headers("shed-" + std::to_string(i));
      // The three attempt headers: Keel-Attempt, Envoy's count, gRPC's previous attempts.
      if (i % 3 == 0) h.emplace("Keel-Attempt", std::to_string(answers[i].attempt));
      if (i % 3 == 1) h.emplace("x-envoy-attempt-count", std::to_string(answers[i].attempt));
      if (i % 3 == 2) {
        h.emplace("grpc-previous-rpc-attempts", std::to_string(answers[i].attempt - 1));
      }
      ++ready;
      while (ready.load() < kFirst + kRetries) std::this_thread::yield();
      auto r = c.Post("/v1/charges", h, kCharge, "application/json");
      if (!r) return;
      answers[i].status = r->status;
      answers[i].retry_after = r->get_header_value("Retry-After");
      answers[i].content_type = r->get_header_value("Content-Type");
    });
  }
  for (auto& t : threads) t.join();
  int refused_retries = 0;
  for (const Answer& a : answers) {
    if (a.attempt == 1) {
      EXPECT_EQ(a.status, 201) << "a first attempt was refused";
      continue;
    }
    ASSERT_TRUE(a.status == 201 || a.status == 503) << a.status;
    if (a.status == 503) {
      ++refused_retries;
      const int seconds = std::stoi(a.retry_after);
      EXPECT_GE(seconds, 1);
      EXPECT_LE(seconds, 10);
      EXPECT_EQ(a.content_type, "application/problem+json");
    }
  }
  EXPECT_GE(refused_retries, kRetries - 2);
  EXPECT_EQ(charges(), kFirst + kRetries - refused_retries);
  auto m = server.client().Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_NE(m->body.find("keel_admission_shed_total{reason=\"retry\"} " +
                         std::to_string(refused_retries) + "\n"),
            std::string::npos)
      << m->body;
  EXPECT_NE(m->body.find("keel_admission_shed_total{reason=\"over_capacity\"} 0\n"),
            std::string::npos);
  EXPECT_NE(m->body.find("keel_admission_in_flight 0\n"), std::string::npos);
}

/// The value of the metric `name` (a series without labels) in a /metrics body; -1 when absent.
std::int64_t metric(const std::string& text, const std::string& name) {
  const auto at = text.find("\n" + name + " ");
  return at == std::string::npos ? -1 : std::stoll(text.substr(at + name.size() + 2));
}

TEST_P(Serve, AdaptiveLatencyCutsTheLimitOnlyWhenSlowRequestsFillIt) {
  // Every request takes 300 ms, over the 100 ms threshold. One at a time they are a slow
  // dependency, not a queue: the limit stays at 8. Ten at once fill it (8 + a queue of 2): the
  // ones admitted with the limit full cut it by 10% each (rounded down).
  ServeProcess server(args({"--max-concurrency", "8", "--adaptive-latency", "100ms",
                            "--chaos-delay-fraction", "1", "--chaos-delay", "300ms"}));
  auto c = server.client();
  for (int i = 0; i < 2; ++i) {
    auto r =
        c.Post("/v1/charges", headers("adapt-" + std::to_string(i)), kCharge, "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 201);
  }
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_EQ(metric(m->body, "keel_admission_limit"), 8) << m->body;
  std::atomic<int> ready{0};
  std::atomic<int> created{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 10; ++i) {
    threads.emplace_back([&, i] {
      auto client = server.client();
      ++ready;
      while (ready.load() < 10) std::this_thread::yield();
      auto r = client.Post("/v1/charges", headers("fill-" + std::to_string(i)), kCharge,
                           "application/json");
      if (r && r->status == 201) ++created;
    });
  }
  for (auto& t : threads) t.join();
  m = c.Get("/metrics");
  ASSERT_TRUE(m);
  const std::int64_t limit = metric(m->body, "keel_admission_limit");
  EXPECT_GE(created.load(), 8);
  EXPECT_GE(limit, 1) << m->body;
  EXPECT_LE(limit, 7) << m->body;
}

/// What an open-loop load of GET requests saw: latencies of the admitted ones (answered 404, the
/// route's answer for a charge that is not there), from the moment each was sent, and the shed.
struct LoadSeen {
  std::vector<double> admitted_ms;
  int shed = 0;
  int failed = 0;
  [[nodiscard]] double p99() const {
    if (admitted_ms.empty()) return 0;
    std::vector<double> v = admitted_ms;
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, v.size() * 99 / 100)];
  }
  [[nodiscard]] double shed_fraction() const {
    const auto all = admitted_ms.size() + static_cast<std::size_t>(shed + failed);
    return all == 0 ? 0 : static_cast<double>(shed) / static_cast<double>(all);
  }
};

/// `rate` requests a second on a fixed schedule (each sent at its time by the first of 64 senders
/// free), `warm` at `warm_rate` first; only the requests after the first `settle` of the load are
/// counted.
LoadSeen open_loop(const ServeProcess& server, double warm_rate, Duration warm, double rate,
                   Duration length, Duration settle) {
  using clock = std::chrono::steady_clock;
  const int warm_count = static_cast<int>(warm_rate * std::chrono::duration<double>(warm).count());
  const int count = static_cast<int>(rate * std::chrono::duration<double>(length).count());
  const int settle_count = static_cast<int>(rate * std::chrono::duration<double>(settle).count());
  const auto start = clock::now() + 200ms;
  const auto when = [&](int i) {
    const double s = i < warm_count
                         ? i / warm_rate
                         : std::chrono::duration<double>(warm).count() + (i - warm_count) / rate;
    return start + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(s));
  };
  std::atomic<int> next{0};
  std::mutex mu;
  LoadSeen seen;
  std::vector<std::thread> senders;
  for (int t = 0; t < 64; ++t) {
    senders.emplace_back([&] {
      auto c = server.client();
      for (int i = next++; i < warm_count + count; i = next++) {
        std::this_thread::sleep_until(when(i));
        const auto sent = clock::now();
        auto r = c.Get("/v1/charges/ch_absent", headers(""));
        const double ms = std::chrono::duration<double, std::milli>(clock::now() - sent).count();
        if (i < warm_count + settle_count) continue;
        std::lock_guard lock(mu);
        if (r && r->status == 404) {
          seen.admitted_ms.push_back(ms);
        } else if (r && r->status == 503) {
          ++seen.shed;
        } else {
          ++seen.failed;
        }
      }
    });
  }
  for (auto& t : senders) t.join();
  return seen;
}

TEST_P(Serve, AdaptiveAdmissionKeepsAnOverloadsLatencyNearAFixedLimitSetRightAndShedsNoSlowWork) {
  // A drill of seconds of real load, timed: in the optimised build on SQLite (the route reads
  // one row). Two servers: 4 threads x 40 ms (100/s) at 3x, 8 threads x 20 ms (400/s) at 2x; the
  // AIMD threshold 1.5x the unloaded latency, both adaptive limits at most 64.
  if (!test::kTimingAsserted || GetParam() != Backend::kSqlite) {
    GTEST_SKIP() << "a timed drill: the optimised build, once";
  }
  struct Point {
    int threads;
    int hold_ms;
    double overload;
  };
  for (const Point p : {Point{4, 40, 3}, Point{8, 20, 2}}) {
    const double capacity = p.threads * 1000.0 / p.hold_ms;
    const auto overload = [&](std::vector<std::string> limit) {
      std::vector<std::string> a = {
          "--threads", std::to_string(p.threads), "--chaos-delay-fraction",
          "1",         "--chaos-delay",           std::to_string(p.hold_ms) + "ms"};
      a.insert(a.end(), limit.begin(), limit.end());
      ServeProcess server(args(a));
      // 2 s at half the capacity (the unloaded latency the adaptive limits learn), then the
      // overload, counted after its first 2 s.
      return open_loop(server, capacity / 2, 2s, capacity * p.overload, 6s, 2s);
    };
    const LoadSeen fixed =
        overload({"--max-concurrency", std::to_string(p.threads), "--admission-queue", "1"});
    const LoadSeen aimd = overload({"--max-concurrency", "64", "--adaptive-latency",
                                    std::to_string(p.hold_ms * 3 / 2) + "ms"});
    const LoadSeen gradient = overload({"--max-concurrency", "64", "--adaptive-admission"});
    std::printf(
        "%d threads x %d ms at %.0fx, p99 of admitted / shed: fixed %d %.1f ms / %.0f%%, AIMD "
        "%.1f ms / %.0f%%, threshold-free %.1f ms / %.0f%%\n",
        p.threads, p.hold_ms, p.overload, p.threads, fixed.p99(), 100 * fixed.shed_fraction(),
        aimd.p99(), 100 * aimd.shed_fraction(), gradient.p99(), 100 * gradient.shed_fraction());
    const auto served = static_cast<std::size_t>(0.7 * capacity * 4);  // 70% of 4 s
    ASSERT_GT(fixed.admitted_ms.size(), served / 2) << p.threads;
    EXPECT_LE(aimd.p99(), 1.5 * fixed.p99()) << p.threads;
    EXPECT_LE(gradient.p99(), 1.5 * fixed.p99()) << p.threads;
    // Each adaptive limit still serves most of the capacity, not a trickle.
    EXPECT_GE(aimd.admitted_ms.size(), served) << p.threads;
    EXPECT_GE(gradient.admitted_ms.size(), served) << p.threads;
  }

  // A slow dependency that keeps up: 300 ms a request at 10/s on 16 threads (3 in flight of a
  // capacity of 53/s). Neither adaptive limit takes it for overload.
  const auto slow = [&](std::vector<std::string> limit) {
    std::vector<std::string> a = {"--threads",     "16",   "--chaos-delay-fraction", "1",
                                  "--chaos-delay", "300ms"};
    a.insert(a.end(), limit.begin(), limit.end());
    ServeProcess server(args(a));
    return open_loop(server, 10, 1s, 10, 6s, 0s);
  };
  const LoadSeen slow_aimd = slow({"--max-concurrency", "16", "--adaptive-latency", "100ms"});
  const LoadSeen slow_gradient = slow({"--max-concurrency", "16", "--adaptive-admission"});
  std::printf("slow dependency, shed: AIMD (100 ms) %.1f%%, threshold-free %.1f%%\n",
              100 * slow_aimd.shed_fraction(), 100 * slow_gradient.shed_fraction());
  EXPECT_LT(slow_aimd.shed_fraction(), 0.05);
  EXPECT_LT(slow_gradient.shed_fraction(), 0.05);
  EXPECT_EQ(slow_aimd.failed + slow_gradient.failed, 0);
}

TEST_P(Serve, MaxConcurrencyShedsFirstAttemptsPastTheQueueBound) {
  // --admission-queue 0: one limit for all. Three first attempts at once on a limit of 1: the
  // ones that find it taken are refused with reason over_capacity. Each admitted one takes 2 s,
  // long enough that the three arrive while the first is still in flight even on a slow machine.
  ServeProcess server(args({"--max-concurrency", "1", "--admission-queue", "0",
                            "--chaos-delay-fraction", "1", "--chaos-delay", "2s"}));
  std::atomic<int> ok{0};
  std::atomic<int> refused{0};
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      auto c = server.client();
      ++ready;
      while (ready.load() < 3) std::this_thread::yield();
      auto r =
          c.Post("/v1/charges", headers("cap-" + std::to_string(i)), kCharge, "application/json");
      if (r && r->status == 201) ++ok;
      if (r && r->status == 503) ++refused;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_GE(ok.load(), 1);
  EXPECT_GE(refused.load(), 1);
  EXPECT_EQ(ok.load() + refused.load(), 3);
  auto m = server.client().Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_NE(m->body.find("keel_admission_shed_total{reason=\"over_capacity\"} " +
                         std::to_string(refused.load()) + "\n"),
            std::string::npos)
      << m->body;
}

INSTANTIATE_TEST_SUITE_P(Backends, Serve, ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

/// Bodies nested `depth` deep: arrays, objects, and the two alternating.
std::vector<std::string> deep_bodies(std::size_t depth) {
  std::string objects;
  for (std::size_t i = 1; i < depth; ++i) objects += "{\"a\":";
  objects += "{}" + std::string(depth - 1, '}');
  std::string mixed_open;
  std::string mixed_close;
  for (std::size_t i = 0; i < depth; ++i) {
    mixed_open += i % 2 == 0 ? "[" : "{\"a\":";
    mixed_close.insert(0, i % 2 == 0 ? "]" : "}");
  }
  return {std::string(depth, '[') + std::string(depth, ']'), objects,
          mixed_open + "1" + mixed_close};
}

TEST_P(Serve, DeepOrDuplicateMemberJsonIs400NotStoredAndTheServerStaysUp) {
  ServeProcess server(args());
  auto c = server.client();
  int i = 0;
  for (const std::size_t depth : {65u, 1000u, 100000u}) {
    for (const std::string& body : deep_bodies(depth)) {
      auto r =
          c.Post("/v1/charges", headers("deep-" + std::to_string(i++)), body, "application/json");
      ASSERT_TRUE(r) << "keel-demo serve died on a body nested " << depth << " deep";
      EXPECT_EQ(r->status, 400);
      EXPECT_EQ(r->get_header_value("Content-Type"), "application/problem+json");
      EXPECT_NE(r->body.find("limit of 64"), std::string::npos) << r->body;
    }
  }
  for (const std::string body : {
           R"({"amount":5,"amount":500000,"currency":"eur","customer":"c"})",
           R"({"amount":5,"currency":"eur","customer":"c","meta":{"k":1,"k":2}})",
       }) {
    auto r = c.Post("/v1/charges", headers("dup-" + std::to_string(i++)), body, "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << body;
    EXPECT_NE(r->body.find("more than once"), std::string::npos) << r->body;
  }
  // 64 levels are within the limit: the middleware lets them through, the charge is invalid.
  auto at_limit =
      c.Post("/v1/charges", headers("at-limit"), deep_bodies(64)[0], "application/json");
  ASSERT_TRUE(at_limit);
  EXPECT_EQ(at_limit->status, 400);
  EXPECT_NE(at_limit->body.find("not a JSON object"), std::string::npos) << at_limit->body;
  auto health = c.Get("/healthz");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(charges(), 0);
  EXPECT_EQ(open_database(url())->query("SELECT COUNT(*) FROM keel_idempotency").integer(0, 0), 0);
}

TEST_P(Serve, MaxJsonDepthFlagSetsTheLimit) {
  ServeProcess server(args({"--max-json-depth", "2"}));
  auto c = server.client();
  auto ok =
      c.Post("/v1/charges", headers("d2"),
             R"({"amount":1,"currency":"eur","customer":"c","m":{"x":1}})", "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 201) << ok->body;
  auto deep =
      c.Post("/v1/charges", headers("d3"),
             R"({"amount":1,"currency":"eur","customer":"c","m":{"x":[1]}})", "application/json");
  ASSERT_TRUE(deep);
  EXPECT_EQ(deep->status, 400);
  EXPECT_NE(deep->body.find("limit of 2 levels"), std::string::npos) << deep->body;
  EXPECT_EQ(charges(), 1);
}

TEST_P(Serve, BodiesOverMaxBodyBytesAre413BeforeBeingRead) {
  ServeProcess server(args({"--max-body-bytes", "2048"}));
  auto c = server.client();
  // kCharge padded with spaces to exactly the limit, and one byte over.
  const std::string at = kCharge + std::string(2048 - kCharge.size(), ' ');
  auto ok = c.Post("/v1/charges", headers("at"), at, "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 201) << ok->body;
  for (const std::size_t size : {2049u, 100000u}) {
    const std::string over = kCharge + std::string(size - kCharge.size(), ' ');
    auto r =
        c.Post("/v1/charges", headers("over-" + std::to_string(size)), over, "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 413);
    EXPECT_EQ(r->get_header_value("Content-Type"), "application/problem+json");
    EXPECT_NE(r->body.find("limit of 2048 bytes"), std::string::npos) << r->body;
  }
  auto health = server.client().Get("/healthz");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(charges(), 1);
}

TEST_P(Serve, WrongMethodIs405WithAllowAndUnknownPathsAreProblemJson) {
  ServeProcess server(args());
  auto c = server.client();
  auto del = c.Delete("/v1/charges");
  ASSERT_TRUE(del);
  EXPECT_EQ(del->status, 405);
  EXPECT_EQ(del->get_header_value("Allow"), "GET, HEAD, POST");
  auto post = c.Post("/healthz", "", "text/plain");
  ASSERT_TRUE(post);
  EXPECT_EQ(post->status, 405);
  EXPECT_EQ(post->get_header_value("Allow"), "GET, HEAD");
  auto missing = c.Get("/nope");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
  EXPECT_EQ(missing->get_header_value("Content-Type"), "application/problem+json");
}

TEST_P(Serve, ChargesStoreAHashOfThePrincipalNeverTheToken) {
  ServeProcess server(args());
  auto c = server.client();
  auto r = c.Post("/v1/charges", headers("k1", "tok-very-secret"), kCharge, "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 201);
  // The owner still sees it; another token, "anonymous" included, does not.
  auto mine = c.Get("/v1/charges/" + charge_id(r), headers("", "tok-very-secret"));
  ASSERT_TRUE(mine);
  EXPECT_EQ(mine->status, 200);
  for (const std::string other : {"anonymous", "tok-other"}) {
    auto theirs = c.Get("/v1/charges/" + charge_id(r), headers("", other));
    ASSERT_TRUE(theirs);
    EXPECT_EQ(theirs->status, 404) << other;
  }
  auto db = open_database(url());
  for (const std::string sql :
       {"SELECT principal FROM charges", "SELECT scope FROM keel_idempotency"}) {
    const Rows rows = db->query(sql);
    ASSERT_EQ(rows.size(), 1u);
    EXPECT_EQ(rows.text(0, 0).find("tok-very-secret"), std::string::npos) << rows.text(0, 0);
    EXPECT_EQ(rows.text(0, 0).rfind("p:", 0), 0u) << rows.text(0, 0);
  }
}

TEST_P(Serve, UpgradeFromPlaintextPrincipalsKeepsOwnersAndReplays) {
  std::string id;
  {
    ServeProcess server(args());
    auto r = server.client().Post("/v1/charges", headers("up-1", "tok-upgrade"), kCharge,
                                  "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 201);
    id = charge_id(r);
  }
  {
    // Back to payments schema 1, which stored the token itself.
    auto db = open_database(url());
    db->execute("UPDATE charges SET principal = 'tok-upgrade'");
    db->execute("UPDATE keel_idempotency SET scope = 'tok-upgrade'");
    db->execute("DROP TABLE serve_scope_secret");
    db->execute("UPDATE keel_schema SET version = 1 WHERE component = 'payments'");
  }
  ServeProcess server(args());
  auto c = server.client();
  auto mine = c.Get("/v1/charges/" + id, headers("", "tok-upgrade"));
  ASSERT_TRUE(mine);
  EXPECT_EQ(mine->status, 200);
  auto again = c.Post("/v1/charges", headers("up-1", "tok-upgrade"), kCharge, "application/json");
  ASSERT_TRUE(again);
  EXPECT_EQ(again->get_header_value("Idempotent-Replayed"), "true");
  EXPECT_EQ(charge_id(again), id);
  auto db = open_database(url());
  EXPECT_EQ(db->query("SELECT COUNT(*) FROM charges WHERE principal LIKE 'p:%'").integer(0, 0), 1);
  EXPECT_EQ(db->query("SELECT COUNT(*) FROM keel_idempotency WHERE scope LIKE 'p:%'").integer(0, 0),
            1);
}

TEST_P(Serve, ManyDistinctTokensKeepTheRateLimitTableBounded) {
  ServeProcess server(args({"--rate-limit", "1000000/s", "--rate-limit-principals", "64"}));
  auto c = server.client();
  for (int i = 0; i < 2000; ++i) {
    const std::string token = std::to_string(i) + std::string(4096, 't');
    auto r = c.Get("/v1/charges?customer=x", headers("", token));
    ASSERT_TRUE(r) << i;
    ASSERT_EQ(r->status, 200) << i;
    if (i % 500 == 0) {
      auto m = c.Get("/metrics");
      ASSERT_TRUE(m);
      EXPECT_LE(metric(m->body, "keel_rate_limit_principals"), 64) << i;
    }
  }
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_EQ(metric(m->body, "keel_rate_limit_principals"), 64) << m->body;
}

TEST_P(Serve, RotatingTokensDoNotBypassTheRateLimit) {
  ServeProcess server(args({"--rate-limit", "5/s"}));
  auto c = server.client();
  const auto start = std::chrono::steady_clock::now();
  int admitted = 0;
  for (int i = 0; i < 60; ++i) {
    auto r = c.Get("/v1/charges?customer=x", headers("", "rotating-" + std::to_string(i)));
    ASSERT_TRUE(r);
    if (r->status == 200) ++admitted;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The shared bucket: a burst of 5 plus 5 a second, whatever the number of tokens.
  EXPECT_LE(admitted, 5 + static_cast<int>(seconds * 5) + 1) << seconds;
  EXPECT_GE(admitted, 5);
}

TEST(ServePort, APortInUseIsAnErrorNamingTheAddressUnlessSharingIsAsked) {
  test::TempDir dir;
  const std::string db1 = "sqlite:" + (dir.path() / "one.db").string();
  const std::string db2 = "sqlite:" + (dir.path() / "two.db").string();
  ServeProcess first({"--listen", "127.0.0.1:0", "--db", db1});
  const std::string address = "127.0.0.1:" + std::to_string(first.port());
  const auto [code, out] = run_refused("--listen " + address + " --db " + db2);
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find(address), std::string::npos) << out;
  EXPECT_NE(out.find("in use"), std::string::npos) << out;
  // --reuse-port on both: the second one starts (the operator asked for it).
  ServeProcess shared_one({"--listen", "127.0.0.1:0", "--db", db1, "--reuse-port"});
  ServeProcess shared_two(
      {"--listen", "127.0.0.1:" + std::to_string(shared_one.port()), "--db", db2, "--reuse-port"});
  EXPECT_EQ(shared_two.port(), shared_one.port());
}

/// Writes `bytes` on a fresh loopback connection; returns what came back until the server
/// closed the connection (or 3 s passed) and whether it closed.
std::pair<std::string, bool> raw_exchange(int port, const std::string& bytes) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return {"", false};
  }
  (void)::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  std::string out;
  bool closed = false;
  const auto until = std::chrono::steady_clock::now() + 3s;
  while (!closed && std::chrono::steady_clock::now() < until) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    char buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) {
      closed = true;
    } else {
      out.append(buf, static_cast<std::size_t>(n));
    }
  }
  ::close(fd);
  return {out, closed};
}

TEST_P(Serve, FormBodiesFollowMaxBodyBytesNotCppHttplibsFormLimit) {
  // cpp-httplib alone answers 413 to any form-urlencoded body over 8,192 bytes (curl's and
  // `keel call -d`'s default Content-Type); keel's own limit is the one that decides.
  ServeProcess server(args({"--max-body-bytes", "4194304"}));
  auto c = server.client();
  const auto padded = [](std::size_t size) {
    std::string body = R"({"amount": 1250, "currency": "eur", "customer": "cus_1", "note": ")";
    body += std::string(size - body.size() - 2, 'x');
    return body + "\"}";
  };
  for (const std::size_t size : {std::size_t{9000}, std::size_t{1} << 20}) {
    auto r = c.Post("/v1/charges", headers("form-" + std::to_string(size)), padded(size),
                    "application/x-www-form-urlencoded");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 201) << size << ": " << r->body;
  }
  // Over the limit: refused before the body is read, so written raw (httplib::Client would die
  // of SIGPIPE writing the rest).
  const std::string over = padded((std::size_t{4} << 20) + 1);
  const auto [text, closed] = raw_exchange(
      server.port(),
      "POST /v1/charges HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice\r\n"
      "Idempotency-Key: form-over\r\nContent-Type: application/x-www-form-urlencoded\r\n"
      "Content-Length: " +
          std::to_string(over.size()) + "\r\n\r\n" + over);
  EXPECT_EQ(text.rfind("HTTP/1.1 413 ", 0), 0u) << text;
  EXPECT_NE(text.find("Content-Type: application/problem+json"), std::string::npos) << text;
  EXPECT_NE(text.find("limit of 4194304 bytes"), std::string::npos) << text;
  EXPECT_TRUE(closed);
  EXPECT_EQ(charges(), 2);
}

TEST_P(Serve, AmbiguousFramingIs400AndClosesTheConnection) {
  // On cpp-httplib chunked and length-less bodies were 411 and a folded Transfer-Encoding 400;
  // the Beast server reads them as RFC 9112 says (below).
  ServeProcess server(args());
  const std::string post =
      "POST /v1/charges HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice\r\n"
      "Idempotency-Key: smuggle\r\nContent-Type: application/json\r\n";
  const std::string body = kCharge;
  const std::string len = std::to_string(body.size());
  for (const std::string& bytes : {
           post + "Content-Length: " + len + "\r\nContent-Length: 5\r\n\r\n" + body,
           post + "Content-Length: " + len + "\r\nTransfer-Encoding: chunked\r\n\r\n" + body,
           post + "Transfer-Encoding: x-custom\r\n\r\n" + body,
       }) {
    const auto [text, closed] = raw_exchange(server.port(), bytes);
    EXPECT_EQ(text.rfind("HTTP/1.1 400 ", 0), 0u) << text;
    EXPECT_NE(text.find("application/problem+json"), std::string::npos) << text;
    EXPECT_TRUE(closed);
  }
  // An obs-folded line is part of the field before it (RFC 9112 section 5.2: replaced by a
  // space), so "X-A: 1 Transfer-Encoding: chunked" is one field and Content-Length frames the
  // body: one charge, nothing read as another request.
  const auto [folded, folded_closed] = raw_exchange(
      server.port(), post +
                         "Connection: close\r\nX-A: 1\r\n Transfer-Encoding: chunked\r\n"
                         "Content-Length: " +
                         len + "\r\n\r\n" + body);
  EXPECT_EQ(folded.rfind("HTTP/1.1 201 ", 0), 0u) << folded;
  EXPECT_EQ(folded.find("HTTP/1.1 ", 1), std::string::npos) << folded;
  EXPECT_TRUE(folded_closed);
  // A chunked body is read and judged as any other (a charge); a POST without a length has no
  // body, and the bytes after its head are read as the next request (not a request: 400, close).
  const std::string chunked =
      "POST /v1/charges HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice\r\n"
      "Idempotency-Key: chunked-1\r\nContent-Type: application/json\r\nConnection: close\r\n"
      "Transfer-Encoding: chunked\r\n\r\n";
  char size[16];
  std::snprintf(size, sizeof size, "%zx", body.size());
  const auto [charged, charged_closed] =
      raw_exchange(server.port(), chunked + size + "\r\n" + body + "\r\n0\r\n\r\n");
  EXPECT_EQ(charged.rfind("HTTP/1.1 201 ", 0), 0u) << charged;
  EXPECT_TRUE(charged_closed);
  const auto [lengthless, lengthless_closed] =
      raw_exchange(server.port(),
                   "POST /v1/charges HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice\r\n"
                   "Idempotency-Key: lengthless-1\r\nContent-Type: application/json\r\n\r\n" +
                       body);
  EXPECT_EQ(lengthless.rfind("HTTP/1.1 400 ", 0), 0u) << lengthless;
  EXPECT_NE(lengthless.find("HTTP/1.1 400 ", 1), std::string::npos) << lengthless;
  EXPECT_TRUE(lengthless_closed);
  EXPECT_EQ(charges(), 2);
  auto health = server.client().Get("/healthz");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

/// The answers in `text`, each the status code and the body (framed by Content-Length).
std::vector<std::pair<int, std::string>> split_answers(const std::string& text) {
  std::vector<std::pair<int, std::string>> out;
  std::size_t at = 0;
  while (text.compare(at, 9, "HTTP/1.1 ") == 0) {
    const std::size_t head_end = text.find("\r\n\r\n", at);
    if (head_end == std::string::npos) break;
    const std::string head = text.substr(at, head_end - at);
    const std::size_t length_at = head.find("Content-Length: ");
    const std::size_t length =
        length_at == std::string::npos ? 0 : std::stoul(head.substr(length_at + 16));
    out.emplace_back(std::stoi(head.substr(9, 3)), text.substr(head_end + 4, length));
    at = head_end + 4 + length;
  }
  return out;
}

TEST_P(Serve, PipelinedRequestsAreAnsweredEachInOrder) {
  // cpp-httplib answered the first of three requests written in one packet and dropped the rest.
  ServeProcess server(args());
  std::string packet;
  for (int i = 1; i <= 3; ++i) {
    const std::string body =
        R"({"amount": )" + std::to_string(i) + R"(, "currency": "eur", "customer": "cus_pipe"})";
    packet +=
        "POST /v1/charges HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice\r\n"
        "Idempotency-Key: pipe-" +
        std::to_string(i) +
        "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
        "\r\n\r\n" + body;
  }
  packet +=
      "GET /v1/charges?customer=cus_pipe HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice\r\n"
      "Connection: close\r\n\r\n";
  const auto [text, closed] = raw_exchange(server.port(), packet);
  EXPECT_TRUE(closed);
  const auto answers = split_answers(text);
  ASSERT_EQ(answers.size(), 4u) << text;
  for (int i = 1; i <= 3; ++i) {
    const auto& [status, body] = answers[static_cast<std::size_t>(i - 1)];
    EXPECT_EQ(status, 201) << body;
    EXPECT_EQ(nlohmann::json::parse(body).at("amount"), i) << "answered out of order: " << text;
  }
  EXPECT_EQ(answers[3].first, 200);
  EXPECT_EQ(nlohmann::json::parse(answers[3].second).at("data").size(), 3u) << answers[3].second;
  EXPECT_EQ(charges(), 3);
}

TEST_P(Serve, AMebibyteFormBodyIsJudgedByMaxBodyBytes) {
  // cpp-httplib refused any form-urlencoded body over 8,192 bytes, whatever --max-body-bytes.
  ServeProcess server(args({"--max-body-bytes", "1048576"}));
  const auto padded = [](std::size_t size) {
    std::string body = R"({"amount": 1250, "currency": "eur", "customer": "cus_1", "note": ")";
    body += std::string(size - body.size() - 2, 'x');
    return body + "\"}";
  };
  const auto post = [&](const std::string& key, const std::string& body) {
    return raw_exchange(server.port(),
                        "POST /v1/charges HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice\r\n"
                        "Idempotency-Key: " +
                            key +
                            "\r\nContent-Type: application/x-www-form-urlencoded\r\n"
                            "Connection: close\r\nContent-Length: " +
                            std::to_string(body.size()) + "\r\n\r\n" + body);
  };
  const auto [at_limit, at_closed] = post("form-mib", padded(std::size_t{1} << 20));
  EXPECT_EQ(at_limit.rfind("HTTP/1.1 201 ", 0), 0u) << at_limit.substr(0, 300);
  const auto [over, over_closed] = post("form-mib-over", padded((std::size_t{1} << 20) + 1));
  EXPECT_EQ(over.rfind("HTTP/1.1 413 ", 0), 0u) << over;
  EXPECT_NE(over.find("limit of 1048576 bytes"), std::string::npos) << over;
  EXPECT_TRUE(over_closed);
  EXPECT_EQ(charges(), 1);
}

TEST_P(Serve, HealthzAnswersWhile48ConnectionsTrickleHeaders) {
  // On cpp-httplib (a read timeout per recv, a thread per connection) this /healthz took 99 s.
  ServeProcess server(args());
  const std::string head =
      "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + std::string(260, 'a') + "\r\n\r\n";
  std::vector<int> tricklers;
  for (int i = 0; i < 48; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(server.port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    tricklers.push_back(fd);
  }
  std::atomic<bool> done{false};
  std::thread trickle([&] {
    // One byte each every 50 ms: 15 s for a head if nobody cut them.
    for (std::size_t at = 0; at < head.size() && !done; ++at) {
      for (const int fd : tricklers) (void)::send(fd, head.data() + at, 1, MSG_NOSIGNAL);
      std::this_thread::sleep_for(50ms);
    }
  });
  std::this_thread::sleep_for(300ms);  // the tricklers are under way
  const auto asked = std::chrono::steady_clock::now();
  auto c = server.client();
  auto health = c.Get("/healthz");
  const auto took = std::chrono::steady_clock::now() - asked;
  done = true;
  trickle.join();
  for (const int fd : tricklers) ::close(fd);
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  if (test::kTimingAsserted) {
    EXPECT_LT(took, 1s);
  }
}

TEST(ServePort, JobsMetricsListenOnAPortInUseIsAnErrorNamingTheAddress) {
  // A plain listening socket (no SO_REUSEPORT) holds the port.
  test::LoopbackSocket holder;
  const std::string address = holder.address();
  test::TempDir dir;
  const std::string db = "sqlite:" + (dir.path() / "jobs.db").string();
  const std::string keel = std::string(KEEL_BINARY) + " jobs --db " + db;
  ASSERT_EQ(std::system((keel + " enqueue --queue x --payload '{}' >/dev/null").c_str()), 0);
  FILE* p = popen(
      (keel + " work --queue x --exec true --exit-when-idle --metrics-listen " + address + " 2>&1")
          .c_str(),
      "r");
  std::string out;
  char buf[256];
  while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
  const int status = pclose(p);
  holder.close();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << out;
  EXPECT_NE(out.find(address), std::string::npos) << out;
}

TEST(ServeFleet, TwoServersOnOnePostgresMakeOneChargePerKey) {
  const auto url = test::postgres_url();
  if (!url) GTEST_SKIP() << "no PostgreSQL test server (run through ctest)";
  const std::vector<std::string> a = {"--listen", "127.0.0.1:0", "--db", *url, "--threads", "8"};
  ServeProcess one(a);
  ServeProcess two(a);
  constexpr int kKeys = 20;
  std::mutex mu;
  std::map<std::string, std::set<std::string>> ids;
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (const ServeProcess* s : {&one, &two}) {
    threads.emplace_back([&, s] {
      auto c = s->client();
      for (int i = 0; i < kKeys; ++i) {
        const std::string key = "fleet-" + std::to_string(i);
        auto r = c.Post("/v1/charges", headers(key), kCharge, "application/json");
        if (!r || (r->status != 201 && r->status != 409)) {
          ++bad;
          continue;
        }
        if (r->status == 201) {
          std::lock_guard lock(mu);
          ids[key].insert(charge_id(r));
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
  for (const auto& [key, set] : ids) EXPECT_EQ(set.size(), 1u) << key;
  auto db = open_database(parse_database_url(*url).value());
  EXPECT_EQ(db->query("SELECT COUNT(*) FROM charges").integer(0, 0), kKeys);
  // Each server replays the other's charge.
  for (int i = 0; i < kKeys; ++i) {
    const std::string key = "fleet-" + std::to_string(i);
    auto r =
        (i % 2 ? one : two).client().Post("/v1/charges", headers(key), kCharge, "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 201);
    EXPECT_EQ(r->get_header_value("Idempotent-Replayed"), "true");
  }
}

TEST(ServeFlags, BadValuesExit2NamingTheFlag) {
  for (const auto& [args, flag] : std::vector<std::pair<std::string, std::string>>{
           {"--idempotency-ttl soon", "--idempotency-ttl"},
           {"--lock-timeout 0s", "--lock-timeout"},
           {"--rate-limit 10", "--rate-limit"},
           {"--rate-limit 0/s", "--rate-limit"},
           {"--db nosuch://x", "--db"},
           {"--db sqlite:", "--db"},
           {"--listen 127.0.0.1", "--listen"},
           {"--listen 127.0.0.1:70000", "--listen"},
           {"--chaos-503 1.5", "--chaos-503"},
           {"--chaos-delay 3parsecs", "--chaos-delay"},
           {"--max-body-bytes 0", "--max-body-bytes"},
           {"--max-body-bytes 1MB", "--max-body-bytes"},
           {"--max-json-depth 0", "--max-json-depth"},
           {"--max-json-depth 100001", "--max-json-depth"},
           {"--max-json-depth deep", "--max-json-depth"},
           {"--max-concurrency -1", "--max-concurrency"},
           {"--max-concurrency many", "--max-concurrency"},
           {"--admission-queue -2", "--admission-queue"},
           {"--max-concurrency 4 --adaptive-latency soon", "--adaptive-latency"},
           {"--adaptive-latency 100ms", "--adaptive-latency"},
           {"--max-concurrency 8 --adaptive-admission --adaptive-latency 100ms",
            "--adaptive-admission"},
           {"--scope-secret-file /nonexistent/secret", "--scope-secret-file"},
           {"--max-connections 0", "--max-connections"},
           {"--max-connections many", "--max-connections"},
           {"--max-connections 2000000", "--max-connections"},
           {"--first-byte-timeout 0s", "--first-byte-timeout"},
           {"--header-timeout soon", "--header-timeout"},
           {"--body-timeout 0ms", "--body-timeout"},
           {"--idle-timeout 500us", "--idle-timeout"},
           {"--write-timeout 25h", "--write-timeout"},
           {"--drain-timeout -1s", "--drain-timeout"},
           {"--health-timeout 0s", "--health-timeout"}}) {
    const auto [code, out] = run_refused(args);
    EXPECT_EQ(code, 2) << args << ": " << out;
    EXPECT_NE(out.find(flag), std::string::npos) << args << ": " << out;
  }
}

TEST(ServeFlags, AFlagWithoutTheFlagItNeedsExits2NamingBoth) {
  // Each was silently ignored before.
  for (const auto& [args, flag, needed] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"--admission-queue 4", "--admission-queue", "--max-concurrency"},
           {"--admission-queue 0", "--admission-queue", "--max-concurrency"},
           {"--adaptive-latency 100ms", "--adaptive-latency", "--max-concurrency"},
           {"--adaptive-admission", "--adaptive-admission", "--max-concurrency"},
           {"--rate-limit-principals 64", "--rate-limit-principals", "--rate-limit"},
           {"--chaos-503-retry-after 1s", "--chaos-503-retry-after", "--chaos-503"},
           {"--chaos-delay 1s", "--chaos-delay", "--chaos-delay-fraction"},
           {"--chaos-hang 1s", "--chaos-hang", "--chaos-hang-fraction"}}) {
    const auto [code, out] = run_refused(args);
    EXPECT_EQ(code, 2) << args << ": " << out;
    EXPECT_NE(out.find(flag + " needs " + needed), std::string::npos) << args << ": " << out;
  }
}

// ---- Idle sockets, the limit of open files, a blocked database, the stop, and the HTTP details
// of RFC 9110 and 9112.

sockaddr_in loopback(int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return addr;
}

/// A non-blocking socket connecting to 127.0.0.1:port (the connect may still be under way); -1
/// when no socket could be made.
int connect_nonblocking(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  const sockaddr_in addr = loopback(port);
  (void)::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
  return fd;
}

/// Raises this process's soft limit of open files to `want` when it is lower; false when the
/// hard limit is lower.
bool raise_own_nofile(rlim_t want) {
  rlimit limits{};
  if (::getrlimit(RLIMIT_NOFILE, &limits) != 0) return false;
  if (limits.rlim_max != RLIM_INFINITY && limits.rlim_max < want) return false;
  if (limits.rlim_cur != RLIM_INFINITY && limits.rlim_cur < want) limits.rlim_cur = want;
  return ::setrlimit(RLIMIT_NOFILE, &limits) == 0;
}

/// What `spawn()` returns, run with this process's soft limit of open files at `soft` (a child
/// inherits it), the limit put back after.
template <class Spawn>
auto with_soft_nofile(rlim_t soft, Spawn spawn) {
  rlimit saved{};
  EXPECT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  struct Restore {
    rlimit limits;
    ~Restore() { ::setrlimit(RLIMIT_NOFILE, &limits); }
  } restore{saved};
  rlimit lowered = saved;
  lowered.rlim_cur = soft;
  EXPECT_EQ(::setrlimit(RLIMIT_NOFILE, &lowered), 0);
  return spawn();
}

/// The soft limit of open files of process `pid` (/proc/PID/limits); 0 when unreadable.
std::uint64_t soft_nofile_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/limits");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("Max open files", 0) == 0) return std::stoull(line.substr(26));
  }
  return 0;
}

/// `count` connections to 127.0.0.1:port that never send a byte, each reopened as soon as the
/// server closes it, held by a thread of their own until destroyed.
class IdleSockets {
 public:
  IdleSockets(int port, std::size_t count) : port_(port) {
    for (std::size_t i = 0; i < count; ++i) fds_.push_back({connect_nonblocking(port), POLLIN, 0});
    thread_ = std::thread([this] { run(); });
  }
  ~IdleSockets() {
    stop_ = true;
    thread_.join();
    for (const pollfd& p : fds_) {
      if (p.fd >= 0) ::close(p.fd);
    }
  }
  IdleSockets(const IdleSockets&) = delete;
  IdleSockets& operator=(const IdleSockets&) = delete;

  /// Connections the server closed and that were opened again.
  [[nodiscard]] std::uint64_t reopened() const { return reopened_.load(); }

 private:
  void run() {
    while (!stop_) {
      if (::poll(fds_.data(), fds_.size(), 20) > 0) {
        for (pollfd& p : fds_) {
          if (p.revents == 0) continue;
          char buf[512];
          const ssize_t n = ::recv(p.fd, buf, sizeof buf, MSG_DONTWAIT);
          const bool open = n > 0 || (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));
          if (open && (p.revents & (POLLHUP | POLLERR)) == 0) continue;
          ::close(p.fd);
          p.fd = connect_nonblocking(port_);
          ++reopened_;
        }
      }
      for (pollfd& p : fds_) {
        if (p.fd < 0) p.fd = connect_nonblocking(port_);
      }
    }
  }

  int port_;
  std::vector<pollfd> fds_;
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> reopened_{0};
  std::thread thread_;
};

/// GET /healthz on a fresh connection: the status (0 when none came within `timeout`) and how
/// long it took, from the connect to the status line.
std::pair<int, std::chrono::steady_clock::duration> healthz_once(
    int port, std::chrono::milliseconds timeout) {
  const auto began = std::chrono::steady_clock::now();
  const auto left = [&] {
    const auto spent = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - began);
    return static_cast<int>(std::max<std::int64_t>(0, (timeout - spent).count()));
  };
  const int fd = connect_nonblocking(port);
  if (fd < 0) return {0, std::chrono::steady_clock::now() - began};
  std::string text;
  pollfd connected{fd, POLLOUT, 0};
  if (::poll(&connected, 1, left()) == 1 && (connected.revents & (POLLERR | POLLHUP)) == 0) {
    const std::string request = "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
        static_cast<ssize_t>(request.size())) {
      while (text.find("\r\n") == std::string::npos) {
        pollfd readable{fd, POLLIN, 0};
        if (::poll(&readable, 1, left()) != 1) break;
        char buf[512];
        const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
        if (n <= 0) break;
        text.append(buf, static_cast<std::size_t>(n));
      }
    }
  }
  const auto took = std::chrono::steady_clock::now() - began;
  ::close(fd);
  const bool answered = text.rfind("HTTP/1.1 ", 0) == 0 && text.size() >= 12;
  return {answered ? std::stoi(text.substr(9, 3)) : 0, took};
}

TEST(ServeSlots, HealthzAnswersWhile2000IdleSocketsAreHeldOpenUnderASoftLimitOf1024Files) {
  // Before: 1,030 sockets that never sent a byte (reopened when closed) kept every slot, each
  // for the 10 s head deadline, and a fresh /healthz failed 83 times out of 85; under the soft
  // limit of open files systemd gives a service (1024), accept failed with EMFILE before the
  // server's own limit of 1,024 connections and new connections waited in the backlog.
  if (!raise_own_nofile(4096)) GTEST_SKIP() << "the hard limit of open files is under 4096";
  test::TempDir dir;
  const auto server = with_soft_nofile(1024, [&] {
    return std::make_unique<ServeProcess>(
        std::vector<std::string>{"--listen", "127.0.0.1:0", "--db",
                                 "sqlite:" + (dir.path() / "slots.db").string(), "--threads", "8"});
  });
  // It raised its own soft limit for its 1,024 connections and its other descriptors.
  EXPECT_GE(soft_nofile_of(server->pid()), 1024u + 128u);
  IdleSockets idle(server->port(), 2000);
  // Under way: the server has had to close idle connections.
  for (const auto until = std::chrono::steady_clock::now() + 20s;
       idle.reopened() < 2000 && std::chrono::steady_clock::now() < until;) {
    std::this_thread::sleep_for(5ms);
  }
  const int probes = test::kTimingAsserted ? 200 : 20;
  int asked = 0;
  int answered = 0;
  int within_100ms = 0;
  std::chrono::steady_clock::duration slowest{};
  // Stops once more than 1% went unanswered: the test has failed, and each costs 2 s.
  for (; asked < probes && (asked - answered) * 100 <= probes; ++asked) {
    const auto [status, took] = healthz_once(server->port(), 2s);
    if (status != 200) continue;
    ++answered;
    if (took < 100ms) ++within_100ms;
    slowest = std::max(slowest, took);
  }
  std::printf(
      "fresh /healthz beside 2000 idle sockets: %d of %d asked answered, %d within 100 ms, "
      "slowest %.1f ms, %llu idle sockets reopened\n",
      answered, asked, within_100ms, std::chrono::duration<double, std::milli>(slowest).count(),
      static_cast<unsigned long long>(idle.reopened()));
  // What is asserted is that a fresh connection is served at all (each probe waits 2 s, where
  // before 83 of 85 got nothing); how fast is the figure printed above, not an assertion, since
  // under a loaded machine's scheduling a share within 100 ms is not the server's doing.
  EXPECT_GE(answered * 100, probes * 99);
}

/// The admission gauge of /metrics (keel_admission_in_flight), -1 when it cannot be read.
std::int64_t in_flight(const ServeProcess& server) {
  auto m = server.client().Get("/metrics");
  if (!m) return -1;
  const std::string name = "keel_admission_in_flight ";
  const std::size_t at = m->body.find("\n" + name);
  return at == std::string::npos ? -1 : std::stoll(m->body.substr(at + 1 + name.size()));
}

/// Holds the database so that a charge blocks on it: on SQLite the write lock (BEGIN IMMEDIATE),
/// on PostgreSQL LOCK TABLE charges IN EXCLUSIVE MODE. Released by release() or destruction.
class DatabaseHold {
 public:
  explicit DatabaseHold(const DatabaseUrl& url) : conn_(open_database(url)) {
    conn_->begin();
    if (url.backend == Backend::kPostgres) {
      conn_->execute("LOCK TABLE charges IN EXCLUSIVE MODE");
    } else {
      (void)conn_->query("DELETE FROM charges WHERE id = 'none'");  // takes the write lock
    }
  }
  ~DatabaseHold() { release(); }
  DatabaseHold(const DatabaseHold&) = delete;
  DatabaseHold& operator=(const DatabaseHold&) = delete;
  void release() { conn_->rollback(); }

 private:
  std::unique_ptr<Connection> conn_;
};

TEST_P(Serve, HealthzAnswersWhileEveryWorkerIsBlockedOnTheDatabase) {
  // Before: /healthz took its connection from the pool the blocked flows held, behind them on
  // the same worker threads, and waited 12.6 s.
  ServeProcess server(args({"--threads", "2", "--max-concurrency", "1000"}));
  DatabaseHold hold(url());
  std::vector<std::thread> posts;
  std::atomic<int> created{0};
  for (int i = 0; i < 6; ++i) {
    posts.emplace_back([&, i] {
      auto r = server.client().Post("/v1/charges", headers("blocked-" + std::to_string(i)), kCharge,
                                    "application/json");
      if (r && r->status == 201) ++created;
    });
  }
  // All six are in: two on the worker threads, blocked on the database, four queued for them.
  bool inside = false;
  for (const auto until = std::chrono::steady_clock::now() + 20s;
       !inside && std::chrono::steady_clock::now() < until;) {
    inside = in_flight(server) == 6;
    if (!inside) std::this_thread::sleep_for(5ms);
  }
  ASSERT_TRUE(inside) << "the charges never got in";
  for (int i = 0; i < 3; ++i) {
    const auto [status, took] = healthz_once(server.port(), 5s);
    EXPECT_EQ(status, 200);
    if (test::kTimingAsserted) {
      EXPECT_LT(took, 500ms);
    }
  }
  hold.release();
  for (std::thread& t : posts) t.join();
  EXPECT_EQ(created.load(), 6);
}

TEST_P(Serve, SigtermWhileAChargeIsBlockedExitsWithinTheDrainAndNothingCommits) {
  // Before: the stop waited for the blocked flow (24.1 s against a 10 s drain), and the charge
  // committed after its client had got EOF.
  ServeProcess server(
      args({"--threads", "2", "--max-concurrency", "1000", "--drain-timeout", "1s"}));
  auto hold = std::make_unique<DatabaseHold>(url());
  std::optional<int> status;
  bool answered = false;
  std::thread post([&] {
    auto c = server.client();
    c.set_read_timeout(30);
    auto r = c.Post("/v1/charges", headers("abandoned"), kCharge, "application/json");
    answered = static_cast<bool>(r);
    if (r) status = r->status;
  });
  bool inside = false;
  for (const auto until = std::chrono::steady_clock::now() + 20s;
       !inside && std::chrono::steady_clock::now() < until;) {
    inside = in_flight(server) == 1;
    if (!inside) std::this_thread::sleep_for(5ms);
  }
  ASSERT_TRUE(inside) << "the charge never got in";
  const auto signalled = std::chrono::steady_clock::now();
  const int exit_status = server.terminate(SIGTERM);
  const auto took = std::chrono::steady_clock::now() - signalled;
  post.join();
  EXPECT_TRUE(WIFEXITED(exit_status) && WEXITSTATUS(exit_status) == 0) << exit_status;
  EXPECT_FALSE(answered) << "the blocked charge was answered " << status.value_or(0);
  if (test::kTimingAsserted) {
    EXPECT_LT(took, 2s) << "the drain is 1 s";
  } else {
    EXPECT_LT(took, 10s);
  }
  // The database goes on once the hold is released; nothing of the abandoned charge commits.
  hold.reset();
  auto db = open_database(url());
  if (GetParam() == Backend::kPostgres) {
    // The server's backend runs its INSERT once the lock is free, then finds its client gone.
    for (const auto until = std::chrono::steady_clock::now() + 10s;
         std::chrono::steady_clock::now() < until;) {
      const auto busy = db->query(
          "SELECT COUNT(*) FROM pg_stat_activity WHERE state <> 'idle' AND query LIKE "
          "'%INSERT INTO charges%' AND pid <> pg_backend_pid()");
      if (busy.integer(0, 0) == 0) break;
      std::this_thread::sleep_for(5ms);
    }
  }
  EXPECT_EQ(db->query("SELECT COUNT(*) FROM charges").integer(0, 0), 0);
  EXPECT_EQ(db->query("SELECT COUNT(*) FROM keel_idempotency").integer(0, 0), 0);
}

TEST_P(Serve, SighupDrainsLikeSigterm) {
  // Before: SIGHUP's default action killed the process, the request in flight unanswered.
  ServeProcess server(args({"--chaos-delay-fraction", "1", "--chaos-delay", "2s"}));
  std::optional<int> status;
  std::thread request([&] {
    auto r = server.client().Post("/v1/charges", headers("hup"), kCharge, "application/json");
    if (r) status = r->status;
  });
  auto c = server.client();
  bool inside = false;
  for (const auto until = std::chrono::steady_clock::now() + 20s;
       !inside && std::chrono::steady_clock::now() < until;) {
    auto m = c.Get("/metrics");
    inside = m && m->body.find("keel_chaos_injected_total{fault=\"delay\"} 1") != std::string::npos;
    if (!inside) std::this_thread::sleep_for(2ms);
  }
  const int exit_status = server.terminate(SIGHUP);
  request.join();
  ASSERT_TRUE(inside) << "the request was never seen inside the server before SIGHUP";
  ASSERT_TRUE(status.has_value()) << "the in-flight request was cut off";
  EXPECT_EQ(*status, 201);
  EXPECT_TRUE(WIFEXITED(exit_status) && WEXITSTATUS(exit_status) == 0) << exit_status;
  EXPECT_EQ(charges(), 1);
}

/// The status of the answer to `request` on a fresh connection (0 when none), and its text.
std::pair<int, std::string> status_of(int port, const std::string& request) {
  const auto [text, closed] = raw_exchange(port, request);
  const bool answered = text.rfind("HTTP/1.", 0) == 0 && text.size() >= 12;
  return {answered ? std::stoi(text.substr(9, 3)) : 0, text};
}

TEST(ServeHttp, HostMustBeOneValidFieldAndHttp11MustSendIt) {
  // Before: each of these was answered 200 (RFC 9112 section 3.2 says 400).
  test::TempDir dir;
  ServeProcess server(
      {"--listen", "127.0.0.1:0", "--db", "sqlite:" + (dir.path() / "h.db").string()});
  for (const std::string refused : {
           "GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: x\r\nHost: x\r\nConnection: close\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: x\r\nHost: y\r\nConnection: close\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: a b\r\nConnection: close\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: a@b\r\nConnection: close\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: a/b\r\nConnection: close\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: [::1\r\nConnection: close\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: a:port\r\nConnection: close\r\n\r\n",
       }) {
    const auto [status, text] = status_of(server.port(), refused);
    EXPECT_EQ(status, 400) << refused << text;
  }
  for (const std::string accepted : {
           "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost:\r\nConnection: close\r\n\r\n",
           "GET /healthz HTTP/1.1\r\nHost: [::1]:8080\r\nConnection: close\r\n\r\n",
           "GET /healthz HTTP/1.0\r\n\r\n",
       }) {
    const auto [status, text] = status_of(server.port(), accepted);
    EXPECT_EQ(status, 200) << accepted << text;
  }
}

TEST_P(Serve, HeadIsAnsweredOnEveryGetRouteWithoutABody) {
  // Before: HEAD /healthz was 405 (RFC 9110 section 9.3.2: HEAD is GET without the body).
  ServeProcess server(args());
  auto created = server.client().Post("/v1/charges", headers("head"), kCharge, "application/json");
  ASSERT_TRUE(created);
  ASSERT_EQ(created->status, 201);
  // /metrics on the event loop, /healthz on the health check's threads, the charges on the
  // worker threads.
  for (const std::string& target :
       std::vector<std::string>{"/healthz", "/metrics", "/v1/charges?customer=cus_1",
                                "/v1/charges/" + charge_id(created)}) {
    SCOPED_TRACE(target);
    const std::string rest = " " + target +
                             " HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice\r\n"
                             "Connection: close\r\n\r\n";
    const auto [get, get_closed] = raw_exchange(server.port(), "GET" + rest);
    const auto [head, head_closed] = raw_exchange(server.port(), "HEAD" + rest);
    ASSERT_EQ(get.rfind("HTTP/1.1 200 ", 0), 0u) << get;
    ASSERT_EQ(head.rfind("HTTP/1.1 200 ", 0), 0u) << head;
    const std::size_t get_end = get.find("\r\n\r\n") + 4;
    const std::size_t length_at = get.find("Content-Length: ");
    ASSERT_NE(length_at, std::string::npos) << get;
    const std::string length = get.substr(length_at, get.find("\r\n", length_at) - length_at);
    if (target.rfind("/metrics", 0) != 0) {  // the counters move between the two
      EXPECT_NE(head.find(length + "\r\n"), std::string::npos) << head;
    }
    EXPECT_GT(get.size(), get_end);
    EXPECT_EQ(head.size(), head.find("\r\n\r\n") + 4) << "the HEAD answer has a body: " << head;
    EXPECT_TRUE(head_closed);
  }
}

TEST(ServeHttp, EmptyLinesBeforeARequestLineAreIgnoredAndCannotHoldAConnection) {
  // Before: an empty line before the request line was answered 400 and the connection closed
  // (RFC 9112 section 2.2: a server SHOULD ignore at least one).
  test::TempDir dir;
  ServeProcess server({"--listen", "127.0.0.1:0", "--db",
                       "sqlite:" + (dir.path() / "e.db").string(), "--first-byte-timeout",
                       "500ms"});
  const std::string healthz = "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  for (const std::string& before :
       {std::string("\r\n"), std::string("\r\n\r\n\r\n"), std::string("\n")}) {
    const auto [status, text] = status_of(server.port(), before + healthz);
    EXPECT_EQ(status, 200) << text;
  }
  // Only empty lines, one every 50 ms: closed at the first byte's deadline, never answered.
  const int fd = connect_nonblocking(server.port());
  ASSERT_GE(fd, 0);
  pollfd connected{fd, POLLOUT, 0};
  ASSERT_EQ(::poll(&connected, 1, 5000), 1);
  const auto began = std::chrono::steady_clock::now();
  bool closed = false;
  std::string got;
  for (int i = 0; i < 200 && !closed; ++i) {
    (void)::send(fd, "\r\n", 2, MSG_NOSIGNAL);
    pollfd readable{fd, POLLIN, 0};
    if (::poll(&readable, 1, 50) == 1) {
      char buf[512];
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) closed = true;
      if (n > 0) got.append(buf, static_cast<std::size_t>(n));
    }
  }
  ::close(fd);
  EXPECT_TRUE(closed) << "a stream of empty lines held the connection for 10 s";
  EXPECT_TRUE(got.empty()) << got;
  if (test::kTimingAsserted) {
    EXPECT_LT(std::chrono::steady_clock::now() - began, 1500ms);
  }
}

TEST(ServeHttp, AnHttp10ClientGetsNo100Continue) {
  // Before: HTTP/1.0 with Expect: 100-continue got a 100 (RFC 9110 section 10.1.1: a server
  // must not send 100 to an HTTP/1.0 client).
  test::TempDir dir;
  ServeProcess server(
      {"--listen", "127.0.0.1:0", "--db", "sqlite:" + (dir.path() / "x.db").string()});
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  const sockaddr_in addr = loopback(server.port());
  ASSERT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr), 0);
  const std::string head =
      "POST /v1/charges HTTP/1.0\r\nHost: x\r\nAuthorization: Bearer alice\r\n"
      "Idempotency-Key: expect-10\r\nContent-Type: application/json\r\n"
      "Expect: 100-continue\r\nContent-Length: " +
      std::to_string(kCharge.size()) + "\r\n\r\n";
  ASSERT_EQ(::send(fd, head.data(), head.size(), MSG_NOSIGNAL), static_cast<ssize_t>(head.size()));
  pollfd early{fd, POLLIN, 0};
  EXPECT_EQ(::poll(&early, 1, 300), 0) << "an answer came before the body was sent";
  ASSERT_EQ(::send(fd, kCharge.data(), kCharge.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(kCharge.size()));
  std::string text;
  for (const auto until = std::chrono::steady_clock::now() + 5s;
       std::chrono::steady_clock::now() < until;) {
    pollfd readable{fd, POLLIN, 0};
    if (::poll(&readable, 1, 50) != 1) continue;
    char buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    text.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  EXPECT_EQ(text.rfind("HTTP/1.0 201 ", 0), 0u) << text;
  EXPECT_EQ(text.find(" 100 "), std::string::npos) << text;
}

}  // namespace
}  // namespace keel::store
