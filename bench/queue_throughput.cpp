// Job-queue throughput: jobs per second through enqueue + lease + done with a no-op handler,
// W worker threads each on its own connection, on SQLite or PostgreSQL. With --batch B each
// thread enqueues B jobs in one transaction, then records the success of the jobs it holds and
// leases up to B more in one step (JobQueue::complete_and_lease: one statement on PostgreSQL,
// one transaction on SQLite); --batch 1 enqueues with one statement.
//
//   keel_bench_queue --db URL [--jobs N] [--workers W] [--batch B]
//                    [--worker 1 [--processes P] [--seconds S]]
//   keel_bench_queue --db URL --latency N [--producer thread|process] [--gap-ms G] [--poll-ms P]
//
// --worker 1 drains through keel::store::Worker instead (what `keel jobs work` runs): the jobs are
// enqueued first, then one Worker with concurrency W and batch B drains them with a no-op
// handler (with --processes P, one Worker in each of P processes, W / P slots each; with
// --seconds S, each stops after S seconds and the rate counts the jobs done by then); the line
// adds the log lines that mention a deadlock (40P01) and the jobs that ran more than once (a
// lease that expired).
//
// --enqueue C measures the producer alone: W threads enqueue N jobs, C per call (1:
// JobQueue::enqueue, one statement; more: enqueue_many, one multi-row INSERT per call).
//
// --cycle 1 measures enqueue and drain together, as a user's service and its workers run: W
// producer threads enqueue N jobs, B per call, while one keel::store::Worker with W slots and
// batch B drains them; the rate is N over the time until the last job was recorded.
//
// --storm N measures what wakeups cost a busy queue: P worker processes (--processes, default 8;
// one slot each, batch B, WorkerOptions::wakeups from --wakeups 1|0) wait on an empty queue, then
// 4 producer threads enqueue N jobs one per call. Prints the producers' time, the time until
// every job was done, the server's transactions per job (pg_stat_database) and the workers' CPU;
// with KEEL_BENCH_WAKEUPS set, each worker's wakeup counters and its log lines on stderr.
//
// --latency N measures pickup latency instead: one keel::store::Worker with the default options
// (concurrency 1; --poll-ms sets WorkerOptions::poll_interval) waits on an empty queue while a
// producer enqueues N jobs one at a time, G ms apart (default 100, plus up to 20 ms of random
// spread), each carrying its enqueue time (CLOCK_REALTIME, taken right before enqueue is called);
// the handler records now - that time. --producer thread enqueues from a thread of this process
// (its own connection and JobQueue), --producer process from a child process forked before any
// thread starts. Prints the median, p90, p99 and max.
//
// --soak R runs a steady load for --seconds S: one producer thread enqueues R jobs a second (in
// bulk, every 10 ms its share) while one keel::store::Worker with W slots and batch B runs a
// no-op handler, as `keel jobs work` would with its defaults. Prints a line a second
// (soak t=... enqueued=... handled=... backlog=...) and, at the end, the summary line.
// scripts/bench-soak.sh runs it next to graphile-worker and pg-boss with a snapshot held.
//
// Prints one line: backend=... batch=... workers=... jobs=... seconds=... jobs_per_s=...
// scripts/bench-queue.sh runs it next to pgbench on the same server.
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "keel/db/database.hpp"
#include "keel/queue/queue.hpp"
#include "keel/queue/queue_worker.hpp"

