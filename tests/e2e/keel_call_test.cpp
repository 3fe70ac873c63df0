// `keel call` and `keel-demo upstream` as processes: exit statuses, what they print, and what
// the upstream saw. The upstream is a keel::faults::FaultServer in this process unless the test
// is about `keel-demo upstream` itself.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "integration/support/loopback_socket.hpp"
#include "keel/faults/fault_server.hpp"
#include "run_keel.hpp"

#ifndef KEEL_BINARY
#error "KEEL_BINARY must name the keel executable"
#endif
#ifndef KEEL_DEMO_BINARY
#error "KEEL_DEMO_BINARY must name the keel-demo executable"
#endif

namespace {

using keel::faults::Arrival;
using keel::faults::FaultServer;

using keel::test::TempDir;

struct ProcessRun {
  int status = -1;
  std::string out;
  std::string err;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Runs the program `binary` with args (no shell), stdout and stderr captured through files.
ProcessRun run_binary(const char* binary, const std::vector<std::string>& args) {
  TempDir dir;
  const std::string out = dir.file("out");
  const std::string err = dir.file("err");
  const pid_t pid = fork();
  if (pid == 0) {
    const int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    const int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ::dup2(o, 1);
    ::dup2(e, 2);
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(binary));
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(binary, argv.data());
    ::_exit(127);
  }
  int wstatus = 0;
  ::waitpid(pid, &wstatus, 0);
  ProcessRun r;
  r.status = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

ProcessRun keel(const std::vector<std::string>& args) { return run_binary(KEEL_BINARY, args); }
ProcessRun keel_demo(const std::vector<std::string>& args) {
  return run_binary(KEEL_DEMO_BINARY, args);
}

std::string header(const Arrival& a, std::string_view name) {
  auto v = keel::http::find_header(a.headers, name);
  return v ? std::string(*v) : std::string();
}

// Fast retries for the tests.
std::vector<std::string> call(std::vector<std::string> extra) {
  std::vector<std::string> args = {"call", "--backoff-base", "1ms", "--backoff-cap", "5ms"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

TEST(KeelCall, SuccessPrintsTheBodyAndExitsZero) {
  FaultServer server({.script = "200/body=hello"});
  server.start();
  const ProcessRun r = keel(call({server.url("/x")}));
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "hello\n");
  ASSERT_EQ(server.arrivals().size(), 1u);
  EXPECT_EQ(server.arrivals()[0].method, "GET");
  EXPECT_EQ(header(server.arrivals()[0], "Keel-Attempt"), "1");
}

TEST(KeelCall, IncludePrintsStatusLineAndHeaders) {
  FaultServer server({.script = "201"});
  server.start();
  const ProcessRun r = keel(call({"-i", server.url("/")}));
  EXPECT_EQ(r.status, 0);
  EXPECT_TRUE(r.out.starts_with("HTTP/1.1 201 Created\r\n")) << r.out;
  EXPECT_NE(r.out.find("Content-Length: 3\r\n"), std::string::npos) << r.out;
  EXPECT_TRUE(r.out.ends_with("\r\n\r\nok\n")) << r.out;
}

TEST(KeelCall, PermanentFailureExitsThreeWithTheBodyAndNoRetry) {
  FaultServer server({.script = "400/body=bad-field,200"});
  server.start();
  const ProcessRun r = keel(call({"-X", "POST", "-d", "x", server.url("/")}));
  EXPECT_EQ(r.status, 3);
  EXPECT_EQ(r.out, "bad-field\n");
  EXPECT_EQ(server.arrivals().size(), 1u);
}

TEST(KeelCall, GivesUpAfterTheLastAttemptWithExitFour) {
  FaultServer server({.script = "503"});
  server.start();
  const ProcessRun r = keel(call({"--max-attempts", "2", server.url("/")}));
  EXPECT_EQ(r.status, 4);
  EXPECT_EQ(server.arrivals().size(), 2u);
  EXPECT_NE(r.err.find("gave up after 2 attempts"), std::string::npos) << r.err;
}

TEST(KeelCall, RetryAfterPastTheDeadlineExitsFiveWithoutASecondAttempt) {
  FaultServer server({.script = "503/retry-after=30,200"});
  server.start();
  const ProcessRun r = keel(call({"--deadline", "2s", server.url("/")}));
  EXPECT_EQ(r.status, 5) << r.err;
  EXPECT_EQ(server.arrivals().size(), 1u);
  EXPECT_NE(r.err.find("deadline"), std::string::npos) << r.err;
}

TEST(KeelCall, AmbiguousPostWithoutKeyExitsSixWithoutRetry) {
  FaultServer server({.script = "drop,200"});
  server.start();
  const ProcessRun r = keel(call({"-d", "pay", "--idempotency-key", "off", server.url("/pay")}));
  EXPECT_EQ(r.status, 6) << r.err;
  ASSERT_EQ(server.arrivals().size(), 1u);
  EXPECT_EQ(header(server.arrivals()[0], "Idempotency-Key"), "");
}

TEST(KeelCall, PostWithAutoKeySendsOneKeyOnEveryAttempt) {
  FaultServer server({.script = "drop,503,200"});
  server.start();
  const ProcessRun r = keel(call({"-d", "pay", server.url("/pay")}));
  EXPECT_EQ(r.status, 0) << r.err;
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 3u);
  const std::string key = header(arrivals[0], "Idempotency-Key");
  EXPECT_EQ(key.size(), 36u);
  for (std::size_t i = 0; i < arrivals.size(); ++i) {
    EXPECT_EQ(header(arrivals[i], "Idempotency-Key"), key);
    EXPECT_EQ(header(arrivals[i], "Keel-Attempt"), std::to_string(i + 1));
  }
}

TEST(KeelCall, DuplicateIsSuccessAfterADroppedResponseExitsZero) {
  FaultServer server({.script = "drop,409/body=name already exists"});
  server.start();
  const ProcessRun r = keel(
      call({"-d", "video", "--duplicate-is-success", "409:already exists", server.url("/videos")}));
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "name already exists\n");
  EXPECT_NE(r.err.find("an earlier attempt took effect"), std::string::npos) << r.err;
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 2u);
  EXPECT_EQ(header(arrivals[0], "Idempotency-Key"), header(arrivals[1], "Idempotency-Key"));
  EXPECT_FALSE(header(arrivals[0], "Idempotency-Key").empty());
}

