// What consumer deduplication costs per message: one transaction with the effect (an INSERT into
// a business table) alone, next to the same transaction through ProcessedMessages::process (the
// record's unique insert first), and a duplicate (the record's insert finds the id, the
// transaction rolls back). SQLite on a file in TMPDIR always; PostgreSQL when
// KEEL_BENCH_POSTGRES_URL names a server (scripts/pg-test-server.sh start DIR prints one).
//
//   keel_bench_consumer [--benchmark_min_time=...]
//
// It reports, it does not assert times.
#include <benchmark/benchmark.h>
#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "keel/consumers/processed_messages.hpp"
#include "keel/db/database.hpp"
#include "keel/db/transaction.hpp"

namespace {

namespace store = keel::store;

struct Target {
  std::string name;
  std::string url;
};

std::unique_ptr<store::Connection> open_fresh(const Target& target) {
  auto conn = store::open_database(store::parse_database_url(target.url).value());
  conn->execute("DROP TABLE IF EXISTS bench_effects");
  conn->execute("CREATE TABLE bench_effects (message TEXT NOT NULL, n BIGINT NOT NULL)");
  store::ProcessedMessages::migrate(*conn);
  conn->execute("DELETE FROM keel_processed_messages WHERE consumer = 'bench'");
  return conn;
}

bool effect(store::Connection& tx, const std::string& message) {
  tx.query("INSERT INTO bench_effects (message, n) VALUES ($1, 1)", {message});
  return true;
}

void effect_only(benchmark::State& state, const Target& target) {
  auto conn = open_fresh(target);
  std::int64_t i = 0;
  for (auto _ : state) {
    const std::string id = "m-" + std::to_string(i++);
    const auto r =
        store::with_transaction_retry(*conn, [&](store::Connection& tx) { return effect(tx, id); });
    if (!r.committed()) state.SkipWithError(r.error.c_str());
  }
  state.SetItemsProcessed(state.iterations());
}

void with_record(benchmark::State& state, const Target& target) {
  auto conn = open_fresh(target);
  store::ProcessedMessages records({.consumer = "bench"});
  std::int64_t i = 0;
  for (auto _ : state) {
    const std::string id = "m-" + std::to_string(i++);
    const auto r =
        records.process(*conn, id, [&](store::Connection& tx) { return effect(tx, id); });
    if (!r || r->status != store::ProcessStatus::kProcessed) state.SkipWithError("not processed");
  }
  state.SetItemsProcessed(state.iterations());
}

void duplicate(benchmark::State& state, const Target& target) {
  auto conn = open_fresh(target);
  store::ProcessedMessages records({.consumer = "bench"});
  (void)records.process(*conn, "seen", [&](store::Connection& tx) { return effect(tx, "seen"); });
  for (auto _ : state) {
    const auto r =
        records.process(*conn, "seen", [&](store::Connection& tx) { return effect(tx, "seen"); });
    if (!r || r->status != store::ProcessStatus::kDuplicate) state.SkipWithError("not duplicate");
  }
  state.SetItemsProcessed(state.iterations());
}

}  // namespace

int main(int argc, char** argv) {
  const char* base = std::getenv("TMPDIR");
  std::string pattern =
      std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/keel-bench.XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) return 1;
  std::vector<Target> targets{{"sqlite", "sqlite:" + pattern + "/consumer.db"}};
  if (const char* pg = std::getenv("KEEL_BENCH_POSTGRES_URL"); pg != nullptr && *pg != '\0') {
    targets.push_back({"postgres", pg});
  }
  for (const Target& t : targets) {
    benchmark::RegisterBenchmark(("effect_only/" + t.name).c_str(), effect_only, t)
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("effect_with_record/" + t.name).c_str(), with_record, t)
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("duplicate_skipped/" + t.name).c_str(), duplicate, t)
        ->Unit(benchmark::kMicrosecond);
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  std::filesystem::remove_all(pattern);
  return 0;
}
