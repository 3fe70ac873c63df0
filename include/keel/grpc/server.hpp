// keel::grpc::IdempotentUnary: keel's receiving side for a gRPC service's unary methods. Inside a
// synchronous service method it refuses a call whose deadline has passed, sheds retries first
// when an AdmissionLimiter is full (grpc-previous-rpc-attempts), and runs keel's idempotency flow
// (keel/idempotency/idempotency_flow.hpp) keyed by the call's idempotency-key metadata: the
// handler's writes and its reply are committed together, a repeat of the same call is answered
// with the stored reply, and a key reused with another request, or still held by a call in
// progress, is refused. The request message's bytes (deterministic serialization) and the method
// are the fingerprint a repeat must match.
//
// The answers, as gRPC statuses (a wait is sent as grpc-retry-pushback-ms, from core's jitter):
//   executed, replayed           OK with the reply (a replay adds initial metadata
//                                idempotent-replayed: true)
//   the handler's own error      its status; nothing stored, the writes rolled back
//   in progress, claim lost      ABORTED + pushback: another call holds the key
//   key reused, other request    FAILED_PRECONDITION
//   key missing, malformed, sent twice                INVALID_ARGUMENT
//   deadline passed (grpc-timeout or keel-deadline-ms, the earlier)   DEADLINE_EXCEEDED
//   shed by the admission limiter                     RESOURCE_EXHAUSTED + pushback
//   database unavailable         UNAVAILABLE + pushback
//   commit in doubt              UNKNOWN + pushback (a retry with the key gets the stored reply)
//   handler threw                INTERNAL
//   database error no retry can fix                   INTERNAL + pushback -1 (do not retry)
// The text of an exception or a database error goes to the flow's log, never to the client.
//
// Thread-safety: run() is safe from every thread of the server; the options' store, pool and
// limiter must outlive the object and be safe for concurrent use.
//
// Example (a synchronous service):
//   grpc::Status Charge(grpc::ServerContext* ctx, const ChargeRequest* req,
//                       ChargeReply* reply) override {
//     return guard.run(*ctx, "/payments.Payments/Charge", *req, *reply,
//                      [&](keel::store::Connection& tx, ChargeReply& out) {
//                        tx.query("INSERT INTO charges (account, cents) VALUES ($1, $2)", ...);
//                        out.set_charge_id(...);
//                        return grpc::Status::OK;
//                      });
//   }
#pragma once

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include <functional>
#include <string>
#include <string_view>
#include <type_traits>

#include "keel/core/admission.hpp"
#include "keel/idempotency/idempotency_flow.hpp"

namespace keel::grpc {

struct ServerOptions {
  /// The idempotency flow's options: store and pool are required (see FlowOptions). Its clock
  /// is what deadlines are read against.
  store::FlowOptions flow;
  /// Sheds retries first when full (keel/core/admission.hpp): a call's attempt number is its
  /// grpc-previous-rpc-attempts plus one (or Keel-Attempt). Non-owning. Default none.
  AdmissionLimiter* limiter = nullptr;
  /// Who the call authenticates as, verified by the server (keys are scoped by it). Default: the
  /// authorization metadata as keel's HTTP receivers read the Authorization header ("" without
  /// one).
  std::function<std::string(const ::grpc::ServerContext&)> principal;
  /// Called for each call the limiter shed. Default none.
  std::function<void(const ::grpc::ServerContext&, const Admission&)> on_shed;
};

/// The work of one unary method: writes through `tx` (a transaction is open), fills `reply` and
/// returns OK to commit both, or a non-OK status to roll back and answer it (nothing stored). May
/// run more than once (the transaction is retried on serialization failures): do nothing outside
/// `tx`.
template <class Response>
using UnaryHandler = std::function<::grpc::Status(store::Connection& tx, Response& reply)>;

class IdempotentUnary {
 public:
  /// Throws std::invalid_argument naming the field when the flow's options are invalid.
  explicit IdempotentUnary(ServerOptions options);

  /// Serves one call of `method` (its full name, "/package.Service/Method": part of the
  /// fingerprint).
  template <class Request, class Response>
  ::grpc::Status run(::grpc::ServerContext& context, std::string_view method,
                     const Request& request, Response& reply,
                     const std::type_identity_t<UnaryHandler<Response>>& handler) const {
    std::string reply_bytes;
    const ::grpc::Status status = serve(
        context, method, deterministic_bytes(request),
        [&](store::Connection& tx, std::string& out) {
          Response fresh;  // a retried transaction starts from an empty reply
          ::grpc::Status s = handler(tx, fresh);
          if (s.ok()) out = deterministic_bytes(fresh);
          return s;
        },
        reply_bytes);
    if (status.ok() && !reply.ParseFromString(reply_bytes)) {
      return {::grpc::StatusCode::INTERNAL, "keel: the stored reply does not parse"};
    }
    return status;
  }

  [[nodiscard]] const ServerOptions& options() const noexcept { return options_; }

 private:
  using BytesHandler = std::function<::grpc::Status(store::Connection&, std::string&)>;
  ::grpc::Status serve(::grpc::ServerContext& context, std::string_view method,
                       const std::string& request_bytes, const BytesHandler& handler,
                       std::string& reply_bytes) const;

  template <class Message>
  static std::string deterministic_bytes(const Message& message) {
    std::string bytes;
    {
      google::protobuf::io::StringOutputStream stream(&bytes);
      google::protobuf::io::CodedOutputStream out(&stream);
      out.SetSerializationDeterministic(true);
      message.SerializeToCodedStream(&out);
    }
    return bytes;
  }

  ServerOptions options_;
  store::IdempotentRequestFlow flow_;
};

}  // namespace keel::grpc
