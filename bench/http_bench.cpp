// Requests per second through keel's two HTTP clients against a local server, next to raw
// libcurl doing the same thing with the same connection reuse. Every benchmark drives the same
// keel::faults::FaultServer on 127.0.0.1 answering 200 to every GET over one keep-alive
// connection, one request at a time, so the difference is the client's own cost: the retry
// engine, the per-host breaker and the budget, the request's header list, the handle pool.
//
//   blocking (curl_easy_perform)
//     RawCurlGet             one easy handle set up once and kept: the floor
//     RawCurlSharedResetGet  the connection reuse keel::http::Client uses: the handle reset and
//                            set up again per request, connections in a shared cache (CURLSH)
//     RawCurlSameRequestGet  the same, sending the request head the client sends (User-Agent,
//                            Keel-Attempt, Keel-Deadline-Ms) with a header callback: what the
//                            wire format costs libcurl, with no keel code at all
//     KeelClientGet          keel::http::Client with its defaults (breakers and budget on)
//     KeelClientGetNoGuards  the same without the per-host breaker and the retry budget
//   Asio (curl_multi_socket_action on an io_context, one thread)
//     RawCurlMultiAsioGet    one easy handle set up once, on a raw multi handle whose socket and
//                            timer callbacks are mapped onto the io_context as
//                            src/asio/curl_multi.cpp does: the Asio floor
//     AsioClientGet          keel::asio::HttpClient with its defaults
//     AsioClientGetNoGuards  the same without the breaker and the budget
//     AsioClientGetNoTimeouts  the same with no per-attempt timeout or deadline: no backstop
//                            timer raced against each attempt (keel::asio::retry's
//                            parallel_group), no Keel-Deadline-Ms
//
// Each benchmark also reports allocs/op: operator new calls per request on the client's thread
// (keel's and the standard library's; libcurl allocates with malloc, which is not counted; the
// server's thread is not counted).
//
// Run:   keel_bench_http --benchmark_min_time=1 --benchmark_repetitions=5
//          --benchmark_enable_random_interleaving=true
// Ratio: Keel*Get items_per_second / RawCurl*Get items_per_second (goal >= 0.95); scripts/bench.sh
// runs it that way and bench_report.py puts the medians side by side.
#include <benchmark/benchmark.h>
#include <curl/curl.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "alloc_counter.hpp"
#include "keel/core/deadline_header.hpp"
#include "keel/faults/fault_server.hpp"
#include "keel/http/client.hpp"
#include "loopback_upstream.hpp"

#if KEEL_BENCH_HTTP_ASIO
#include <poll.h>

#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>
#include <asio/posix/stream_descriptor.hpp>
#include <asio/post.hpp>
#include <asio/steady_timer.hpp>
#include <chrono>
#include <exception>
#include <unordered_map>

#include "keel/asio/http_client.hpp"
#endif

namespace {

using keel::bench::server;

size_t discard_into(char* data, size_t size, size_t count, void* user) {
  static_cast<std::string*>(user)->append(data, size * count);
  return size * count;
}

size_t ignore_header(char*, size_t size, size_t count, void*) { return size * count; }

// What every raw row sets on its handle: the URL, no signals, the body appended to `body`, and
// the client's default connect and transfer timeouts.
void set_raw_get(CURL* h, const std::string& url, std::string& body) {
  curl_easy_setopt(h, CURLOPT_URL, url.c_str());
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, &discard_into);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, &body);
  curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, 2000L);
  curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, 10000L);
}

// Counts operator new calls from construction to finish() and reports them per iteration.
class AllocationsPerRequest {
 public:
  explicit AllocationsPerRequest(benchmark::State& state)
      : state_(state), start_(keel::bench::thread_allocations()) {}
  void finish() {
    state_.counters["allocs/op"] =
        benchmark::Counter(static_cast<double>(keel::bench::thread_allocations() - start_),
                           benchmark::Counter::kAvgIterations);
    state_.SetItemsProcessed(state_.iterations());
  }

 private:
  benchmark::State& state_;
  std::uint64_t start_;
};

