// Careless and hostile input on the caller's side, through the real keel binary: the user's own
// Idempotency-Key, invalid URLs, flags that must be usage errors naming the flag, a large
// response streamed to -o FILE or stdout with bounded memory, and response heads too large to
// take. Upstreams on loopback: FaultServer, or RawHttpServer for what FaultServer cannot send.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "integration/support/loopback_socket.hpp"
#include "keel/faults/fault_server.hpp"
#include "raw_http_server.hpp"
#include "run_keel.hpp"

namespace {

using keel::faults::Arrival;
using keel::faults::FaultServer;
using keel::test::KeelRun;
using keel::test::RawHttpServer;
using keel::test::response_head;
using keel::test::run_keel;
using keel::test::TempDir;

std::vector<std::string> call(std::vector<std::string> extra) {
  std::vector<std::string> args = {"call", "--backoff-base", "1ms", "--backoff-cap", "5ms"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

std::vector<std::string> keys_of(const Arrival& a) {
  std::vector<std::string> keys;
  for (const auto& [name, value] : a.headers) {
    if (keel::http::same_header_name(name, "Idempotency-Key")) keys.push_back(value);
  }
  return keys;
}

TEST(KeelCallInput, TheUsersKeyIsTheOneSentOnceOnEveryAttempt) {
  const std::vector<std::vector<std::string>> cases = {
      {"-X", "POST", "-H", "Idempotency-Key: charge-1"},
      {"-X", "POST", "-H", "idempotency-key: charge-1"},
      {"-X", "POST", "-H", "IDEMPOTENCY-KEY:charge-1", "--idempotency-key", "off"},
      {"-X", "PATCH", "-H", "Idempotency-Key: charge-1", "--idempotency-key", "charge-1"},
      {"-d", "x", "-H", "Idempotency-Key:   charge-1  ", "--idempotency-key", "auto"},
      {"-d", "x", "--idempotency-key", "charge-1"},
      {"-X", "DELETE", "-H", "Idempotency-Key: charge-1", "-H", "idempotency-key: charge-1"},
      // One key in its canonical form: "charge-1" is charge-1 (keel/core/idempotency_key.hpp).
      {"-d", "x", "--idempotency-key", "\"charge-1\""},
      {"-X", "POST", "-H", "Idempotency-Key: \"charge-1\"", "--idempotency-key", "charge-1"},
  };
  for (const auto& c : cases) {
    FaultServer server({.script = "drop,200"});
    server.start();
    std::vector<std::string> args = c;
    args.push_back(server.url("/pay"));
    const KeelRun r = run_keel(call(args));
    const std::string label = c[1] + " " + c[3];
    EXPECT_EQ(r.status, 0) << label << ": " << r.err;
    const auto arrivals = server.arrivals();
    ASSERT_EQ(arrivals.size(), 2u) << label << ": the key makes the dropped request repeatable";
    for (const Arrival& a : arrivals) {
      EXPECT_EQ(keys_of(a), std::vector<std::string>{"charge-1"}) << label;
    }
  }
}

TEST(KeelCallInput, BadKeysAndConflictingKeysExitTwoBeforeSending) {
  FaultServer server({.script = "200"});
  server.start();
  const std::string url = server.url("/pay");
  const std::string long_key(256, 'k');
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"-d", "x", "-H", "Idempotency-Key: a", "--idempotency-key", "b"}, "--idempotency-key"},
      {{"-d", "x", "-H", "Idempotency-Key: a", "-H", "idempotency-key: b"}, "--header"},
      {{"-d", "x", "-H", "Idempotency-Key: " + long_key}, "--header"},
      {{"-d", "x", "--idempotency-key", long_key}, "--idempotency-key"},
      {{"-d", "x", "--idempotency-key",
        "a\x01"
        "b"},
       "--idempotency-key"},
      {{"-d", "x", "--idempotency-key", "a\nb"}, "--idempotency-key"},
      {{"-d", "x", "-H", "Idempotency-Key: a\x7f"}, "--header"},
      {{"-d", "x", "-H", "Idempotency-Key:"}, "--header"},
      // What keel-demo serve would refuse (dead on the first attempt) is refused here.
      {{"-d", "x", "--idempotency-key", "\"open"}, "--idempotency-key"},
      {{"-d", "x", "--idempotency-key", "\"a\"b"}, "--idempotency-key"},
      {{"-d", "x", "-H", "Idempotency-Key: a b"}, "--header"},
      {{"-d", "x", "-H", "Idempotency-Key: a,b"}, "--header"},
      {{"-d", "x", "--idempotency-key", "caf\xc3\xa9"}, "--idempotency-key"},
      {{"-H", "X-A: v\r\nX-Injected: 1"}, "--header"},
      {{"-H", "Bad Name: v"}, "--header"},
      {{"-H", ": v"}, "--header"},
  };
  for (const auto& [extra, flag] : cases) {
    std::vector<std::string> args = extra;
    args.push_back(url);
    const KeelRun r = run_keel(call(args));
    EXPECT_EQ(r.status, 2) << extra.back() << ": " << r.err;
    EXPECT_NE(r.err.find(flag), std::string::npos) << r.err;
  }
  EXPECT_EQ(server.arrivals().size(), 0u);
  // The longest key is fine.
  const KeelRun ok = run_keel(call({"-d", "x", "--idempotency-key", std::string(255, 'k'), url}));
  EXPECT_EQ(ok.status, 0) << ok.err;
}

