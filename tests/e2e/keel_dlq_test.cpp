// keel dlq and keel jobs stats as processes: one exit status for a job id that is not there
// (3, "not found", as the help says) across show, replay and discard, and read commands that
// work for a user who may only read the database (opened read-only, never migrated).
#include <gtest/gtest.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "run_keel.hpp"

namespace {

using keel::test::KeelRun;
using keel::test::run_keel;
using keel::test::slurp;
using keel::test::TempDir;

// A database with one ready job (id 1) on queue q.
std::string make_db(const TempDir& dir) {
  const std::string db = "sqlite:" + dir.file("q.db");
  const KeelRun r = run_keel({"jobs", "enqueue", "--db", db, "--queue", "q", "--payload", "{}"});
  EXPECT_EQ(r.status, 0) << r.err;
  return db;
}

TEST(KeelDlq, AJobIdThatIsNotThereExitsThreeForShowReplayAndDiscard) {
  TempDir dir;
  const std::string db = make_db(dir);
  const std::vector<std::vector<std::string>> cases = {
      {"dlq", "--db", db, "show", "99"},
      {"dlq", "--db", db, "replay", "99"},
      {"dlq", "--db", db, "discard", "99"},
      {"dlq", "--db", db, "replay", "1"},   // there, but not dead
      {"dlq", "--db", db, "discard", "1"},  // there, but not dead
      {"dlq", "--db", db, "replay", "1", "99"},
  };
  for (const auto& args : cases) {
    const KeelRun r = run_keel(args);
    EXPECT_EQ(r.status, 3) << args[3] << " " << args[4] << ": " << r.err;
    EXPECT_FALSE(r.err.empty());
  }
  EXPECT_EQ(run_keel({"dlq", "--db", db, "show", "1"}).status, 0);
  // A database without a job queue: the same.
  const std::string empty = "sqlite:" + dir.file("empty.db");
  ASSERT_EQ(
      run_keel({"jobs", "enqueue", "--db", empty, "--queue", "other", "--payload", "{}"}).status,
      0);
  for (const char* cmd : {"show", "replay", "discard"}) {
    EXPECT_EQ(run_keel({"dlq", "--db", empty, cmd, "42"}).status, 3) << cmd;
  }
  // Bad arguments stay usage errors, and the help says what 3 means.
  EXPECT_EQ(run_keel({"dlq", "--db", db, "show", "x"}).status, 2);
  EXPECT_EQ(run_keel({"dlq", "--db", db, "replay"}).status, 2);
  const KeelRun help = run_keel({"dlq", "--help"});
  EXPECT_NE(help.out.find("3  not found"), std::string::npos) << help.out;
}

TEST(KeelDlq, ReadCommandsLeaveTheDatabaseFileUntouched) {
  TempDir dir;
  const std::string db = make_db(dir);
  const std::string file = dir.file("q.db");
  const std::string before = slurp(file);
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"jobs", "stats", "--db", db},
                                             {"dlq", "--db", db, "list"},
                                             {"dlq", "--db", db, "depth"},
                                             {"dlq", "--db", db, "show", "1"}}) {
    const KeelRun r = run_keel(args);
    EXPECT_EQ(r.status, 0) << args[1] << ": " << r.err;
  }
  EXPECT_EQ(slurp(file), before);
}

// Root may write anything, so the read-only case runs as `nobody` when the system has it.
TEST(KeelDlq, AReadOnlyUserCanRunStatsAndListButNotReplay) {
  if (::access("/usr/sbin/runuser", X_OK) != 0 || ::getpwnam("nobody") == nullptr ||
      ::geteuid() != 0) {
    GTEST_SKIP() << "needs root, runuser and the user nobody";
  }
  TempDir dir;
  const std::string db = make_db(dir);
  const std::string file = dir.file("q.db");
  ASSERT_EQ(::chmod(file.c_str(), 0444), 0);
  ASSERT_EQ(::chmod(dir.path().c_str(), 0555), 0);
  const std::string before = slurp(file);
  const keel::test::KeelRunOptions nobody{.as_user = "nobody"};
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"jobs", "stats", "--db", db},
                                             {"dlq", "--db", db, "list"},
                                             {"dlq", "--db", db, "list", "--json"},
                                             {"dlq", "--db", db, "depth"},
                                             {"dlq", "--db", db, "show", "1"}}) {
    const KeelRun r = run_keel(args, nobody);
    EXPECT_EQ(r.status, 0) << args[1] << " " << args.back() << ": " << r.err;
    EXPECT_EQ(r.err.find("readonly"), std::string::npos) << r.err;
  }
  EXPECT_EQ(run_keel({"dlq", "--db", db, "show", "99"}, nobody).status, 3);
  // A write is a database failure (1), with SQLite's reason.
  const KeelRun replay = run_keel({"dlq", "--db", db, "replay", "--all"}, nobody);
  EXPECT_EQ(replay.status, 1) << replay.err;
  EXPECT_EQ(slurp(file), before);
  std::size_t entries = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir.path())) ++entries;
  EXPECT_EQ(entries, 1u) << "nothing created next to the database";
  ::chmod(dir.path().c_str(), 0755);
}

}  // namespace
