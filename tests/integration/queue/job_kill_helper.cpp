// A worker process for the transactional handler SIGKILL drill (job_kill_drill_test.cpp): runs a
// keel::store::Worker over the queue "drill" until it is idle. Each job's handler inserts one
// row (job, attempt) into the table `effects`, then, for a seeded pseudo-random choice of
// (job, attempt), kills its own process with SIGKILL: after the insert, before the handler
// returns, so between the effect and the job's completion.
//
//   job_kill_helper DATABASE_URL MODE SEED KILL_PERCENT
//
// MODE "tx": a TransactionalJobHandler; the insert goes through the job's transaction and
// commits with the completion, so a kill rolls it back. MODE "plain": a JobHandler that inserts
// on a connection of its own (committed at once) and reports a success; a kill leaves the row
// and the job unfinished, so the job's next attempt inserts a second row.
//
// The queue's options (lease, backoff) are fixed here so that every run uses the same ones.
// Exits 0 when the queue is idle, 1 on an error, 2 on bad usage; a kill ends it with SIGKILL.
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "keel/db/database.hpp"
#include "keel/queue/queue.hpp"
#include "keel/queue/queue_worker.hpp"

namespace store = keel::store;

namespace {

using namespace std::chrono_literals;

std::uint64_t mix(std::uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Whether this attempt of this job kills the process: the same answer in every run.
bool kill_here(std::uint64_t seed, const store::LeasedJob& job, int percent) {
  const std::uint64_t h = mix(seed ^ mix(static_cast<std::uint64_t>(job.id) * 1000003ULL +
                                         static_cast<std::uint64_t>(job.attempt)));
  return static_cast<int>(h % 100) < percent;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: job_kill_helper DATABASE_URL tx|plain SEED KILL_PERCENT\n");
    return 2;
  }
  const std::string mode = argv[2];
  if (mode != "tx" && mode != "plain") {
    std::fprintf(stderr, "job_kill_helper: MODE must be tx or plain, not '%s'\n", argv[2]);
    return 2;
  }
  const std::uint64_t seed = std::strtoull(argv[3], nullptr, 10);
  const int percent = std::atoi(argv[4]);
  try {
    store::ConnectionPool pool(store::parse_database_url(argv[1]).value(), {.max_connections = 6});
    // Short leases, so that the jobs of a killed run come back quickly; small backoffs.
    const store::JobQueue queue(
        {.backoff = {.base = 5ms, .cap = 40ms}, .lease = 400ms, .seed = seed + 1});
    const store::WorkerOptions options{.queue = "drill",
                                       .concurrency = 2,
                                       .batch = 2,
                                       .poll_interval = 10ms,
                                       .exit_when_idle = true,
                                       .log = [](std::string_view line) {
                                         std::fprintf(stderr, "worker: %.*s\n",
                                                      static_cast<int>(line.size()), line.data());
                                       }};
    std::int64_t recorded = 0;
    if (mode == "tx") {
      store::Worker worker(
          pool, queue, options,
          [&](store::Connection& tx, const store::LeasedJob& job, const std::atomic<bool>&) {
            tx.query("INSERT INTO effects (job, attempt) VALUES ($1, $2)", {job.id, job.attempt});
            if (kill_here(seed, job, percent)) std::raise(SIGKILL);
            return store::AttemptReport::success();
          });
      recorded = worker.run();
      if (worker.failed()) throw std::runtime_error(worker.failure());
    } else {
      store::Worker worker(pool, queue, options,
                           [&](const store::LeasedJob& job, const std::atomic<bool>&) {
                             auto conn = pool.acquire();
                             conn->query("INSERT INTO effects (job, attempt) VALUES ($1, $2)",
                                         {job.id, job.attempt});
                             if (kill_here(seed, job, percent)) std::raise(SIGKILL);
                             return store::AttemptReport::success();
                           });
      recorded = worker.run();
      if (worker.failed()) throw std::runtime_error(worker.failure());
    }
    std::printf("%lld attempts recorded\n", static_cast<long long>(recorded));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "job_kill_helper: %s\n", e.what());
    return 1;
  }
}
