// CommandHandler: one /bin/sh child per job attempt in a process group of its own, fed its
// payload and drained of its stderr through non-blocking pipes, watched for its timeout and
// cancellation, and its group ended before the call returns (see
// keel/handlers/command_handler.hpp).
#include "keel/handlers/command_handler.hpp"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string_view>
#include <utility>
#include <vector>

#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "keel/core/text.hpp"

extern char** environ;

namespace keel::store {
namespace {

using SteadyClock = std::chrono::steady_clock;

// write(2) to the command's stdin with SIGPIPE blocked in this thread, so that a command that
// exits without reading its input costs an EPIPE, not the process (whatever the caller's
// SIGPIPE disposition). A SIGPIPE this write raised is taken back before the mask is restored.
ssize_t write_without_sigpipe(int fd, const char* data, std::size_t size) {
  sigset_t sigpipe;
  sigemptyset(&sigpipe);
  sigaddset(&sigpipe, SIGPIPE);
  sigset_t pending;
  sigemptyset(&pending);
  sigpending(&pending);
  const bool was_pending = sigismember(&pending, SIGPIPE) == 1;
  sigset_t old;
  pthread_sigmask(SIG_BLOCK, &sigpipe, &old);
  const ssize_t w = ::write(fd, data, size);
  const int saved = errno;
  if (w < 0 && saved == EPIPE && !was_pending) {
    const timespec zero{0, 0};
    while (sigtimedwait(&sigpipe, nullptr, &zero) < 0 && errno == EINTR) {
    }
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  errno = saved;
  return w;
}

// One running command: the shell (leader of its own process group, pgid == pid), the write end
// of its stdin and the read end of its stderr.
class Child {
 public:
  Child(pid_t pid, int in_fd, int err_fd) : pid_(pid), in_fd_(in_fd), err_fd_(err_fd) {
    fcntl(in_fd_, F_SETFL, fcntl(in_fd_, F_GETFL) | O_NONBLOCK);
    fcntl(err_fd_, F_SETFL, fcntl(err_fd_, F_GETFL) | O_NONBLOCK);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() {
    close_fd(in_fd_);
    close_fd(err_fd_);
  }

  /// Whether the shell has exited (and is reaped; its status in status()).
  bool reaped() {
    if (reaped_) return true;
    int st = 0;
    pid_t r = 0;
    while ((r = ::waitpid(pid_, &st, WNOHANG)) < 0 && errno == EINTR) {
    }
    if (r == pid_ || (r < 0 && errno == ECHILD)) {
      reaped_ = true;
      status_ = st;
    }
    return reaped_;
  }
  [[nodiscard]] int status() const { return status_; }

  /// Whether any process of the group is left. Before the shell is reaped it is: the group's id
  /// is the shell's pid, held until then. After, the id stays allocated while a member lives, so
  /// a signal to it reaches only this group's survivors.
  bool group_alive() {
    if (!reaped()) return true;
    return ::kill(-pid_, 0) == 0 || errno == EPERM;
  }

  /// Feeds `payload` to stdin and collects stderr for up to `wait` (less when the pipes are
  /// ready sooner).
  void pump(const std::string& payload, std::chrono::milliseconds wait) {
    if (in_fd_ >= 0 && written_ >= payload.size()) close_fd(in_fd_);
    pollfd fds[2];
    nfds_t n = 0;
    int err_at = -1;
    int in_at = -1;
    if (err_fd_ >= 0) {
      err_at = static_cast<int>(n);
      fds[n++] = {err_fd_, POLLIN, 0};
    }
    if (in_fd_ >= 0) {
      in_at = static_cast<int>(n);
      fds[n++] = {in_fd_, POLLOUT, 0};
    }
    const int ms = static_cast<int>(std::max<std::chrono::milliseconds::rep>(wait.count(), 0));
    if (::poll(fds, n, ms) <= 0) return;
    if (in_at >= 0 && (fds[in_at].revents & (POLLOUT | POLLERR | POLLHUP)) != 0) {
      const ssize_t w =
          write_without_sigpipe(in_fd_, payload.data() + written_, payload.size() - written_);
      if (w > 0) {
        written_ += static_cast<std::size_t>(w);
      } else if (w < 0 && errno != EAGAIN && errno != EINTR) {
        close_fd(in_fd_);  // the command does not read its input (EPIPE): fine
      }
    }
    if (err_at >= 0 && (fds[err_at].revents & (POLLIN | POLLHUP | POLLERR)) != 0) drain_stderr();
  }

  /// Reads what stderr holds now, without waiting; closes it at end of file.
  void drain_stderr() {
    char buf[4096];
    while (err_fd_ >= 0) {
      const ssize_t r = ::read(err_fd_, buf, sizeof buf);
      if (r > 0) {
        err_tail_.append(buf, static_cast<std::size_t>(r));
        if (err_tail_.size() > 4000) err_tail_.erase(0, err_tail_.size() - 2000);
      } else if (r < 0 && errno == EINTR) {
        continue;
      } else {
        if (r == 0 || errno != EAGAIN) close_fd(err_fd_);
        return;
      }
    }
  }

  /// Ends the group: SIGTERM, then SIGKILL to whatever is left after `kill_after`. Returns once
  /// the shell is reaped. A process killed by SIGKILL runs no more code, so none of the group can
  /// apply an effect after this returns. Then reads what is left of stderr without waiting for its
  /// end (a process that left the group may hold it open).
  void end_group(std::chrono::milliseconds kill_after) {
    if (group_alive()) {
      ::kill(-pid_, SIGTERM);
      const auto until = SteadyClock::now() + kill_after;
      while (group_alive() && SteadyClock::now() < until) {
        pump({}, std::chrono::milliseconds(5));  // keep stderr flowing so no one blocks on it
      }
      if (group_alive()) ::kill(-pid_, SIGKILL);
      while (!reaped()) {
        int st = 0;
        if (::waitpid(pid_, &st, 0) == pid_) {
          reaped_ = true;
          status_ = st;
        } else if (errno != EINTR) {
          reaped_ = true;
        }
      }
    }
    drain_stderr();
  }

  /// The end of stderr, trailing newlines trimmed, as text the queue can store: at most
  /// CommandHandler::kStderrTailBytes from a character boundary, what is not UTF-8 replaced
  /// (keel::storable_text).
  [[nodiscard]] std::string stderr_tail() const {
    std::string_view tail = err_tail_;
    while (!tail.empty() && (tail.back() == '\n' || tail.back() == '\r')) tail.remove_suffix(1);
    return storable_text(tail, CommandHandler::kStderrTailBytes, Keep::kEnd);
  }

 private:
  static void close_fd(int& fd) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }

  pid_t pid_;
  int in_fd_;
  int err_fd_;
  std::size_t written_ = 0;
  std::string err_tail_;
  bool reaped_ = false;
  int status_ = 0;
};

}  // namespace

CommandHandler::CommandHandler(std::string command, CommandOptions options)
    : command_(std::move(command)), options_(options) {
  if (command_.empty()) {
    throw_invalid({.context = "keel::store::CommandHandler",
                   .field = "command",
                   .problem = "must not be empty"});
  }
  if (options_.timeout <= Duration::zero()) {
    throw_invalid({.context = "keel::store::CommandHandler",
                   .field = "timeout",
                   .problem = "must be > 0",
                   .got = format_duration(options_.timeout)});
  }
}

namespace {

// The command's environment: this process's, without the job variables it may have inherited
// (a worker started from a job's command), and the job's own.
std::vector<std::string> job_environment(const LeasedJob& job) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view v(*e);
    if (v.starts_with("KEEL_IDEMPOTENCY_KEY=") || v.starts_with("KEEL_ATTEMPT=") ||
        v.starts_with("KEEL_JOB_ID=") || v.starts_with("KEEL_QUEUE=")) {
      continue;
    }
    env.emplace_back(v);
  }
  env.push_back("KEEL_IDEMPOTENCY_KEY=" + job.idempotency_key);
  env.push_back("KEEL_ATTEMPT=" + std::to_string(job.attempt));
  env.push_back("KEEL_JOB_ID=" + std::to_string(job.id));
  env.push_back("KEEL_QUEUE=" + job.queue);
  return env;
}

// The report of a run that did not succeed: `stopped` says why it was stopped (empty: it ended
// on its own with wait status `status`), `tail` is the end of its stderr.
AttemptReport failure_report(const std::string& stopped, int status, const std::string& tail) {
  AttemptReport report;
  std::string what = stopped;
  if (!stopped.empty()) {
    report.outcome = Outcome::transient();
  } else if (WIFEXITED(status)) {
    const int code = WEXITSTATUS(status);
    report.outcome =
        code == CommandHandler::kTransientExitStatus ? Outcome::transient() : Outcome::permanent();
    report.outcome.code = code;
    what = "exit status " + std::to_string(code) +
           (code == CommandHandler::kTransientExitStatus ? " (EX_TEMPFAIL)" : "");
  } else {
    // Killed by a signal (the OOM killer, a crash, someone's kill): a timing accident.
    report.outcome = Outcome::transient();
    what = "killed by signal " + std::to_string(WTERMSIG(status));
  }
  report.error = what + (tail.empty() ? "" : ": " + tail);
  return report;
}

}  // namespace

