// keel::grpc::Client next to the plain generated stub, and next to gRPC's own retry policy, over
// real gRPC on 127.0.0.1 (in-process synchronous servers of tests/integration/grpc's
// test_service.proto, one per behaviour).
//
// The success path, one call at a time (calls/s; the ratio keel / stub, goal >= 0.95):
//   PlainStubCharge               the generated stub, a ClientContext per call: the floor
//   PlainStubChargeSameHead       the same with what keel puts on the wire (a deadline, an
//                                 idempotency-key made per call)
//   KeelClientCharge              keel::grpc::Client with its defaults (breaker, budget, a key)
//   KeelClientChargeIdempotent    the same for a call marked idempotent (no key)
//   KeelClientChargeNoGuards      the same without the breaker and the budget
//
// A dependency in trouble (requests the server received per call, and per success):
//   *Outage    every call answered UNAVAILABLE
//   *Flaky     every fourth arrival answered UNAVAILABLE (25%, under the breaker's 50%)
//   GrpcPolicy*           gRPC's retryPolicy (5 attempts, backoff 1-5 ms, on UNAVAILABLE)
//   GrpcPolicyThrottled*  the same with gRPC's retryThrottling (maxTokens 10, tokenRatio 0.1)
//   KeelClient*           keel's client, 5 attempts, backoff 1-5 ms, its budget and breaker
//   KeelClientBudgetOnly* the same without the breaker
// Each trouble row makes 300 calls on a fresh client or channel: a budget or throttle drains
// within them, so the figure is the average over a dependency's first 300 calls in trouble.
//
// Run:   keel_bench_grpc --benchmark_min_time=1 --benchmark_repetitions=5
//          --benchmark_enable_random_interleaving=true
#include <benchmark/benchmark.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "keel/grpc/client.hpp"
#include "test_service.grpc.pb.h"

namespace {

using namespace std::chrono_literals;

enum class Behaviour { kOk, kOutage, kFlaky };

class Payments final : public keel::test::Payments::Service {
 public:
  explicit Payments(Behaviour b) : behaviour_(b) {}
  ::grpc::Status Charge(::grpc::ServerContext*, const keel::test::ChargeRequest*,
                        keel::test::ChargeReply* reply) override {
    const long n = ++arrivals;
    if (behaviour_ == Behaviour::kOutage || (behaviour_ == Behaviour::kFlaky && n % 4 == 1)) {
      return {::grpc::StatusCode::UNAVAILABLE, "down"};
    }
    reply->set_charge_id("ch_1");
    return ::grpc::Status::OK;
  }
  std::atomic<long> arrivals{0};

 private:
  Behaviour behaviour_;
};

struct Server {
  explicit Server(Behaviour b) : service(b) {
    ::grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", ::grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
  }
  [[nodiscard]] std::string target() const { return "127.0.0.1:" + std::to_string(port); }
  Payments service;
  int port = 0;
  std::unique_ptr<::grpc::Server> server;
};

Server& server(Behaviour b) {
  static Server ok(Behaviour::kOk);
  static Server outage(Behaviour::kOutage);
  static Server flaky(Behaviour::kFlaky);
  return b == Behaviour::kOk ? ok : b == Behaviour::kOutage ? outage : flaky;
}

keel::test::ChargeRequest request() {
  keel::test::ChargeRequest r;
  r.set_account("acct_1");
  r.set_amount_cents(500);
  return r;
}

void PlainStubCharge(benchmark::State& state) {
  auto stub = keel::test::Payments::NewStub(
      ::grpc::CreateChannel(server(Behaviour::kOk).target(), ::grpc::InsecureChannelCredentials()));
  const auto req = request();
  for (auto _ : state) {
    ::grpc::ClientContext context;
    keel::test::ChargeReply reply;
    if (!stub->Charge(&context, req, &reply).ok()) state.SkipWithError("call failed");
  }
  state.SetItemsProcessed(state.iterations());
}

void PlainStubChargeSameHead(benchmark::State& state) {
  auto stub = keel::test::Payments::NewStub(
      ::grpc::CreateChannel(server(Behaviour::kOk).target(), ::grpc::InsecureChannelCredentials()));
  const auto req = request();
  for (auto _ : state) {
    ::grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 10s);
    context.AddMetadata("idempotency-key", keel::grpc::make_idempotency_key());
    keel::test::ChargeReply reply;
    if (!stub->Charge(&context, req, &reply).ok()) state.SkipWithError("call failed");
  }
  state.SetItemsProcessed(state.iterations());
}

void keel_success(benchmark::State& state, bool idempotent, bool guards) {
  keel::grpc::ClientOptions options{.target = server(Behaviour::kOk).target()};
  options.brakes.circuit_breakers = guards;
  options.brakes.retry_budget = guards;
  keel::grpc::Client client(options);
  auto stub = keel::test::Payments::NewStub(client.channel());
  const auto req = request();
  for (auto _ : state) {
    keel::test::ChargeReply reply;
    if (!client
             .call(*stub, &keel::test::Payments::Stub::Charge, req, &reply,
                   {.idempotent = idempotent})
             .ok()) {
      state.SkipWithError("call failed");
    }
  }
  state.SetItemsProcessed(state.iterations());
}
void KeelClientCharge(benchmark::State& s) { keel_success(s, false, true); }
void KeelClientChargeIdempotent(benchmark::State& s) { keel_success(s, true, true); }
void KeelClientChargeNoGuards(benchmark::State& s) { keel_success(s, false, false); }

