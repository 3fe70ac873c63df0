// keel's receiving side for gRPC unary methods (see keel/grpc/server.hpp).
#include "keel/grpc/server.hpp"

#include <cctype>
#include <chrono>
#include <optional>
#include <string>
#include <utility>

#include "keel/core/grpc_status.hpp"
#include "keel/core/random.hpp"
#include "keel/core/retry_after.hpp"
#include "keel/grpc/client.hpp"
#include "keel/idempotency/request_translation.hpp"

namespace keel::grpc {
namespace {

/// A call's metadata as keel's one request translation reads header fields: gRPC keys are lower
/// case, so a field name is looked up lower-cased ("Idempotency-Key" is idempotency-key).
class GrpcMetadata final : public store::HeaderLookup {
 public:
  explicit GrpcMetadata(const ::grpc::ServerContext& context) noexcept
      : metadata_(context.client_metadata()) {}
  [[nodiscard]] std::optional<std::string_view> first(std::string_view name) const override {
    const std::string key = lower(name);
    const auto it = metadata_.find(::grpc::string_ref(key.data(), key.size()));
    if (it == metadata_.end()) return std::nullopt;
    return std::string_view(it->second.data(), it->second.size());
  }
  [[nodiscard]] std::size_t count(std::string_view name) const override {
    const std::string key = lower(name);
    return metadata_.count(::grpc::string_ref(key.data(), key.size()));
  }

