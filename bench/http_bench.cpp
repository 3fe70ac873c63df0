// Requests per second through keel::http::Client against a local server, next to raw libcurl
// with the same connection reuse (one easy handle kept across requests). Both drive the same
// keel::testing::FaultServer on 127.0.0.1 answering 200 to every GET over one keep-alive
// connection, one request at a time, so the difference is the client's own cost: the retry
// engine, the per-host breaker and the budget, the per-request header list, the handle pool.
//
// Run:   keel_bench_http --benchmark_min_time=2
// Ratio: KeelClientGet items_per_second / RawCurlGet items_per_second (target >= 0.95).
// RawCurlSharedResetGet and KeelClientGetNoGuards split the difference: libcurl's cost of a
// reset handle on a shared connection cache, and the cost of the breaker and the budget.
#include <benchmark/benchmark.h>
#include <curl/curl.h>

#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "keel/http/client.hpp"
#include "keel/testing/fault_server.hpp"

namespace {

keel::testing::FaultServer& server() {
  static auto* s = [] {
    auto* srv = new keel::testing::FaultServer({.script = "200"});
    srv->start();
    return srv;
  }();
  return *s;
}

size_t discard_into(char* data, size_t size, size_t count, void* user) {
  static_cast<std::string*>(user)->append(data, size * count);
  return size * count;
}

void RawCurlGet(benchmark::State& state) {
  const std::string url = server().url("/bench");
  CURL* h = curl_easy_init();
  std::string body;
  curl_easy_setopt(h, CURLOPT_URL, url.c_str());
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, &discard_into);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, &body);
  curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, 2000L);
  curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, 10000L);
  for (auto _ : state) {
    body.clear();
    if (curl_easy_perform(h) != CURLE_OK) {
      state.SkipWithError("curl_easy_perform failed");
      break;
    }
    benchmark::DoNotOptimize(body.data());
  }
  curl_easy_cleanup(h);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(RawCurlGet)->UseRealTime();

// Raw libcurl set up as the client sets up each attempt: curl_easy_reset, then every option
// again, with the connection cache in a CURLSH (what lets many handles share connections).
void RawCurlSharedResetGet(benchmark::State& state) {
  const std::string url = server().url("/bench");
  static std::mutex lock;
  CURLSH* share = curl_share_init();
  curl_share_setopt(
      share, CURLSHOPT_LOCKFUNC,
      +[](CURL*, curl_lock_data, curl_lock_access, void*) { lock.lock(); });
  curl_share_setopt(
      share, CURLSHOPT_UNLOCKFUNC, +[](CURL*, curl_lock_data, void*) { lock.unlock(); });
  curl_share_setopt(share, CURLSHOPT_SHARE, CURL_LOCK_DATA_CONNECT);
  CURL* h = curl_easy_init();
  std::string body;
  for (auto _ : state) {
    curl_easy_reset(h);
    curl_easy_setopt(h, CURLOPT_SHARE, share);
    curl_easy_setopt(h, CURLOPT_URL, url.c_str());
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, &discard_into);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &body);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, 2000L);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, 10000L);
    body.clear();
    if (curl_easy_perform(h) != CURLE_OK) {
      state.SkipWithError("curl_easy_perform failed");
      break;
    }
    benchmark::DoNotOptimize(body.data());
  }
  curl_easy_cleanup(h);
  curl_share_cleanup(share);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(RawCurlSharedResetGet)->UseRealTime();

void KeelClientGet(benchmark::State& state) {
  keel::http::ClientOptions options;  // defaults: breakers and budget on
  keel::http::Client client(options);
  const keel::http::Request request{.url = server().url("/bench")};
  for (auto _ : state) {
    keel::http::Result r = client.send(request);
    if (!r.ok()) {
      state.SkipWithError("keel request failed");
      break;
    }
    benchmark::DoNotOptimize(r.response->body.data());
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(KeelClientGet)->UseRealTime();

// The client without its per-host breaker and retry budget: the engine and libcurl only.
void KeelClientGetNoGuards(benchmark::State& state) {
  keel::http::ClientOptions options;
  options.circuit_breakers = false;
  options.retry_budget = false;
  keel::http::Client client(options);
  const keel::http::Request request{.url = server().url("/bench")};
  for (auto _ : state) {
    keel::http::Result r = client.send(request);
    if (!r.ok()) {
      state.SkipWithError("keel request failed");
      break;
    }
    benchmark::DoNotOptimize(r.response->body.data());
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(KeelClientGetNoGuards)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