namespace {

int usage() {
  std::fprintf(stderr,
               "usage: keel_bench_queue --db URL [--jobs N] [--workers W] [--batch B]"
               " [--worker 1 [--processes P] [--seconds S]]\n"
               "       keel_bench_queue --db URL [--jobs N] [--workers W] --enqueue C\n"
               "       keel_bench_queue --db URL [--jobs N] [--workers W] [--batch B] --cycle 1\n"
               "       keel_bench_queue --db URL --storm N [--processes P] [--wakeups 1|0]\n"
               "       keel_bench_queue --db URL --soak R [--seconds S] [--workers W] [--batch B]\n"
               "       (--keep-done 0 with any of them: each success deletes its job)\n"
               "       keel_bench_queue --db URL --latency N [--producer thread|process]"
               " [--gap-ms G] [--poll-ms P]\n");
  return 2;
}

// One keel::store::Worker with `workers` slots and batch `batch` drains `queue` with a no-op
// handler until it is idle or `seconds` have passed (0: no limit). Returns what it recorded.
std::int64_t drain(const keel::store::DatabaseUrl& url, const keel::store::JobQueue& q,
                   const std::string& queue, int workers, int batch, double seconds,
                   int* deadlock_lines) {
  keel::store::ConnectionPool pool(url, {.max_connections = workers + 2});
  std::mutex mu;
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
                                      ++*deadlock_lines;
                                    }
                                    if (log_lines <= 3)
                                      std::fprintf(stderr, "worker: %.*s\n", int(line.size()),
                                                   line.data());
                                  }},
                             [](const keel::store::LeasedJob&, const std::atomic<bool>&) {
                               return keel::store::AttemptReport::success();
                             });
  std::mutex stop_mu;
  std::condition_variable stop_cv;
  bool finished = false;
  std::thread timer([&] {
    if (seconds <= 0) return;
    std::unique_lock lock(stop_mu);
    if (!stop_cv.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return finished; })) {
      worker.stop();
    }
  });
  const std::int64_t recorded = worker.run();
  {
    std::lock_guard lock(stop_mu);
    finished = true;
  }
  stop_cv.notify_all();
  timer.join();
  return recorded;
}

// --worker 1: enqueue everything, then drain with keel::store::Worker, in this process or (with
// --processes P > 1) in P child processes forked before any thread starts, each with
// max(1, W / P) slots. The rate counts the jobs done when the last worker returned.
int run_worker(const keel::store::DatabaseUrl& url, const keel::store::JobQueue& q,
               const std::string& queue, int jobs, int workers, int batch, int processes,
               double seconds) {
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
  int deadlock_lines = 0;
  const auto start = std::chrono::steady_clock::now();
  if (processes <= 1) {
    (void)drain(url, q, queue, workers, batch, seconds, &deadlock_lines);
  } else {
    std::vector<pid_t> children;
    for (int p = 0; p < processes; ++p) {
      const pid_t child = fork();
      if (child == 0) {
        int lines = 0;
        (void)drain(url, q, queue, std::max(1, workers / processes), batch, seconds, &lines);
        _exit(lines > 0 ? 3 : 0);
      }
      if (child < 0) return 1;
      children.push_back(child);
    }
    for (const pid_t child : children) {
      int status = 0;
      waitpid(child, &status, 0);
      if (WIFEXITED(status) && WEXITSTATUS(status) == 3) ++deadlock_lines;
    }
  }
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  auto conn = keel::store::open_database(url);
  const keel::store::Rows counts = conn->query(
      "SELECT COUNT(*) FILTER (WHERE state = 'done'),"
      " COUNT(*) FILTER (WHERE attempts > 1), COUNT(*) FROM keel_jobs WHERE queue = $1",
      {queue});
  // A queue that keeps no done job (--keep-done 0): the jobs gone are the ones done.
  const std::int64_t done =
      q.options().keep_done ? counts.integer(0, 0) : jobs - counts.integer(0, 2);
  std::printf(
      "backend=%s mode=worker batch=%d workers=%d processes=%d jobs=%lld seconds=%.3f"
      " jobs_per_s=%.1f deadlock_log_lines=%d rerun_jobs=%lld\n",
      std::string(keel::store::to_string(url.backend)).c_str(), batch, workers,
      std::max(1, processes), static_cast<long long>(done), elapsed,
      static_cast<double>(done) / elapsed, deadlock_lines,
      static_cast<long long>(counts.integer(0, 1)));
  return 0;
}

double since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// --enqueue C: W threads enqueue N jobs between them, C per call.
int run_enqueue(const keel::store::DatabaseUrl& url, const keel::store::JobQueue& q,
                const std::string& queue, int jobs, int workers, int chunk) {
  {
    auto conn = keel::store::open_database(url);  // the queue's row exists
    (void)q.enqueue(*conn, {.queue = queue, .payload = "{}"});
  }
  std::atomic<int> left{jobs};
  std::atomic<bool> failed{false};
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&] {
      try {
        auto conn = keel::store::open_database(url);
        for (;;) {
          const int take = std::min(chunk, left.fetch_sub(chunk));
          if (take <= 0) break;
          if (take == 1) {
            if (!q.enqueue(*conn, {.queue = queue, .payload = "{}"}).ok()) failed = true;
          } else {
            const std::vector<keel::store::EnqueueRequest> reqs(
                static_cast<std::size_t>(take),
                keel::store::EnqueueRequest{.queue = queue, .payload = "{}"});
            for (const auto& r : q.enqueue_many(*conn, reqs)) {
              if (!r.ok()) failed = true;
            }
          }
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "keel_bench_queue: %s\n", e.what());
        failed = true;
      }
    });
  }
  for (auto& t : threads) t.join();
  const double seconds = since(start);
  if (failed.load()) return 1;
  std::printf("backend=%s mode=enqueue chunk=%d workers=%d jobs=%d seconds=%.3f jobs_per_s=%.1f\n",
              std::string(keel::store::to_string(url.backend)).c_str(), chunk, workers, jobs,
              seconds, jobs / seconds);
  return 0;
}