TEST(KeelCallInput, InvalidUrlsExitTwoAtOnceNamingTheProblem) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"http://", "no host"},
      {"http://:80/", "no host"},
      {"http://127.0.0.1:99999/", "99999"},
      {"http://127.0.0.1:0/", "out of range"},
      {"http://127.0.0.1:8o/", "port"},
      {"http://127.0.0.1:/", "port"},
      {"http://[::1", "']'"},
      {"http://[::1]x/", "after the IPv6"},
      {"http://a b/", "space"},
      {"http:///path", "no host"},
      {"ftp://127.0.0.1/", "scheme"},
      {"127.0.0.1:8080/", "scheme"},
      {"http://bad_host!@/", "no host"},
      {"", "empty"},
      // What libcurl cannot send is refused here, not attempted and retried.
      {"http://a!b.test/", "contains '!'"},
      {"http://a,b.test/", "contains ','"},
      {"http://b\xFC"
       "cher.test/",
       "byte 0xfc at byte 8 that is not UTF-8"},
      {"http://127.0.0.1/\xFF", "byte 0xff at byte 17 that is not UTF-8"},
      {"http://a\xE2\x80\xA8"
       "b.test/",
       "not a valid internationalised domain name"},
      {"http://a\x01b/", "control character"},
      {"http://a\tb/", "control character"},
      {"http://127.0.0.1:65536/", "out of range"},
      {"http://u:p@127.0.0.1:99999/", "out of range"},
  };
  for (const auto& [url, problem] : cases) {
    // "At once": a keel that tried to connect would wait out the 20 s connect timeout, while a
    // sanitizer build on a busy machine can take a second or more just to start and exit.
    const auto began = std::chrono::steady_clock::now();
    const KeelRun r = run_keel(call({"--connect-timeout", "20s", url}));
    const auto took = std::chrono::steady_clock::now() - began;
    EXPECT_EQ(r.status, 2) << url << ": " << r.err;
    EXPECT_NE(r.err.find("URL"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(problem), std::string::npos) << url << ": " << r.err;
    EXPECT_EQ(r.err.find("attempt"), std::string::npos)
        << "no attempt for " << url << ": " << r.err;
    EXPECT_LT(took, std::chrono::seconds(10)) << url;
  }
  // Schemes are case-insensitive.
  FaultServer server({.script = "200/body=up"});
  server.start();
  for (const char* scheme : {"HTTP", "Http", "hTtP"}) {
    std::string url = server.url("/");
    url.replace(0, 4, scheme);
    const KeelRun r = run_keel(call({url}));
    EXPECT_EQ(r.status, 0) << url << ": " << r.err;
    EXPECT_EQ(r.out, "up\n");
  }
  EXPECT_EQ(server.arrivals().size(), 3u);
}