void RawCurlGet(benchmark::State& state) {
  const std::string url = server().url("/bench");
  CURL* h = curl_easy_init();
  std::string body;
  set_raw_get(h, url, body);
  AllocationsPerRequest allocs(state);
  for (auto _ : state) {
    body.clear();
    if (curl_easy_perform(h) != CURLE_OK) {
      state.SkipWithError("curl_easy_perform failed");
      break;
    }
    benchmark::DoNotOptimize(body.data());
  }
  allocs.finish();
  curl_easy_cleanup(h);
}
BENCHMARK(RawCurlGet)->UseRealTime();

// A connection cache shared between easy handles, as keel::http::Client keeps one.
struct SharedCache {
  SharedCache() {
    share = curl_share_init();
    curl_share_setopt(share, CURLSHOPT_LOCKFUNC, &SharedCache::lock);
    curl_share_setopt(share, CURLSHOPT_UNLOCKFUNC, &SharedCache::unlock);
    curl_share_setopt(share, CURLSHOPT_USERDATA, this);
    curl_share_setopt(share, CURLSHOPT_SHARE, CURL_LOCK_DATA_CONNECT);
  }
  ~SharedCache() { curl_share_cleanup(share); }
  SharedCache(const SharedCache&) = delete;
  SharedCache& operator=(const SharedCache&) = delete;
  static void lock(CURL*, curl_lock_data, curl_lock_access, void* self) {
    static_cast<SharedCache*>(self)->mutex.lock();
  }
  static void unlock(CURL*, curl_lock_data, void* self) {
    static_cast<SharedCache*>(self)->mutex.unlock();
  }
  CURLSH* share = nullptr;
  std::mutex mutex;
};

// Raw libcurl set up as the client sets up each attempt: curl_easy_reset, then every option
// again, with the connection cache in a CURLSH (what lets many handles share connections).
void RawCurlSharedResetGet(benchmark::State& state) {
  const std::string url = server().url("/bench");
  SharedCache cache;
  CURL* h = curl_easy_init();
  std::string body;
  AllocationsPerRequest allocs(state);
  for (auto _ : state) {
    curl_easy_reset(h);
    curl_easy_setopt(h, CURLOPT_SHARE, cache.share);
    set_raw_get(h, url, body);
    body.clear();
    if (curl_easy_perform(h) != CURLE_OK) {
      state.SkipWithError("curl_easy_perform failed");
      break;
    }
    benchmark::DoNotOptimize(body.data());
  }
  allocs.finish();
  curl_easy_cleanup(h);
}
BENCHMARK(RawCurlSharedResetGet)->UseRealTime();

// RawCurlSharedResetGet sending the request head keel::http::Client sends for this GET: its
// User-Agent, Keel-Attempt and Keel-Deadline-Ms (the client's default 30 s overall timeout), with
// a header callback as the client has one. The floor for the client's wire format.
void RawCurlSameRequestGet(benchmark::State& state) {
  const std::string url = server().url("/bench");
  const std::string user_agent = keel::http::ClientOptions{}.transport.user_agent;
  SharedCache cache;
  CURL* h = curl_easy_init();
  std::string body;
  AllocationsPerRequest allocs(state);
  for (auto _ : state) {
    curl_slist* headers = curl_slist_append(nullptr, "Keel-Attempt: 1");
    const std::string deadline = std::string(keel::kDeadlineHeader) + ": " +
                                 keel::format_deadline_header(std::chrono::seconds(30));
    headers = curl_slist_append(headers, deadline.c_str());
    curl_easy_reset(h);
    curl_easy_setopt(h, CURLOPT_SHARE, cache.share);
    set_raw_get(h, url, body);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(h, CURLOPT_USERAGENT, user_agent.c_str());
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, &ignore_header);
    body.clear();
    const CURLcode rc = curl_easy_perform(h);
    curl_slist_free_all(headers);
    if (rc != CURLE_OK) {
      state.SkipWithError("curl_easy_perform failed");
      break;
    }
    benchmark::DoNotOptimize(body.data());
  }
  allocs.finish();
  curl_easy_cleanup(h);
}
BENCHMARK(RawCurlSameRequestGet)->UseRealTime();