// --cycle 1: W producer threads enqueue N jobs, B per call, while one Worker with W slots and
// batch B drains them.
int run_cycle(const keel::store::DatabaseUrl& url, const keel::store::JobQueue& q,
              const std::string& queue, int jobs, int workers, int batch) {
  {
    auto conn = keel::store::open_database(url);  // the queue's row exists; one job fewer below
    (void)q.enqueue(*conn, {.queue = queue, .payload = "{}"});
  }
  keel::store::ConnectionPool pool(url, {.max_connections = workers + 2});
  std::atomic<int> recorded{0};
  keel::store::Worker* self = nullptr;
  keel::store::Worker worker(pool, q,
                             {.queue = queue,
                              .concurrency = workers,
                              .batch = batch,
                              .on_event =
                                  [&](const keel::store::WorkerEvent& e) {
                                    if (e.result.status == keel::store::CompleteStatus::kDone &&
                                        recorded.fetch_add(1) + 1 == jobs) {
                                      self->stop();
                                    }
                                  },
                              .log =
                                  [](std::string_view line) {
                                    std::fprintf(stderr, "worker: %.*s\n", int(line.size()),
                                                 line.data());
                                  }},
                             [](const keel::store::LeasedJob&, const std::atomic<bool>&) {
                               return keel::store::AttemptReport::success();
                             });
  self = &worker;
  std::atomic<int> left{jobs - 1};
  std::atomic<bool> failed{false};
  const auto start = std::chrono::steady_clock::now();
  std::thread runner([&] { (void)worker.run(); });
  std::vector<std::thread> producers;
  for (int w = 0; w < workers; ++w) {
    producers.emplace_back([&] {
      try {
        auto conn = keel::store::open_database(url);
        for (;;) {
          const int take = std::min(batch, left.fetch_sub(batch));
          if (take <= 0) break;
          if (take == 1) {
            (void)q.enqueue(*conn, {.queue = queue, .payload = "{}"});
          } else {
            (void)q.enqueue_many(
                *conn, std::vector<keel::store::EnqueueRequest>(static_cast<std::size_t>(take),
                                                                {.queue = queue, .payload = "{}"}));
          }
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "keel_bench_queue: %s\n", e.what());
        failed = true;
      }
    });
  }
  for (auto& t : producers) t.join();
  if (failed.load()) worker.stop();
  runner.join();
  const double seconds = since(start);
  if (failed.load()) return 1;
  std::printf("backend=%s mode=cycle batch=%d workers=%d jobs=%d seconds=%.3f jobs_per_s=%.1f\n",
              std::string(keel::store::to_string(url.backend)).c_str(), batch, workers,
              recorded.load(), seconds, recorded.load() / seconds);
  return 0;
}

