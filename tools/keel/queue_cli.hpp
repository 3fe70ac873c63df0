// Pieces shared by `keel jobs` and `keel dlq`: opening the queue's database from --db, and
// messages in one format.
#pragma once

#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "commands.hpp"
#include "keel/db/database.hpp"
#include "keel/queue/queue.hpp"

namespace keel::cli::queue_cli {

/// Exit status of an operational failure (the database could not be opened or written).
inline constexpr int kExitFailure = 1;

inline int usage_error(const char* command, const std::string& message) {
  std::fprintf(stderr, "keel %s: %s\n", command, message.c_str());
  return kExitUsage;
}

inline int failure(const char* command, const std::string& message) {
  std::fprintf(stderr, "keel %s: %s\n", command, message.c_str());
  return kExitFailure;
}

/// Parses --db; prints an error naming the flag and returns nullopt when malformed.
inline std::optional<store::DatabaseUrl> parse_db_flag(const char* command,
                                                       const std::string& text) {
  auto url = store::parse_database_url(text);
  if (!url) {
    usage_error(command, url.error().in("--db").message());
    return std::nullopt;
  }
  return *std::move(url);
}

/// Opens the database; with `create`, migrates the queue's schema. Without it, a database that
/// has no queue schema yet is left untouched and `has_schema` is false. Throws DatabaseError.
inline std::unique_ptr<store::Connection> open_queue_db(const store::DatabaseUrl& url, bool create,
                                                        bool* has_schema) {
  auto conn = store::open_database(url);
  if (create) {
    store::JobQueue::migrate(*conn);
    if (has_schema != nullptr) *has_schema = true;
  } else {
    const bool present = store::schema_version(*conn, "queue") > 0;
    if (present) store::JobQueue::migrate(*conn);  // upgrades an older schema; no-op otherwise
    if (has_schema != nullptr) *has_schema = present;
  }
  return conn;
}

/// Opens the database for a command that only reads (jobs stats, dlq list/show/depth): read-only
/// (store::ConnectOptions::read_only) and without migrations, so that a user who may only read
/// the file can run it and reading never writes. `has_schema` says whether the queue's schema
/// is there. Throws DatabaseError.
inline std::unique_ptr<store::Connection> open_queue_db_read_only(const store::DatabaseUrl& url,
                                                                  bool* has_schema) {
  auto conn = store::open_database(url, {.read_only = true});
  *has_schema = store::schema_version(*conn, "queue") > 0;
  return conn;
}

/// "2026-01-02T03:04:05.678Z" for calendar milliseconds.
inline std::string format_ms(std::int64_t ms) {
  const std::time_t secs = static_cast<std::time_t>(ms / 1000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
                tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                static_cast<int>(ms % 1000));
  return buf;
}

}  // namespace keel::cli::queue_cli
