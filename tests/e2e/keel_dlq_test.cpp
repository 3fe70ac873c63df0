// keel dlq and keel jobs stats as processes: one exit status for a job id that is not there
// (3, "not found", as the help says) across show, replay and discard, and read commands that
// work for a user who may only read the database (opened read-only, never migrated).
#include <gtest/gtest.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "keel/db/database.hpp"
#include "keel/queue/dead_letters.hpp"
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

// A database whose queue `hooks` holds `n` dead jobs (ids 1..n, "permanent: exit status 1") and
// whose queue `mail` holds one (id n + 1, "permanent: exit status 2").
std::string make_dead(const TempDir& dir, int n) {
  const std::string db = "sqlite:" + dir.file("dead.db");
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(run_keel({"jobs", "enqueue", "--db", db, "--queue", "hooks", "--payload", "{}",
                        "--max-attempts", "1"})
                  .status,
              0);
  }
  EXPECT_EQ(run_keel({"jobs", "enqueue", "--db", db, "--queue", "mail", "--payload", "{}",
                      "--max-attempts", "1"})
                .status,
            0);
  for (const char* q : {"hooks", "mail"}) {
    const std::string code = std::string(q) == "hooks" ? "exit 1" : "exit 2";
    const KeelRun r =
        run_keel({"jobs", "--db", db, "work", "--queue", q, "--exec", code, "--exit-when-idle"});
    EXPECT_EQ(r.status, 0) << r.err;
  }
  return db;
}

std::string depth(const std::string& db, const std::string& queue) {
  return run_keel({"dlq", "--db", db, "depth", "--queue", queue}).out;
}

// The calendar ms of every RFC 3339 time in a column of a dry run's table (the 5th field: DUE).
std::vector<std::int64_t> due_times(const std::string& table) {
  std::vector<std::int64_t> out;
  std::istringstream lines(table);
  std::string line;
  std::getline(lines, line);  // header
  while (std::getline(lines, line)) {
    std::istringstream fields(line);
    std::string id, queue, attempts, died, due;
    fields >> id >> queue >> attempts >> died >> due;
    const auto ms = keel::store::dead_letters::parse_time_bound(due, 0);
    EXPECT_TRUE(ms.has_value()) << line << ": " << (ms ? "" : ms.error().message());
    out.push_back(ms.value_or(0));
  }
  return out;
}

