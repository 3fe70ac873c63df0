// Helpers for the tests that run `keel jobs` and `keel dlq` as real processes: a child process
// with its output in files, a loopback HTTP receiver that deduplicates by Idempotency-Key and
// can fail, go down or hang on command, and a fixture mixin that runs the CLI against a test
// database.
#pragma once

#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "keel/queue/queue.hpp"
#include "test_support.hpp"

extern char** environ;

namespace keel::store::test_jobs {

// A child process with its stdout and stderr in files.
class Process {
 public:
  Process(const std::vector<std::string>& args, const std::filesystem::path& dir,
          const std::string& tag) {
    out_ = dir / (tag + ".out");
    err_ = dir / (tag + ".err");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, out_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&actions, 2, err_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    std::vector<std::string> copy = args;
    std::vector<char*> argv;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&actions);
  }
  ~Process() {
    if (pid_ > 0 && !exited_) {
      ::kill(pid_, SIGKILL);
      (void)wait();
    }
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  [[nodiscard]] pid_t pid() const { return pid_; }
  void signal(int sig) const { ::kill(pid_, sig); }
  /// Exit status, or 128 + signal.
  int wait() {
    if (exited_) return status_;
    int st = 0;
    while (::waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
    }
    exited_ = true;
    status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    return status_;
  }
  /// Whether it has exited (reaped).
  bool poll() {
    if (exited_) return true;
    int st = 0;
    if (::waitpid(pid_, &st, WNOHANG) == pid_) {
      exited_ = true;
      status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    return exited_;
  }
  [[nodiscard]] std::string out() const { return slurp(out_); }
  [[nodiscard]] std::string err() const { return slurp(err_); }

 private:
  static std::string slurp(const std::filesystem::path& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = -1;
  std::filesystem::path out_, err_;
};

struct CmdResult {
  int status = -1;
  std::string out;
  std::string err;
};

// The receiver: POST /hook applies an effect once per Idempotency-Key (a repeat is answered 200
// without applying it again); a share of requests fail with 503 before anything is applied.
// /poison always answers 400. /always503 answers 503 until `fixed` is set. For outage drills,
// `outage` makes every /hook request answer 503 (kDown503) or hang until the outage ends
// (kHang, then 503, nothing applied), and stop_listening() / listen_again() close and reopen the
// port (connection refused in between).
class Receiver {
 public:
  enum Outage : int { kNone = 0, kDown503 = 1, kHang = 2 };

  /// `threads`: the server's thread pool, one thread per open connection (0: cpp-httplib's
  /// default, 8 or more); a fleet of workers keeps more connections alive than that.
  explicit Receiver(std::uint64_t seed = 2024, int threads = 0) : threads_(threads), rng_(seed) {
    listen(0);
  }
  ~Receiver() { stop_listening(); }
  [[nodiscard]] std::string url(const std::string& path) const {
    return "http://127.0.0.1:" + std::to_string(port_) + path;
  }

  void stop_listening() {
    if (!server_) return;
    server_->stop();
    thread_.join();
    server_.reset();
  }
  void listen_again() { listen(port_); }

  void set_outage(Outage o) {
    {
      std::lock_guard lock(mu);
      outage_ = o;
    }
    outage_changed_.notify_all();
  }

  [[nodiscard]] int total_requests() {
    std::lock_guard lock(mu);
    int n = 0;
    for (const auto& [k, c] : requests) n += c;
    return n;
  }

  std::atomic<double> fail_rate{0.0};
  std::atomic<bool> fixed{false};

  std::mutex mu;
  std::map<std::string, int> applied;    // key -> effects applied (guarded by mu)
  std::map<std::string, int> requests;   // key -> requests seen (guarded by mu)
  std::map<std::string, int> in_flight;  // key -> requests being handled (guarded by mu)
  int overlaps = 0;                      // a key handled twice at once (guarded by mu)
  int missing_key = 0;                   // requests without Idempotency-Key (guarded by mu)

 private:
  void listen(int port) {
    server_ = std::make_unique<httplib::Server>();
    if (threads_ > 0) {
      server_->new_task_queue = [n = threads_] {
        return new httplib::ThreadPool(static_cast<std::size_t>(n));
      };
    }
    server_->Post("/hook", [this](const httplib::Request& req, httplib::Response& res) {
      handle(req, res, /*poison=*/false, /*always_fail=*/false);
    });
    server_->Post("/poison", [this](const httplib::Request& req, httplib::Response& res) {
      handle(req, res, true, false);
    });
    server_->Post("/always503", [this](const httplib::Request& req, httplib::Response& res) {
      handle(req, res, false, !fixed.load());
    });
    if (port == 0) {
      port_ = server_->bind_to_any_port("127.0.0.1");
    } else {
      // The port was ours a moment ago; bounded retries while the kernel lets it go.
      for (int i = 0; i < 200 && !server_->bind_to_port("127.0.0.1", port); ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    thread_ = std::thread([this] { server_->listen_after_bind(); });
    while (!server_->is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }

  void handle(const httplib::Request& req, httplib::Response& res, bool poison, bool always_fail) {
    const std::string key = req.get_header_value("Idempotency-Key");
    bool fail = false;
    Outage outage = kNone;
    {
      std::unique_lock lock(mu);
      if (key.empty()) ++missing_key;
      ++requests[key];
      if (in_flight[key]++ > 0) ++overlaps;
      fail = std::uniform_real_distribution<double>(0, 1)(rng_) < fail_rate.load();
      outage = outage_;
      if (outage == kHang) {
        // Past any per-try timeout, bounded so a test never waits on a lost request for long.
        outage_changed_.wait_for(lock, std::chrono::seconds(3), [&] { return outage_ != kHang; });
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));  // widen the overlap window
    std::lock_guard lock(mu);
    --in_flight[key];
    if (poison) {
      res.status = 400;
      res.set_content(R"({"error":"field 'to' is required"})", "application/json");
    } else if (always_fail || fail || outage != kNone) {
      res.status = 503;
      res.set_content("busy", "text/plain");
    } else {
      if (applied[key] == 0) applied[key] = 1;  // dedupe by key: the effect happens once
      res.status = 200;
      res.set_content("{}", "application/json");
    }
  }

  std::unique_ptr<httplib::Server> server_;
  int threads_ = 0;
  int port_ = 0;
  std::thread thread_;
  std::condition_variable outage_changed_;
  Outage outage_ = kNone;  // guarded by mu
  std::mt19937_64 rng_;    // guarded by mu
};

// `keel jobs` run as a user runs it, for a fixture that gives url(), url_text() and dir().
// How often each line appears in the file at `path` (a drill's effects log: one key a line).
inline std::map<std::string, int> line_counts(const std::filesystem::path& path) {
  std::map<std::string, int> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) ++out[line];
  return out;
}

template <class Base>
class JobsHarness : public Base {
 protected:
  using Base::dir;
  using Base::url;
  using Base::url_text;

  CmdResult keel(std::vector<std::string> args) {
    args.insert(args.begin(), KEEL_BINARY);
    Process p(args, this->dir().path(), "run" + std::to_string(runs_++));
    CmdResult r;
    r.status = p.wait();
    r.out = p.out();
    r.err = p.err();
    return r;
  }
  std::unique_ptr<Process> spawn(std::vector<std::string> args) {
    args.insert(args.begin(), KEEL_BINARY);
    return std::make_unique<Process>(args, this->dir().path(), "bg" + std::to_string(runs_++));
  }
  std::vector<std::string> work_args(const std::string& queue, const std::string& deliver_url) {
    return {"jobs",          "--db",      url_text(),  "work",           "--queue",
            queue,           "--deliver", deliver_url, "--backoff-base", "10ms",
            "--backoff-cap", "100ms",     "--poll",    "10ms",           "--exit-when-idle"};
  }
  // Enqueues n jobs in one transaction through the library .
  void enqueue_many(const std::string& queue, int n) {
    auto conn = open_database(url());
    JobQueue::migrate(*conn);
    JobQueue q;
    std::vector<EnqueueRequest> batch;
    for (int i = 0; i < n; ++i) {
      batch.push_back({.queue = queue, .payload = R"({"n":)" + std::to_string(i) + "}"});
    }
    for (const auto& r : q.enqueue_many(*conn, batch)) ASSERT_TRUE(r.ok()) << r.error;
  }
  // On one connection kept for the polls (a connection per poll, beside eight loaded workers,
  // timed out connecting), opened again once when it fails (a server restarted by the test).
  std::int64_t count(const std::string& sql) {
    for (int tries = 0;; ++tries) {
      try {
        if (!count_conn_) count_conn_ = open_database(url());
        return count_conn_->query(sql).integer(0, 0);
      } catch (const std::exception&) {
        count_conn_.reset();
        if (tries > 0) throw;
      }
    }
  }
  std::set<std::string> keys(const std::string& queue) {
    auto conn = open_database(url());
    const Rows r = conn->query("SELECT idem_key FROM keel_jobs WHERE queue = $1", {queue});
    std::set<std::string> out;
    for (std::size_t i = 0; i < r.size(); ++i) out.insert(r.text(i, 0));
    return out;
  }

  int runs_ = 0;
  std::unique_ptr<Connection> count_conn_;
};

}  // namespace keel::store::test_jobs
