// Processed-message records (keel/consumers/processed_messages.hpp): the table, the claim that
// runs first in the effect's transaction, and retention. Ids travel as hex text on both backends:
// PostgreSQL decodes them into bytea, SQLite stores the hex itself.
#include "keel/consumers/processed_messages.hpp"

#include <chrono>
#include <iterator>
#include <span>
#include <string>
#include <utility>

#include "db/detail/commit.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/text.hpp"
#include "keel/db/dialect.hpp"

namespace keel::store {

namespace {

constexpr std::string_view kOptions = "keel::store::ProcessedMessagesOptions";

// Version 1: the backends differ only in the id's type. WITHOUT ROWID keeps SQLite's rows in the
// primary key's b-tree, as PostgreSQL's index holds the key; the second index serves prune().
constexpr Migration kMigrations[] = {
    {"CREATE TABLE keel_processed_messages ("
     " consumer TEXT NOT NULL,"
     " message_id TEXT NOT NULL,"
     " processed_ms BIGINT NOT NULL,"
     " PRIMARY KEY (consumer, message_id)) WITHOUT ROWID;"
     "CREATE INDEX keel_processed_messages_age ON keel_processed_messages"
     " (consumer, processed_ms);",
     "CREATE TABLE keel_processed_messages ("
     " consumer TEXT NOT NULL,"
     " message_id BYTEA NOT NULL,"
     " processed_ms BIGINT NOT NULL,"
     " PRIMARY KEY (consumer, message_id));"
     "CREATE INDEX keel_processed_messages_age ON keel_processed_messages"
     " (consumer, processed_ms);"},
};

std::string to_hex(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (const char c : bytes) {
    const auto b = static_cast<unsigned char>(c);
    out += kDigits[b >> 4];
    out += kDigits[b & 0xf];
  }
  return out;
}

// The stored form of an id in a statement, from its hex text in $N.
std::string id_param(const Connection& connection, int n) {
  return connection.dialect().bytes_from_hex("$" + std::to_string(n));
}

// Inserts the record in the open transaction: true when it was new. On a concurrent insert of
// the same key, the unique index makes this statement wait for the other transaction's end.
bool insert_record(Connection& tx, const std::string& consumer, const std::string& id_hex,
                   std::int64_t now) {
  const Rows r = tx.query(
      "INSERT INTO keel_processed_messages (consumer, message_id, processed_ms)"
      " VALUES ($1, " +
          id_param(tx, 2) + ", $3) ON CONFLICT DO NOTHING",
      {consumer, id_hex, now});
  return r.affected() == 1;
}

}  // namespace

Expected<void> check_message_id(std::string_view id) {
  if (id.empty()) return Error{.field = "message id", .problem = "must not be empty"};
  if (id.size() > kMaxMessageIdBytes) {
    return Error{.field = "message id",
                 .problem = "must be at most " + std::to_string(kMaxMessageIdBytes) +
                            " bytes; it has " + std::to_string(id.size()),
                 .got = quote_value(id)};
  }
  return {};
}

Expected<void> check_consumer_name(std::string_view name) { return check_name("consumer", name); }

std::string_view to_string(ProcessStatus status) noexcept {
  switch (status) {
    case ProcessStatus::kProcessed:
      return "processed";
    case ProcessStatus::kDuplicate:
      return "duplicate";
    case ProcessStatus::kRolledBack:
      return "rolled back";
    case ProcessStatus::kFailed:
      return "failed";
  }
  return "failed";
}

ProcessedMessages::ProcessedMessages(ProcessedMessagesOptions options)
    : options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : &steady_clock()),
      retry_(options_.retry != nullptr ? options_.retry : &default_transaction_retry_policy()) {
  if (auto checked = check_consumer_name(options_.consumer); !checked) {
    throw_invalid(std::move(checked).error().in("consumer", std::string(kOptions)));
  }
}

void ProcessedMessages::migrate(Connection& connection) {
  (void)store::migrate(connection, "processed",
                       std::span<const Migration>(std::begin(kMigrations), std::end(kMigrations)));
}

SchemaComponent ProcessedMessages::schema() noexcept {
  return schema_component("processed", kMigrations, &ProcessedMessages::migrate);
}