TEST(KeelDlq, FiltersSelectWhatReplayAndDiscardMove) {
  TempDir dir;
  const std::string db = make_dead(dir, 3);
  ASSERT_EQ(depth(db, "hooks"), "3\n");
  // A dry run lists and changes nothing.
  KeelRun r = run_keel({"dlq", "--db", db, "replay", "--reason", "exit status 2", "--dry-run"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("mail"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("hooks"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("would replay 1 dead job(s); nothing changed"), std::string::npos);
  EXPECT_EQ(depth(db, "mail"), "1\n");
  r = run_keel({"dlq", "--db", db, "discard", "--queue", "hooks", "--dry-run"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("would discard 3 dead job(s)"), std::string::npos) << r.err;
  EXPECT_EQ(depth(db, "hooks"), "3\n");
  // Nothing died in the future or more than an hour ago.
  r = run_keel({"dlq", "--db", db, "replay", "--died-before", "1h"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "0\n");
  r = run_keel({"dlq", "--db", db, "replay", "--died-after", "2999-01-01T00:00:00Z"});
  EXPECT_EQ(r.out, "0\n");
  // The filter moves exactly its jobs.
  r = run_keel({"dlq", "--db", db, "replay", "--reason", "exit status 2", "--died-after", "1h"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "1\n");
  EXPECT_EQ(depth(db, "mail"), "0\n");
  r = run_keel({"dlq", "--db", db, "discard", "--queue", "hooks", "--reason", "status 1"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "3\n");
  EXPECT_EQ(depth(db, "hooks"), "0\n");
}

// --kind: the kind each job died of is stored with it; list, replay and discard select by it.
TEST(KeelDlq, KindSelectsTheJobsThatDiedOfIt) {
  TempDir dir;
  const std::string db = make_dead(dir, 2);  // permanent failures (exit 1 and exit 2)
  ASSERT_EQ(run_keel({"jobs", "enqueue", "--db", db, "--queue", "slow", "--payload", "{}",
                      "--max-attempts", "1"})
                .status,
            0);
  KeelRun r = run_keel(
      {"jobs", "--db", db, "work", "--queue", "slow", "--exec", "exit 75", "--exit-when-idle"});
  ASSERT_EQ(r.status, 0) << r.err;  // 75: transient, its only attempt spent
  r = run_keel({"dlq", "--db", db, "list", "--kind", "exhausted", "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find(R"("dead_kind": "attempts_exhausted")"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(R"("queue": "slow")"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find(R"("queue": "hooks")"), std::string::npos) << r.out;
  r = run_keel({"dlq", "--db", db, "list", "--kind", "permanent"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out.find("slow"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("mail"), std::string::npos) << r.out;
  r = run_keel({"dlq", "--db", db, "replay", "--kind", "attempts_exhausted"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "1\n");
  EXPECT_EQ(depth(db, "slow"), "0\n");
  r = run_keel({"dlq", "--db", db, "discard", "--kind", "crashed"});
  EXPECT_EQ(r.out, "0\n") << "nothing crashed";
  EXPECT_EQ(depth(db, "hooks"), "2\n");
  for (const char* bad : {"Permanent", "", "exhaust", "max age"}) {
    r = run_keel({"dlq", "--db", db, "list", "--kind", bad});
    EXPECT_EQ(r.status, 2) << bad;
    EXPECT_NE(r.err.find("--kind"), std::string::npos) << r.err;
  }
}

// --rate 4/s: the jobs are due 250 ms apart, oldest death first, and the command returns at once.
TEST(KeelDlq, ReplayRateSpreadsTheDueTimes) {
  TempDir dir;
  const std::string db = make_dead(dir, 5);
  const KeelRun plan =
      run_keel({"dlq", "--db", db, "replay", "--queue", "hooks", "--rate", "4/s", "--dry-run"});
  ASSERT_EQ(plan.status, 0) << plan.err;
  const std::vector<std::int64_t> due = due_times(plan.out);
  ASSERT_EQ(due.size(), 5u) << plan.out;
  for (std::size_t i = 1; i < due.size(); ++i) EXPECT_EQ(due[i] - due[i - 1], 250) << plan.out;
  // 120/m is 2 a second: 500 ms apart.
  const std::vector<std::int64_t> slow = due_times(
      run_keel({"dlq", "--db", db, "replay", "--all", "--rate", "120/m", "--dry-run"}).out);
  ASSERT_EQ(slow.size(), 6u);
  EXPECT_EQ(slow[5] - slow[0], 2500);
  const KeelRun r = run_keel({"dlq", "--db", db, "replay", "--queue", "hooks", "--rate", "4/s"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "5\n");
  EXPECT_NE(r.err.find("replayed 5 dead job(s) at 4/s, due from"), std::string::npos) << r.err;
  EXPECT_EQ(depth(db, "hooks"), "0\n");
  EXPECT_EQ(depth(db, "mail"), "1\n");
}

TEST(KeelDlq, InvalidFiltersExitTwoAndMissingIdsThree) {
  TempDir dir;
  const std::string db = make_dead(dir, 1);
  const std::vector<std::pair<std::vector<std::string>, std::string>> usage = {
      {{"replay", "--rate", "0/s", "--all"}, "--rate must be greater than zero (got '0/s')"},
      {{"replay", "--rate", "5", "--all"}, "--rate must be N/s, N/m or N/h"},
      {{"replay", "--rate", "nan/s", "--all"}, "--rate must be a decimal number"},
      {{"replay", "--rate", "inf/s", "--all"}, "--rate"},
      {{"replay", "--rate", "-1/s", "--all"}, "--rate"},
      {{"replay", "--rate", "4/sx", "--all"}, "--rate"},
      {{"replay", "--died-after", "yesterday"}, "--died-after must be an RFC 3339 timestamp"},
      {{"replay", "--died-after", "-1h"}, "--died-after"},
      {{"discard", "--died-before", "2026-13-01T00:00:00Z"},
       "--died-before is not an RFC 3339 timestamp"},
      {{"discard", "--died-before", "2026-12-01T00:00:00"}, "--died-before"},
      {{"replay", "1", "--reason", "x"}, "give job ids, or --all and filters (not both)"},
      {{"replay", "1", "--all"}, "not both"},
      {{"discard"}, "give job ids, --all, or a filter"},
      {{"replay", "--queue", "typo"}, "unknown queue 'typo'"},
  };
  for (const auto& [args, message] : usage) {
    std::vector<std::string> full = {"dlq", "--db", db};
    full.insert(full.end(), args.begin(), args.end());
    const KeelRun r = run_keel(full);
    EXPECT_EQ(r.status, 2) << args[0] << " " << args.back() << ": " << r.err;
    EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
  }
  EXPECT_EQ(run_keel({"dlq", "--db", db, "discard", "--rate", "1/s", "--all"}).status, 2);
  EXPECT_EQ(depth(db, "hooks"), "1\n");
  // A missing id exits 3, with a rate or in a dry run too; the others are still replayed.
  EXPECT_EQ(run_keel({"dlq", "--db", db, "replay", "99", "--dry-run"}).status, 3);
  EXPECT_EQ(depth(db, "hooks"), "1\n");
  const KeelRun r = run_keel({"dlq", "--db", db, "replay", "1", "99", "--rate", "1/s"});
  EXPECT_EQ(r.status, 3) << r.err;
  EXPECT_EQ(r.out, "1\n");
  EXPECT_NE(r.err.find("not in the dead-letter queue (skipped): 99"), std::string::npos);
  EXPECT_EQ(depth(db, "hooks"), "0\n");
}

// Payloads as anything may have stored them (an older keel, a script, SQL), deeply nested: dlq
// show and list, text and --json, exit 0 with output a small multiple of the payload's size, in
// time linear in it (no recursive parse or print: a payload nested too deep for that is shown
// as a JSON string). Measured before: 20 KB nested 10,000 deep gave 200 MB of --json; 200 KB
// crashed (SIGSEGV).
TEST(KeelDlq, DeeplyNestedPayloadsAreShownInLinearSpaceWithoutCrashing) {
  TempDir dir;
  const std::string db = make_db(dir);
  const auto store_payload = [&db](const std::string& payload) {
    auto conn = keel::store::open_database(keel::store::parse_database_url(db).value());
    (void)conn->query(
        "UPDATE keel_jobs SET payload = $1, state = 'dead', dead_reason = 'permanent: test'"
        " WHERE id = 1",
        {payload});
  };
  for (const std::size_t depth :
       {std::size_t{10'000}, std::size_t{100'000}, std::size_t{200'000}}) {
    for (const std::string& payload :
         {std::string(depth, '[') + std::string(depth, ']'),
          std::string(depth / 2, '[') + std::string(depth / 2, '{'),  // unbalanced, not JSON
          [depth] {
            std::string nested;
            for (std::size_t i = 0; i < depth / 8; ++i) nested += "{\"a\":[";
            return nested + "1";  // cut short: not JSON either
          }()}) {
      store_payload(payload);
      for (const std::vector<std::string>& args :
           std::vector<std::vector<std::string>>{{"dlq", "--db", db, "show", "1", "--json"},
                                                 {"dlq", "--db", db, "list", "--json"},
                                                 {"dlq", "--db", db, "show", "1"},
                                                 {"dlq", "--db", db, "list"}}) {
        const std::string out = dir.file("out.txt");
        const auto start = std::chrono::steady_clock::now();
        const KeelRun r = run_keel(args, {.stdout_path = out});
        const auto took = std::chrono::steady_clock::now() - start;
        const std::string what = args[3] + (args.back() == "--json" ? " --json" : "") + " of " +
                                 std::to_string(payload.size()) + " bytes";
        EXPECT_EQ(r.status, 0) << what << ": " << r.err;
        const auto size = std::filesystem::file_size(out);
        EXPECT_LE(size, 2 * payload.size() + 4096) << what;
        EXPECT_LT(took, std::chrono::seconds(10)) << what;
        if (args[3] == "show" && args.back() == "--json" && payload[0] == '[') {
          EXPECT_NE(slurp(out).find("\"payload\": \"" + payload.substr(0, 16)), std::string::npos)
              << what << ": shown as a JSON string";
        }
      }
    }
  }
  // A payload within the depth limit is shown as JSON, compact, after the job's fields.
  store_payload(R"({"order": [1, {"id": 7}]})");
  const KeelRun shown = run_keel({"dlq", "--db", db, "show", "1", "--json"});
  EXPECT_EQ(shown.status, 0) << shown.err;
  EXPECT_NE(shown.out.find(R"("payload": {"order":[1,{"id":7}]})"), std::string::npos) << shown.out;
  EXPECT_NE(shown.out.find(R"("dead_reason": "permanent: test")"), std::string::npos) << shown.out;
  const KeelRun listed = run_keel({"dlq", "--db", db, "list", "--json"});
  EXPECT_EQ(listed.status, 0) << listed.err;
  EXPECT_NE(listed.out.find("[\n  {\n    \"attempts\""), std::string::npos) << listed.out;
  EXPECT_NE(listed.out.find(R"(    "payload": {"order":[1,{"id":7}]})"), std::string::npos)
      << listed.out;
}

}  // namespace
