// A program that uses keel::grpc through find_package(keel COMPONENTS grpc ...): a call to a
// port nothing listens on, retried by core's engine, ends UNAVAILABLE after its attempts; the
// receiving side and the job handler's options are built.
#include <grpcpp/generic/generic_stub.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <keel/grpc/client.hpp>
#include <keel/grpc/job_handler.hpp>
#include <keel/grpc/server.hpp>
#include <mutex>

int main() {
  using namespace std::chrono_literals;
  keel::grpc::Client client({.target = "127.0.0.1:9",
                             .retry = {.max_attempts = 3,
                                       .per_try_timeout = 500ms,
                                       .overall_timeout = 5s,
                                       .backoff = {.base = 1ms, .cap = 5ms}},
                             .log = [](std::string_view) {}});
  grpc::GenericStub stub(client.channel());
  const keel::grpc::CallResult r =
      client.run({.idempotent = true}, [&](grpc::ClientContext& context) {
        grpc::Slice empty("");  // an empty message
        grpc::ByteBuffer request(&empty, 1);
        grpc::ByteBuffer reply;
        grpc::Status status;
        bool done = false;
        std::mutex mu;
        std::condition_variable cv;
        stub.UnaryCall(&context, "/payments.Payments/Charge", grpc::StubOptions(), &request, &reply,
                       [&](grpc::Status s) {
                         std::lock_guard lock(mu);
                         status = std::move(s);
                         done = true;
                         cv.notify_all();
                       });
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return done; });
        return status;
      });
  const keel::grpc::ClientOptions job = keel::grpc::job_client_options("127.0.0.1:9", 1s);
  std::printf("%s after %d attempts\n", r.status.error_message().c_str(), r.attempts);
  return r.status.error_code() == grpc::StatusCode::UNAVAILABLE && r.attempts == 3 &&
                 job.retry.max_attempts == 1
             ? 0
             : 1;
}
