// The failover drill: keel on a PostgreSQL cluster as its users run it (scripts/pg-cluster.sh:
// a primary, a streaming standby, PgBouncer in transaction pooling mode), with real processes:
// three `keel jobs work --deliver --share-breakers` workers draining a queue of jobs (each job at
// most one attempt, so a job run again after its outcome was lost is dead), `keel-demo serve`
// under a load of POSTs with Idempotency-Keys, and a consumer applying messages through
// ProcessedMessages, all on the multi-host URL (target_session_attrs=read-write).
//
// The scenarios: the standby promoted mid-drain with the old primary killed (synchronous and
// asynchronous replication), with the old primary left up and read-only, with the old primary
// frozen (SIGSTOP); and a drain through PgBouncer by more worker connections than its pool has,
// then what keel leaves on a pooled server connection.
//
// What every failover scenario asserts (synchronous replication; the asynchronous one asserts
// the loss bound instead of no loss):
//  - no job lost: every job enqueued before the failover is on the new primary;
//  - no job run twice after its run succeeded (the upstream counts deliveries per
//    Idempotency-Key), and none dead (--max-attempts 1: a job whose outcome was lost and whose
//    lease expired is dead);
//  - no charge made twice (one per customer) and none lost, no request answered 500;
//  - no message applied twice or lost;
//  - jobs, charges and messages resume within 5 s of the new primary accepting writes (timing in
//    the release build only), including jobs enqueued on the new primary after it;
//  - the workers stop on SIGTERM (within kStopBound, 8 s; their --grace is 2 s).
// Each scenario prints its figures on one line ("failover drill: ...").
//
// Release build only (tests/integration/CMakeLists.txt): the processes are what is measured, and
// the sanitizer builds test the pieces one by one.
#include <gtest/gtest.h>
#include <signal.h>

#include <cstdio>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "build_kind.hpp"
#include "failover_drill_support.hpp"
#include "keel/faults/fault_server.hpp"
#include "keel/queue/queue.hpp"
#include "support/waiting.hpp"

namespace keel::store {
namespace {

using failover::ChargeLoad;
using failover::Clock;
using failover::Cluster;
using failover::Consumer;
using failover::seconds_between;
using failover::Serve;
using test_jobs::Process;
using namespace std::chrono_literals;

constexpr char kQueue[] = "drill";
constexpr int kWorkers = 3;
constexpr int kConcurrency = 4;
// Before the failover: enough for the drain to be under way when the primary goes (each job's
// delivery takes 20 ms in the upstream).
constexpr int kJobs = 1200;
// After it, on the new primary: they run only if the workers found it.
constexpr int kJobsAfter = 60;
// Bounds of the waits, so that today's failures end the scenario instead of the test's timeout.
constexpr auto kResumeBound = 10s;
constexpr auto kDrainBound = 20s;  // from the promotion
constexpr auto kStallBound = 5s;   // a drain with no job settled for this long has stopped
constexpr auto kStopBound = 8s;
// What resuming within 5 s of the promotion means.
constexpr double kResumeLimitS = 5.0;

using Workers = std::vector<std::unique_ptr<Process>>;

// Counts on one node (a fresh connection each time: the node may die under it).
struct JobCounts {
  std::int64_t done = -1;
  std::int64_t dead = -1;
  std::int64_t total = -1;
};

JobCounts job_counts(Connection& conn) {
  const Rows r = conn.query(
      "SELECT count(*) FILTER (WHERE state = 'done'), count(*) FILTER (WHERE state = 'dead'),"
      " count(*) FROM keel_jobs WHERE queue = $1",
      {std::string(kQueue)});
  return {r.integer(0, 0), r.integer(0, 1), r.integer(0, 2)};
}

// Polls one node over one connection, reopened when it breaks; -1 counts while it cannot.
class Poller {
 public:
  explicit Poller(std::string url) : url_(std::move(url)) {}
  JobCounts counts() {
    try {
      if (!conn_ || conn_->broken()) {
        conn_ = open_database(parse_database_url(url_).value(), {.connect_timeout = 2s});
      }
      return job_counts(*conn_);
    } catch (const std::exception&) {
      conn_.reset();
      return {};
    }
  }
  Connection& conn() {
    if (!conn_ || conn_->broken()) {
      conn_ = open_database(parse_database_url(url_).value(), {.connect_timeout = 2s});
    }
    return *conn_;
  }

