// The job queue delivering over gRPC (keel::grpc::UnaryJobHandler) to a receiver with keel's
// idempotency flow (keel::grpc::IdempotentUnary), on SQLite and PostgreSQL, through the seeds'
// outage story: the receiver is down for longer than the queue's retries. With keel's breaker the
// work is parked (deferred, not charged) and delivered once when the receiver is back; without
// it, every job burns its attempts and is dead before the receiver returns.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "charges_database.hpp"
#include "keel/grpc/job_handler.hpp"
#include "keel/grpc/server.hpp"
#include "keel/queue/queue_worker.hpp"
#include "test_service.grpc.pb.h"

namespace {

using namespace std::chrono_literals;
using keel::store::Backend;
using keel::store::JobState;

class Receiver final : public keel::test::Payments::Service {
 public:
  explicit Receiver(const keel::grpc::IdempotentUnary& guard) : guard_(guard) {}
  ::grpc::Status Charge(::grpc::ServerContext* context, const keel::test::ChargeRequest* request,
                        keel::test::ChargeReply* reply) override {
    return guard_.run(*context, "/keel.test.Payments/Charge", *request, *reply,
                      [&](keel::store::Connection& tx, keel::test::ChargeReply& out) {
                        ++handled;
                        keel::test::insert_charge(tx, *request);
                        out.set_charge_id("ch_" + request->account());
                        return ::grpc::Status::OK;
                      });
  }
  std::atomic<int> handled{0};

 private:
  const keel::grpc::IdempotentUnary& guard_;
};

class GrpcJobs : public keel::test::ChargesDatabaseTest {
 protected:
  void SetUp() override {
    ChargesDatabaseTest::SetUp();
    if (IsSkipped()) return;
    keel::store::JobQueue::migrate(*pool_->acquire());
    guard_ = std::make_unique<keel::grpc::IdempotentUnary>(with_flow());
    receiver_ = std::make_unique<Receiver>(*guard_);
  }
  void TearDown() override { stop_receiver(); }

  /// Listens on `port` (0: any free one); returns the port.
  int start_receiver(int port) {
    ::grpc::ServerBuilder builder;
    int bound = 0;
    builder.AddListeningPort("127.0.0.1:" + std::to_string(port),
                             ::grpc::InsecureServerCredentials(), &bound);
    builder.RegisterService(receiver_.get());
    server_ = builder.BuildAndStart();
    return bound;
  }
  void stop_receiver() {
    if (server_) {
      server_->Shutdown(std::chrono::system_clock::now() + 500ms);
      server_.reset();
    }
  }

  [[nodiscard]] std::int64_t count(const std::string& sql) const {
    return pool_->acquire()->query(sql).integer(0, 0);
  }

  /// 20 jobs through a Worker while the receiver is down for `outage`, then back on its port.
  /// Returns the jobs dead when the outage ended.
  std::int64_t deliver_through_an_outage(bool breaker, keel::Duration outage) {
    const int port = start_receiver(0);
    stop_receiver();  // the outage starts before the first delivery
    keel::store::JobQueue queue({.max_attempts = 6, .backoff = {.base = 50ms, .cap = 200ms}});
    {
      auto conn = pool_->acquire();
      for (int i = 0; i < 20; ++i) {
        (void)queue.enqueue(*conn, {.queue = "charges",
                                    .payload = R"({"account":"acct_)" + std::to_string(i) +
                                               R"(","amountCents":"500"})"});
      }
    }
    keel::grpc::ClientOptions options =
        keel::grpc::job_client_options("127.0.0.1:" + std::to_string(port), 2s);
    options.brakes.circuit_breakers = breaker;
    // A breaker that opens after 3 failures and probes after 250 ms, then twice as long each
    // time: few probes (each a charged attempt) in an outage of seconds.
    options.brakes.own_breakers = {.breaker = {.minimum_calls = 3,
                                               .failure_rate_threshold = 0.5,
                                               .break_duration = 250ms,
                                               .break_growth = 2.0}};
    keel::grpc::Client client(options);
    auto stub = keel::test::Payments::NewStub(client.channel());
    keel::store::Worker worker(
        *pool_, queue, {.queue = "charges"},
        keel::grpc::UnaryJobHandler(client, *stub, &keel::test::Payments::Stub::Charge));
    std::thread running([&] { (void)worker.run(); });
    std::this_thread::sleep_for(outage);
    const std::int64_t dead_in_outage =
        count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'dead'");
    EXPECT_EQ(start_receiver(port), port);
    for (int i = 0; i < 400; ++i) {
      if (count("SELECT COUNT(*) FROM keel_jobs WHERE state IN ('done', 'dead')") == 20) break;
      std::this_thread::sleep_for(50ms);
    }
    worker.stop();
    running.join();
    return dead_in_outage;
  }

  std::unique_ptr<keel::grpc::IdempotentUnary> guard_;
  std::unique_ptr<Receiver> receiver_;
  std::unique_ptr<::grpc::Server> server_;
};

TEST_P(GrpcJobs, AnOutageLongerThanTheRetriesParksTheWorkAndItIsDeliveredOnce) {
  EXPECT_EQ(deliver_through_an_outage(/*breaker=*/true, 2500ms), 0);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'"), 20);
  EXPECT_EQ(count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'dead'"), 0);
  EXPECT_EQ(count("SELECT COUNT(*) FROM charges"), 20);  // each job charged once
  EXPECT_EQ(receiver_->handled.load(), 20);
  // The outage's charged attempts: the breaker's first failures and its probes, not 20 x 6.
  const std::int64_t failed = count("SELECT SUM(attempts) FROM keel_jobs") - 20;
  EXPECT_LE(failed, 10);
  RecordProperty("failed_attempts", static_cast<int>(failed));
}

TEST_P(GrpcJobs, WithoutABreakerTheSameOutageBurnsTheAttempts) {
  const std::int64_t dead = deliver_through_an_outage(/*breaker=*/false, 2500ms);
  EXPECT_GT(dead, 0);
  RecordProperty("dead_in_outage", static_cast<int>(dead));
  EXPECT_EQ(count("SELECT COUNT(*) FROM charges"),
            count("SELECT COUNT(*) FROM keel_jobs WHERE state = 'done'"));
}

TEST_P(GrpcJobs, APayloadThatIsNotTheMessagesJsonIsDeadAtOnce) {
  const int port = start_receiver(0);
  keel::store::JobQueue queue({.max_attempts = 5});
  std::int64_t id = 0;
  {
    auto conn = pool_->acquire();
    id =
        queue.enqueue(*conn, {.queue = "charges", .payload = R"({"account": 5, "nope": true})"}).id;
  }
  keel::grpc::Client client(
      keel::grpc::job_client_options("127.0.0.1:" + std::to_string(port), 2s));
  auto stub = keel::test::Payments::NewStub(client.channel());
  keel::store::Worker worker(
      *pool_, queue, {.queue = "charges", .exit_when_idle = true},
      keel::grpc::UnaryJobHandler(client, *stub, &keel::test::Payments::Stub::Charge));
  EXPECT_EQ(worker.run(), 1);
  const keel::store::Job job = queue.get(*pool_->acquire(), id).value();
  EXPECT_EQ(job.state, JobState::kDead);
  EXPECT_EQ(job.attempts, 1);
  EXPECT_NE(job.dead_reason.find("keel.test.ChargeRequest"), std::string::npos) << job.dead_reason;
  EXPECT_EQ(receiver_->handled.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, GrpcJobs,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         keel::test::backend_name);

}  // namespace
