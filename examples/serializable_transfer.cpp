// A PostgreSQL transaction retried on serialization failure: keel::store::with_transaction_retry.
//
// A transfer runs at SERIALIZABLE: it reads the payer's balance, then writes both accounts. On its
// first run another client's update to the payer commits between the read and the write, so
// PostgreSQL aborts the transfer with SQLSTATE 40001 (serialization_failure). A 40001 poisons the
// whole transaction, so keel rolls back and runs the WHOLE function again from BEGIN after a
// full-jitter delay; the second run sees the new balance and commits.
//
// Usage: example_serializable_transfer [POSTGRES_URL]
// Without an argument the URL comes from KEEL_TEST_POSTGRES_URL, or from the file named by
// KEEL_TEST_POSTGRES_URL_FILE (what the ctest fixture `postgres` provides). The example works in
// a schema of its own and drops it at the end.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <keel/core/duration.hpp>
#include <keel/db/database.hpp>
#include <keel/db/row_cursor.hpp>
#include <keel/db/transaction.hpp>
#include <string>

namespace store = keel::store;
using namespace std::chrono_literals;

namespace {

std::string base_url(int argc, char** argv) {
  if (argc > 1) return argv[1];
  if (const char* url = std::getenv("KEEL_TEST_POSTGRES_URL"); url != nullptr && *url != '\0') {
    return url;
  }
  std::string url;
  if (const char* file = std::getenv("KEEL_TEST_POSTGRES_URL_FILE"); file != nullptr) {
    std::ifstream in(file);
    in >> url;
  }
  return url;
}

std::int64_t balance(store::Connection& conn, const char* id) {
  const store::Rows rows = conn.query("SELECT balance FROM accounts WHERE id = $1", {id});
  return store::RowCursor(rows, 0).integer();
}

}  // namespace

int main(int argc, char** argv) {
  const std::string base = base_url(argc, argv);
  if (base.empty()) {
    std::fprintf(stderr, "usage: %s POSTGRES_URL\n", argv[0]);
    return 2;
  }
  const auto admin_url = store::parse_database_url(base);
  if (!admin_url || admin_url->backend != store::Backend::kPostgres) {
    std::fprintf(stderr, "not a PostgreSQL URL: %s\n",
                 admin_url ? base.c_str() : admin_url.error().message().c_str());
    return 2;
  }

  // A schema of our own, so that nothing else on the server is touched.
  const std::string schema = "keel_example_" + std::to_string(getpid());
  auto admin = store::open_database(*admin_url);
  admin->execute("CREATE SCHEMA " + schema);
  const char sep = base.find('?') == std::string::npos ? '?' : '&';
  const auto url = store::parse_database_url(base + sep + "options=-csearch_path%3D" + schema);

  bool ok = false;
  try {
    auto conn = store::open_database(*url);   // the transfer's connection
    auto other = store::open_database(*url);  // another client, writing at the worst moment
    conn->execute(
        "CREATE TABLE accounts (id TEXT PRIMARY KEY, balance BIGINT NOT NULL);"
        "INSERT INTO accounts VALUES ('alice', 100), ('bob', 0);");

    const keel::RetryPolicy policy({
        .max_attempts = 5,
        .backoff = {.base = 5ms, .cap = 250ms},  // full jitter
        .on_retry =
            [](const keel::RetryEvent& e) {
              std::printf("attempt %d: %s; running the transaction again in %s\n", e.attempt,
                          keel::describe(e.outcome).c_str(),
                          keel::format_duration(e.delay).c_str());
            },
    });

    int runs = 0;
    const auto result = store::with_transaction_retry(
        *conn,
        [&](store::Connection& tx) {
          ++runs;
          const std::int64_t have = balance(tx, "alice");  // the snapshot is taken here
          if (runs == 1) {
            // Another client spends 30 from alice and commits, after our read.
            other->query("UPDATE accounts SET balance = balance - 30 WHERE id = 'alice'");
          }
          if (have < 50) return false;  // not enough money: roll back, no retry
          tx.query("UPDATE accounts SET balance = balance - 50 WHERE id = 'alice'");
          tx.query("UPDATE accounts SET balance = balance + 50 WHERE id = 'bob'");
          return true;
        },
        policy, store::Isolation::kSerializable);

    std::printf("transfer: %s after %d attempts%s%s\n",
                std::string(store::to_string(result.status)).c_str(), result.attempts,
                result.sqlstate.empty() ? "" : ", last SQLSTATE ", result.sqlstate.c_str());
    const std::int64_t alice = balance(*conn, "alice");
    const std::int64_t bob = balance(*conn, "bob");
    std::printf("alice %lld, bob %lld\n", static_cast<long long>(alice),
                static_cast<long long>(bob));
    // 100 - 30 (the other client) - 50 (the transfer) = 20: nothing lost, nothing applied twice.
    ok = result.committed() && result.attempts == 2 && alice == 20 && bob == 50;
  } catch (const store::DatabaseError& e) {
    std::fprintf(stderr, "database error: %s\n", e.what());
  }
  admin->execute("DROP SCHEMA " + schema + " CASCADE");
  std::printf("%s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
