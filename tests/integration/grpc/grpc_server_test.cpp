// keel::grpc::IdempotentUnary over real gRPC on loopback, on SQLite and PostgreSQL: replays,
// a key reused or in progress, the handler's own errors, deadlines, shedding retries first,
// hostile metadata, and the flaky story (a reply lost after the charge committed) with keel's
// client against a naive retry loop.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "charges_database.hpp"
#include "keel/core/grpc_status.hpp"
#include "keel/grpc/client.hpp"
#include "keel/grpc/server.hpp"
#include "test_service.grpc.pb.h"

namespace {

using namespace std::chrono_literals;
using ::grpc::StatusCode;
using keel::store::Backend;
using keel::store::Connection;

constexpr std::string_view kMethod = "/keel.test.Payments/Charge";

/// A gate a handler waits at until the test opens it.
class Gate {
 public:
  void open() {
    std::lock_guard lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, 20s, [&] { return open_; });
  }
  void arrived() {
    std::lock_guard lock(mu_);
    ++arrived_;
    cv_.notify_all();
  }
  bool wait_arrived(int n) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, 20s, [&] { return arrived_ >= n; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
  int arrived_ = 0;
};

/// Payments.Charge inserting one row per charge: through keel's flow (guarded), or straight
/// into the table as a naive service does.
class ChargeService final : public keel::test::Payments::Service {
 public:
  ChargeService(const keel::grpc::IdempotentUnary& guard, keel::store::ConnectionPool& pool)
      : guard_(guard), pool_(pool) {}

  ::grpc::Status Charge(::grpc::ServerContext* context, const keel::test::ChargeRequest* request,
                        keel::test::ChargeReply* reply) override {
    const int arrival = ++arrivals;
    ::grpc::Status status;
    if (guarded) {
      status = guard_.run(
          *context, kMethod, *request, *reply,
          [&](Connection& tx, keel::test::ChargeReply& out) { return charge(tx, *request, out); });
    } else {
      auto conn = pool_.acquire();
      status = charge(*conn, *request, *reply);
    }
    // The flaky story: the first reply is lost on the way back (its charge committed).
    if (lose_first_reply && arrival == 1) std::this_thread::sleep_for(400ms);
    return status;
  }

  std::atomic<int> arrivals{0};
  std::atomic<int> handled{0};
  std::atomic<bool> guarded{true};
  std::atomic<bool> lose_first_reply{false};
  Gate slow;  // a charge of account "slow" waits here

 private:
  ::grpc::Status charge(Connection& tx, const keel::test::ChargeRequest& request,
                        keel::test::ChargeReply& out) {
    ++handled;
    if (request.account() == "slow") {
      slow.arrived();
      slow.wait();
    }
    if (request.account() == "refused") {
      return {StatusCode::FAILED_PRECONDITION, "account closed"};
    }
    keel::test::insert_charge(tx, request);
    out.set_charge_id("ch_" +
                      std::to_string(tx.query("SELECT COUNT(*) FROM charges").integer(0, 0)));
    return ::grpc::Status::OK;
  }

  const keel::grpc::IdempotentUnary& guard_;
  keel::store::ConnectionPool& pool_;
};

class GrpcServer : public keel::test::ChargesDatabaseTest {
 protected:
  void SetUp() override {
    ChargesDatabaseTest::SetUp();
    if (IsSkipped()) return;
    start({});
  }
  void TearDown() override {
    if (server_) {
      service_->slow.open();
      server_->Shutdown(std::chrono::system_clock::now() + 1s);
    }
  }

  void start(keel::grpc::ServerOptions options) {
    if (server_) {
      service_->slow.open();
      server_->Shutdown(std::chrono::system_clock::now() + 1s);
      server_.reset();
    }
    options = with_flow(std::move(options));
    options.flow.max_wait = 500ms;  // SQLite's one writer: a second call waits this long
    guard_ = std::make_unique<keel::grpc::IdempotentUnary>(std::move(options));
    service_ = std::make_unique<ChargeService>(*guard_, *pool_);
    ::grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", ::grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_TRUE(server_ != nullptr);
    // gRPC's own retries off, as on keel's channels: with them on, gRPC sets
    // grpc-previous-rpc-attempts itself and drops the caller's.
    ::grpc::ChannelArguments arguments;
    arguments.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
    channel_ =
        ::grpc::CreateCustomChannel(target(), ::grpc::InsecureChannelCredentials(), arguments);
    stub_ = keel::test::Payments::NewStub(channel_);
  }

