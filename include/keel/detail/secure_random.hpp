// Private to keel's adapters, never installed: random bytes from OpenSSL's CSPRNG, and the
// idempotency key keel generates from them. One home for what keel::http, keel::grpc and the
// store each need, header-only so that it adds no library: keel::core has no CSPRNG (it may use
// no third-party library) and the adapters link none of each other, only keel::core and OpenSSL.
// A target that includes this header links OpenSSL::Crypto.
//
// Thread-safety: both functions may be called from any thread (RAND_bytes is thread-safe).
#pragma once

#include <openssl/rand.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>

#include "keel/core/idempotency_key.hpp"

namespace keel::detail {

/// `size` bytes from OpenSSL's CSPRNG into `out`. Throws std::runtime_error ("LIBRARY: the CSPRNG
/// (RAND_bytes) could not supply bytes", `library` naming the caller's: "keel::http") when it
/// has none.
inline void secure_random_bytes(unsigned char* out, std::size_t size, std::string_view library) {
  if (RAND_bytes(out, static_cast<int>(size)) != 1) {
    throw std::runtime_error(std::string(library) +
                             ": the CSPRNG (RAND_bytes) could not supply bytes");
  }
}

/// A new idempotency key: keel::uuid_v4 of 16 bytes from the CSPRNG. Throws as
/// secure_random_bytes.
[[nodiscard]] inline std::string random_idempotency_key(std::string_view library) {
  UuidBytes bytes{};
  secure_random_bytes(bytes.data(), bytes.size(), library);
  return uuid_v4(bytes);
}

}  // namespace keel::detail