 private:
  static std::string lower(std::string_view name) {
    std::string out(name);
    for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return out;
  }
  const std::multimap<::grpc::string_ref, ::grpc::string_ref>& metadata_;
};

/// The call's deadline on `clock`: the earlier of its gRPC deadline (grpc-timeout, kept by gRPC
/// on the system clock) and its keel-deadline-ms.
Deadline call_deadline(const ::grpc::ServerContext& context, const store::HeaderLookup& metadata,
                       Clock& clock, TimePoint arrival) {
  Deadline deadline = store::request_deadline(metadata, arrival);
  const auto grpc_deadline = context.deadline();
  if (grpc_deadline != std::chrono::system_clock::time_point::max()) {
    const auto left = grpc_deadline - std::chrono::system_clock::now();
    deadline = deadline.min(Deadline::after(
        clock, left > left.zero() ? std::chrono::duration_cast<Duration>(left) : Duration::zero()));
  }
  return deadline;
}

/// The wait a Retry-After field of the flow's answer asks for, as a pushback trailer.
void add_pushback(::grpc::ServerContext& context, const store::FlowResponse& answer) {
  const std::optional<std::string_view> retry_after = answer.header("Retry-After");
  if (!retry_after) return;
  // The flow sends whole seconds (never a date), which need no clock to read.
  const std::optional<Duration> wait = parse_retry_after(*retry_after, WallTime{});
  if (!wait) return;
  context.AddTrailingMetadata(std::string(kPushbackMetadata), format_grpc_pushback(*wait));
}

/// The handler's own non-OK status, carried through the flow (which stores nothing for it).
constexpr std::string_view kStatusField = "grpc-status";
constexpr std::string_view kMessageField = "grpc-message";

::grpc::Status handler_status(const store::FlowResponse& answer) {
  const std::optional<std::string_view> code = answer.header(kStatusField);
  const std::optional<std::string_view> message = answer.header(kMessageField);
  int value = static_cast<int>(::grpc::StatusCode::UNKNOWN);
  if (code) value = std::stoi(std::string(*code));
  return {static_cast<::grpc::StatusCode>(value), std::string(message.value_or(""))};
}

/// The flow's answer as a gRPC status (see the table in keel/grpc/server.hpp).
::grpc::Status to_status(::grpc::ServerContext& context, const store::FlowResponse& answer) {
  using store::FlowOutcome;
  using Code = ::grpc::StatusCode;
  const std::string what = "keel: " + std::string(to_string(answer.outcome));
  switch (answer.outcome) {
    case FlowOutcome::kExecuted:
    case FlowOutcome::kTookOver:
      return ::grpc::Status::OK;
    case FlowOutcome::kReplayed:
      context.AddInitialMetadata("idempotent-replayed", "true");
      return ::grpc::Status::OK;
    case FlowOutcome::kNotStored:
      return handler_status(answer);
    case FlowOutcome::kInProgress:
    case FlowOutcome::kClaimLost:
      add_pushback(context, answer);
      return {Code::ABORTED, what + ": another call holds this idempotency-key"};
    case FlowOutcome::kMismatch:
      return {Code::FAILED_PRECONDITION,
              what + ": this idempotency-key was used with a different request"};
    case FlowOutcome::kMissingKey:
      return {Code::INVALID_ARGUMENT, what + ": send one idempotency-key metadata entry"};
    case FlowOutcome::kInvalidKey:
      return {Code::INVALID_ARGUMENT, what + ": the idempotency-key is malformed or sent twice"};
    case FlowOutcome::kInvalidBody:
      return {Code::INVALID_ARGUMENT, what};
    case FlowOutcome::kDeadlineExceeded:
      return {Code::DEADLINE_EXCEEDED, what};
    case FlowOutcome::kDatabaseUnavailable:
      add_pushback(context, answer);
      return {Code::UNAVAILABLE, what};
    case FlowOutcome::kCommitInDoubt:
      add_pushback(context, answer);
      return {Code::UNKNOWN, what + ": retry with the same idempotency-key"};
    case FlowOutcome::kHandlerError:
      return {Code::INTERNAL, what};
    case FlowOutcome::kDatabaseError:
      context.AddTrailingMetadata(std::string(kPushbackMetadata), "-1");  // a retry fails alike
      return {Code::INTERNAL, what};
  }
  return {Code::INTERNAL, what};
}

}  // namespace

IdempotentUnary::IdempotentUnary(ServerOptions options)
    : options_(std::move(options)), flow_(options_.flow) {}

::grpc::Status IdempotentUnary::serve(::grpc::ServerContext& context, std::string_view method,
                                      const std::string& request_bytes, const BytesHandler& handler,
                                      std::string& reply_bytes) const {
  Clock& clock = options_.flow.clock != nullptr ? *options_.flow.clock : steady_clock();
  const TimePoint arrival = clock.now();
  const GrpcMetadata metadata(context);
  const Deadline deadline = call_deadline(context, metadata, clock, arrival);
  if (deadline.expired(arrival)) {
    return {::grpc::StatusCode::DEADLINE_EXCEEDED, "keel: the deadline passed before it arrived"};
  }
  Admission admission;
  if (options_.limiter != nullptr) {
    admission = options_.limiter->admit(store::request_attempt(metadata), thread_rng());
    if (!admission) {
      if (options_.on_shed) options_.on_shed(context, admission);
      context.AddTrailingMetadata(std::string(kPushbackMetadata),
                                  format_grpc_pushback(admission.retry_after()));
      return {::grpc::StatusCode::RESOURCE_EXHAUSTED,
              admission.reason() == ShedReason::kRetryOverLimit
                  ? "keel: overloaded, retries shed first"
                  : "keel: overloaded"};
    }
  }
  const std::string principal =
      options_.principal ? options_.principal(context) : store::principal_from_headers(metadata);
  store::FlowRequest request =
      store::flow_request(metadata, "POST", method, request_bytes, principal, deadline);
  request.content_type = "application/grpc";
  const store::FlowResponse answer = flow_.run(request, [&](store::Connection& tx) {
    std::string out;
    const ::grpc::Status status = handler(tx, out);
    if (status.ok()) return store::StoredResponse{200, {}, std::move(out)};
    // Not stored (not 2xx): the flow rolls back and answers it; the code travels in a field.
    return store::StoredResponse{
        500,
        {{std::string(kStatusField), std::to_string(static_cast<int>(status.error_code()))},
         {std::string(kMessageField), status.error_message()}},
        ""};
  });
  const TimePoint ended = clock.now();
  admission.release(ended - arrival, ended);
  const ::grpc::Status status = to_status(context, answer);
  if (status.ok()) reply_bytes = answer.body;
  return status;
}

}  // namespace keel::grpc
