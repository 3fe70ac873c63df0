// A worker with a dead-letter queue: keel::store's job queue on a temporary SQLite file.
//
//   1. Five jobs are enqueued on "hooks"; one of them is a poison job its handler cannot process.
//   2. A keel::store::Worker drains the queue: the good jobs are done; the poison job fails with a
//      transient error on every attempt, is retried with full-jitter backoff until its attempts
//      run out, and lands in the dead-letter queue (nothing is dropped silently).
//   3. The dead-letter queue is listed, with each job's reason and idempotency key.
//   4. The handler is "fixed" and the dead job replayed: it runs again with the SAME key, so a
//      receiver that saw an earlier attempt recognises it, and the queue ends empty.
#include <stdlib.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <keel/db/database.hpp>
#include <keel/queue/queue.hpp>
#include <keel/queue/queue_worker.hpp>
#include <string>

namespace store = keel::store;
using namespace std::chrono_literals;

namespace {

std::filesystem::path make_temp_dir() {
  const char* base = std::getenv("TMPDIR");
  std::string pattern =
      std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/keel-example.XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  return pattern;
}

bool check(bool condition, const char* what) {
  std::printf("  %s %s\n", condition ? "ok  " : "FAIL", what);
  return condition;
}

}  // namespace

int main() {
  const std::filesystem::path dir = make_temp_dir();
  bool ok = true;
  {
    store::ConnectionPool pool(
        store::parse_database_url("sqlite:" + (dir / "jobs.db").string()).value(),
        {.max_connections = 4});
    // Short delays so the example finishes at once; production defaults are base 1 s, cap 1 h.
    const store::JobQueue queue(
        {.max_attempts = 3, .backoff = {.base = 5ms, .cap = 20ms}, .lease = 30s});

    std::string poison_key;
    {
      auto conn = pool.acquire();
      store::JobQueue::migrate(*conn);
      for (int order = 1; order <= 5; ++order) {
        const bool poison = order == 3;
        const auto job = queue.enqueue(*conn, {.queue = "hooks",
                                               .payload = R"({"order": )" + std::to_string(order) +
                                                          (poison ? R"(, "poison": true})" : "}")});
        if (!job.ok()) {
          std::fprintf(stderr, "enqueue: %s\n", job.error.c_str());
          return 1;
        }
        if (poison) poison_key = job.idempotency_key;
      }
    }

    // The handler: in real life it delivers job.payload with job.idempotency_key and classifies
    // the result (keel::classify_http_status). The poison job fails until `fixed` is set.
    std::atomic<bool> fixed{false};
    std::atomic<int> poison_attempts{0};
    const store::JobHandler handler = [&](const store::LeasedJob& job, const std::atomic<bool>&) {
      if (job.payload.find("poison") != std::string::npos && !fixed.load()) {
        ++poison_attempts;
        return store::AttemptReport{.outcome = keel::Outcome::transient(),
                                    .error = "receiver answered 503"};
      }
      return store::AttemptReport::success();
    };
    const store::WorkerOptions options{
        .queue = "hooks",
        .concurrency = 2,
        .poll_interval = 5ms,
        .exit_when_idle = true,
        .on_event = [](const store::WorkerEvent& e) {
          std::printf("  job %lld attempt %d: %s\n", static_cast<long long>(e.job.id),
                      e.job.attempt, std::string(to_string(e.result.status)).c_str());
        }};

    std::printf("first run:\n");
    {
      store::Worker worker(pool, queue, options, handler);
      worker.run();
    }

    auto conn = pool.acquire();
    const auto dead = queue.list_dead(*conn, "hooks");
    std::printf("dead-letter queue (%zu):\n", dead.size());
    for (const auto& job : dead) {
      std::printf("  job %lld key %s: %s\n", static_cast<long long>(job.id),
                  job.idempotency_key.c_str(), job.dead_reason.c_str());
    }
    ok &= check(dead.size() == 1 && dead[0].idempotency_key == poison_key,
                "only the poison job is dead");
    ok &= check(poison_attempts.load() == 3, "it was tried max_attempts (3) times");
    const auto stats = queue.stats(*conn);
    ok &= check(!stats.empty() && stats[0].done == 4, "the four good jobs are done");

    std::printf("replay after the fix:\n");
    fixed = true;
    const auto replayed = queue.replay_all(*conn, "hooks");
    {
      store::Worker worker(pool, queue, options, handler);
      worker.run();
    }
    const auto job = queue.get(*conn, dead.empty() ? 0 : dead[0].id);
    ok &= check(replayed == 1, "one job replayed");
    ok &= check(job && job->state == store::JobState::kDone && job->idempotency_key == poison_key,
                "the replayed job is done, with the same idempotency key");
    ok &= check(queue.dead_depth(*conn, "hooks") == 0, "the dead-letter queue is empty");
    if (job) {
      std::printf("history of job %lld:\n", static_cast<long long>(job->id));
      for (const auto& a : job->history) {
        std::printf("  round %d attempt %d: %s %s\n", a.round, a.attempt, a.outcome.c_str(),
                    a.error.c_str());
      }
    }
  }
  std::filesystem::remove_all(dir);
  std::printf("%s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