std::int64_t ProcessedMessages::now_ms() const noexcept { return wall_ms(*clock_); }

Expected<ProcessResult> ProcessedMessages::process(Connection& connection,
                                                   std::string_view message_id,
                                                   const std::function<bool(Connection&)>& effect,
                                                   const CallOptions& call) {
  if (auto checked = check_message_id(message_id); !checked) return std::move(checked).error();
  const std::string id_hex = to_hex(message_id);
  bool duplicate = false;
  ProcessResult out;
  out.transaction = with_transaction_retry(
      connection,
      [&](Connection& tx) {
        // Each attempt claims again: a retried transaction starts from nothing.
        duplicate = !insert_record(tx, options_.consumer, id_hex, now_ms());
        if (duplicate) return false;
        return effect(tx);
      },
      *retry_, options_.isolation, call);
  switch (out.transaction.status) {
    case TransactionStatus::kCommitted:
      out.status = ProcessStatus::kProcessed;
      processed_.fetch_add(1, std::memory_order_relaxed);
      break;
    case TransactionStatus::kRolledBack:
      out.status = duplicate ? ProcessStatus::kDuplicate : ProcessStatus::kRolledBack;
      (duplicate ? duplicates_ : rolled_back_).fetch_add(1, std::memory_order_relaxed);
      break;
    case TransactionStatus::kFailed:
    case TransactionStatus::kCommitInDoubt:
      out.status = ProcessStatus::kFailed;
      failed_.fetch_add(1, std::memory_order_relaxed);
      break;
  }
  return out;
}

Expected<bool> ProcessedMessages::claim(Connection& tx, std::string_view message_id) const {
  if (auto checked = check_message_id(message_id); !checked) return std::move(checked).error();
  if (!tx.in_transaction()) {
    return Error{.context = "keel::store::ProcessedMessages::claim",
                 .field = "connection",
                 .problem =
                     "has no transaction open; claim runs inside the caller's transaction "
                     "(or use process())"};
  }
  return insert_record(tx, options_.consumer, to_hex(message_id), now_ms());
}

Expected<bool> ProcessedMessages::contains(Connection& connection,
                                           std::string_view message_id) const {
  if (auto checked = check_message_id(message_id); !checked) return std::move(checked).error();
  const Rows r = connection.query(
      "SELECT 1 FROM keel_processed_messages WHERE consumer = $1 AND message_id = " +
          id_param(connection, 2),
      {options_.consumer, to_hex(message_id)});
  return !r.empty();
}

std::int64_t ProcessedMessages::prune(Connection& connection, Duration older_than, int batch) {
  if (older_than < Duration::zero()) {
    throw_invalid({.context = "keel::store::ProcessedMessages::prune",
                   .field = "older_than",
                   .problem = "must be >= 0",
                   .got = format_duration(older_than)});
  }
  if (batch < 1) {
    throw_invalid({.context = "keel::store::ProcessedMessages::prune",
                   .field = "batch",
                   .problem = "must be >= 1",
                   .got = std::to_string(batch)});
  }
  const std::int64_t cutoff = now_ms() - keel::to_ms(older_than);
  std::int64_t deleted = 0;
  detail::statement_or_throw(connection, "processed messages", [&](Connection& tx) {
    deleted = tx.query(
                    "DELETE FROM keel_processed_messages WHERE consumer = $1 AND message_id IN"
                    " (SELECT message_id FROM keel_processed_messages"
                    " WHERE consumer = $1 AND processed_ms < $2"
                    " ORDER BY processed_ms LIMIT $3)",
                    {options_.consumer, cutoff, batch})
                  .affected();
    return true;
  });
  pruned_.fetch_add(deleted, std::memory_order_relaxed);
  return deleted;
}

ProcessedCounts ProcessedMessages::counts() const noexcept {
  return {.processed = processed_.load(std::memory_order_relaxed),
          .duplicates = duplicates_.load(std::memory_order_relaxed),
          .rolled_back = rolled_back_.load(std::memory_order_relaxed),
          .failed = failed_.load(std::memory_order_relaxed),
          .pruned = pruned_.load(std::memory_order_relaxed)};
}

}  // namespace keel::store