  [[nodiscard]] std::string target() const { return "127.0.0.1:" + std::to_string(port_); }

  [[nodiscard]] long long rows() const {
    auto conn = pool_->acquire();
    return conn->query("SELECT COUNT(*) FROM charges").integer(0, 0);
  }

  static keel::test::ChargeRequest request(std::string account, long long cents = 500) {
    keel::test::ChargeRequest r;
    r.set_account(std::move(account));
    r.set_amount_cents(cents);
    return r;
  }

  /// One plain call with the metadata given; the context is kept for its trailers.
  ::grpc::Status raw(::grpc::ClientContext& context, const keel::test::ChargeRequest& req,
                     keel::test::ChargeReply& reply,
                     const std::vector<std::pair<std::string, std::string>>& metadata,
                     keel::test::Payments::Stub* stub = nullptr) {
    for (const auto& [k, v] : metadata) context.AddMetadata(k, v);
    context.set_deadline(std::chrono::system_clock::now() + 10s);
    return (stub != nullptr ? stub : stub_.get())->Charge(&context, req, &reply);
  }

  /// A stub on a channel of its own (a refusal that closes a connection ends there).
  [[nodiscard]] std::unique_ptr<keel::test::Payments::Stub> fresh_stub() const {
    ::grpc::ChannelArguments arguments;
    arguments.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
    arguments.SetInt("keel.test.unshared", ++channels_);  // not a channel gRPC shares
    return keel::test::Payments::NewStub(
        ::grpc::CreateCustomChannel(target(), ::grpc::InsecureChannelCredentials(), arguments));
  }
  mutable int channels_ = 0;

  static std::string trailer(const ::grpc::ClientContext& context, const std::string& key) {
    const auto& md = context.GetServerTrailingMetadata();
    const auto it = md.find(key);
    return it == md.end() ? "<none>" : std::string(it->second.data(), it->second.size());
  }