TEST(KeelCall, DuplicateIsSuccessKeepsAFirstAttemptConflictAndChecksTheText) {
  FaultServer server({.script = "409/body=name already exists"});
  server.start();
  const ProcessRun first =
      keel(call({"-d", "video", "--idempotency-key", "off", "--duplicate-is-success",
                 "409:already exists", server.url("/videos")}));
  EXPECT_EQ(first.status, 3) << first.err;
  EXPECT_EQ(first.err.find("an earlier attempt took effect"), std::string::npos) << first.err;
  EXPECT_EQ(server.arrivals().size(), 1u);

  server.set_script("drop,409/body=version mismatch");
  server.reset();
  const ProcessRun other =
      keel(call({"-d", "video", "--max-attempts", "2", "--duplicate-is-success",
                 "409:already exists", server.url("/videos")}));
  EXPECT_NE(other.status, 0) << other.err;
  EXPECT_EQ(server.arrivals().size(), 2u);
}

TEST(KeelCall, CallerKeyAndHeadersAndDataFromAFile) {
  TempDir dir;
  const std::string body_file = dir.file("body.json");
  std::ofstream(body_file) << R"({"amount": 5})";
  FaultServer server({.script = "200"});
  server.start();
  const ProcessRun r = keel(
      call({"-X", "PATCH", "-d", "@" + body_file, "-H", "X-Trace: t1", "-H",
            "Content-Type: application/json", "--idempotency-key", "job-7", server.url("/acct")}));
  EXPECT_EQ(r.status, 0) << r.err;
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 1u);
  const Arrival& a = arrivals[0];
  EXPECT_EQ(a.method, "PATCH");
  EXPECT_EQ(a.body, R"({"amount": 5})");
  EXPECT_EQ(header(a, "X-Trace"), "t1");
  EXPECT_EQ(header(a, "Content-Type"), "application/json");
  EXPECT_EQ(header(a, "Idempotency-Key"), "job-7");
}

