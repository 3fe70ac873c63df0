// keel's job queue delivering over gRPC: a job handler (keel::store::Worker, `keel jobs work`'s
// library) that sends each job as one unary call through a keel::grpc::Client. The job's payload
// is the request message in protobuf's JSON form (what `keel jobs enqueue` and `keel dlq show`
// read and write); the job's idempotency key travels as idempotency-key metadata, the same on
// every attempt of every worker, so a receiver with keel::grpc::IdempotentUnary answers a
// repeated delivery with its stored reply; the job's earlier attempts are the call's
// prior_attempts (grpc-previous-rpc-attempts on the wire, and a retry for the client's budget).
//
// The queue is the retrying layer: give the client one attempt per call (job_client_options),
// or a job that always fails reaches the server max_attempts x the client's attempts times. When
// the client sends nothing (the target's breaker is open, the budget is empty), the report is
// kNotAttempted and the Worker defers the job without charging an attempt: an outage longer than
// the retries parks the work until the breaker's next probe instead of burning its attempts.
//
// Thread-safety: operator() is safe from several threads at once (the client and stub are).
//
// Example:
//   keel::grpc::Client client(keel::grpc::job_client_options("payments:50051", 10s));
//   auto stub = payments::Payments::NewStub(client.channel());
//   keel::store::Worker worker(pool, queue, {.queue = "charges"},
//                              keel::grpc::UnaryJobHandler(client, *stub,
//                                                          &payments::Payments::Stub::Charge));
#pragma once

#include <google/protobuf/util/json_util.h>

#include <atomic>
#include <string>
#include <string_view>

#include "keel/grpc/client.hpp"
#include "keel/queue/queue.hpp"

namespace keel::grpc {

/// Client options for a job handler: one attempt per call, per-try and overall timeout
/// `timeout`, no give-up line (the queue records every attempt); breakers and budget are the
/// client's defaults. Requires: timeout > 0 (else std::invalid_argument).
[[nodiscard]] ClientOptions job_client_options(std::string target, Duration timeout);

/// The report of a job attempt whose call ended with `result`: kNotAttempted with why nothing
/// was sent when nothing was ("circuit open for TARGET, next probe in 4.9s"); otherwise the
/// outcome, with keel::describe of it and the status message (storable text, at most 200 bytes).
[[nodiscard]] store::AttemptReport report_of(const CallResult& result, std::string_view target);

/// The report of a job whose payload is not the request message's JSON: permanent (a retry
/// parses the same bytes).
[[nodiscard]] store::AttemptReport unparsable_payload(std::string_view message_type,
                                                      std::string_view problem);

template <class Stub, class Request, class Response>
class UnaryJobHandler {
 public:
  using Method = ::grpc::Status (Stub::*)(::grpc::ClientContext*, const Request&, Response*);

  /// Requires: client and stub outlive the handler and every copy of it.
  UnaryJobHandler(Client& client, Stub& stub, Method method)
      : client_(&client), stub_(&stub), method_(method) {}

  /// Sends one call for `job`. `cancel` is not watched: the client's timeout bounds the call.
  [[nodiscard]] store::AttemptReport operator()(const store::LeasedJob& job,
                                                const std::atomic<bool>& /*cancel*/) const {
    Request request;
    const auto parsed = google::protobuf::util::JsonStringToMessage(job.payload, &request);
    if (!parsed.ok()) {
      return unparsable_payload(Request::descriptor()->full_name(), parsed.ToString());
    }
    Response reply;
    const CallResult result =
        client_->call(*stub_, method_, request, &reply,
                      {.idempotency_key = job.idempotency_key, .prior_attempts = job.attempt - 1});
    return report_of(result, client_->options().target);
  }

 private:
  Client* client_;
  Stub* stub_;
  Method method_;
};

}  // namespace keel::grpc
