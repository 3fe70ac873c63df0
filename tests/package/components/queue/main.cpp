// A program on keel's job queue alone: an SQLite queue, one job enqueued twice under one key.
#include <cstdio>
#include <keel/db/database.hpp>
#include <keel/queue/queue.hpp>

int main() {
  auto conn =
      keel::store::open_database(keel::store::parse_database_url("sqlite::memory:").value());
  keel::store::JobQueue::migrate(*conn);
  const keel::store::JobQueue queue;
  const auto first =
      queue.enqueue(*conn, {.queue = "hooks", .payload = R"({"order": 1})", .key = "order-1"});
  const auto again =
      queue.enqueue(*conn, {.queue = "hooks", .payload = R"({"order": 1})", .key = "order-1"});
  const auto stats = queue.stats(*conn);
  const bool ok = first.ok() && first.created && again.ok() && !again.created &&
                  stats.size() == 1 && stats[0].ready == 1;
  std::printf("queue: %s, %zu queue(s), %lld ready\n", ok ? "ok" : "FAIL", stats.size(),
              stats.empty() ? 0LL : static_cast<long long>(stats[0].ready));
  return ok ? 0 : 1;
}
