// The signals that stop a keel process (keel, keel-demo), one set for all of them: SIGINT,
// SIGTERM and SIGHUP (none has a configuration to reload: a hang-up stops it as SIGTERM does).
// One thread takes them with sigwait; block_stop_signals() blocks them before the first thread
// starts, so that every thread inherits the mask. SIGPIPE is ignored: a peer that went away is an
// error on the write, not the end of the process.
#pragma once

#include <pthread.h>

#include <csignal>

namespace keel::cli {

[[nodiscard]] inline sigset_t block_stop_signals() {
  ::signal(SIGPIPE, SIG_IGN);
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}

// The name of a stop signal, for the line that says why the process stops.
[[nodiscard]] inline const char* stop_signal_name(int sig) noexcept {
  return sig == SIGINT ? "SIGINT" : sig == SIGHUP ? "SIGHUP" : "SIGTERM";
}

}  // namespace keel::cli
