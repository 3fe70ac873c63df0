// A job handler that runs a shell command per job attempt: `/bin/sh -c COMMAND` with the job's
// payload on stdin and KEEL_IDEMPOTENCY_KEY, KEEL_ATTEMPT, KEEL_JOB_ID and KEEL_QUEUE added to
// the environment (the rest of it inherited). stdout is inherited.
//
// Outcomes: exit status 0 is done, 75 (EX_TEMPFAIL from sysexits.h) transient, any other status
// permanent; a command killed by a signal (the OOM killer, a crash, someone's kill) is
// transient, and so is a command stopped by its timeout or by cancellation, whatever it exited
// with. The report's error is "exit status N", "killed by signal N", "timed out after D" or
// "cancelled", followed by the end of the command's stderr: at most kStderrTailBytes (500), from
// a character boundary, with bytes that are not UTF-8 (a Latin-1 message, a character cut by the
// tail) replaced by U+FFFD and counted (keel::storable_text), so that the queue can store it.
//
// Each command runs in a process group of its own, and no process of that group outlives the
// call: when the timeout passes or the worker raises the cancel flag (watched every 20 ms), the
// group gets SIGTERM, then SIGKILL 250 ms later if any of it is left; when the shell exits on its
// own, what it left running in its group (a background `&`, a grandchild) is ended the same way.
// So a command killed for its job's lease never applies its effect after another worker has run
// the job again. A process that moved itself to another group or session (setsid, a daemon) is
// out of reach.
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
//                              keel::store::CommandHandler("convert-thumbnail",
//                                                          {.timeout = std::chrono::minutes(5)}));
//   worker.run();
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <string>

#include "keel/core/clock.hpp"
#include "keel/queue/queue.hpp"

namespace keel::store {

struct CommandOptions {
  /// Longest run of one attempt, measured in real time from the start of the command; then its
  /// process group is killed and the attempt is transient ("timed out after D"). Must be > 0.
  /// Default: no limit (kInfinite).
  Duration timeout = kInfinite;
};

class CommandHandler {
 public:
  /// Exit status of a command that asks to be retried (EX_TEMPFAIL).
  static constexpr int kTransientExitStatus = 75;
  /// How often a running command's cancel flag and timeout are checked.
  static constexpr std::chrono::milliseconds kWatchInterval{20};
  /// Between SIGTERM and SIGKILL to a command's process group.
  static constexpr std::chrono::milliseconds kKillAfter{250};
  /// The longest end of stderr a report's error carries, in bytes.
  static constexpr std::size_t kStderrTailBytes = 500;

  /// Throws std::invalid_argument when `command` is empty or `options.timeout` is not > 0.
  /// Requires: /bin/sh exists.
  explicit CommandHandler(std::string command, CommandOptions options = {});

  /// Runs one attempt of `job` and returns once the command's process group is gone. Failing to
  /// start the command (no pipe, no /bin/sh) is reported as a transient outcome with the reason
  /// in the error; it never throws.
  [[nodiscard]] AttemptReport operator()(const LeasedJob& job,
                                         const std::atomic<bool>& cancel) const;

  [[nodiscard]] const std::string& command() const noexcept { return command_; }
  [[nodiscard]] const CommandOptions& options() const noexcept { return options_; }

 private:
  std::string command_;
  CommandOptions options_;
};

}  // namespace keel::store
