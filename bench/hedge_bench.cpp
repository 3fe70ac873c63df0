// The cost of hedging on the success path: requests per second through both HTTP clients with
// hedging on but never triggered (the delay is far above the loopback latency) next to the same
// client without it, one request at a time against a keel::faults::FaultServer on 127.0.0.1
// that answers 200 over one keep-alive connection. With hedging on, a blocking request runs on a
// pooled curl multi handle instead of curl_easy_perform, and an asynchronous one in the hedged
// loop (a coroutine per attempt and a wake-up timer) instead of keel::asio::retry's.
//
// Run:   keel_bench_hedge --benchmark_min_time=2
// Ratio: *HedgeNotTriggered items_per_second / the same client's plain row (goal >= 0.9).
#include <benchmark/benchmark.h>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <chrono>
#include <optional>
#include <string>

#include "keel/asio/http_client.hpp"
#include "keel/core/hedge.hpp"
#include "keel/faults/fault_server.hpp"
#include "keel/http/client.hpp"
#include "loopback_upstream.hpp"

namespace {

using keel::bench::server;

keel::http::ClientOptions options(bool hedge) {
  keel::http::ClientOptions o;  // defaults: breakers and budget on
  if (hedge) o.hedge = keel::HedgeOptions{.delay = std::chrono::seconds(1)};
  return o;
}

void blocking(benchmark::State& state, bool hedge) {
  keel::http::Client client(options(hedge));
  const keel::http::Request request{.url = server().url("/bench")};
  for (auto _ : state) {
    keel::http::Result r = client.send(request);
    if (!r.ok() || r.attempts != 1) {
      state.SkipWithError("keel request failed or was hedged");
      break;
    }
    benchmark::DoNotOptimize(r.response->body.data());
  }
  state.SetItemsProcessed(state.iterations());
}

void BlockingGet(benchmark::State& state) { blocking(state, false); }
void BlockingGetHedgeNotTriggered(benchmark::State& state) { blocking(state, true); }
BENCHMARK(BlockingGet)->UseRealTime();
BENCHMARK(BlockingGetHedgeNotTriggered)->UseRealTime();

void async(benchmark::State& state, bool hedge) {
  ::asio::io_context io;
  keel::asio::HttpClient client(io.get_executor(), options(hedge));
  const keel::http::Request request{.url = server().url("/bench")};
  for (auto _ : state) {
    std::optional<keel::http::Result> out;
    ::asio::co_spawn(io, client.send(request),
                     [&](std::exception_ptr, keel::http::Result r) { out = std::move(r); });
    io.restart();
    io.run();
    if (!out || !out->ok() || out->attempts != 1) {
      state.SkipWithError("keel request failed or was hedged");
      break;
    }
    benchmark::DoNotOptimize(out->response->body.data());
  }
  state.SetItemsProcessed(state.iterations());
}

void AsyncGet(benchmark::State& state) { async(state, false); }
void AsyncGetHedgeNotTriggered(benchmark::State& state) { async(state, true); }
BENCHMARK(AsyncGet)->UseRealTime();
BENCHMARK(AsyncGetHedgeNotTriggered)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