// --soak R: a producer at R jobs a second and one Worker, for `seconds`; a line a second.
int run_soak(const keel::store::DatabaseUrl& url, const keel::store::JobQueue& q,
             const std::string& queue, double rate, double seconds, int workers, int batch) {
  keel::store::ConnectionPool pool(url, {.max_connections = workers + 2});
  std::atomic<std::int64_t> handled{0};
  std::atomic<std::int64_t> enqueued{0};
  std::atomic<bool> stop{false};
  std::atomic<bool> failed{false};
  keel::store::Worker worker(pool, q,
                             {.queue = queue,
                              .concurrency = workers,
                              .batch = batch,
                              .log =
                                  [](std::string_view line) {
                                    std::fprintf(stderr, "worker: %.*s\n", int(line.size()),
                                                 line.data());
                                  }},
                             [&](const keel::store::LeasedJob&, const std::atomic<bool>&) {
                               handled.fetch_add(1);
                               return keel::store::AttemptReport::success();
                             });
  std::thread runner([&] { (void)worker.run(); });
  const auto start = std::chrono::steady_clock::now();
  std::thread producer([&] {
    try {
      auto conn = keel::store::open_database(url);
      double owed = 0;
      auto tick = start;
      while (!stop.load()) {
        tick += std::chrono::milliseconds(10);
        std::this_thread::sleep_until(tick);
        owed += rate / 100;
        const auto take = static_cast<std::size_t>(owed);
        if (take == 0) continue;
        owed -= static_cast<double>(take);
        if (take == 1) {
          (void)q.enqueue(*conn, {.queue = queue, .payload = "{}"});
        } else {
          (void)q.enqueue_many(*conn, std::vector<keel::store::EnqueueRequest>(
                                          take, {.queue = queue, .payload = "{}"}));
        }
        enqueued.fetch_add(static_cast<std::int64_t>(take));
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "keel_bench_queue: %s\n", e.what());
      failed = true;
    }
  });
  std::int64_t last = 0;
  const int whole = static_cast<int>(seconds);
  for (int t = 1; t <= whole && !failed.load(); ++t) {
    std::this_thread::sleep_until(start + std::chrono::seconds(t));
    const std::int64_t h = handled.load();
    const std::int64_t e = enqueued.load();
    std::printf("soak t=%d enqueued=%lld handled=%lld backlog=%lld\n", t, static_cast<long long>(e),
                static_cast<long long>(h - last), static_cast<long long>(e - h));
    std::fflush(stdout);
    last = h;
  }
  stop = true;
  producer.join();
  worker.stop();
  runner.join();
  if (failed.load()) return 1;
  std::printf(
      "backend=%s mode=soak rate=%.0f batch=%d workers=%d enqueued=%lld handled=%lld"
      " seconds=%d\n",
      std::string(keel::store::to_string(url.backend)).c_str(), rate, batch, workers,
      static_cast<long long>(enqueued.load()), static_cast<long long>(handled.load()), whole);
  return 0;
}

std::int64_t server_transactions(keel::store::Connection& conn) {
  return conn
      .query(
          "SELECT xact_commit + xact_rollback FROM pg_stat_database"
          " WHERE datname = current_database()",
          {})
      .integer(0, 0);
}

