// One translation of an incoming HTTP request for keel's server adapters (cpp-httplib's,
// keel/serve/httplib/, and Boost.Beast's, keel/serve/beast/), so that the rules a receiver
// applies to a request's header fields are written once: which fields carry the attempt number
// (Keel-Attempt, x-envoy-attempt-count, grpc-previous-rpc-attempts), that Keel-Deadline-Ms sent
// twice is ignored, that the Authorization field names the principal, how many Idempotency-Key
// fields came, and what a shed request is answered (503 problem+json with Retry-After). An
// adapter gives a HeaderLookup over its framework's request and copies the FlowResponse these
// return into its framework's response.
//
// Thread-safety: free functions over the caller's objects; safe to call from many threads.
//
// Example (an adapter for a framework whose request has find(name) and count(name)):
//   struct Fields final : keel::store::HeaderLookup {
//     const Req& r;
//     explicit Fields(const Req& req) : r(req) {}
//     std::optional<std::string_view> first(std::string_view n) const override { ... }
//     std::size_t count(std::string_view n) const override { return r.count(n); }
//   };
//   const int attempt = keel::store::request_attempt(Fields(req));
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "keel/core/admission.hpp"
#include "keel/core/clock.hpp"
#include "keel/idempotency/idempotency_flow.hpp"

namespace keel::store {

/// A request's header fields as a server framework holds them; names are compared without regard
/// to case. The views first() returns stay valid while the request does.
class HeaderLookup {
 public:
  /// The first value of field `name`; nullopt when the request has none.
  [[nodiscard]] virtual std::optional<std::string_view> first(std::string_view name) const = 0;
  /// How many fields named `name` the request carries.
  [[nodiscard]] virtual std::size_t count(std::string_view name) const = 0;

 protected:
  HeaderLookup() = default;
  HeaderLookup(const HeaderLookup&) = default;
  HeaderLookup& operator=(const HeaderLookup&) = default;
  ~HeaderLookup() = default;
};

/// The attempt number the request declares (keel::attempt_number over Keel-Attempt,
/// x-envoy-attempt-count and grpc-previous-rpc-attempts): 1 when it declares none.
[[nodiscard]] int request_attempt(const HeaderLookup& headers);

/// The deadline of a request that arrived at `arrival`: request_deadline(Keel-Deadline-Ms,
/// arrival). A field sent twice is invalid, hence ignored (infinite).
[[nodiscard]] Deadline request_deadline(const HeaderLookup& headers, TimePoint arrival);

/// The principal the Authorization field names (principal_from_authorization), "" without one.
[[nodiscard]] std::string principal_from_headers(const HeaderLookup& headers);

/// The request as IdempotentRequestFlow reads it: `method`, `path` (what identifies the
/// operation), `body`, the verified `principal` and `deadline`, with the Idempotency-Key (its
/// first field and how many came) and Content-Type read from `headers`. The views must outlive
/// the flow's run().
[[nodiscard]] FlowRequest flow_request(const HeaderLookup& headers, std::string_view method,
                                       std::string_view path, std::string_view body,
                                       std::string_view principal, Deadline deadline);

/// The answer to a request that `admission` shed: 503 problem+json "Overloaded", saying whether
/// retries were shed first, with the admission's Retry-After in whole seconds. The flow did not
/// run: its outcome field is left at its default and means nothing for this answer (adapters
/// report a shed request through their on_shed hook, not on_outcome).
/// Requires: !admission (a shed admission).
[[nodiscard]] FlowResponse shed_response(const Admission& admission);

}  // namespace keel::store
