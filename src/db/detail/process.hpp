// What the store's shared rows call this process, and the random bytes the store draws: one home
// for each, used by the queue (a Worker's default worker_id, a job's key), the idempotency
// records (tokens, the scope secret) and the fleet (a member's name).
//
// Thread-safety: both functions may be called from any thread.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <string>

#include "keel/core/random.hpp"
#include "keel/detail/secure_random.hpp"

namespace keel::store::detail {

// `size` bytes from OpenSSL's CSPRNG into `out`; throws std::runtime_error when it has none
// (the including target links OpenSSL::Crypto).
inline void secure_random_bytes(unsigned char* out, std::size_t size) {
  keel::detail::secure_random_bytes(out, size, "keel::store");
}

// "host:pid:xxxxxxxx": the host name (spaces and line breaks made '_', "localhost" when it has
// none), the process id and 32 random bits, so that two processes of one host, or one pid
// reused, are told apart in the rows they share (a job's worker, a fleet's member).
inline std::string process_name() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  std::string name = host[0] != '\0' ? host : "localhost";
  std::replace_if(
      name.begin(), name.end(), [](char c) { return c == ' ' || c == '\n' || c == '\r'; }, '_');
  char tail[16];
  std::snprintf(tail, sizeof tail, "%08x", static_cast<unsigned>(random_seed()));
  return name + ":" + std::to_string(::getpid()) + ":" + tail;
}

}  // namespace keel::store::detail