// --storm N: P worker processes (one slot each) wait on an empty queue; 4 producer threads
// enqueue N jobs one per call.
int run_storm(const keel::store::DatabaseUrl& url, const keel::store::JobQueue& q,
              const std::string& queue, int jobs, int processes, int batch, bool wakeups) {
  constexpr int kProducers = 4;
  {
    auto conn = keel::store::open_database(url);  // the queue's row exists
    (void)q.enqueue(*conn, {.queue = queue, .payload = "{}"});
  }
  std::int64_t xacts_before = 0;
  {
    auto conn = keel::store::open_database(url);
    xacts_before = server_transactions(*conn);
  }
  // The workers, forked before any thread of this process starts; each stops when its pipe
  // closes.
  int stop_pipe[2] = {-1, -1};
  if (pipe(stop_pipe) != 0) return 1;
  std::vector<pid_t> children;
  for (int p = 0; p < processes; ++p) {
    const pid_t child = fork();
    if (child < 0) return 1;
    if (child > 0) {
      children.push_back(child);
      continue;
    }
    close(stop_pipe[1]);
    keel::store::ConnectionPool pool(url, {.max_connections = 3});
    keel::store::Worker worker(pool, q,
                               {.queue = queue,
                                .concurrency = 1,
                                .batch = batch,
                                // With KEEL_BENCH_WAKEUPS set, the workers' own lines (a
                                // listener that failed, a database outage) go to stderr too.
                                .log =
                                    [](std::string_view line) {
                                      if (std::getenv("KEEL_BENCH_WAKEUPS") != nullptr) {
                                        std::fprintf(stderr, "worker: %.*s\n",
                                                     static_cast<int>(line.size()), line.data());
                                      }
                                    },
                                .wakeups = wakeups},
                               [](const keel::store::LeasedJob&, const std::atomic<bool>&) {
                                 return keel::store::AttemptReport::success();
                               });
    std::thread stopper([&] {
      char c = 0;
      while (read(stop_pipe[0], &c, 1) > 0) {
      }
      worker.stop();
    });
    (void)worker.run();
    stopper.join();
    if (std::getenv("KEEL_BENCH_WAKEUPS") != nullptr) {
      const keel::store::WorkerWakeups w = worker.wakeup_counts();
      std::fprintf(stderr,
                   "worker %d: notifications=%lld deferred=%lld local=%lld due_checks=%lld"
                   " woken_leases=%lld lost=%lld\n",
                   p, static_cast<long long>(w.notifications),
                   static_cast<long long>(w.deferred_notifications),
                   static_cast<long long>(w.local), static_cast<long long>(w.due_checks),
                   static_cast<long long>(w.woken_leases), static_cast<long long>(w.lost_wakeups));
    }
    _exit(0);
  }
  close(stop_pipe[0]);
  std::this_thread::sleep_for(std::chrono::seconds(2));  // the workers are idle and listening
  auto conn = keel::store::open_database(url);
  std::atomic<int> left{jobs};
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> producers;
  for (int w = 0; w < kProducers; ++w) {
    producers.emplace_back([&] {
      auto c = keel::store::open_database(url);
      while (left.fetch_sub(1) > 0) (void)q.enqueue(*c, {.queue = queue, .payload = "{}"});
    });
  }
  for (auto& t : producers) t.join();
  const double produced = since(start);
  for (;;) {  // until every job is done
    const keel::store::Rows r =
        conn->query("SELECT COUNT(*) FROM keel_jobs WHERE queue = $1 AND state <> 'done'", {queue});
    if (r.integer(0, 0) == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const double drained = since(start);
  close(stop_pipe[1]);
  for (const pid_t child : children) waitpid(child, nullptr, 0);
  rusage usage{};
  getrusage(RUSAGE_CHILDREN, &usage);
  const double cpu = static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
                     static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
  conn.reset();
  // A backend reports its counts when it exits or at most a second later.
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  auto after = keel::store::open_database(url);
  const std::int64_t xacts = server_transactions(*after) - xacts_before;
  std::printf(
      "backend=postgres mode=storm wakeups=%d processes=%d batch=%d jobs=%d produce_s=%.3f"
      " drain_s=%.3f xacts_per_job=%.2f worker_cpu_s=%.2f\n",
      wakeups ? 1 : 0, processes, batch, jobs, produced, drained, static_cast<double>(xacts) / jobs,
      cpu);
  return 0;
}

std::int64_t realtime_us() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return std::int64_t{ts.tv_sec} * 1'000'000 + ts.tv_nsec / 1000;
}

// The producer of --latency: N jobs, one at a time, `gap_ms` (plus up to 20 ms) apart.
void produce(const keel::store::DatabaseUrl& url, const std::string& queue, int jobs, int gap_ms) {
  keel::store::JobQueue q({.seed = 7});
  auto conn = keel::store::open_database(url);
  std::mt19937 gen(11);
  std::uniform_int_distribution<int> spread(0, 20);
  for (int i = 0; i < jobs; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(gap_ms + spread(gen)));
    const std::string payload = R"({"t":)" + std::to_string(realtime_us()) + "}";
    (void)q.enqueue(*conn, {.queue = queue, .payload = payload});
  }
}

