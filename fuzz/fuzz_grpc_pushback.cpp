// Fuzzes the grpc-retry-pushback-ms parser and the gRPC status classifier: no crash, no UB; a
// delay is never negative and comes only from ASCII digits; anything else says "do not retry";
// what a receiver formats reads back as a delay at least as long; any status code classifies.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <keel/core/grpc_status.hpp>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const keel::GrpcPushback p = keel::parse_grpc_pushback(text);
  bool digits = !text.empty();
  for (const char c : text) digits = digits && c >= '0' && c <= '9';
  if (digits != (p.kind == keel::GrpcPushback::Kind::kDelay)) std::abort();
  if (p.kind == keel::GrpcPushback::Kind::kDelay) {
    if (p.delay < keel::Duration::zero()) std::abort();
    const keel::GrpcPushback again = keel::parse_grpc_pushback(keel::format_grpc_pushback(p.delay));
    if (again.kind != keel::GrpcPushback::Kind::kDelay || again.delay < p.delay) std::abort();
  }
  int code = 0;
  std::memcpy(&code, data, size < sizeof code ? size : sizeof code);
  const keel::Outcome o = keel::classify_grpc_status(code, {.pushback = p});
  if (o.source != keel::OutcomeSource::kGrpc || o.code != code) std::abort();
  if (o.kind == keel::OutcomeKind::kSuccess && code != 0) std::abort();
  if (p.kind == keel::GrpcPushback::Kind::kNoRetry && o.kind != keel::OutcomeKind::kSuccess &&
      o.kind != keel::OutcomeKind::kPermanent && o.retry_limit != 0) {
    std::abort();
  }
  return 0;
}
