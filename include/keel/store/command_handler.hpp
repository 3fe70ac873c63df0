// A job handler that runs a shell command per job attempt: `/bin/sh -c COMMAND` with the job's
// payload on stdin and KEEL_IDEMPOTENCY_KEY, KEEL_ATTEMPT, KEEL_JOB_ID and KEEL_QUEUE added to
// the environment (the rest of it inherited). Exit status 0 is done, 75 (EX_TEMPFAIL from
// sysexits.h) transient, any other status permanent; a command killed by a signal (the OOM
// killer, a crash, cancellation) is transient. The report's error is "exit status N" or
// "killed by signal N", followed by the last 500 bytes of the command's stderr. When the
// worker raises the cancel flag the command is killed (SIGKILL). stdout is inherited. This is
// what `keel jobs work --exec CMD` runs.
//
// The child starts with no signal blocked and SIGPIPE at its default, whatever the worker's
// mask; a command that exits without reading its stdin is not an error, and writing to it
// never raises SIGPIPE in the calling process.
//
// Thread-safety: immutable after construction; operator() is safe to call from several threads
// at once (each call spawns its own child).
//
// Example:
//   keel::store::Worker worker(pool, queue, {.queue = "thumbnails", .concurrency = 4},
//                              keel::store::CommandHandler("convert-thumbnail"));
//   worker.run();
#pragma once

#include <atomic>
#include <string>

#include "keel/store/queue.hpp"

namespace keel::store {

class CommandHandler {
 public:
  /// Exit status of a command that asks to be retried (EX_TEMPFAIL).
  static constexpr int kTransientExitStatus = 75;

  /// Throws std::invalid_argument when `command` is empty. Requires: /bin/sh exists.
  explicit CommandHandler(std::string command);

  /// Runs one attempt of `job`. Failing to start the command (no pipe, no /bin/sh) is reported
  /// as a transient outcome with the reason in the error; it never throws.
  [[nodiscard]] AttemptReport operator()(const LeasedJob& job,
                                         const std::atomic<bool>& cancel) const;

  [[nodiscard]] const std::string& command() const noexcept { return command_; }

 private:
  std::string command_;
};

}  // namespace keel::store