int run_latency(const keel::store::DatabaseUrl& url, const keel::store::JobQueue& q,
                const std::string& queue, int jobs, bool process, int gap_ms, int poll_ms) {
  {
    auto conn = keel::store::open_database(url);  // the queue exists before the worker starts
    (void)q.enqueue(*conn, {.queue = queue, .payload = R"({"t":0})"});
  }
  int go[2] = {-1, -1};
  pid_t child = -1;
  if (process) {
    // Forked before any thread of this process starts.
    if (pipe(go) != 0) return 1;
    child = fork();
    if (child == 0) {
      close(go[1]);
      char c = 0;
      if (read(go[0], &c, 1) != 1) _exit(1);
      produce(url, queue, jobs, gap_ms);
      _exit(0);
    }
    close(go[0]);
  }
  keel::store::ConnectionPool pool(url, {.max_connections = 4});
  std::mutex mu;
  std::vector<double> latencies_ms;
  keel::store::Worker* self = nullptr;
  keel::store::WorkerOptions options{.queue = queue};
  if (poll_ms > 0) options.poll_interval = std::chrono::milliseconds(poll_ms);
  keel::store::Worker worker(pool, q, options,
                             [&](const keel::store::LeasedJob& job, const std::atomic<bool>&) {
                               const std::int64_t now = realtime_us();
                               const std::int64_t t = std::stoll(job.payload.substr(5));
                               std::lock_guard lock(mu);
                               if (t != 0)
                                 latencies_ms.push_back(static_cast<double>(now - t) / 1000.0);
                               if (static_cast<int>(latencies_ms.size()) == jobs) self->stop();
                               return keel::store::AttemptReport::success();
                             });
  self = &worker;
  std::thread runner([&] { (void)worker.run(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the worker is idle
  if (process) {
    if (write(go[1], "g", 1) != 1) return 1;
    close(go[1]);
    int status = 0;
    waitpid(child, &status, 0);
  } else {
    produce(url, queue, jobs, gap_ms);
  }
  runner.join();
  const keel::store::WorkerWakeups woken = worker.wakeup_counts();
  std::vector<double> order = latencies_ms;
  std::sort(latencies_ms.begin(), latencies_ms.end());
  const auto at = [&](double f) {
    return latencies_ms[std::min(
        latencies_ms.size() - 1,
        static_cast<std::size_t>(f * static_cast<double>(latencies_ms.size())))];
  };
  std::printf(
      "backend=%s mode=latency producer=%s jobs=%zu gap_ms=%d median_ms=%.2f p90_ms=%.2f"
      " p99_ms=%.2f max_ms=%.2f notifications=%lld local_wakeups=%lld woken_leases=%lld"
      " due_checks=%lld\n",
      std::string(keel::store::to_string(url.backend)).c_str(), process ? "process" : "thread",
      latencies_ms.size(), gap_ms, at(0.5), at(0.9), at(0.99), latencies_ms.back(),
      static_cast<long long>(woken.notifications), static_cast<long long>(woken.local),
      static_cast<long long>(woken.woken_leases), static_cast<long long>(woken.due_checks));
  if (std::getenv("KEEL_BENCH_SLOW") != nullptr) {
    for (std::size_t i = 0; i < order.size(); ++i) {
      if (order[i] > 20) std::fprintf(stderr, "job %zu: %.2f ms\n", i, order[i]);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string db;
  int jobs = 2000;
  int workers = 2;
  int batch = 1;
  bool use_worker = false;
  int latency = 0;
  bool process_producer = false;
  int gap_ms = 100;
  int poll_ms = 0;
  int processes = 1;
  double limit_s = 0;  // --seconds
  int enqueue_chunk = 0;
  bool cycle = false;
  int storm = 0;
  bool wakeups = true;
  bool processes_given = false;
  double soak = 0;
  bool keep_done = true;
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
    } else if (flag == "--latency") {
      latency = std::atoi(v);
    } else if (flag == "--producer") {
      if (std::strcmp(v, "thread") != 0 && std::strcmp(v, "process") != 0) return usage();
      process_producer = std::strcmp(v, "process") == 0;
    } else if (flag == "--gap-ms") {
      gap_ms = std::atoi(v);
    } else if (flag == "--processes") {
      processes = std::atoi(v);
      processes_given = true;
    } else if (flag == "--enqueue") {
      enqueue_chunk = std::atoi(v);
    } else if (flag == "--cycle") {
      cycle = std::atoi(v) != 0;
    } else if (flag == "--storm") {
      storm = std::atoi(v);
    } else if (flag == "--wakeups") {
      wakeups = std::atoi(v) != 0;
    } else if (flag == "--seconds") {
      limit_s = std::atof(v);
    } else if (flag == "--poll-ms") {
      poll_ms = std::atoi(v);
    } else if (flag == "--soak") {
      soak = std::atof(v);
    } else if (flag == "--keep-done") {
      keep_done = std::atoi(v) != 0;
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
  // The soak runs the queue as `keel jobs work` does, with its default options.
  keel::store::QueueOptions options =
      soak > 0 ? keel::store::QueueOptions{}
               : keel::store::QueueOptions{.lease = std::chrono::minutes(5), .seed = 1};
  options.keep_done = keep_done;
  keel::store::JobQueue q(options);
  if (latency > 0) {
    return run_latency(*url, q, queue, latency, process_producer, std::max(0, gap_ms), poll_ms);
  }
  if (soak > 0) return run_soak(*url, q, queue, soak, limit_s > 0 ? limit_s : 60, workers, batch);
  if (enqueue_chunk > 0) return run_enqueue(*url, q, queue, jobs, workers, enqueue_chunk);
  if (cycle) return run_cycle(*url, q, queue, jobs, workers, batch);
  if (storm > 0) {
    return run_storm(*url, q, queue, storm, processes_given ? processes : 8, batch, wakeups);
  }
  if (use_worker) return run_worker(*url, q, queue, jobs, workers, batch, processes, limit_s);
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