void run_client(benchmark::State& state, const keel::http::ClientOptions& options) {
  keel::http::Client client(options);
  const keel::http::Request request{.url = server().url("/bench")};
  AllocationsPerRequest allocs(state);
  for (auto _ : state) {
    keel::http::Result r = client.send(request);
    if (!r.ok()) {
      state.SkipWithError("keel request failed");
      break;
    }
    benchmark::DoNotOptimize(r.response->body.data());
  }
  allocs.finish();
}

void KeelClientGet(benchmark::State& state) {
  run_client(state, {});  // defaults: breakers and budget on
}
BENCHMARK(KeelClientGet)->UseRealTime();

// The client without its per-host breaker and retry budget: the engine and libcurl only.
void KeelClientGetNoGuards(benchmark::State& state) {
  run_client(state, {.brakes = {.circuit_breakers = false, .retry_budget = false}});
}
BENCHMARK(KeelClientGetNoGuards)->UseRealTime();

#if KEEL_BENCH_HTTP_ASIO

// The Asio floor: libcurl's multi interface on an io_context with nothing else, the way
// src/asio/curl_multi.cpp maps it (a stream_descriptor wait per direction libcurl asks for, one
// steady_timer, a look with poll() when a read wait starts, since the reactor reports edges).
class RawMulti {
 public:
  explicit RawMulti(::asio::io_context& io) : io_(io), timer_(io) {
    multi_ = curl_multi_init();
    curl_multi_setopt(multi_, CURLMOPT_SOCKETFUNCTION, &RawMulti::on_socket);
    curl_multi_setopt(multi_, CURLMOPT_SOCKETDATA, this);
    curl_multi_setopt(multi_, CURLMOPT_TIMERFUNCTION, &RawMulti::on_timer);
    curl_multi_setopt(multi_, CURLMOPT_TIMERDATA, this);
  }
  ~RawMulti() {
    curl_multi_cleanup(multi_);  // closes the cached connection; on_socket releases its watch
    for (auto& [fd, w] : watches_) w->release();
  }
  RawMulti(const RawMulti&) = delete;
  RawMulti& operator=(const RawMulti&) = delete;

  // Runs one transfer of `easy` to its end on the io_context; returns its code.
  CURLcode perform(CURL* easy) {
    done_ = false;
    curl_multi_add_handle(multi_, easy);  // arms the timer: the transfer starts from it
    io_.restart();                        // run_one() stops the context when it runs out of work
    while (!done_) {
      if (io_.run_one() == 0) return CURLE_FAILED_INIT;  // nothing left that could end it
    }
    return result_;
  }

 private:
  struct Watch {
    Watch(::asio::io_context& io, curl_socket_t s) : fd(s), descriptor(io, s) {}
    ~Watch() {
      if (!released) descriptor.release();
    }
    void release() {
      released = true;
      descriptor.release();
    }
    curl_socket_t fd;
    ::asio::posix::stream_descriptor descriptor;
    int what = 0;
    bool reading = false;
    bool writing = false;
    bool released = false;
  };

