// Running the keel executable (or keel-demo) as a process in the e2e tests: arguments without a
// shell, stdout and stderr captured through files, the exit status and the child's peak resident
// set.
#pragma once

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "temp_dir.hpp"

#ifndef KEEL_BINARY
#error "KEEL_BINARY must name the keel executable"
#endif

namespace keel::test {

inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

struct KeelRun {
  int status = -1;
  std::string out;
  std::string err;
  long peak_rss_kib = 0;  // the child's ru_maxrss
};

struct KeelRunOptions {
  /// Where stdout goes; empty: a temporary file read back into KeelRun::out.
  std::string stdout_path;
  /// Run as this user (via runuser) when non-empty.
  std::string as_user;
  /// The executable to run: keel unless another is named (KEEL_DEMO_BINARY).
  const char* binary = KEEL_BINARY;
};

/// Runs keel (or options.binary) with `args` (no shell) and waits for it.
inline KeelRun run_keel(const std::vector<std::string>& args, const KeelRunOptions& options = {}) {
  TempDir dir;
  const std::string out = options.stdout_path.empty() ? dir.file("out") : options.stdout_path;
  const std::string err = dir.file("err");
  if (!options.as_user.empty()) ::chmod(dir.path().c_str(), 0777);
  const pid_t pid = fork();
  if (pid == 0) {
    const int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0666);
    const int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0666);
    ::dup2(o, 1);
    ::dup2(e, 2);
    std::vector<std::string> full;
    if (!options.as_user.empty()) full = {"/usr/sbin/runuser", "-u", options.as_user, "--"};
    full.push_back(options.binary);
    full.insert(full.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : full) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  int wstatus = 0;
  rusage usage{};
  ::wait4(pid, &wstatus, 0, &usage);
  KeelRun r;
  r.status = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : -1;
  if (options.stdout_path.empty()) r.out = slurp(out);
  r.err = slurp(err);
  r.peak_rss_kib = usage.ru_maxrss;
  return r;
}

}  // namespace keel::test