  std::unique_ptr<keel::grpc::IdempotentUnary> guard_;
  std::unique_ptr<ChargeService> service_;
  std::unique_ptr<::grpc::Server> server_;
  std::shared_ptr<::grpc::Channel> channel_;
  std::unique_ptr<keel::test::Payments::Stub> stub_;
  int port_ = 0;
};

TEST_P(GrpcServer, ARepeatIsAnsweredWithTheStoredReply) {
  keel::grpc::Client client({.target = target(), .log = [](std::string_view) {}});
  auto stub = keel::test::Payments::NewStub(client.channel());
  keel::test::ChargeReply first;
  const auto r = client.call(*stub, &keel::test::Payments::Stub::Charge, request("acct_1"), &first,
                             {.idempotency_key = "order-1"});
  ASSERT_TRUE(r.ok()) << r.status.error_message();
  ::grpc::ClientContext context;
  keel::test::ChargeReply again;
  const ::grpc::Status s = raw(context, request("acct_1"), again, {{"idempotency-key", "order-1"}});
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(again.charge_id(), first.charge_id());
  const auto& initial = context.GetServerInitialMetadata();
  const auto replayed = initial.find("idempotent-replayed");
  ASSERT_NE(replayed, initial.end());
  EXPECT_EQ(std::string(replayed->second.data(), replayed->second.size()), "true");
  EXPECT_EQ(rows(), 1);
  EXPECT_EQ(service_->handled.load(), 1);
}

TEST_P(GrpcServer, AKeyReusedWithAnotherRequestIsRefused) {
  keel::grpc::Client client({.target = target(), .log = [](std::string_view) {}});
  auto stub = keel::test::Payments::NewStub(client.channel());
  keel::test::ChargeReply reply;
  ASSERT_TRUE(client
                  .call(*stub, &keel::test::Payments::Stub::Charge, request("acct_1", 500), &reply,
                        {.idempotency_key = "order-2"})
                  .ok());
  const auto r = client.call(*stub, &keel::test::Payments::Stub::Charge, request("acct_1", 900),
                             &reply, {.idempotency_key = "order-2"});
  EXPECT_EQ(r.status.error_code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(r.reason, keel::StopReason::kPermanent);
  EXPECT_EQ(r.attempts, 1);
  EXPECT_EQ(rows(), 1);
}

TEST_P(GrpcServer, AKeyHeldByACallInProgressIsAnsweredAbortedWithAPushback) {
  std::thread first([&] {
    ::grpc::ClientContext context;
    keel::test::ChargeReply reply;
    const ::grpc::Status s = raw(context, request("slow"), reply, {{"idempotency-key", "k-3"}});
    EXPECT_TRUE(s.ok()) << s.error_message();
  });
  ASSERT_TRUE(service_->slow.wait_arrived(1));
  ::grpc::ClientContext context;
  keel::test::ChargeReply reply;
  const ::grpc::Status s = raw(context, request("slow"), reply, {{"idempotency-key", "k-3"}});
  const keel::GrpcPushback pushback =
      keel::parse_grpc_pushback(trailer(context, "grpc-retry-pushback-ms"));
  EXPECT_EQ(pushback.kind, keel::GrpcPushback::Kind::kDelay)
      << trailer(context, "grpc-retry-pushback-ms");
  if (GetParam() == Backend::kPostgres) {
    EXPECT_EQ(s.error_code(), StatusCode::ABORTED) << s.error_message();
    // The flow's Retry-After: a spread of 1..3 s while the claim is uncommitted, the lock's
    // expiry (30 s) plus 0..2 s once it is.
    EXPECT_GE(pushback.delay, 1s);
    EXPECT_LE(pushback.delay, 33s);
  } else {
    // SQLite has one writer, held by the call in progress: the second waits max_wait for it.
    EXPECT_EQ(s.error_code(), StatusCode::UNAVAILABLE) << s.error_message();
    EXPECT_GE(pushback.delay, 1s);
    EXPECT_LE(pushback.delay, 3s);
  }
  service_->slow.open();
  first.join();
  EXPECT_EQ(rows(), 1);
}

TEST_P(GrpcServer, TheHandlersOwnErrorIsAnsweredAndNothingIsStored) {
  for (int i = 0; i < 2; ++i) {
    ::grpc::ClientContext context;
    keel::test::ChargeReply reply;
    const ::grpc::Status s = raw(context, request("refused"), reply, {{"idempotency-key", "k-4"}});
    EXPECT_EQ(s.error_code(), StatusCode::FAILED_PRECONDITION);
    EXPECT_EQ(s.error_message(), "account closed");
  }
  EXPECT_EQ(service_->handled.load(), 2);  // not stored: the repeat ran again
  EXPECT_EQ(rows(), 0);
}

TEST_P(GrpcServer, AnExpiredDeadlineIsRefusedBeforeTheHandler) {
  ::grpc::ClientContext context;
  keel::test::ChargeReply reply;
  const ::grpc::Status s = raw(context, request("acct_1"), reply,
                               {{"idempotency-key", "k-5"}, {"keel-deadline-ms", "0"}});
  EXPECT_EQ(s.error_code(), StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(service_->handled.load(), 0);
  EXPECT_EQ(rows(), 0);
}

TEST_P(GrpcServer, RetriesAreShedFirstWhenTheLimiterIsFull) {
  keel::AdmissionLimiter limiter({.max_concurrency = 1, .queue_bound = 1});
  start({.limiter = &limiter});
  std::thread first([&] {
    ::grpc::ClientContext context;
    keel::test::ChargeReply reply;
    EXPECT_TRUE(raw(context, request("slow"), reply, {{"idempotency-key", "k-6a"}}).ok());
  });
  ASSERT_TRUE(service_->slow.wait_arrived(1));
  EXPECT_EQ(limiter.in_flight(), 1);
  {
    ::grpc::ClientContext context;
    keel::test::ChargeReply reply;
    const ::grpc::Status s =
        raw(context, request("acct_1"), reply,
            {{"idempotency-key", "k-6b"}, {"grpc-previous-rpc-attempts", "1"}});
    EXPECT_EQ(s.error_code(), StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_NE(s.error_message().find("retries shed first"), std::string::npos);
    const keel::GrpcPushback pushback =
        keel::parse_grpc_pushback(trailer(context, "grpc-retry-pushback-ms"));
    EXPECT_EQ(pushback.kind, keel::GrpcPushback::Kind::kDelay);
  }
  {
    // A first attempt is still admitted (the queue bound); on SQLite it then waits for the one
    // writer, which the call in progress holds.
    ::grpc::ClientContext context;
    keel::test::ChargeReply reply;
    const ::grpc::Status s = raw(context, request("acct_1"), reply, {{"idempotency-key", "k-6c"}});
    if (GetParam() == Backend::kPostgres) {
      EXPECT_TRUE(s.ok()) << s.error_message();
    } else {
      EXPECT_EQ(s.error_code(), StatusCode::UNAVAILABLE) << s.error_message();
    }
  }
  service_->slow.open();
  first.join();
  EXPECT_EQ(rows(), GetParam() == Backend::kPostgres ? 2 : 1);
  EXPECT_EQ(limiter.stats().shed[static_cast<int>(keel::ShedReason::kRetryOverLimit)], 1U);
}

// Metadata a hostile or broken client sends: refused with INVALID_ARGUMENT (or by gRPC itself
// before it reaches the method), the handler never runs, nothing is stored.
TEST_P(GrpcServer, HostileMetadataIsRefusedWithoutRunningTheHandler) {
  using Metadata = std::vector<std::pair<std::string, std::string>>;
  const std::vector<Metadata> cases = {
      {},
      {{"idempotency-key", ""}},
      {{"idempotency-key", "a"}, {"idempotency-key", "b"}},
      {{"idempotency-key", "a"}, {"idempotency-key", "a"}},
      {{"idempotency-key", std::string(300, 'k')}},
      {{"idempotency-key", "has space"}},
      {{"idempotency-key", std::string(12000, 'k')}},
      {{"idempotency-key-bin", std::string("\x00\xff\x10", 3)}},
  };
  // Names and values gRPC's own client refuses to send (an API misuse that aborts the process:
  // upper case or non-ASCII names, non-ASCII or control bytes in a value) cannot be sent from
  // here; keel's client refuses them before sending (grpc_client_test.cpp).
  for (const Metadata& md : cases) {
    SCOPED_TRACE(md.empty() ? std::string("no key")
                            : md.front().first + " x" + std::to_string(md.size()));
    ::grpc::ClientContext context;
    keel::test::ChargeReply reply;
    const auto stub = fresh_stub();
    const ::grpc::Status s = raw(context, request("acct_1"), reply, md, stub.get());
    EXPECT_FALSE(s.ok());
    EXPECT_TRUE(s.error_code() == StatusCode::INVALID_ARGUMENT ||
                s.error_code() == StatusCode::RESOURCE_EXHAUSTED ||
                s.error_code() == StatusCode::INTERNAL)
        << s.error_code() << " " << s.error_message();
  }
  EXPECT_EQ(service_->handled.load(), 0);
  EXPECT_EQ(rows(), 0);
}

// A message whose bytes begin like a JSON document ('\n', then a length of 123, '{') nested
// deeper than the JSON limit: a gRPC message is protobuf, never held to them.
TEST_P(GrpcServer, AMessageWhoseBytesLookLikeDeepJsonIsStoredAsAnyOther) {
  ::grpc::ClientContext context;
  keel::test::ChargeReply reply;
  const ::grpc::Status s =
      raw(context, request(std::string(123, '[')), reply, {{"idempotency-key", "k-8"}});
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(rows(), 1);
}

// Seed 001's flaky story over gRPC: the first reply is lost after its charge committed. keel's
// client retries with the same key and gets the stored reply: one charge. A naive loop (retry on
// DEADLINE_EXCEEDED, no key, a service without the flow) charges twice.
TEST_P(GrpcServer, ALostReplyIsRetriedIntoTheStoredOneNotASecondCharge) {
  service_->lose_first_reply = true;
  keel::grpc::ClientOptions o{.target = target(), .log = [](std::string_view) {}};
  o.retry.per_try_timeout = 150ms;
  o.retry.backoff = {.base = 1ms, .cap = 10ms};
  keel::grpc::Client client(o);
  auto stub = keel::test::Payments::NewStub(client.channel());
  keel::test::ChargeReply reply;
  const auto r = client.call(*stub, &keel::test::Payments::Stub::Charge, request("acct_1"), &reply);
  EXPECT_TRUE(r.ok()) << r.status.error_message();
  EXPECT_EQ(r.attempts, 2);
  EXPECT_EQ(reply.charge_id(), "ch_1");
  EXPECT_EQ(rows(), 1);

  // The naive side, on a fresh table.
  {
    auto conn = pool_->acquire();
    conn->execute("DELETE FROM charges");
  }
  start({});
  service_->guarded = false;
  service_->lose_first_reply = true;
  int calls = 0;
  for (; calls < 3; ++calls) {
    ::grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 150ms);
    keel::test::ChargeReply naive;
    if (stub_->Charge(&context, request("acct_1"), &naive).ok()) break;
  }
  EXPECT_EQ(calls, 1);   // the second call succeeded
  EXPECT_EQ(rows(), 2);  // charged twice
}

INSTANTIATE_TEST_SUITE_P(Backends, GrpcServer,
                         ::testing::Values(Backend::kSqlite, Backend::kPostgres),
                         keel::test::backend_name);

}  // namespace