TEST(KeelCall, VerbosePrintsOneLinePerAttempt) {
  FaultServer server({.script = "503,429/retry-after=0,200"});
  server.start();
  const ProcessRun r = keel(call({"-v", server.url("/")}));
  EXPECT_EQ(r.status, 0);
  for (int n = 1; n <= 3; ++n) {
    EXPECT_NE(r.err.find("attempt " + std::to_string(n) + ": GET"), std::string::npos) << r.err;
  }
  EXPECT_EQ(r.err.find("attempt 4"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("stop: success"), std::string::npos) << r.err;
}

TEST(KeelCall, OutputWritesTheBodyToAFile) {
  TempDir dir;
  FaultServer server({.script = "200/body=saved"});
  server.start();
  const std::string file = dir.file("resp.txt");
  const ProcessRun r = keel(call({"-o", file, server.url("/")}));
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(slurp(file), "saved\n");
}

TEST(KeelCall, ConnectionRefusedIsRetriedAndExitsFour) {
  const keel::test::ClosedPort closed;
  const ProcessRun r = keel(call({"-d", "x", "--idempotency-key", "off", closed.url("/")}));
  EXPECT_EQ(r.status, 4) << r.err;
  EXPECT_NE(r.err.find("gave up after 3 attempts"), std::string::npos) << r.err;
}

TEST(KeelCall, AdaptiveConcurrencyCallsThroughTheHostsLimit) {
  FaultServer server({.script = "503,200/body=hello"});
  server.start();
  const ProcessRun r = keel(call({"--adaptive-concurrency", server.url("/x")}));
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "hello\n");
  EXPECT_EQ(server.arrivals().size(), 2u);
}

TEST(KeelJobsWork, AdaptiveConcurrencyDeliversEveryJobThroughEachDependencysLimit) {
  // Eight slots, every first delivery a 503 (a drop that cuts the limit), then 200s.
  FaultServer server({.script = "503,503,503,503,200"});
  server.start();
  TempDir dir;
  const std::string db = "sqlite:" + dir.file("q.db");
  for (int i = 0; i < 12; ++i) {
    const ProcessRun e = keel({"jobs", "--db", db, "enqueue", "--queue", "q", "--payload",
                               "{\"n\":" + std::to_string(i) + "}"});
    ASSERT_EQ(e.status, 0) << e.err;
  }
  const ProcessRun w =
      keel({"jobs", "--db", db, "work", "--queue", "q", "--deliver", server.url("/hook"),
            "--concurrency", "8", "--backoff-base", "10ms", "--backoff-cap", "20ms",
            "--adaptive-concurrency", "--exit-when-idle"});
  EXPECT_EQ(w.status, 0) << w.err;
  const ProcessRun stats = keel({"jobs", "--db", db, "stats", "--json"});
  EXPECT_NE(stats.out.find("\"done\": 12,"), std::string::npos) << stats.out;
  EXPECT_EQ(server.arrivals().size(), 16u);
  // An --exec job calls nothing keel knows of: the flag is refused, naming it.
  const ProcessRun exec = keel(
      {"jobs", "--db", db, "work", "--queue", "q", "--exec", "true", "--adaptive-concurrency"});
  EXPECT_EQ(exec.status, 2);
  EXPECT_NE(exec.err.find("--adaptive-concurrency"), std::string::npos) << exec.err;
}