// An internationalised host name is sent in its ASCII form whatever the locale (libcurl converts
// only in a UTF-8 one, and keel never calls setlocale): a name that exists is reached, one that
// does not is a permanent failure after one attempt (exit 3), never three transient ones (exit 4).
TEST(KeelCallInput, AnInternationalisedHostIsSentInItsAsciiForm) {
  FaultServer server({.script = "200/body=up"});
  server.start();
  const std::string port = std::to_string(server.port());
  // libcurl resolves every name under .localhost to the loopback address.
  const KeelRun ok =
      run_keel(call({"http://b\xC3\xBC"
                     "cher.localhost:" +
                     port + "/x"}));
  EXPECT_EQ(ok.status, 0) << ok.err;
  EXPECT_EQ(ok.out, "up\n");
  const auto arrivals = server.arrivals();
  ASSERT_EQ(arrivals.size(), 1u);
  EXPECT_EQ(keel::http::find_header(arrivals[0].headers, "Host").value_or(""),
            "xn--bcher-kva.localhost:" + port);
  // .test is reserved: the name does not exist.
  const KeelRun missing = run_keel(call({"-v", "--deadline", "20s",
                                         "http://b\xC3\xBC"
                                         "cher.test/"}));
  EXPECT_EQ(missing.status, 3) << missing.err;
  EXPECT_NE(missing.err.find("attempt 1:"), std::string::npos) << missing.err;
  EXPECT_EQ(missing.err.find("attempt 2:"), std::string::npos) << missing.err;
  EXPECT_NE(missing.err.find("xn--bcher-kva.test"), std::string::npos) << missing.err;
  EXPECT_NE(missing.err.find("(permanent)"), std::string::npos) << missing.err;
  // A userinfo is sent as credentials, an upper-case name is the same name.
  const KeelRun userinfo =
      run_keel(call({"http://u:p@B\xC3\x9C"
                     "CHER.localhost:" +
                     port + "/"}));
  EXPECT_EQ(userinfo.status, 0) << userinfo.err;
  ASSERT_EQ(server.arrivals().size(), 2u);
  EXPECT_EQ(keel::http::find_header(server.arrivals()[1].headers, "Authorization").value_or(""),
            "Basic dTpw");
}