/// Requests the server received per call and per success, over the benchmark's calls.
void report(benchmark::State& state, const Server& s, long arrivals_before, long successes) {
  const auto calls = static_cast<double>(state.iterations());
  const auto sent = static_cast<double>(s.service.arrivals.load() - arrivals_before);
  state.counters["requests_per_call"] = calls > 0 ? sent / calls : 0;
  state.counters["requests_per_success"] =
      successes > 0 ? sent / static_cast<double>(successes) : sent;
  state.counters["success_rate"] = calls > 0 ? static_cast<double>(successes) / calls : 0;
}

void grpc_policy(benchmark::State& state, Behaviour b, bool throttled) {
  Server& s = server(b);
  std::string config =
      R"({"methodConfig":[{"name":[{"service":"keel.test.Payments"}],"retryPolicy":)"
      R"({"maxAttempts":5,"initialBackoff":"0.001s","maxBackoff":"0.005s",)"
      R"("backoffMultiplier":2,"retryableStatusCodes":["UNAVAILABLE"]}}])";
  config += throttled ? R"(,"retryThrottling":{"maxTokens":10,"tokenRatio":0.1}})" : "}";
  ::grpc::ChannelArguments arguments;
  arguments.SetServiceConfigJSON(config);
  auto stub = keel::test::Payments::NewStub(
      ::grpc::CreateCustomChannel(s.target(), ::grpc::InsecureChannelCredentials(), arguments));
  const auto req = request();
  const long before = s.service.arrivals.load();
  long successes = 0;
  for (auto _ : state) {
    ::grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 10s);
    keel::test::ChargeReply reply;
    if (stub->Charge(&context, req, &reply).ok()) ++successes;
  }
  report(state, s, before, successes);
}

void keel_trouble(benchmark::State& state, Behaviour b, bool breaker) {
  Server& s = server(b);
  keel::grpc::ClientOptions options{.target = s.target(), .log = [](std::string_view) {}};
  options.retry.max_attempts = 5;
  options.retry.backoff = {.base = 1ms, .cap = 5ms};
  options.brakes.circuit_breakers = breaker;
  keel::grpc::Client client(options);
  auto stub = keel::test::Payments::NewStub(client.channel());
  const auto req = request();
  const long before = s.service.arrivals.load();
  long successes = 0;
  for (auto _ : state) {
    keel::test::ChargeReply reply;
    if (client.call(*stub, &keel::test::Payments::Stub::Charge, req, &reply).ok()) ++successes;
  }
  report(state, s, before, successes);
}

void GrpcPolicyOutage(benchmark::State& s) { grpc_policy(s, Behaviour::kOutage, false); }
void GrpcPolicyThrottledOutage(benchmark::State& s) { grpc_policy(s, Behaviour::kOutage, true); }
void KeelClientOutage(benchmark::State& s) { keel_trouble(s, Behaviour::kOutage, true); }
void KeelClientBudgetOnlyOutage(benchmark::State& s) { keel_trouble(s, Behaviour::kOutage, false); }
void GrpcPolicyFlaky(benchmark::State& s) { grpc_policy(s, Behaviour::kFlaky, false); }
void GrpcPolicyThrottledFlaky(benchmark::State& s) { grpc_policy(s, Behaviour::kFlaky, true); }
void KeelClientFlaky(benchmark::State& s) { keel_trouble(s, Behaviour::kFlaky, true); }
void KeelClientBudgetOnlyFlaky(benchmark::State& s) { keel_trouble(s, Behaviour::kFlaky, false); }

// Every trouble row makes the same number of calls, so that their requests compare.
constexpr int kTroubleCalls = 300;

}  // namespace

BENCHMARK(PlainStubCharge)->UseRealTime();
BENCHMARK(PlainStubChargeSameHead)->UseRealTime();
BENCHMARK(KeelClientCharge)->UseRealTime();
BENCHMARK(KeelClientChargeIdempotent)->UseRealTime();
BENCHMARK(KeelClientChargeNoGuards)->UseRealTime();
BENCHMARK(GrpcPolicyOutage)->UseRealTime()->Iterations(kTroubleCalls);
BENCHMARK(GrpcPolicyThrottledOutage)->UseRealTime()->Iterations(kTroubleCalls);
BENCHMARK(KeelClientOutage)->UseRealTime()->Iterations(kTroubleCalls);
BENCHMARK(KeelClientBudgetOnlyOutage)->UseRealTime()->Iterations(kTroubleCalls);
BENCHMARK(GrpcPolicyFlaky)->UseRealTime()->Iterations(kTroubleCalls);
BENCHMARK(GrpcPolicyThrottledFlaky)->UseRealTime()->Iterations(kTroubleCalls);
BENCHMARK(KeelClientFlaky)->UseRealTime()->Iterations(kTroubleCalls);
BENCHMARK(KeelClientBudgetOnlyFlaky)->UseRealTime()->Iterations(kTroubleCalls);

BENCHMARK_MAIN();