 private:
  std::string url_;
  std::unique_ptr<Connection> conn_;
};

// Waits until `total` jobs are done or dead, at most `bound`, and no longer than kStallBound
// without one more settled.
bool wait_for_drain(Poller& poller, std::int64_t total, Clock::duration bound) {
  const auto give_up = Clock::now() + bound;
  std::int64_t settled = -1;
  auto progress = Clock::now();
  while (Clock::now() < give_up) {
    const JobCounts c = poller.counts();
    if (c.done + c.dead >= total) return true;
    if (c.done + c.dead > settled) {
      settled = c.done + c.dead;
      progress = Clock::now();
    } else if (Clock::now() - progress >= kStallBound) {
      return false;
    }
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

std::size_t occurrences(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

enum class OldPrimary { kKilled, kReadOnly, kFrozen };

struct Scenario {
  const char* name;
  const char* replication;  // pg-cluster.sh start's option
  OldPrimary old_primary;
  // Asynchronous replication: the standby stops receiving this long before the primary dies,
  // so that what is lost is measurable (the loss bound); zero: it streams until the end.
  std::chrono::milliseconds detached_before{0};
  // How long the failure lasts before the standby is promoted: an HA manager needs time to tell
  // a frozen node from a slow one (Patroni: its ttl, 30 s by default); zero: at once.
  std::chrono::milliseconds detection{0};
};

struct Figures {
  double promote_s = 0;          // from the failure to the new primary accepting writes
  double jobs_resume_s = -1;     // from then to the first job done on it (-1: none)
  double charges_resume_s = -1;  // ... to the first charge answered 2xx
  double consumer_resume_s = -1;
  double drain_s = -1;  // ... to every job done or dead (-1: not within the bound)
  std::int64_t lost = 0, run_twice = 0, dead = 0, not_done = 0, after_done = 0;
  std::int64_t window_deliveries = 0;  // deliveries while the standby received nothing
  int charges_500 = 0, charges_503 = 0, charges_unanswered = 0;
  std::int64_t charges_duplicated = 0, charges_lost = 0;
  std::int64_t messages_duplicated = 0, messages_lost = 0;
  double workers_stop_s = 0;  // SIGTERM to the last worker's exit (killed at kStopBound)
  int workers_killed = 0;
};

class FailoverDrill : public ::testing::Test {
 protected:
  void TearDown() override {
    if (HasFailure() && cluster_) {
      std::fprintf(stderr, "--- pg-cluster.sh log\n%s", cluster_->log().c_str());
      for (const auto& w : workers_) {
        std::string err = w->err();
        if (err.size() > 4000) err = "..." + err.substr(err.size() - 4000);
        std::fprintf(stderr, "--- worker %d (last lines)\n%s", w->pid(), err.c_str());
      }
    }
  }

  bool start_cluster(const std::string& options) {
    cluster_ = std::make_unique<Cluster>(dir_, options);
    return cluster_->started();
  }

  // The schema of every component on the primary, the ledger of the consumer, the jobs.
  void prepare(const std::string& url, int jobs, const std::string& prefix) {
    auto conn = open_database(parse_database_url(url).value());
    JobQueue::migrate(*conn);
    ProcessedMessages::migrate(*conn);
    conn->execute("CREATE TABLE IF NOT EXISTS ledger (message TEXT NOT NULL)");
    enqueue(*conn, jobs, prefix);
  }
  static void enqueue(Connection& conn, int jobs, const std::string& prefix) {
    JobQueue q;
    std::vector<EnqueueRequest> batch;
    for (int i = 0; i < jobs; ++i) {
      batch.push_back({.queue = kQueue,
                       .payload = R"({"n":)" + std::to_string(i) + "}",
                       .key = prefix + std::to_string(i),
                       .max_attempts = 1});
    }
    for (const auto& r : q.enqueue_many(conn, batch)) ASSERT_TRUE(r.ok()) << r.error;
  }

  std::vector<std::string> worker_args(const std::string& db, const std::string& hook) {
    return {KEEL_BINARY, "jobs",          "--db",  db,
            "work",      "--queue",       kQueue,  "--deliver",
            hook,        "--concurrency", "4",     "--lease",
            "10s",       "--timeout",     "5s",    "--backoff-base",
            "10ms",      "--backoff-cap", "100ms", "--idle-poll",
            "200ms",     "--grace",       "2s",    "--share-breakers"};
  }
  void start_workers(const std::string& db, const std::string& hook, int n) {
    for (int i = 0; i < n; ++i) {
      workers_.push_back(std::make_unique<Process>(worker_args(db, hook), dir_.path(),
                                                   "worker" + std::to_string(i)));
    }
    const bool up = test::wait_until(
        [&] {
          return std::all_of(workers_.begin(), workers_.end(), [](const auto& w) {
            return w->err().find("keel jobs: worker ") != std::string::npos || w->poll();
          });
        },
        30s);
    EXPECT_TRUE(up) << "the workers did not start within 30 s";
  }
  // SIGTERM to every worker; seconds until the last exited (those still running at kStopBound
  // are killed and counted).
  double stop_workers(int& killed) {
    const auto start = Clock::now();
    for (auto& w : workers_) {
      if (!w->poll()) w->signal(SIGTERM);
    }
    (void)test::wait_until(
        [&] {
          return std::all_of(workers_.begin(), workers_.end(),
                             [](const auto& w) { return w->poll(); });
        },
        kStopBound);
    const double took = seconds_between(start, Clock::now());
    killed = 0;
    for (auto& w : workers_) {
      if (!w->poll()) {
        ++killed;
        w->signal(SIGKILL);
        (void)w->wait();
      }
    }
    return took;
  }
  static std::string lines_with(const std::string& text, const std::string& what, int most) {
    std::string out;
    std::istringstream in(text);
    int n = 0;
    for (std::string line; std::getline(in, line) && n < most;) {
      if (line.find(what) != std::string::npos) {
        out += "    " + line + "\n";
        ++n;
      }
    }
    return out;
  }

  void run(const Scenario& s);

  test::TempDir dir_;
  std::unique_ptr<Cluster> cluster_;
  Workers workers_;
};

// One failover scenario: the drain under way, the old primary failed as the scenario says, the
// standby promoted, new jobs enqueued on it; then the figures.
void FailoverDrill::run(const Scenario& s) {
  ASSERT_TRUE(start_cluster(s.replication)) << cluster_->log();
  const std::string url = cluster_->url();
  const std::string node1 = cluster_->node_url("node1");
  const std::string node2 = cluster_->node_url("node2");
  ASSERT_NO_FATAL_FAILURE(prepare(node1, kJobs, "job-"));

  faults::FaultServer upstream({.script = "200/delay=20ms"});
  upstream.start();
  Serve serve(url, dir_);
  ASSERT_GT(serve.port(), 0) << serve.process().err();
  ChargeLoad charges(serve.port(), 6);
  Consumer consumer(url);
  start_workers(url, upstream.url("/hook"), kWorkers);
  ASSERT_FALSE(HasFailure());

  // Mid-drain: a quarter of the jobs done.
  Poller on_node1(node1);
  ASSERT_TRUE(test::wait_until([&] { return on_node1.counts().done >= kJobs / 4; }, 30s))
      << "the drain did not start";
  std::int64_t window_start_arrivals = 0;
  if (s.detached_before > 0ms) {
    window_start_arrivals = static_cast<std::int64_t>(upstream.arrivals().size());
    // The window starts where the standby has received everything the primary wrote so far: an
    // asynchronous standby runs behind, and what it lacked at the detach is lost as well (a
    // loaded machine's lag was 50 deliveries). Outcomes of deliveries before the window that
    // commit after this point are the ones in flight, which the bound allows for.
    {
      Poller primary(node1);
      auto standby_conn = open_database(parse_database_url(node2).value(),
                                        {.connect_timeout = 2s, .read_only = true});
      const std::string lsn = primary.conn().query("SELECT pg_current_wal_lsn()::text").text(0, 0);
      ASSERT_TRUE(test::wait_until(
          [&] {
            return standby_conn
                       ->query("SELECT (pg_last_wal_receive_lsn() >= $1::pg_lsn)::int", {lsn})
                       .integer(0, 0) == 1;
          },
          10s))
          << "the standby did not catch up with " << lsn;
    }
    ASSERT_TRUE(cluster_->run("detach"));
    std::this_thread::sleep_for(s.detached_before);
  }
  const auto failed = Clock::now();
  const std::int64_t arrivals_at_failure = static_cast<std::int64_t>(upstream.arrivals().size());
  switch (s.old_primary) {
    case OldPrimary::kKilled:
      ASSERT_TRUE(cluster_->run("kill node1"));
      break;
    case OldPrimary::kReadOnly:
      ASSERT_TRUE(cluster_->run("read-only node1"));
      break;
    case OldPrimary::kFrozen:
      ASSERT_TRUE(cluster_->run("freeze node1"));
      break;
  }
  std::this_thread::sleep_for(s.detection);
  ASSERT_TRUE(cluster_->run("promote")) << cluster_->log();
  const auto promoted = Clock::now();
  Figures f;
  f.promote_s = seconds_between(failed, promoted);
  if (s.detached_before > 0ms) f.window_deliveries = arrivals_at_failure - window_start_arrivals;

  Poller on_node2(node2);
  const JobCounts at_promotion = on_node2.counts();
  ASSERT_GE(at_promotion.total, 0) << "the new primary does not answer";
  // Jobs that exist only on the new primary: idle and busy workers must both find it.
  ASSERT_NO_FATAL_FAILURE(enqueue(on_node2.conn(), kJobsAfter, "after-"));
  const std::int64_t total = at_promotion.total + kJobsAfter;

  const bool resumed =
      test::wait_until([&] { return on_node2.counts().done > at_promotion.done; }, kResumeBound);
  if (resumed) f.jobs_resume_s = seconds_between(promoted, Clock::now());
  const bool drained =
      resumed && wait_for_drain(on_node2, total, promoted + kDrainBound - Clock::now());
  if (drained) f.drain_s = seconds_between(promoted, Clock::now());
  // Let the load run on for a moment after the drain, so that a slow resumption still shows.
  (void)test::wait_until(
      [&] {
        return charges.first_ok_after(promoted).has_value() &&
               consumer.first_done_after(promoted).has_value();
      },
      drained ? 5s : 1s);
  charges.stop();
  f.workers_stop_s = stop_workers(f.workers_killed);
  serve.process().signal(SIGKILL);
  // A frozen node holds its clients' connections forever: killed, it lets the consumer go.
  if (s.old_primary == OldPrimary::kFrozen) {
    EXPECT_TRUE(cluster_->run("kill node1"));
  }
  consumer.stop();

  // ---- the figures, read on the new primary
  if (const auto at = charges.first_ok_after(promoted)) {
    f.charges_resume_s = seconds_between(promoted, *at);
  }
  if (const auto at = consumer.first_done_after(promoted)) {
    f.consumer_resume_s = seconds_between(promoted, *at);
  }
  Connection& db = on_node2.conn();
  {
    // Enqueued before the failover and missing now.
    std::set<std::string> keys;
    const Rows r =
        db.query("SELECT idem_key, state FROM keel_jobs WHERE queue = $1", {std::string(kQueue)});
    for (std::size_t i = 0; i < r.size(); ++i) {
      keys.insert(r.text(i, 0));
      if (r.text(i, 1) == "dead") ++f.dead;
      if (r.text(i, 1) != "done" && r.text(i, 1) != "dead") ++f.not_done;
      if (r.text(i, 0).rfind("after-", 0) == 0 && r.text(i, 1) == "done") ++f.after_done;
    }
    for (int i = 0; i < kJobs; ++i) {
      if (keys.count("job-" + std::to_string(i)) == 0) ++f.lost;
    }
  }
  {
    std::map<std::string, int> deliveries;
    for (const auto& a : upstream.arrivals()) {
      for (const auto& [name, value] : a.headers) {
        if (name == "Idempotency-Key" || name == "idempotency-key") ++deliveries[value];
      }
    }
    for (const auto& [key, n] : deliveries) {
      if (n > 1) ++f.run_twice;
    }
  }
  const ChargeLoad::Figures load = charges.figures();
  for (const auto& [status, n] : load.statuses) {
    if (status == 500) f.charges_500 += n;
    if (status >= 501) f.charges_503 += n;
    if (status == 0) f.charges_unanswered += n;
  }
  {
    std::map<std::string, std::int64_t> made;
    const Rows r = db.query("SELECT customer, count(*) FROM charges GROUP BY customer");
    for (std::size_t i = 0; i < r.size(); ++i) {
      made[r.text(i, 0)] = r.integer(i, 1);
      if (r.integer(i, 1) > 1) f.charges_duplicated += r.integer(i, 1) - 1;
    }
    for (const auto& customer : std::set<std::string>(load.charged.begin(), load.charged.end())) {
      if (made.count(customer) == 0) ++f.charges_lost;
    }
  }
  {
    std::map<std::string, std::int64_t> applied;
    const Rows r = db.query("SELECT message, count(*) FROM ledger GROUP BY message");
    for (std::size_t i = 0; i < r.size(); ++i) {
      applied[r.text(i, 0)] = r.integer(i, 1);
      if (r.integer(i, 1) > 1) f.messages_duplicated += r.integer(i, 1) - 1;
    }
    for (const auto& m : consumer.done()) {
      if (applied.count(m) == 0) ++f.messages_lost;
    }
  }

  std::string logs;
  for (const auto& w : workers_) logs += w->err();
  std::printf(
      "failover drill, %s: new primary accepting writes %.2f s after the failure; jobs resumed "
      "after %.2f s, charges after %.2f s, messages after %.2f s (-1: not within %lld s); "
      "drained %.2f s after the promotion (-1: not within %lld s); jobs lost %lld, run twice "
      "%lld, dead %lld, not done %lld (of those enqueued after the promotion done: %lld of %d); "
      "deliveries while the standby received nothing %lld; charges answered 500: %d, 503: %d, "
      "unanswered: %d, duplicated %lld, lost %lld; messages duplicated %lld, lost %lld "
      "(consumer failures %d); workers stopped %.1f s after SIGTERM, %d killed at %lld s\n",
      s.name, f.promote_s, f.jobs_resume_s, f.charges_resume_s, f.consumer_resume_s,
      static_cast<long long>(std::chrono::seconds(kResumeBound).count()), f.drain_s,
      static_cast<long long>(std::chrono::seconds(kDrainBound).count()),
      static_cast<long long>(f.lost), static_cast<long long>(f.run_twice),
      static_cast<long long>(f.dead), static_cast<long long>(f.not_done),
      static_cast<long long>(f.after_done), kJobsAfter, static_cast<long long>(f.window_deliveries),
      f.charges_500, f.charges_503, f.charges_unanswered,
      static_cast<long long>(f.charges_duplicated), static_cast<long long>(f.charges_lost),
      static_cast<long long>(f.messages_duplicated), static_cast<long long>(f.messages_lost),
      consumer.failures(), f.workers_stop_s, f.workers_killed,
      static_cast<long long>(std::chrono::seconds(kStopBound).count()));
  std::printf("  worker log lines (first of each kind):\n%s%s%s%s",
              lines_with(logs, "lease failed", 3).c_str(),
              lines_with(logs, "recording the outcome failed", 3).c_str(),
              lines_with(logs, "heartbeat failed", 2).c_str(),
              lines_with(logs, "shared breakers", 2).c_str());
  std::fflush(stdout);

  // ---- what must hold
  const bool synchronous = s.detached_before == 0ms;
  EXPECT_EQ(f.lost, 0) << "jobs enqueued before the failover missing on the new primary";
  if (synchronous) {
    EXPECT_EQ(f.run_twice, 0) << "jobs delivered again after a successful delivery";
    EXPECT_EQ(f.dead, 0) << "jobs dead (--max-attempts 1: a run whose outcome was lost)";
    EXPECT_EQ(f.charges_lost, 0) << "charges answered 2xx and missing on the new primary";
    EXPECT_EQ(f.messages_lost, 0) << "messages applied and missing on the new primary";
  } else {
    // Asynchronous replication loses what the standby had not received: at most the outcomes
    // of the deliveries made while it received nothing, and of those in flight.
    EXPECT_LE(f.run_twice + f.dead, f.window_deliveries + kWorkers * kConcurrency)
        << "more jobs run again than the replication lag can explain";
  }
  EXPECT_EQ(f.not_done, 0) << "jobs neither done nor dead " << kDrainBound.count()
                           << " s after the promotion";
  EXPECT_EQ(f.after_done, kJobsAfter) << "jobs enqueued on the new primary not done";
  EXPECT_EQ(f.charges_500, 0) << "POSTs answered 500 for the failover";
  EXPECT_EQ(f.charges_duplicated, 0) << "charges made twice";
  EXPECT_EQ(f.messages_duplicated, 0) << "messages applied twice";
  EXPECT_GE(f.jobs_resume_s, 0) << "no job done on the new primary within " << kResumeBound.count()
                                << " s";
  EXPECT_GE(f.charges_resume_s, 0) << "no charge made on the new primary";
  EXPECT_GE(f.consumer_resume_s, 0) << "no message applied on the new primary";
  EXPECT_EQ(f.workers_killed, 0) << "workers still running " << kStopBound.count()
                                 << " s after SIGTERM (grace 2 s)";
  if (test::kTimingAsserted) {
    EXPECT_LT(f.jobs_resume_s, kResumeLimitS);
    EXPECT_LT(f.charges_resume_s, kResumeLimitS);
    EXPECT_LT(f.consumer_resume_s, kResumeLimitS);
  }
}

TEST_F(FailoverDrill, SynchronousReplicationPromotionMidDrainWithTheOldPrimaryKilled) {
  run({.name = "synchronous, old primary killed",
       .replication = "--sync",
       .old_primary = OldPrimary::kKilled});
}

TEST_F(FailoverDrill, AsynchronousReplicationPromotionMidDrainLosesAtMostTheLag) {
  run({.name = "asynchronous (standby 1 s behind), old primary killed",
       .replication = "--async",
       .old_primary = OldPrimary::kKilled,
       .detached_before = 1000ms});
}

TEST_F(FailoverDrill, PromotionWithTheOldPrimaryLeftUpReadOnly) {
  run({.name = "synchronous, old primary read-only and reachable",
       .replication = "--sync",
       .old_primary = OldPrimary::kReadOnly});
}

TEST_F(FailoverDrill, PromotionWithTheOldPrimaryFrozen) {
  // Promoted 3 s after the freeze, far sooner than Patroni's ttl would: keel's bound on a
  // statement's answer (5 s and half a second) passes 2.5 s after the promotion.
  run({.name = "synchronous, old primary frozen (SIGSTOP), promoted 3 s later",
       .replication = "--sync",
       .old_primary = OldPrimary::kFrozen,
       .detection = 3000ms});
}

// ---------------------------------------------------------------------------------------------
// PgBouncer in transaction pooling mode.

TEST_F(FailoverDrill, ADrainThroughPgBouncerCompletesAndLeavesNoSettingOnThePool) {
  constexpr int kPoolJobs = 300;
  // A pool of 2 server connections for 3 workers of 4 slots (each with a heartbeat, a listener
  // and the shared breakers' connection besides).
  ASSERT_TRUE(start_cluster("--async --pgbouncer --pool-size 2")) << cluster_->log();
  // keel's URLs say that they go through a transaction pooler; a plain client's do not.
  const std::string pooled = cluster_->bouncer_url() + "?keel_pooler=transaction";
  const std::string one = cluster_->bouncer_url("keel_one");
  const std::string keel_one = one + "?keel_pooler=transaction";
  ASSERT_NO_FATAL_FAILURE(prepare(cluster_->node_url("node1"), kPoolJobs, "job-"));
  faults::FaultServer upstream({.script = "200/delay=5ms"});
  upstream.start();
  const auto start = Clock::now();
  start_workers(pooled, upstream.url("/hook"), kWorkers);
  Poller on_node1(cluster_->node_url("node1"));
  const bool drained = wait_for_drain(on_node1, kPoolJobs, kDrainBound);
  const double drain_s = drained ? seconds_between(start, Clock::now()) : -1;
  const JobCounts c = on_node1.counts();
  const auto exited_early =
      std::count_if(workers_.begin(), workers_.end(), [](const auto& w) { return w->poll(); });
  int killed = 0;
  const double stop_s = stop_workers(killed);
  std::string logs;
  for (const auto& w : workers_) logs += w->err();
  const std::size_t errors = occurrences(logs, "(SQLSTATE ");
  std::int64_t run_twice = 0;
  {
    std::map<std::string, int> deliveries;
    for (const auto& a : upstream.arrivals()) {
      for (const auto& [name, value] : a.headers) {
        if (name == "Idempotency-Key" || name == "idempotency-key") ++deliveries[value];
      }
    }
    for (const auto& [key, n] : deliveries) run_twice += n > 1 ? 1 : 0;
  }

  // What keel leaves on a server connection of a pool of one, seen by the next plain client:
  // a worker sharing its breakers through it for a moment, then keel jobs stats (which opens its
  // connection read-only).
  const std::string timeout_before = failover::plain_query(one, "SHOW statement_timeout");
  const std::string read_only_before =
      failover::plain_query(one, "SHOW default_transaction_read_only");
  {
    // Its queue on the primary itself, its breakers shared through the pool.
    std::vector<std::string> args = worker_args(cluster_->node_url("node1"), upstream.url("/hook"));
    args.back() = "--share-breakers=" + keel_one;
    Process sharer(args, dir_.path(), "sharer");
    (void)test::wait_until(
        [&] {
          return sharer.err().find("keel jobs: worker ") != std::string::npos || sharer.poll();
        },
        10s);
    std::this_thread::sleep_for(1s);
    sharer.signal(SIGTERM);
    (void)test::wait_until([&] { return sharer.poll(); }, 5s);
  }
  const std::string timeout_after = failover::plain_query(one, "SHOW statement_timeout");
  const test_jobs::CmdResult stats = [&] {
    Process p({KEEL_BINARY, "jobs", "--db", keel_one, "stats"}, dir_.path(), "stats");
    test_jobs::CmdResult r;
    r.status = p.wait();
    r.err = p.err();
    return r;
  }();
  const std::string read_only_after =
      failover::plain_query(one, "SHOW default_transaction_read_only");

  std::printf(
      "failover drill, PgBouncer (transaction pooling, pool of 2, %d workers of %d): drained "
      "%.2f s (-1: not within %lld s): done %lld, dead %lld of %d, run twice %lld; workers "
      "exited before SIGTERM %lld, database errors in their logs %zu; stopped %.1f s after "
      "SIGTERM, %d killed; keel jobs stats through a pool of one: exit %d; "
      "the next client sees default_transaction_read_only %s (before: %s), statement_timeout "
      "%s after a --share-breakers worker (before: %s)\n",
      kWorkers, kConcurrency, drain_s,
      static_cast<long long>(std::chrono::seconds(kDrainBound).count()),
      static_cast<long long>(c.done), static_cast<long long>(c.dead), kPoolJobs,
      static_cast<long long>(run_twice), static_cast<long long>(exited_early), errors, stop_s,
      killed, stats.status, read_only_after.c_str(), read_only_before.c_str(),
      timeout_after.c_str(), timeout_before.c_str());
  std::printf("  worker log lines (first of each kind):\n%s%s%s",
              lines_with(logs, "SQLSTATE", 3).c_str(), lines_with(logs, "lease failed", 2).c_str(),
              lines_with(stats.err, "keel jobs", 2).c_str());
  std::fflush(stdout);

  EXPECT_TRUE(drained) << "the drain through PgBouncer did not complete";
  EXPECT_EQ(c.done, kPoolJobs);
  EXPECT_EQ(c.dead, 0);
  EXPECT_EQ(run_twice, 0);
  EXPECT_EQ(exited_early, 0) << "workers that gave up on the pool";
  EXPECT_EQ(errors, 0U) << "statements that failed through the pool";
  EXPECT_EQ(killed, 0);
  EXPECT_EQ(stats.status, 0) << stats.err;
  EXPECT_EQ(read_only_before, "off");
  EXPECT_EQ(read_only_after, "off") << "keel jobs stats' read-only session reached the next client";
  EXPECT_EQ(timeout_before, "0");
  EXPECT_EQ(timeout_after, "0") << "the shared breakers' statement_timeout reached the next client";
}

}  // namespace
}  // namespace keel::store