// Values a flag cannot honour are refused with the flag's name and the value: durations below
// the millisecond the queue, libcurl and the timers count in (a --lease of 1ns rounded to 0 ran one
// job again and again), a lease shorter than a heartbeat's round trip, timeouts past libcurl's
// longest, rates whose replay times would overflow, numbers with a sign, space or exponent.
TEST(KeelFlags, ValuesAComponentCannotHonourAreRefusedNamingTheFlag) {
  TempDir dir;
  const std::string db = "sqlite:" + dir.file("q.db");
  struct Case {
    std::vector<std::string> args;
    std::string flag;
    std::string value;
    std::string says;
  };
  std::vector<Case> cases;
  const auto work = [&](const std::string& flag, const std::string& value, const std::string& says,
                        std::vector<std::string> handler = {"--exec", "true"}) {
    std::vector<std::string> args = {"jobs", "--db", db, "work", "--queue", "q", flag, value};
    args.insert(args.end(), handler.begin(), handler.end());
    cases.push_back({args, flag, value, says});
  };
  for (const char* value : {"1ns", "99ms", "0s", "-1s", "99999999999h"}) {
    work("--lease", value, std::string(value) == "0s" ? "greater than zero" : "");
  }
  work("--lease", "1ns", "at least 100ms");
  for (const char* flag : {"--backoff-base", "--backoff-cap", "--poll", "--idle-poll",
                           "--max-db-outage", "--max-age", "--timeout"}) {
    work(flag, "999us", "at least 1ms");
    work(flag, "0s", "greater than zero");
    work(flag, "99999999999h", "too large");
  }
  for (const char* flag : {"--grace", "--retain-done"}) work(flag, "1ns", "0 or at least 1ms");
  for (const char* value : {"forevermore", "Forever", "", "-1h"}) {
    work("--retain-done", value, "or 'forever'");
  }
  work("--dead-letter-warning", "1ns", "0 or at least 1ms",
       {"--exec", "true", "--dead-letter-retention", "1h"});
  work("--dead-letter-retention", "1ns", "at least 1ms");
  work("--timeout", "597h", "at most 596h", {"--deliver", "http://127.0.0.1:9/"});
  work("--timeout", "1ns", "libcurl", {"--deliver", "http://127.0.0.1:9/"});
  for (const char* value : {"1e2", "nan", "-1", "1001", "0x10", " 1", ""}) {
    work("--retry-budget", value, "ratio");
  }
  for (const char* value : {":+80", ":65536", ":-1", ": 80", "127.0.0.1:", "80"}) {
    work("--metrics-listen", value, "");
  }
  for (const char* value : {"0", "257", "-1"}) work("--concurrency", value, "");
  for (const char* value : {"0", "1001"}) work("--batch", value, "");
  work("--deliver",
       "http://b\xFC"
       "cher.test/",
       "not UTF-8", {});
  work("--deliver", "http://a!b.test/", "contains '!'", {});
  for (const char* value : {"1ns", "999us", "-1s"}) {
    cases.push_back(
        {{"jobs", "--db", db, "enqueue", "--queue", "q", "--payload", "{}", "--delay", value},
         "--delay",
         value,
         ""});
  }
  for (const char* value : {"0", "-1", "99999999999"}) {
    cases.push_back({{"jobs", "--db", db, "enqueue", "--queue", "q", "--payload", "{}",
                      "--max-attempts", value},
                     "--max-attempts",
                     value,
                     ""});
  }
  cases.push_back({{"jobs", "--db", db, "stats", "--dead-letter-retention", "1ns"},
                   "--dead-letter-retention",
                   "1ns",
                   "at least 1ms"});
  for (const char* value : {"0.0001/s", "0.0009/h", "0/s", "-1/s", "1e3/s", "nan/s", "5"}) {
    cases.push_back({{"dlq", "--db", db, "replay", "--all", "--rate", value}, "--rate", value, ""});
  }
  for (const char* value : {"+5", " 5", "0", "1e3", "0x10", "99999999999999999999"}) {
    cases.push_back({{"dlq", "--db", db, "replay", value}, "job id", value, "positive integer"});
    cases.push_back({{"dlq", "--db", db, "show", value}, "job id", value, "positive integer"});
  }
  cases.push_back(
      {{"dlq", "--db", db, "discard", "--reason", "M\xFCller"}, "--reason", "", "UTF-8"});
  for (const char* value : {"-1h", "99999999999h", "1e3s", "2026-13-01T00:00:00Z"}) {
    cases.push_back(
        {{"dlq", "--db", db, "replay", "--died-after", value}, "--died-after", value, ""});
  }
  const std::string url = "http://127.0.0.1:9/";
  for (const char* flag : {"--deadline", "--per-try-timeout", "--connect-timeout", "--hedge"}) {
    cases.push_back({{"call", flag, "999us", url}, flag, "999us", "at least 1ms"});
  }
  for (const char* flag : {"--per-try-timeout", "--connect-timeout"}) {
    cases.push_back({{"call", flag, "597h", url}, flag, "597h", "at most 596h"});
  }
  for (const char* value : {"0", "11", "-1", "1.5"}) {
    cases.push_back(
        {{"call", "--hedge", "10ms", "--max-hedges", value, url}, "--max-hedges", value, ""});
  }
  for (const Case& c : cases) {
    const std::string label =
        c.args[c.args[0] == "call" ? 1 : 3] + " " + c.flag + " '" + c.value + "'";
    const KeelRun r = run_keel(c.args);
    EXPECT_EQ(r.status, 2) << label << ": " << r.err;
    EXPECT_NE(r.err.find(c.flag), std::string::npos) << label << ": " << r.err;
    if (!c.value.empty()) {
      EXPECT_NE(r.err.find(c.value), std::string::npos) << label << ": " << r.err;
    }
    if (!c.says.empty()) {
      EXPECT_NE(r.err.find(c.says), std::string::npos) << label << ": " << r.err;
    }
    EXPECT_EQ(r.out, "") << label;
  }
  EXPECT_FALSE(std::filesystem::exists(dir.file("q.db"))) << "nothing was written";
  // The edges are accepted.
  ASSERT_EQ(
      run_keel({"jobs", "--db", db, "enqueue", "--queue", "q", "--payload", "{}", "--delay", "1ms"})
          .status,
      0);
  const KeelRun edges = run_keel({"jobs",
                                  "--db",
                                  db,
                                  "work",
                                  "--queue",
                                  "q",
                                  "--exec",
                                  "true",
                                  "--lease",
                                  "100ms",
                                  "--poll",
                                  "1ms",
                                  "--idle-poll",
                                  "1ms",
                                  "--backoff-base",
                                  "1ms",
                                  "--backoff-cap",
                                  "1ms",
                                  "--grace",
                                  "0s",
                                  "--retain-done",
                                  "0s",
                                  "--timeout",
                                  "1ms",
                                  "--retry-budget",
                                  "1000",
                                  "--metrics-listen",
                                  "127.0.0.1:0",
                                  "--exit-when-idle"});
  EXPECT_EQ(edges.status, 0) << edges.err;
  EXPECT_EQ(
      run_keel({"dlq", "--db", db, "replay", "--all", "--rate", "0.001/h", "--dry-run"}).status, 0);
}

