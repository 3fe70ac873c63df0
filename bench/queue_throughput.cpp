// Job-queue throughput: jobs per second through enqueue + lease + done with a no-op handler,
// W worker threads each on its own connection, on SQLite or PostgreSQL. With --batch B each
// thread enqueues B jobs in one transaction, then records the success of the jobs it holds and
// leases up to B more in one step (JobQueue::complete_and_lease: one statement on PostgreSQL,
// one transaction on SQLite); --batch 1 enqueues with one statement.
//
//   keel_bench_queue --db URL [--jobs N] [--workers W] [--batch B] [--worker 1]
//
// --worker 1 drains through keel::store::Worker instead (what `keel jobs work` runs): the jobs are
// enqueued first, then one Worker with concurrency W and batch B drains them with a no-op
// handler; the line adds the log lines that mention a deadlock (40P01) and the jobs that ran more
// than once (a lease that expired).
//
// Prints one line: backend=... batch=... workers=... jobs=... seconds=... jobs_per_s=...
// scripts/bench-queue.sh runs it next to pgbench on the same server.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "keel/store/database.hpp"
#include "keel/store/queue.hpp"
#include "keel/store/queue_worker.hpp"

namespace {

int usage() {
  std::fprintf(stderr,
               "usage: keel_bench_queue --db URL [--jobs N] [--workers W] [--batch B]"
               " [--worker 1]\n");
  return 2;
}

// --worker 1: enqueue everything, then drain with one keel::store::Worker.
int run_worker(const keel::store::DatabaseUrl& url, const keel::store::JobQueue& q,
               const std::string& queue, int jobs, int workers, int batch) {
  {
    auto conn = keel::store::open_database(url);
    constexpr int kChunk = 1000;
    for (int done = 0; done < jobs; done += kChunk) {
      std::vector<keel::store::EnqueueRequest> reqs(
          static_cast<std::size_t>(std::min(kChunk, jobs - done)),
          keel::store::EnqueueRequest{.queue = queue, .payload = "{}"});
      (void)q.enqueue_many(*conn, reqs);
    }
  }
  keel::store::ConnectionPool pool(url, {.max_connections = workers + 2});
  std::mutex mu;
  int deadlock_lines = 0;
  int log_lines = 0;
  keel::store::Worker worker(pool, q,
                             {.queue = queue,
                              .concurrency = workers,
                              .batch = batch,
                              .poll_interval = std::chrono::milliseconds(5),
                              .exit_when_idle = true,
                              .log =
                                  [&](std::string_view line) {
                                    std::lock_guard lock(mu);
                                    ++log_lines;
                                    if (line.find("40P01") != std::string_view::npos ||
                                        line.find("deadlock") != std::string_view::npos) {
                                      ++deadlock_lines;
                                    }
                                    if (log_lines <= 3)
                                      std::fprintf(stderr, "worker: %.*s\n", int(line.size()),
                                                   line.data());
                                  }},
                             [](const keel::store::LeasedJob&, const std::atomic<bool>&) {
                               return keel::store::AttemptReport::success();
                             });
  const auto start = std::chrono::steady_clock::now();
  const std::int64_t recorded = worker.run();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  auto conn = keel::store::open_database(url);
  const std::int64_t reruns =
      conn->query("SELECT COUNT(*) FROM keel_jobs WHERE queue = $1 AND attempts > 1", {queue})
          .integer(0, 0);
  std::printf(
      "backend=%s mode=worker batch=%d workers=%d jobs=%d seconds=%.3f jobs_per_s=%.1f"
      " recorded=%lld deadlock_log_lines=%d rerun_jobs=%lld\n",
      std::string(keel::store::to_string(url.backend)).c_str(), batch, workers, jobs, seconds,
      jobs / seconds, static_cast<long long>(recorded), deadlock_lines,
      static_cast<long long>(reruns));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string db;
  int jobs = 2000;
  int workers = 2;
  int batch = 1;
  bool use_worker = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const char* v = argv[i + 1];
    if (flag == "--db") {
      db = v;
    } else if (flag == "--jobs") {
      jobs = std::atoi(v);
    } else if (flag == "--workers") {
      workers = std::atoi(v);
    } else if (flag == "--batch") {
      batch = std::atoi(v);
    } else if (flag == "--worker") {
      use_worker = std::atoi(v) != 0;
    } else {
      return usage();
    }
  }
  if (db.empty() || jobs < 1 || workers < 1 || batch < 1 || argc % 2 == 0) return usage();
  const auto url = keel::store::parse_database_url(db);
  if (!url) {
    std::fprintf(stderr, "keel_bench_queue: %s\n", url.error().in("--db").message().c_str());
    return 2;
  }
  {
    auto conn = keel::store::open_database(*url);
    keel::store::JobQueue::migrate(*conn);
  }
  const std::string queue =
      "bench-" + std::to_string(getpid()) + "-" + std::to_string(batch) + "-" +
      std::to_string(std::chrono::steady_clock::now().time_since_epoch().count() % 1000000);
  keel::store::JobQueue q({.lease = std::chrono::minutes(5), .seed = 1});
  if (use_worker) return run_worker(*url, q, queue, jobs, workers, batch);
  std::atomic<int> remaining_to_enqueue{jobs};
  std::atomic<int> completed{0};
  std::atomic<bool> failed{false};

  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      try {
        auto conn = keel::store::open_database(*url);
        const std::string name = "bench-worker-" + std::to_string(w);
        // The jobs this thread holds: their success is recorded in the same step that leases
        // the next ones (JobQueue::complete_and_lease), one statement on PostgreSQL.
        std::vector<std::pair<std::int64_t, std::int64_t>> held;
        while (completed.load() < jobs) {
          // Enqueue this thread's next share.
          const int take = std::min(batch, std::max(0, remaining_to_enqueue.fetch_sub(batch)));
          if (take > 0) {
            std::vector<keel::store::EnqueueRequest> reqs(
                static_cast<std::size_t>(take),
                keel::store::EnqueueRequest{.queue = queue, .payload = "{}"});
            if (take == 1) {
              (void)q.enqueue(*conn, reqs.front());
            } else {
              (void)q.enqueue_many(*conn, reqs);
            }
          }
          const keel::store::DoneAndLeased step =
              q.complete_and_lease(*conn, held, queue, name, batch);
          completed.fetch_add(step.current);
          held.clear();
          for (const auto& j : step.leased) held.emplace_back(j.id, j.fence);
          if (held.empty() && take <= 0) std::this_thread::yield();
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "keel_bench_queue: %s\n", e.what());
        failed = true;
        completed.store(jobs);
      }
    });
  }
  for (auto& t : threads) t.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (failed.load()) return 1;
  std::printf("backend=%s batch=%d workers=%d jobs=%d seconds=%.3f jobs_per_s=%.1f\n",
              std::string(keel::store::to_string(url->backend)).c_str(), batch, workers, jobs,
              seconds, jobs / seconds);
  return 0;
}
