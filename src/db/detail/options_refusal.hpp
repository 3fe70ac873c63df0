// How the store's options types refuse a field when their object is built: one message format,
// keel::Error's ("keel::store::WorkerOptions: batch must be >= 1 (got 0)"), for the queue's
// Worker, the idempotency records, the receiver's flow and the receiving HTTP layer's servers.
//
// Thread-safety: a value; calls may be made from any thread.
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include "keel/core/expected.hpp"

namespace keel::store::detail {

// The refusals of the options type named `options` ("keel::store::WorkerOptions"): calling it
// throws std::invalid_argument (keel::throw_invalid) naming the type, the field, the problem
// and the value. `options` must outlive it.
class OptionsRefusal {
 public:
  explicit constexpr OptionsRefusal(std::string_view options) noexcept : options_(options) {}

  [[noreturn]] void operator()(std::string_view field, std::string_view problem,
                               std::string got) const {
    throw_invalid({.context = std::string(options_),
                   .field = std::string(field),
                   .problem = std::string(problem),
                   .got = std::move(got)});
  }
  // The same with the problem "must be REQUIREMENT".
  [[noreturn]] void must_be(std::string_view field, std::string_view requirement,
                            std::string got) const {
    (*this)(field, "must be " + std::string(requirement), std::move(got));
  }

 private:
  std::string_view options_;
};

}  // namespace keel::store::detail
