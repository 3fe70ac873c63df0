// CommandHandler: one /bin/sh child per job attempt, fed its payload and drained of its stderr
// through non-blocking pipes (see keel/store/command_handler.hpp).
#include "keel/store/command_handler.hpp"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string_view>
#include <utility>
#include <vector>

#include "keel/expected.hpp"

extern char** environ;

namespace keel::store {
namespace {

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

}  // namespace

CommandHandler::CommandHandler(std::string command) : command_(std::move(command)) {
  if (command_.empty()) {
    throw_invalid({.context = "keel::store::CommandHandler",
                   .field = "command",
                   .problem = "must not be empty"});
  }
}

AttemptReport CommandHandler::operator()(const LeasedJob& job,
                                         const std::atomic<bool>& cancel) const {
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
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view v(*e);
    if (v.starts_with("KEEL_IDEMPOTENCY_KEY=") || v.starts_with("KEEL_ATTEMPT=") ||
        v.starts_with("KEEL_JOB_ID=") || v.starts_with("KEEL_QUEUE=")) {
      continue;
    }
    env_strings.emplace_back(v);
  }
  env_strings.push_back("KEEL_IDEMPOTENCY_KEY=" + job.idempotency_key);
  env_strings.push_back("KEEL_ATTEMPT=" + std::to_string(job.attempt));
  env_strings.push_back("KEEL_JOB_ID=" + std::to_string(job.id));
  env_strings.push_back("KEEL_QUEUE=" + job.queue);
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
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
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
  // Feed stdin and collect stderr without blocking on either, watching for cancellation.
  fcntl(in_pipe[1], F_SETFL, fcntl(in_pipe[1], F_GETFL) | O_NONBLOCK);
  std::size_t written = 0;
  int in_fd = in_pipe[1];
  int err_fd = err_pipe[0];
  std::string err_tail;
  bool killed = false;
  while (err_fd >= 0) {
    if (cancel.load() && !killed) {
      ::kill(pid, SIGKILL);
      killed = true;
    }
    if (in_fd >= 0 && written >= job.payload.size()) {
      ::close(in_fd);
      in_fd = -1;
    }
    pollfd fds[2];
    nfds_t n = 0;
    fds[n++] = {err_fd, POLLIN, 0};
    if (in_fd >= 0) fds[n++] = {in_fd, POLLOUT, 0};
    if (::poll(fds, n, 100) < 0 && errno != EINTR) break;
    if (n == 2 && (fds[1].revents & (POLLOUT | POLLERR | POLLHUP)) != 0) {
      const ssize_t w =
          write_without_sigpipe(in_fd, job.payload.data() + written, job.payload.size() - written);
      if (w > 0) {
        written += static_cast<std::size_t>(w);
      } else if (w < 0 && errno != EAGAIN && errno != EINTR) {
        ::close(in_fd);  // the command does not read its input (EPIPE): fine
        in_fd = -1;
      }
    }
    if ((fds[0].revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
      char buf[4096];
      const ssize_t r = ::read(err_fd, buf, sizeof buf);
      if (r > 0) {
        err_tail.append(buf, static_cast<std::size_t>(r));
        if (err_tail.size() > 4000) err_tail.erase(0, err_tail.size() - 2000);
      } else if (r == 0 || (errno != EAGAIN && errno != EINTR)) {
        ::close(err_fd);
        err_fd = -1;
      }
    }
  }
  if (in_fd >= 0) ::close(in_fd);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  while (!err_tail.empty() && (err_tail.back() == '\n' || err_tail.back() == '\r')) {
    err_tail.pop_back();
  }
  if (err_tail.size() > 500) err_tail = err_tail.substr(err_tail.size() - 500);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return AttemptReport::success();
  std::string what;
  if (WIFEXITED(status)) {
    const int code = WEXITSTATUS(status);
    report.outcome = code == kTransientExitStatus ? Outcome::transient() : Outcome::permanent();
    report.outcome.code = code;
    what = "exit status " + std::to_string(code) +
           (code == kTransientExitStatus ? " (EX_TEMPFAIL)" : "");
  } else {
    // Killed by a signal (OOM killer, a crash, our cancellation): a timing accident.
    report.outcome = Outcome::transient();
    what = "killed by signal " + std::to_string(WTERMSIG(status));
  }
  report.error = what + (err_tail.empty() ? "" : ": " + err_tail);
  return report;
}

}  // namespace keel::store