// Every numeric and duration flag of keel call, keel sim run and keel-demo core, and the other
// flags that took a bad value silently: a usage error (2) naming the flag and the value.
TEST(KeelFlags, BadValuesExitTwoNamingTheFlagAndTheValue) {
  TempDir dir;
  const std::string url = "http://127.0.0.1:9/";
  struct Case {
    std::vector<std::string> args;
    std::string flag;
    std::string value;
    bool demo = false;  // keel-demo's flag, not keel's
  };
  std::vector<Case> cases;
  for (const char* flag : {"--deadline", "--per-try-timeout", "--connect-timeout", "--backoff-base",
                           "--backoff-cap", "--retry-after-cap"}) {
    for (const char* value : {"nan", "inf", "-1s", "1e3s", "99999999999h", "1s5", "5 s", "0x10s",
                              "+1s", "1s ", "NaNs", ""}) {
      cases.push_back({{"call", flag, value, url}, flag, value});
    }
  }
  for (const char* value :
       {"0", "-1", "1.5", "1e3", "99999999999", "3x", "nan", "inf", " 3", "0x3", "+3", ""}) {
    cases.push_back({{"call", "--max-attempts", value, url}, "--max-attempts", value});
  }
  cases.push_back({{"call", "-d", "@" + dir.path().string(), url}, "--data", dir.path().string()});
  cases.push_back({{"call", "-d", "@" + dir.file("missing"), url}, "--data", dir.file("missing")});
  for (const char* value :
       {"-1", "1.5", "nan", "18446744073709551616", "12abc", "0x10", "+1", ""}) {
    cases.push_back({{"sim", "run", "--scenario", "herd", "--seed", value}, "--seed", value});
    cases.push_back({{"core", "--seed", value}, "--seed", value, true});
  }
  for (const char* value : {"nan", "inf", "-inf", "-0.1", "1.01", "2", "1e-3", "0.5x", "", "."}) {
    cases.push_back({{"core", "--failure-rate", value}, "--failure-rate", value, true});
  }
  for (const char* value : {"0", "-1", "1001", "nan", "1.5"}) {
    cases.push_back({{"core", "--operations", value}, "--operations", value, true});
  }
  for (const char* value : {"0", "101", "-1", "nan"}) {
    cases.push_back({{"core", "--max-attempts", value}, "--max-attempts", value, true});
  }
  for (const char* value : {"0s", "-1s", "nan", "41s", "5x"}) {
    cases.push_back({{"sim", "run", "--scenario", "blip", "--trigger", value}, "--trigger", value});
  }
  const std::string db = "sqlite:" + dir.file("q.db");
  // Rates that mean no limit in practice, or are not rates: refused by keel call and by keel jobs
  // work alike (an empty value too: it was no limit at all for jobs work).
  for (const char* value :
       {"1e-10", "1e-8/h", "0.5/d", "1e3/s", "0", "-5/s", "nan", "inf/s", "5000000/s", "1/x", ""}) {
    cases.push_back({{"call", "--rate-limit", value, url}, "--rate-limit", value});
    cases.push_back(
        {{"jobs", "--db", db, "work", "--queue", "q", "--deliver", url, "--rate-limit", value},
         "--rate-limit",
         value});
  }
  for (const std::string& value : {std::string(), std::string(256, 'k'), std::string("a\tb")}) {
    cases.push_back(
        {{"jobs", "enqueue", "--db", db, "--queue", "q", "--payload", "{}", "--key", value},
         "--key",
         ""});
  }
  for (const Case& c : cases) {
    const KeelRun r = run_keel(c.args, {.binary = c.demo ? KEEL_DEMO_BINARY : KEEL_BINARY});
    EXPECT_EQ(r.status, 2) << c.flag << " '" << c.value << "': " << r.err;
    EXPECT_NE(r.err.find(c.flag), std::string::npos) << c.flag << " '" << c.value << "': " << r.err;
    if (!c.value.empty()) {
      EXPECT_NE(r.err.find(c.value), std::string::npos) << c.flag << ": " << r.err;
    }
    EXPECT_EQ(r.out, "") << c.flag << " '" << c.value << "'";
  }
  // The valid edges are accepted.
  EXPECT_EQ(run_keel({"core", "--failure-rate", "1", "--seed", "18446744073709551615"},
                     {.binary = KEEL_DEMO_BINARY})
                .status,
            0);
  EXPECT_EQ(
      run_keel({"core", "--failure-rate", "0", "--seed", "0"}, {.binary = KEEL_DEMO_BINARY}).status,
      0);
  EXPECT_EQ(run_keel({"sim", "run", "--scenario", "herd", "--seed", "0"}).status, 0);
}

