// Outcomes whose texts are not UTF-8, end to end, on SQLite and on PostgreSQL (whose TEXT refuses
// such bytes and NUL): `keel jobs work --deliver` against a loopback receiver whose permanent 400s
// carry bodies in other bytes, and `--exec` commands whose stderr is Latin-1, cut inside a
// character or holds a NUL. Each job is attempted once and dead-lettered with its own reason
// ("permanent: ..."), stored as valid UTF-8; none is run again because its outcome could not be
// recorded. And internationalised host names: `--deliver http://bücher.localhost:PORT/` is
// delivered to the host's ASCII form, `http://bücher.test/` dead-lettered at once.
#include <gtest/gtest.h>
#include <httplib.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "keel/core/text.hpp"
#include "keel/queue/queue.hpp"
#include "support/jobs_process_support.hpp"

namespace keel::store {
namespace {

using test_jobs::CmdResult;

// A receiver that answers POST /NAME with 400 and the body registered under NAME, or 200 when
// none is; it counts the requests per path and keeps the last Host header.
class BytesReceiver {
 public:
  explicit BytesReceiver(std::map<std::string, std::string> bodies) : bodies_(std::move(bodies)) {
    server_.Post(R"(/(\w+))", [this](const httplib::Request& req, httplib::Response& res) {
      const std::string name = req.matches[1];
      std::lock_guard lock(mu_);
      ++requests_[name];
      host_ = req.get_header_value("Host");
      const auto it = bodies_.find(name);
      if (it == bodies_.end()) {
        res.status = 200;
        return;
      }
      res.status = 400;
      res.set_content(it->second, "text/plain");
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~BytesReceiver() {
    server_.stop();
    thread_.join();
  }
  [[nodiscard]] int port() const { return port_; }
  [[nodiscard]] int requests(const std::string& name) {
    std::lock_guard lock(mu_);
    return requests_[name];
  }
  [[nodiscard]] std::string host() {
    std::lock_guard lock(mu_);
    return host_;
  }

 private:
  httplib::Server server_;
  std::map<std::string, std::string> bodies_;
  int port_ = 0;
  std::thread thread_;
  std::mutex mu_;
  std::map<std::string, int> requests_;  // guarded by mu_
  std::string host_;                     // guarded by mu_
};

class OutcomeTextTest : public test_jobs::JobsHarness<test::BackendTest> {
 protected:
  // Enqueues one job of up to three attempts on `queue`; its id.
  std::int64_t enqueue(const std::string& queue) {
    const CmdResult r = keel({"jobs", "--db", url_text(), "enqueue", "--queue", queue, "--payload",
                              R"({"n":1})", "--max-attempts", "3"});
    EXPECT_EQ(r.status, 0) << r.err;
    return std::stoll(r.out);
  }
  // Works `queue` until it is idle, with a short lease: an outcome that could not be recorded
  // would show as a second run within about a second.
  CmdResult work(const std::string& queue, std::vector<std::string> handler) {
    std::vector<std::string> args = {"jobs",           "--db",  url_text(),        "work",
                                     "--queue",        queue,   "--lease",         "1s",
                                     "--backoff-base", "10ms",  "--poll",          "10ms",
                                     "--backoff-cap",  "100ms", "--exit-when-idle"};
    args.insert(args.end(), handler.begin(), handler.end());
    return keel(args);
  }
  // The job as stored, read through the library.
  Job stored(std::int64_t id) {
    auto conn = open_database(url());
    const std::optional<Job> job = JobQueue().get(*conn, id);
    EXPECT_TRUE(job.has_value());
    return job.value_or(Job{});
  }
  // The job ran once and is dead as permanent, every stored text valid UTF-8 within 2000 bytes;
  // returns its dead reason.
  std::string dead_once(std::int64_t id, const CmdResult& worker) {
    EXPECT_EQ(worker.status, 0) << worker.err;
    EXPECT_EQ(worker.err.find("recording the outcome failed"), std::string::npos) << worker.err;
    const Job job = stored(id);
    EXPECT_EQ(job.state, JobState::kDead);
    EXPECT_EQ(job.attempts, 1);
    EXPECT_TRUE(job.dead_reason.starts_with("permanent: ")) << job.dead_reason;
    for (const std::string* text : {&job.dead_reason, &job.last_error}) {
      EXPECT_TRUE(is_storable_text(*text)) << *text;
      EXPECT_LE(text->size(), 2000u);
    }
    EXPECT_EQ(job.history.size(), 1u);
    for (const JobAttempt& a : job.history) EXPECT_TRUE(is_storable_text(a.error)) << a.error;
    return job.dead_reason;
  }
};

const std::string kFffd = "\xEF\xBF\xBD";

TEST_P(OutcomeTextTest, APermanent400WhoseBodyIsNotUtf8IsDeliveredOnceAndDeadLetteredAsPermanent) {
  const std::map<std::string, std::string> bodies = {
      // The excerpt keeps 200 bytes: the 200th is the first of an "é".
      {"cut", std::string(199, 'x') + "\xC3\xA9 and more"},
      // ... or the third of a 4-byte character.
      {"cutfour", std::string(198, 'x') + "\xF0\x9F\x98\x80"},
      {"latin", "Fehler: ung\xFCltig"},
      {"nul", std::string("a\0b", 3)},
  };
  BytesReceiver receiver(bodies);
  const std::string base = "http://127.0.0.1:" + std::to_string(receiver.port()) + "/";
  std::map<std::string, std::string> reasons;
  for (const auto& [name, body] : bodies) {
    SCOPED_TRACE(name);
    const std::int64_t id = enqueue(name);
    reasons[name] = dead_once(id, work(name, {"--deliver", base + name}));
    EXPECT_EQ(receiver.requests(name), 1) << "a permanent 400 is delivered once";
    EXPECT_TRUE(reasons[name].starts_with("permanent: HTTP 400")) << reasons[name];
  }
  EXPECT_EQ(reasons["cut"], "permanent: HTTP 400 (permanent): " + std::string(199, 'x'));
  EXPECT_EQ(reasons["cutfour"], "permanent: HTTP 400 (permanent): " + std::string(198, 'x'));
  EXPECT_EQ(reasons["latin"], "permanent: HTTP 400 (permanent): Fehler: ung" + kFffd +
                                  "ltig [1 byte that was not UTF-8 text replaced]");
  EXPECT_EQ(reasons["nul"], "permanent: HTTP 400 (permanent): a" + kFffd +
                                "b [1 byte that was not UTF-8 text replaced]");
  // The operator's views show them.
  const CmdResult list = keel({"dlq", "--db", url_text(), "list"});
  EXPECT_EQ(list.status, 0) << list.err;
  EXPECT_NE(list.out.find("Fehler: ung" + kFffd + "ltig"), std::string::npos) << list.out;
}

TEST_P(OutcomeTextTest, AnExecCommandsStderrThatIsNotUtf8IsRecordedAndTheJobRunsOnce) {
  const std::filesystem::path runs = dir().path() / "runs";
  const std::string count_run = "echo run >> '" + runs.string() + "'; ";
  const std::map<std::string, std::string> commands = {
      {"latin", "printf 'Fehler: ung\\374ltig' >&2; exit 1"},
      // 601 bytes of stderr: the last 500 start inside an "é".
      {"cut",
       "i=0; while [ $i -lt 300 ]; do printf '\\303\\251' >&2; i=$((i+1)); done; "
       "printf '!' >&2; exit 1"},
      {"nul", "printf 'a\\000b' >&2; exit 1"},
  };
  std::map<std::string, std::string> reasons;
  for (const auto& [name, command] : commands) {
    SCOPED_TRACE(name);
    std::filesystem::remove(runs);
    const std::int64_t id = enqueue(name);
    reasons[name] = dead_once(id, work(name, {"--exec", count_run + command}));
    std::ifstream in(runs);
    int lines = 0;
    for (std::string line; std::getline(in, line);) ++lines;
    EXPECT_EQ(lines, 1) << "a command that exits 1 runs once";
  }
  EXPECT_EQ(reasons["latin"], "permanent: exit status 1: Fehler: ung" + kFffd +
                                  "ltig [1 byte that was not UTF-8 text replaced]");
  std::string tail;
  for (int i = 0; i < 249; ++i) tail += "\xC3\xA9";
  EXPECT_EQ(reasons["cut"], "permanent: exit status 1: " + tail + "!");
  EXPECT_EQ(reasons["nul"],
            "permanent: exit status 1: a" + kFffd + "b [1 byte that was not UTF-8 text replaced]");
}

TEST_P(OutcomeTextTest, AnInternationalisedHostIsDeliveredToItsAsciiFormOrDeadAtOnce) {
  BytesReceiver receiver({});
  const std::string port = std::to_string(receiver.port());
  // libcurl resolves every name under .localhost to the loopback address.
  const std::int64_t ok = enqueue("idn");
  const CmdResult delivered = work("idn", {"--deliver",
                                           "http://b\xC3\xBC"
                                           "cher.localhost:" +
                                               port + "/ok"});
  ASSERT_EQ(delivered.status, 0) << delivered.err;
  EXPECT_EQ(stored(ok).state, JobState::kDone) << delivered.err;
  EXPECT_EQ(receiver.requests("ok"), 1);
  EXPECT_EQ(receiver.host(), "xn--bcher-kva.localhost:" + port);
  // A name that does not exist (.test is reserved) is a permanent failure: dead at its first
  // attempt, no retry, no breaker.
  const std::int64_t missing = enqueue("nx");
  const std::string reason = dead_once(missing, work("nx", {"--deliver",
                                                            "http://b\xC3\xBC"
                                                            "cher.test/"}));
  EXPECT_TRUE(reason.starts_with("permanent: network: host not found")) << reason;
  EXPECT_NE(reason.find("xn--bcher-kva.test"), std::string::npos) << reason;
  // A URL with a byte that is not UTF-8 is refused at the door, before any job is leased.
  const CmdResult refused = work("nx", {"--deliver",
                                        "http://b\xFC"
                                        "cher.test/"});
  EXPECT_EQ(refused.status, 2);
  EXPECT_NE(refused.err.find("--deliver has a byte 0xfc at byte 8 that is not UTF-8"),
            std::string::npos)
      << refused.err;
}

INSTANTIATE_TEST_SUITE_P(Backends, OutcomeTextTest,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

}  // namespace
}  // namespace keel::store