TEST(KeelCall, BadArgumentsExitTwoNamingTheFlag) {
  struct Case {
    std::vector<std::string> args;
    std::string flag;
  };
  const std::string url = "http://127.0.0.1:9/";
  const std::vector<Case> cases = {
      {{"call", "--deadline", "5x", url}, "--deadline"},
      {{"call", "--per-try-timeout", "fast", url}, "--per-try-timeout"},
      {{"call", "--connect-timeout", "-1s", url}, "--connect-timeout"},
      {{"call", "--backoff-base", "0s", url}, "--backoff-base"},
      {{"call", "--backoff-base", "1s", "--backoff-cap", "10ms", url}, "--backoff-cap"},
      {{"call", "--retry-after-cap", "1y", url}, "--retry-after-cap"},
      {{"call", "--jitter", "wild", url}, "--jitter"},
      {{"call", "--max-attempts", "0", url}, "--max-attempts"},
      {{"call", "--max-attempts", "many", url}, "--max-attempts"},
      {{"call", "-H", "no-colon-here", url}, "--header"},
      {{"call", "-d", "@/nonexistent/keel-e2e-body", url}, "--data"},
      {{"call", "--idempotency-key", "", url}, "--idempotency-key"},
      {{"call", "-X", "GE T", url}, "--request"},
      {{"call", "--duplicate-is-success", "200", url}, "--duplicate-is-success"},
      {{"call", "--duplicate-is-success", "4090:exists", url}, "--duplicate-is-success"},
      {{"call", "--duplicate-is-success", ":exists", url}, "--duplicate-is-success"},
      {{"call", "ftp://127.0.0.1/"}, "URL"},
      {{"call"}, "URL"},
      {{"call", "--no-such-flag", url}, "--no-such-flag"},
  };
  for (const Case& c : cases) {
    const ProcessRun r = keel(c.args);
    EXPECT_EQ(r.status, 2) << c.flag << ": " << r.err;
    EXPECT_NE(r.err.find(c.flag), std::string::npos) << r.err;
    EXPECT_EQ(r.out, "") << c.flag;
  }
}

TEST(KeelCall, HelpDocumentsTheExitStatuses) {
  const ProcessRun r = keel({"call", "--help"});
  EXPECT_EQ(r.status, 0);
  for (const char* text : {"Exit status", "--max-attempts", "--idempotency-key", "--jitter",
                           "--duplicate-is-success", "  5  gave up because", "  6  not retried"}) {
    EXPECT_NE(r.out.find(text), std::string::npos) << text;
  }
}

// `keel-demo upstream` as a process: read its port from stdout, call it, read its log, stop it.
// --hedge: the first request hangs, the hedge sent after the delay answers at once.
TEST(KeelCallHedge, AHedgeAnswersWhenTheFirstAttemptHangs) {
  FaultServer server({.script = "hang,200/body=hedged"});
  server.start();
  const auto began = std::chrono::steady_clock::now();
  const ProcessRun r = keel(call({"--hedge", "100ms", server.url("/slow")}));
  const auto took = std::chrono::steady_clock::now() - began;
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "hedged\n");
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 2u);
  // In either order: on a busy machine the hedge can reach the server first (and hang).
  std::vector<std::string> attempts = {header(arrivals[0], "Keel-Attempt"),
                                       header(arrivals[1], "Keel-Attempt")};
  std::sort(attempts.begin(), attempts.end());
  EXPECT_EQ(attempts, (std::vector<std::string>{"1", "2"}));
  // The answer came after about the delay, not after the first attempt's 10 s timeout.
  EXPECT_LT(took, std::chrono::seconds(5));
}

TEST(KeelCallHedge, APostWithItsKeyIsHedgedWithTheSameKey) {
  FaultServer server({.script = "hang,201/body=created"});
  server.start();
  const ProcessRun r = keel(call({"-X", "POST", "-d", "amount=5", "--idempotency-key", "pay-42",
                                  "--hedge", "100ms", server.url("/pay")}));
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "created\n");
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 2u);
  EXPECT_EQ(header(arrivals[0], "Idempotency-Key"), "pay-42");
  EXPECT_EQ(header(arrivals[1], "Idempotency-Key"), "pay-42");
  EXPECT_EQ(arrivals[1].body, "amount=5");
}

