// The SIGKILL drill for consumer deduplication: a consumer process (consumer_kill_helper.cpp)
// applies an at-least-once stream (1,000 messages, each 1 to 3 times, shuffled) through
// keel::store::ProcessedMessages and is killed with SIGKILL at random points, then restarted
// from its saved offset, until it reaches the end. Every message's effect is applied exactly
// once, on SQLite and on PostgreSQL.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>

#include "keel/consumers/processed_messages.hpp"
#include "support/test_support.hpp"

extern char** environ;

namespace keel::store {
namespace {

using namespace std::chrono_literals;

class ConsumerKillDrillTest : public test::BackendTest {};

// Runs the helper; kills it with SIGKILL after `kill_after` unless it exits first. Returns its
// exit status, or -1 when it was killed.
int run_helper(const std::vector<std::string>& args, std::chrono::microseconds kill_after) {
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) return -2;
  const auto until = std::chrono::steady_clock::now() + kill_after;
  int status = 0;
  while (std::chrono::steady_clock::now() < until) {
    if (waitpid(pid, &status, WNOHANG) == pid) {
      return WIFEXITED(status) ? WEXITSTATUS(status) : -3;
    }
    std::this_thread::sleep_for(200us);
  }
  ::kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  if (WIFEXITED(status)) return WEXITSTATUS(status);  // it finished just before the kill
  return -1;
}

TEST_P(ConsumerKillDrillTest, EveryMessageAppliedOnceThroughRandomKills) {
  {
    auto conn = open_database(url());
    ProcessedMessages::migrate(*conn);
    conn->execute("CREATE TABLE ledger (message TEXT NOT NULL, amount BIGINT NOT NULL)");
    conn->execute("CREATE TABLE balance (total BIGINT NOT NULL)");
    conn->execute("INSERT INTO balance (total) VALUES (0)");
  }
  constexpr int kMessages = 1000;
  std::mt19937 rng(GetParam() == Backend::kSqlite ? 1 : 2);
  std::vector<int> stream;
  std::int64_t expected_total = 0;
  for (int m = 0; m < kMessages; ++m) {
    expected_total += m;
    const int times = 1 + static_cast<int>(rng() % 3);
    for (int t = 0; t < times; ++t) stream.push_back(m);
  }
  std::shuffle(stream.begin(), stream.end(), rng);
  const auto input = dir().path() / "stream.txt";
  const auto offset = dir().path() / "offset";
  {
    std::ofstream out(input);
    for (const int m : stream) out << "msg-" << m << " " << m << "\n";
  }
  int kills = 0;
  int exit_status = -1;
  // The kill comes at a random time within a window that doubles after a run that made no
  // progress (a loaded machine may not even connect within the first window), so the drill ends
  // however slow the machine is, and still kills at random points while it is fast enough.
  const auto read_offset = [&] {
    std::ifstream in(offset);
    std::string text;
    std::getline(in, text);
    return text;
  };
  std::uint32_t window_us = 32000;
  for (int run = 0; run < 500 && exit_status != 0; ++run) {
    const std::string before = read_offset();
    const auto after = std::chrono::microseconds(2000 + rng() % window_us);
    exit_status =
        run_helper({KEEL_CONSUMER_KILL_HELPER, url_text(), input.string(), offset.string()}, after);
    if (exit_status == -1) ++kills;
    ASSERT_TRUE(exit_status == 0 || exit_status == -1) << "helper exited " << exit_status;
    window_us = read_offset() == before ? std::min<std::uint32_t>(window_us * 2, 4000000) : 32000;
  }
  ASSERT_EQ(exit_status, 0) << "the consumer never reached the end of its input";
  auto conn = open_database(url());
  EXPECT_EQ(conn->query("SELECT COUNT(*) FROM ledger").integer(0, 0), kMessages);
  EXPECT_EQ(conn->query("SELECT COUNT(DISTINCT message) FROM ledger").integer(0, 0), kMessages);
  EXPECT_EQ(conn->query("SELECT total FROM balance").integer(0, 0), expected_total);
  EXPECT_EQ(conn->query("SELECT COUNT(*) FROM keel_processed_messages").integer(0, 0), kMessages);
  EXPECT_GE(kills, 3);
  std::printf("kill drill (%s): %d messages, %zu deliveries in the stream, %d SIGKILLs\n",
              std::string(to_string(GetParam())).c_str(), kMessages, stream.size(), kills);
}

INSTANTIATE_TEST_SUITE_P(Backends, ConsumerKillDrillTest,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         test::backend_name);

}  // namespace
}  // namespace keel::store
