// `keel-demo serve`: its flags (ServeOptions, read by add_serve in serve_flags.cpp) and the
// server they describe (run_serve in serve.cpp).
//
// Thread-safety: the options are filled while the command line is parsed and read-only after.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "keel/core/duration.hpp"
#include "keel/db/database.hpp"

namespace keel::cli::serve_cli {

/// A rate as given (its text, for the 429's detail) and in calls per second.
struct RateFlag {
  double per_s = 0;
  std::string text;
};

/// --listen HOST:PORT.
struct ListenFlag {
  std::string host;
  std::uint16_t port = 0;
  std::string text;
};

/// The flags of `keel-demo serve`, each value checked as it was parsed (defaults in
/// serve_flags.cpp). The combinations are checked by add_serve's runner before run_serve.
struct ServeOptions {
  ListenFlag listen;
  store::DatabaseUrl db;
  Duration ttl{};
  Duration lock_timeout{};
  std::optional<RateFlag> rate_limit;
  int rate_limit_principals = 10000;
  std::string scope_secret_file;
  Duration sweep_interval{};
  int threads = 16;
  std::int64_t max_concurrency = 0;
  std::int64_t admission_queue = -1;
  std::optional<Duration> adaptive_latency;
  bool adaptive_admission = false;
  std::size_t max_body_bytes = 0;
  std::size_t max_json_depth = 0;
  int retry_after_spread = 0;
  std::size_t max_connections = 0;
  std::chrono::milliseconds first_byte_timeout{};
  std::chrono::milliseconds header_timeout{};
  std::chrono::milliseconds body_timeout{};
  std::chrono::milliseconds idle_timeout{};
  std::chrono::milliseconds write_timeout{};
  std::chrono::milliseconds drain_timeout{};
  std::chrono::milliseconds health_timeout{};
  bool reuse_port = false;
  bool no_idempotency = false;
  double chaos_503 = 0;
  std::optional<Duration> chaos_503_retry_after;
  double chaos_delay_fraction = 0;
  Duration chaos_delay{};
  double chaos_hang_fraction = 0;
  Duration chaos_hang{};
  double chaos_drop = 0;
  std::uint64_t chaos_seed = 1;
};

/// Prints "keel-demo serve: MESSAGE" on stderr; returns kExitUsage.
int usage_error(const std::string& message);

/// Runs the server the options describe until SIGTERM, SIGINT or SIGHUP; returns the exit
/// status.
int run_serve(const ServeOptions& o);

}  // namespace keel::cli::serve_cli