TEST(KeelCallHedge, APostWithoutAKeyIsNeverHedged) {
  FaultServer server({.script = "200/delay=400ms/body=slow"});
  server.start();
  const ProcessRun r = keel(call({"-X", "POST", "-d", "x", "--idempotency-key", "off", "--hedge",
                                  "50ms", server.url("/pay")}));
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "slow\n");
  EXPECT_EQ(server.arrivals().size(), 1u);
}

TEST(KeelCallHedge, AnAnswerBeforeTheDelaySendsNoHedge) {
  FaultServer server({.script = "200"});
  server.start();
  // A delay no first answer on loopback takes, even from a sanitizer build on a busy machine;
  // the call ends at the answer, not at the delay.
  const ProcessRun r = keel(call({"--hedge", "10s", "--max-hedges", "3", server.url("/")}));
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(server.arrivals().size(), 1u);
}

TEST(KeelCallHedge, BadHedgeFlagsExitTwoNamingTheFlag) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--hedge", "5"}, "keel call: --hedge has no unit"},
      {{"--hedge", "0ms"}, "keel call: --hedge must be greater than zero (got '0ms')"},
      {{"--hedge", "100ms", "--max-hedges", "0"},
       "keel call: --max-hedges must be between 1 and 10 (got '0')"},
      {{"--hedge", "100ms", "--max-hedges", "x"},
       "keel call: --max-hedges must be a whole number (got 'x')"},
      {{"--max-hedges", "2"}, "keel call: --max-hedges needs --hedge DELAY (got '2')"},
  };
  for (const auto& [flags, message] : cases) {
    std::vector<std::string> args = flags;
    args.push_back("http://127.0.0.1:1/");
    const ProcessRun r = keel(call(args));
    EXPECT_EQ(r.status, 2) << message;
    EXPECT_TRUE(r.err.starts_with(message)) << r.err;
  }
}

TEST(KeelUpstream, ServesTheScriptAndReportsWhatItSaw) {
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    ::dup2(pipe_fds[1], 1);
    ::close(pipe_fds[0]);
    ::execl(KEEL_DEMO_BINARY, KEEL_DEMO_BINARY, "upstream", "--script", "503*2,200/body=up",
            "--for", "50s", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(pipe_fds[1]);
  std::string line;
  char c;
  while (::read(pipe_fds[0], &c, 1) == 1 && c != '\n') line.push_back(c);
  ::close(pipe_fds[0]);
  const std::string marker = "http://127.0.0.1:";
  const auto at = line.find(marker);
  ASSERT_NE(at, std::string::npos) << line;
  const std::string port = line.substr(at + marker.size(), line.find(' ', at) - at - marker.size());
  const std::string base = "http://127.0.0.1:" + port;

  const ProcessRun r = keel(call({"-d", "x", base + "/pay"}));
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "up\n");
  const ProcessRun log = keel({"call", base + "/_keel/log"});
  EXPECT_EQ(log.status, 0);
  EXPECT_NE(log.out.find("\"keel_attempt\":3"), std::string::npos) << log.out;
  EXPECT_EQ(log.out.find("\"keel_attempt\":4"), std::string::npos) << log.out;

  ::kill(pid, SIGTERM);
  int wstatus = 0;
  ::waitpid(pid, &wstatus, 0);
  EXPECT_TRUE(WIFEXITED(wstatus));
  EXPECT_EQ(WEXITSTATUS(wstatus), 0);
}

TEST(KeelUpstream, InvalidScriptExitsTwoNamingTheFlag) {
  const ProcessRun r = keel_demo({"upstream", "--script", "503/retry-after=soon"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--script"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("retry-after"), std::string::npos) << r.err;
}

}  // namespace
