// The cost of the event stream on the retry engine's success path (keel::retry of a call that
// succeeds first time, the steady clock, no deadline): without a stream, with a stream nobody
// listens to (one atomic load and a branch per publish), and with one and two subscribers (two
// events per call: attempt started, attempt finished; the subscriber's own work is a per-thread
// count, or a shared relaxed counter), and with one subscriber to outcomes only (one event per
// call). Also on one and two threads sharing the stream. The goal: one subscriber adds no more
// than 10% to the success path. Reports, never asserts.
#include <benchmark/benchmark.h>

#include <atomic>
#include <memory>

#include "alloc_counter.hpp"
#include "keel/core/events.hpp"
#include "keel/core/retry.hpp"

namespace {

struct CountingSink final : keel::EventSink {
  std::atomic<std::uint64_t> events{0};
  void on_event(const keel::Event&) override { events.fetch_add(1, std::memory_order_relaxed); }
};

// Per-thread counts: the subscriber's own work touches no shared cache line.
struct ThreadCountingSink final : keel::EventSink {
  void on_event(const keel::Event& e) override {
    thread_local std::uint64_t n = 0;
    n += static_cast<std::uint64_t>(e.kind) + 1;
    benchmark::DoNotOptimize(n);
  }
};

keel::EventStream& stream() {
  static keel::EventStream s;
  return s;
}

void run_success(benchmark::State& state, keel::EventStream* events) {
  keel::RetryOptions options;
  options.events = events;
  options.operation = "bench";
  const keel::RetryPolicy policy(options);
  keel::CallOptions call;
  call.safe_to_repeat = true;
  const auto before = keel::bench::allocations();
  for (auto _ : state) {
    auto r = keel::retry(
        policy, [] { return keel::Outcome::success(); }, call);
    benchmark::DoNotOptimize(r);
  }
  state.counters["allocs/op"] = benchmark::Counter(
      static_cast<double>(keel::bench::allocations() - before), benchmark::Counter::kAvgIterations);
}

void BM_Events_Success_NoStream(benchmark::State& state) { run_success(state, nullptr); }
BENCHMARK(BM_Events_Success_NoStream)->ThreadRange(1, 2);

void BM_Events_Success_NoSubscriber(benchmark::State& state) { run_success(state, &stream()); }
BENCHMARK(BM_Events_Success_NoSubscriber)->ThreadRange(1, 2);

void BM_Events_Success_OneSubscriber(benchmark::State& state) {
  static const auto sink = std::make_shared<ThreadCountingSink>();
  static keel::SubscriptionId id = 0;
  if (state.thread_index() == 0) id = stream().subscribe(sink);
  run_success(state, &stream());
  if (state.thread_index() == 0) stream().unsubscribe(id);
}
BENCHMARK(BM_Events_Success_OneSubscriber)->ThreadRange(1, 2);

// The same sink asking only for outcomes (keel::kOutcomeEvents, as keel::metrics does): a success
// publishes one event.
void BM_Events_Success_OneOutcomeSubscriber(benchmark::State& state) {
  static const auto sink = std::make_shared<ThreadCountingSink>();
  static keel::SubscriptionId id = 0;
  if (state.thread_index() == 0) id = stream().subscribe(sink, keel::kOutcomeEvents);
  run_success(state, &stream());
  if (state.thread_index() == 0) stream().unsubscribe(id);
}
BENCHMARK(BM_Events_Success_OneOutcomeSubscriber)->ThreadRange(1, 2);

void BM_Events_Success_OneSharedCounter(benchmark::State& state) {
  static const auto sink = std::make_shared<CountingSink>();
  static keel::SubscriptionId id = 0;
  if (state.thread_index() == 0) id = stream().subscribe(sink);
  run_success(state, &stream());
  if (state.thread_index() == 0) stream().unsubscribe(id);
}
BENCHMARK(BM_Events_Success_OneSharedCounter)->ThreadRange(1, 2);

void BM_Events_Success_TwoSubscribers(benchmark::State& state) {
  static const auto a = std::make_shared<ThreadCountingSink>();
  static const auto b = std::make_shared<ThreadCountingSink>();
  static keel::SubscriptionId ia = 0;
  static keel::SubscriptionId ib = 0;
  if (state.thread_index() == 0) {
    ia = stream().subscribe(a);
    ib = stream().subscribe(b);
  }
  run_success(state, &stream());
  if (state.thread_index() == 0) {
    stream().unsubscribe(ia);
    stream().unsubscribe(ib);
  }
}
BENCHMARK(BM_Events_Success_TwoSubscribers);

}  // namespace

BENCHMARK_MAIN();