constexpr std::uint64_t kBig = std::uint64_t{300} << 20;  // 300 MiB
// What a streamed body may add to the peak RSS of the same call with a 1 KiB body: far below the
// body's size. Measured against that baseline, not as an absolute figure, because a sanitizer
// build starts several times larger than a release build.
constexpr long kGrowthLimitKiB = 32 * 1024;

// These tests are about memory, not time: a sanitizer build writing 300 MiB on a busy machine
// may take longer than keel call's default per-try timeout (9 s).
std::vector<std::string> call_big(std::vector<std::string> extra) {
  extra.insert(extra.begin(), {"--per-try-timeout", "120s", "--deadline", "300s"});
  return call(std::move(extra));
}

// The peak RSS of the same call with a 1 KiB body, sent to the same place.
long baseline_peak_kib(const std::vector<std::string>& output_flags,
                       const keel::test::KeelRunOptions& options = {}) {
  RawHttpServer small({{response_head(200, 1024), 1024, 'b'}});
  std::vector<std::string> extra = output_flags;
  extra.push_back(small.url("/small"));
  const KeelRun r = run_keel(call_big(extra), options);
  EXPECT_EQ(r.status, 0) << r.err;
  return r.peak_rss_kib;
}

TEST(KeelCallBigResponse, OutputFileIsStreamedAndHoldsOnlyTheFinalAttempt) {
  TempDir dir;
  RawHttpServer server(
      {{response_head(503, 1 << 20), 1 << 20, 'a'}, {response_head(200, kBig), kBig, 'c'}});
  const std::string file = dir.file("big.bin");
  const KeelRun r = run_keel(call_big({"-o", file, server.url("/big")}));
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(std::filesystem::file_size(file), kBig);
  std::ifstream in(file, std::ios::binary);
  char first = 0;
  in.get(first);
  EXPECT_EQ(first, 'c');
  const long baseline = baseline_peak_kib({"-o", dir.file("small.bin")});
  EXPECT_LT(r.peak_rss_kib - baseline, kGrowthLimitKiB)
      << "peak RSS " << r.peak_rss_kib << " KiB, " << baseline << " KiB with a 1 KiB body";
  std::printf("keel call -o: 300 MiB body, peak RSS %ld KiB (1 KiB body: %ld KiB)\n",
              r.peak_rss_kib, baseline);
  std::filesystem::remove(dir.file("small.bin"));
  // Nothing left behind but the file.
  std::size_t entries = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir.path())) ++entries;
  EXPECT_EQ(entries, 1u);
}

