// A gRPC payments service and its client, both with keel (docs/grpc.md).
//
// The server charges through keel::grpc::IdempotentUnary: the charge row and the reply are
// committed together under the call's idempotency-key, on a SQLite file. The network loses the
// first reply of every charge on its way back (the server answers after the client's attempt
// deadline). keel::grpc::Client retries each charge with the same key and gets the stored reply:
// three orders, three charges, none twice. Exits 0 when that holds.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>

#include "keel/grpc/client.hpp"
#include "keel/grpc/server.hpp"
#include "keel/idempotency/idempotency.hpp"
#include "payments.grpc.pb.h"

using namespace std::chrono_literals;

class PaymentsService final : public payments::Payments::Service {
 public:
  explicit PaymentsService(const keel::grpc::IdempotentUnary& guard) : guard_(guard) {}

  grpc::Status Charge(grpc::ServerContext* context, const payments::ChargeRequest* request,
                      payments::ChargeReply* reply) override {
    const grpc::Status status = guard_.run(
        *context, "/payments.Payments/Charge", *request, *reply,
        [&](keel::store::Connection& tx, payments::ChargeReply& out) {
          const keel::store::Rows row = tx.query(
              "INSERT INTO charges (account, cents) VALUES ($1, $2) RETURNING id",
              {request->account(), keel::store::Value(std::int64_t{request->amount_cents()})});
          out.set_charge_id("ch_" + row.text(0, 0));
          return grpc::Status::OK;
        });
    // The lossy network: the first reply of each call's key arrives after the client gave up.
    if (++arrivals_ % 2 == 1) std::this_thread::sleep_for(300ms);
    return status;
  }

 private:
  const keel::grpc::IdempotentUnary& guard_;
  std::atomic<int> arrivals_{0};
};

int main() {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("keel-grpc-payments-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  int status = 1;
  {
    keel::store::ConnectionPool pool(
        keel::store::parse_database_url("sqlite:" + (dir / "payments.db").string()).value());
    {
      auto conn = pool.acquire();
      keel::store::IdempotencyStore::migrate(*conn);
      conn->execute(
          "CREATE TABLE charges (id INTEGER PRIMARY KEY, account TEXT NOT NULL, cents INTEGER)");
    }
    const keel::store::IdempotencyStore store;
    const keel::grpc::IdempotentUnary guard(
        {.flow = {.store = &store, .pool = &pool, .scope_secret = "example-secret-of-16+bytes"}});
    PaymentsService service(guard);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    const std::unique_ptr<grpc::Server> server = builder.BuildAndStart();

    // Each attempt may take 150 ms; the call as a whole 5 s.
    keel::grpc::Client client({.target = "127.0.0.1:" + std::to_string(port),
                               .retry = {.max_attempts = 4,
                                         .per_try_timeout = 150ms,
                                         .overall_timeout = 5s,
                                         .backoff = {.base = 20ms, .cap = 200ms}}});
    auto stub = payments::Payments::NewStub(client.channel());
    bool all_charged = true;
    for (const char* order : {"order-1", "order-2", "order-3"}) {
      payments::ChargeRequest request;
      request.set_account("acct_42");
      request.set_amount_cents(1999);
      payments::ChargeReply reply;
      // The order's id is the charge's idempotency key: the same on every attempt.
      const keel::grpc::CallResult r = client.call(*stub, &payments::Payments::Stub::Charge,
                                                   request, &reply, {.idempotency_key = order});
      std::printf("%s: %s after %d attempts (%s)\n", order,
                  r.ok() ? reply.charge_id().c_str() : r.status.error_message().c_str(), r.attempts,
                  std::string(keel::to_string(r.reason)).c_str());
      all_charged = all_charged && r.ok();
    }
    const std::int64_t charges =
        pool.acquire()->query("SELECT COUNT(*) FROM charges").integer(0, 0);
    std::printf("charges made: %lld for 3 orders\n", static_cast<long long>(charges));
    server->Shutdown(std::chrono::system_clock::now() + 1s);
    status = all_charged && charges == 3 ? 0 : 1;
  }
  std::filesystem::remove_all(dir);
  return status;
}