AttemptReport CommandHandler::operator()(const LeasedJob& job,
                                         const std::atomic<bool>& cancel) const {
  const auto start = SteadyClock::now();
  AttemptReport report;
  int in_pipe[2];
  int err_pipe[2];
  if (pipe2(in_pipe, O_CLOEXEC) != 0) {
    report.outcome = Outcome::transient();
    report.error = std::string("pipe: ") + std::strerror(errno);
    return report;
  }
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    ::close(in_pipe[0]);
    ::close(in_pipe[1]);
    report.outcome = Outcome::transient();
    report.error = std::string("pipe: ") + std::strerror(errno);
    return report;
  }
  std::vector<std::string> env_strings = job_environment(job);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string sh = "/bin/sh";
  std::string dash_c = "-c";
  std::string cmd = command_;
  char* argv[] = {sh.data(), dash_c.data(), cmd.data(), nullptr};

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in_pipe[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, err_pipe[1], STDERR_FILENO);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);  // the worker blocks SIGTERM; the child must not
  sigset_t defaults;
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGPIPE);  // ignored in the worker; a default in the command's pipelines
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setpgroup(&attr, 0);  // a group of its own, so all of it can be killed
  posix_spawnattr_setflags(&attr,
                           POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETPGROUP);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, sh.c_str(), &actions, &attr, argv, envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  ::close(in_pipe[0]);
  ::close(err_pipe[1]);
  if (rc != 0) {
    ::close(in_pipe[1]);
    ::close(err_pipe[0]);
    report.outcome = Outcome::transient();
    report.error = std::string("cannot start /bin/sh: ") + std::strerror(rc);
    return report;
  }
  Child child(pid, in_pipe[1], err_pipe[0]);

  // Until the shell exits, feed its stdin and collect its stderr, waking at least every
  // kWatchInterval to look at the cancel flag and the timeout.
  const SteadyClock::time_point deadline =
      options_.timeout >= kInfinite || options_.timeout > SteadyClock::time_point::max() - start
          ? SteadyClock::time_point::max()
          : start + std::chrono::duration_cast<SteadyClock::duration>(options_.timeout);
  enum class Stopped { kNo, kTimeout, kCancel } stopped = Stopped::kNo;
  while (!child.reaped()) {
    if (cancel.load()) {
      stopped = Stopped::kCancel;
      break;
    }
    const auto now = SteadyClock::now();
    if (now >= deadline) {
      stopped = Stopped::kTimeout;
      break;
    }
    auto wait = std::chrono::milliseconds(kWatchInterval);
    if (deadline - now < wait) {
      wait = std::chrono::ceil<std::chrono::milliseconds>(deadline - now);
    }
    child.pump(job.payload, wait);
  }
  // Stopped, exited or not: nothing of its group outlives this call.
  child.end_group(kKillAfter);
  const std::string tail = child.stderr_tail();
  const int status = child.status();

  if (stopped == Stopped::kNo && WIFEXITED(status) && WEXITSTATUS(status) == 0) {
    return AttemptReport::success();
  }
  return failure_report(stopped == Stopped::kTimeout
                            ? "timed out after " + format_duration(options_.timeout)
                        : stopped == Stopped::kCancel ? std::string("cancelled")
                                                      : std::string(),
                        status, tail);
}

}  // namespace keel::store