TEST(KeelCallBigResponse, StdoutIsStreamedWithBoundedMemory) {
  TempDir dir;
  RawHttpServer server({{response_head(200, kBig), kBig, 'd'}});
  const std::string out = dir.file("stdout");
  const KeelRun r = run_keel(call_big({"-i", server.url("/big")}), {.stdout_path = out});
  EXPECT_EQ(r.status, 0) << r.err;
  const std::string head = response_head(200, kBig);
  EXPECT_EQ(std::filesystem::file_size(out), head.size() + kBig);
  std::ifstream in(out, std::ios::binary);
  std::string start(head.size(), '\0');
  in.read(start.data(), static_cast<std::streamsize>(start.size()));
  EXPECT_TRUE(start.starts_with("HTTP/1.1 200 X\r\n")) << start;
  const long baseline = baseline_peak_kib({"-i"}, {.stdout_path = dir.file("small")});
  EXPECT_LT(r.peak_rss_kib - baseline, kGrowthLimitKiB)
      << "peak RSS " << r.peak_rss_kib << " KiB, " << baseline << " KiB with a 1 KiB body";
  std::printf("keel call > stdout: 300 MiB body, peak RSS %ld KiB (1 KiB body: %ld KiB)\n",
              r.peak_rss_kib, baseline);
}

TEST(KeelCallBigResponse, AFailedCallLeavesNoOutputFile) {
  TempDir dir;
  RawHttpServer server({{response_head(503, 1000), 1000}});
  const std::string file = dir.file("resp");
  const KeelRun r = run_keel(call({"--max-attempts", "2", "-o", file, server.url("/")}));
  EXPECT_EQ(r.status, 4) << r.err;
  // The final (503) response is still written, as without -o it is printed.
  EXPECT_EQ(std::filesystem::file_size(file), 1000u);
  const keel::test::ClosedPort gone;
  const std::string url = gone.url("/");
  const std::string none = dir.file("none");
  EXPECT_EQ(run_keel(call({"--max-attempts", "1", "-o", none, url})).status, 4);
  EXPECT_FALSE(std::filesystem::exists(none));
  std::size_t entries = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir.path())) ++entries;
  EXPECT_EQ(entries, 1u) << "no temporary file left behind";
}

TEST(KeelCallHostileServer, AnOversizedResponseHeadIsAClearErrorNotRetried) {
  const std::vector<std::string> heads = {
      "X-Big: " + std::string(10 << 20, 'h') + "\r\n",
      "Retry-After: " + std::string(10 << 20, '9') + "\r\n",
      "X-Medium: " + std::string(80 << 10, 'm') + "\r\n",
  };
  for (const std::string& extra : heads) {
    RawHttpServer server({{response_head(503, 2, extra) + "no"}});
    const KeelRun r = run_keel(call({server.url("/")}));
    EXPECT_EQ(r.status, 3) << r.err;
    EXPECT_EQ(server.requests(), 1);
    EXPECT_NE(r.err.find("header"), std::string::npos) << r.err.substr(0, 300);
    EXPECT_EQ(r.err.find("Out of memory"), std::string::npos) << r.err.substr(0, 300);
  }
}

TEST(KeelCallHostileServer, AnAbsurdRetryAfterRunsIntoTheDeadline) {
  for (const char* value :
       {"9223372037", "99999999999999999999", "Fri, 31 Dec 9999 23:59:59 GMT"}) {
    RawHttpServer server(
        {{response_head(503, 2, std::string("Retry-After: ") + value + "\r\n") + "no"},
         {response_head(200, 2) + "ok"}});
    const KeelRun r = run_keel(call({"--deadline", "5s", server.url("/")}));
    EXPECT_EQ(r.status, 5) << value << ": " << r.err;
    EXPECT_EQ(server.requests(), 1) << value;
  }
}

}  // namespace
