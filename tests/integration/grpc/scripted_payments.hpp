// A real gRPC server on loopback whose Payments.Charge answers come from a script: each arrival
// takes the next answer (status, trailers, a delay before it), or the default once the script
// is used up; every arrival's metadata and deadline are recorded. Used in-process by the client
// tests and as a separate process by grpc_test_server.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "test_service.grpc.pb.h"

namespace keel::test {

struct ScriptedAnswer {
  ::grpc::StatusCode code = ::grpc::StatusCode::OK;
  std::vector<std::pair<std::string, std::string>> trailers;
  /// Waited before answering (ended early when the call is cancelled or its deadline passes).
  std::chrono::milliseconds delay{0};
};

struct Arrival {
  std::multimap<std::string, std::string> metadata;
  /// The call's deadline as the server saw it, from the moment it arrived (nullopt: none).
  std::optional<std::chrono::milliseconds> deadline_left;
  std::string account;
  std::int64_t amount_cents = 0;
};

class ScriptedPayments final : public keel::test::Payments::Service {
 public:
  void script(std::vector<ScriptedAnswer> answers, ScriptedAnswer otherwise = {}) {
    std::lock_guard lock(mu_);
    script_.assign(answers.begin(), answers.end());
    otherwise_ = std::move(otherwise);
  }

  ::grpc::Status Charge(::grpc::ServerContext* context, const keel::test::ChargeRequest* request,
                        keel::test::ChargeReply* reply) override {
    ScriptedAnswer answer;
    int arrival = 0;
    {
      std::lock_guard lock(mu_);
      Arrival a;
      for (const auto& [k, v] : context->client_metadata()) {
        a.metadata.emplace(std::string(k.data(), k.size()), std::string(v.data(), v.size()));
      }
      const auto deadline = context->deadline();
      if (deadline != std::chrono::system_clock::time_point::max()) {
        a.deadline_left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::system_clock::now());
      }
      a.account = request->account();
      a.amount_cents = request->amount_cents();
      arrivals_.push_back(std::move(a));
      arrival = static_cast<int>(arrivals_.size());
      if (on_arrival_) on_arrival_(arrivals_.back());
      if (!script_.empty()) {
        answer = std::move(script_.front());
        script_.pop_front();
      } else {
        answer = otherwise_;
      }
      arrived_.notify_all();
    }
    const auto until = std::chrono::steady_clock::now() + answer.delay;
    while (std::chrono::steady_clock::now() < until && !context->IsCancelled()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    if (context->IsCancelled()) {
      std::lock_guard lock(mu_);
      ++cancelled_;
      arrived_.notify_all();
    }
    for (const auto& [k, v] : answer.trailers) context->AddTrailingMetadata(k, v);
    if (answer.code != ::grpc::StatusCode::OK) return {answer.code, "scripted"};
    reply->set_charge_id("ch_" + std::to_string(arrival));
    reply->set_arrival(arrival);
    return ::grpc::Status::OK;
  }

  /// Called under the service's lock as each call arrives.
  void on_arrival(std::function<void(const Arrival&)> hook) {
    std::lock_guard lock(mu_);
    on_arrival_ = std::move(hook);
  }

  [[nodiscard]] std::vector<Arrival> arrivals() const {
    std::lock_guard lock(mu_);
    return arrivals_;
  }
  [[nodiscard]] std::size_t count() const {
    std::lock_guard lock(mu_);
    return arrivals_.size();
  }
  /// Calls the client cancelled (or whose deadline passed) while they were answered.
  [[nodiscard]] int cancelled() const {
    std::lock_guard lock(mu_);
    return cancelled_;
  }
  bool wait_for_cancelled(int n, std::chrono::milliseconds limit) {
    std::unique_lock lock(mu_);
    return arrived_.wait_for(lock, limit, [&] { return cancelled_ >= n; });
  }
  /// Waits (real time, bounded) until n calls have arrived.
  bool wait_for_arrivals(std::size_t n, std::chrono::milliseconds limit) {
    std::unique_lock lock(mu_);
    return arrived_.wait_for(lock, limit, [&] { return arrivals_.size() >= n; });
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable arrived_;
  std::deque<ScriptedAnswer> script_;
  ScriptedAnswer otherwise_;
  std::vector<Arrival> arrivals_;
  std::function<void(const Arrival&)> on_arrival_;
  int cancelled_ = 0;
};

/// The service on 127.0.0.1 (port 0: any free port), stopped on destruction.
class PaymentsServer {
 public:
  explicit PaymentsServer(int port = 0) {
    ::grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:" + std::to_string(port),
                             ::grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
  }
  ~PaymentsServer() { stop(); }
  PaymentsServer(const PaymentsServer&) = delete;
  PaymentsServer& operator=(const PaymentsServer&) = delete;

  void stop() {
    if (server_) {
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
      server_.reset();
    }
  }
  [[nodiscard]] bool started() const noexcept { return server_ != nullptr && port_ > 0; }
  [[nodiscard]] int port() const noexcept { return port_; }
  [[nodiscard]] std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  ScriptedPayments& service() noexcept { return service_; }
  ::grpc::Server& server() noexcept { return *server_; }

 private:
  ScriptedPayments service_;
  int port_ = 0;
  std::unique_ptr<::grpc::Server> server_;
};

}  // namespace keel::test