  static int on_socket(CURL*, curl_socket_t s, int what, void* self, void*) {
    static_cast<RawMulti*>(self)->watch(s, what);
    return 0;
  }
  static int on_timer(CURLM*, long timeout_ms, void* self_ptr) {
    auto* self = static_cast<RawMulti*>(self_ptr);
    if (timeout_ms < 0) {
      self->timer_.cancel();
      return 0;
    }
    self->timer_.expires_after(std::chrono::milliseconds(timeout_ms));
    self->timer_.async_wait([self](const std::error_code& ec) {
      if (!ec) self->act(CURL_SOCKET_TIMEOUT, 0);
    });
    return 0;
  }
  void watch(curl_socket_t s, int what) {
    if (what == CURL_POLL_REMOVE) {
      if (auto it = watches_.find(s); it != watches_.end()) {
        it->second->release();
        watches_.erase(it);
      }
      return;
    }
    auto& w = watches_[s];
    if (!w) w = std::make_shared<Watch>(io_, s);
    w->what = what;
    arm(w, true);
  }
  void arm(const std::shared_ptr<Watch>& w, bool fresh) {
    if (w->released) return;
    bool started_read = false;
    if ((w->what & CURL_POLL_IN) != 0 && !w->reading) {
      w->reading = started_read = true;
      w->descriptor.async_wait(::asio::posix::stream_descriptor::wait_read,
                               [this, w](const std::error_code& ec) {
                                 w->reading = false;
                                 if (ec || w->released) return;
                                 if ((w->what & CURL_POLL_IN) != 0) act(w->fd, CURL_CSELECT_IN);
                                 arm(w, false);
                               });
    }
    if ((w->what & CURL_POLL_OUT) != 0 && !w->writing) {
      w->writing = true;
      w->descriptor.async_wait(::asio::posix::stream_descriptor::wait_write,
                               [this, w](const std::error_code& ec) {
                                 w->writing = false;
                                 if (ec || w->released) return;
                                 if ((w->what & CURL_POLL_OUT) != 0) act(w->fd, CURL_CSELECT_OUT);
                                 arm(w, false);
                               });
    }
    if (fresh && started_read) {
      pollfd p{w->fd, POLLIN, 0};
      if (::poll(&p, 1, 0) > 0) {
        ::asio::post(io_, [this, w] {
          if (!w->released && (w->what & CURL_POLL_IN) != 0) act(w->fd, CURL_CSELECT_IN);
        });
      }
    }
  }
  void act(curl_socket_t s, int events) {
    int running = 0;
    curl_multi_socket_action(multi_, s, events, &running);
    int left = 0;
    while (CURLMsg* msg = curl_multi_info_read(multi_, &left)) {
      if (msg->msg != CURLMSG_DONE) continue;
      result_ = msg->data.result;
      curl_multi_remove_handle(multi_, msg->easy_handle);
      done_ = true;
    }
  }

  ::asio::io_context& io_;
  CURLM* multi_ = nullptr;
  ::asio::steady_timer timer_;
  std::unordered_map<curl_socket_t, std::shared_ptr<Watch>> watches_;
  bool done_ = false;
  CURLcode result_ = CURLE_OK;
};

void RawCurlMultiAsioGet(benchmark::State& state) {
  const std::string url = server().url("/bench");
  ::asio::io_context io(1);
  RawMulti multi(io);
  CURL* h = curl_easy_init();
  std::string body;
  set_raw_get(h, url, body);
  AllocationsPerRequest allocs(state);
  for (auto _ : state) {
    body.clear();
    if (multi.perform(h) != CURLE_OK) {
      state.SkipWithError("curl transfer failed");
      break;
    }
    benchmark::DoNotOptimize(body.data());
  }
  allocs.finish();
  curl_easy_cleanup(h);
}
BENCHMARK(RawCurlMultiAsioGet)->UseRealTime();

void run_asio_client(benchmark::State& state, const keel::asio::HttpClientOptions& options) {
  ::asio::io_context io(1);
  {
    keel::asio::HttpClient client(io.get_executor(), options);
    const keel::http::Request request{.url = server().url("/bench")};
    AllocationsPerRequest allocs(state);
    for (auto _ : state) {
      bool done = false;
      bool ok = false;
      ::asio::co_spawn(io, client.send(request), [&](std::exception_ptr e, keel::http::Result r) {
        done = true;
        ok = !e && r.ok();
        if (ok) benchmark::DoNotOptimize(r.response->body.data());
      });
      io.restart();
      while (!done && io.run_one() != 0) {
      }
      if (!ok) {
        state.SkipWithError("keel::asio request failed");
        break;
      }
    }
    allocs.finish();
  }
  io.poll();  // the handlers the client's destruction cancelled
}

void AsioClientGet(benchmark::State& state) { run_asio_client(state, {}); }
BENCHMARK(AsioClientGet)->UseRealTime();

void AsioClientGetNoGuards(benchmark::State& state) {
  run_asio_client(state, {.brakes = {.circuit_breakers = false, .retry_budget = false}});
}
BENCHMARK(AsioClientGetNoGuards)->UseRealTime();

// Not a configuration to recommend (no attempt can time out): no transfer carries a backstop, so
// the driver's sweep timer is never armed.
void AsioClientGetNoTimeouts(benchmark::State& state) {
  run_asio_client(state, {.retry = {.max_attempts = 3}});
}
BENCHMARK(AsioClientGetNoTimeouts)->UseRealTime();

#endif  // KEEL_BENCH_HTTP_ASIO

}  // namespace

BENCHMARK_MAIN();
