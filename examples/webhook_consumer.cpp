// A webhook consumer that applies each event once: keel::store::ProcessedMessages on a
// cpp-httplib endpoint, with the records and the business tables in one database (SQLite by
// default; pass a database URL to use PostgreSQL).
//
// Webhook senders deliver at least once: a sender that did not see a 2xx (a timeout, a reset,
// a 5xx) sends the event again, and senders also repeat events on their own, out of order. The
// endpoint POST /webhooks takes an event id in the Webhook-Id header and a body
// {"account": "...", "cents": N}; its effect (a ledger row and a balance update) runs inside
// ProcessedMessages::process, in the same transaction as the record of the id:
//   - a new id           -> 200 {"status":"processed"}, the effect committed with its record
//   - an id seen before  -> 200 {"status":"already processed"}, nothing written
//   - an invalid id      -> 400 (empty, or longer than 255 bytes)
//   - an unknown account -> 422, the effect rolled back and the id left free
//   - the handler fails  -> 500, the effect rolled back with the record: the retry applies it
//   - a database failure -> 503 with Retry-After, the same
//
// The example then plays the sender: 200 events, each delivered one to three times, shuffled,
// from 4 threads at once, the first delivery of every 10th event hitting a failure injected
// after its write; a delivery without a 2xx is retried. At the end every balance is the sum of
// its events, once.
#include <httplib.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <keel/consumers/processed_messages.hpp>
#include <keel/db/database.hpp>
#include <keel/db/row_cursor.hpp>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace store = keel::store;

namespace {

std::filesystem::path make_temp_dir() {
  const char* base = std::getenv("TMPDIR");
  std::string pattern =
      std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/keel-example.XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  return pattern;
}

bool check(bool condition, const std::string& what) {
  std::printf("  %s %s\n", condition ? "ok  " : "FAIL", what.c_str());
  return condition;
}

void reply(httplib::Response& res, int status, const nlohmann::json& body) {
  res.status = status;
  res.set_content(body.dump() + "\n", "application/json");
}

struct Event {
  std::string id;
  std::string account;
  std::int64_t cents = 0;
};

}  // namespace

int main(int argc, char** argv) {
  const std::filesystem::path dir = make_temp_dir();
  const std::string url_text = argc > 1 ? argv[1] : "sqlite:" + (dir / "consumer.db").string();
  bool ok = true;
  {
    // ---- the consumer
    store::ConnectionPool pool(store::parse_database_url(url_text).value());
    {
      auto conn = pool.acquire();
      store::ProcessedMessages::migrate(*conn);
      store::migrate(*conn, "example_webhook_consumer",
                     {{"CREATE TABLE accounts (id TEXT PRIMARY KEY, cents BIGINT NOT NULL);"
                       "CREATE TABLE ledger (event TEXT NOT NULL, account TEXT NOT NULL,"
                       " cents BIGINT NOT NULL);"
                       "INSERT INTO accounts (id, cents) VALUES ('acct-1', 0), ('acct-2', 0),"
                       " ('acct-3', 0);"}});
    }
    std::mutex injected_mu;
    std::set<std::string> fail_once;  // guarded by injected_mu: event ids whose first try fails
    const auto inject_failure = [&](const std::string& id) {
      const std::lock_guard lock(injected_mu);
      return fail_once.erase(id) == 1;
    };

    // --- README.md example ---
    store::ProcessedMessages records({.consumer = "ledger"});
    httplib::Server server;
    server.Post("/webhooks", [&](const httplib::Request& req, httplib::Response& res) {
      const std::string id = req.get_header_value("Webhook-Id");
      const auto body = nlohmann::json::parse(req.body, nullptr, /*allow_exceptions=*/false);
      if (body.is_discarded() || !body.contains("account") || !body["account"].is_string() ||
          !body.contains("cents") || !body["cents"].is_number_integer()) {
        return reply(res, 400, {{"error", "body must be {\"account\": string, \"cents\": int}"}});
      }
      const std::string account = body["account"];
      const std::int64_t cents = body["cents"];
      try {
        auto conn = pool.acquire();
        const auto r = records.process(*conn, id, [&](store::Connection& tx) {
          tx.query("INSERT INTO ledger (event, account, cents) VALUES ($1, $2, $3)",
                   {id, account, cents});
          const auto updated =
              tx.query("UPDATE accounts SET cents = cents + $1 WHERE id = $2", {cents, account});
          if (updated.affected() != 1) return false;  // unknown account: roll back
          if (inject_failure(id)) throw std::runtime_error("injected failure after the write");
          return true;
        });
        if (!r) return reply(res, 400, {{"error", r.error().message()}});
        switch (r->status) {
          case store::ProcessStatus::kProcessed:
            return reply(res, 200, {{"status", "processed"}});
          case store::ProcessStatus::kDuplicate:
            return reply(res, 200, {{"status", "already processed"}});
          case store::ProcessStatus::kRolledBack:
            return reply(res, 422, {{"error", "unknown account"}});
          case store::ProcessStatus::kFailed:
            res.set_header("Retry-After", "1");
            return reply(res, 503, {{"error", "database unavailable, retry"}});
        }
      } catch (const std::exception& e) {
        // The transaction was rolled back with the record: the sender's retry applies it.
        return reply(res, 500, {{"error", e.what()}});
      }
    });
    // --- end of the README.md example ---
    const int port = server.bind_to_any_port("127.0.0.1");
    if (port <= 0) {
      std::fprintf(stderr, "cannot bind 127.0.0.1\n");
      return 1;
    }
    std::thread listener([&] { server.listen_after_bind(); });

    // ---- the sender: at least once, duplicated, out of order, from several threads
    std::mt19937 rng(7);
    std::vector<Event> events;
    std::map<std::string, std::int64_t> expected;
    for (int i = 0; i < 200; ++i) {
      Event e{.id = "evt_" + std::to_string(i),
              .account = "acct-" + std::to_string(1 + i % 3),
              .cents = 100 + i};
      expected[e.account] += e.cents;
      if (i % 10 == 0) fail_once.insert(e.id);
      events.push_back(std::move(e));
    }
    std::vector<const Event*> deliveries;
    for (const Event& e : events) {
      const int times = 1 + static_cast<int>(rng() % 3);
      for (int t = 0; t < times; ++t) deliveries.push_back(&e);
    }
    std::shuffle(deliveries.begin(), deliveries.end(), rng);
    std::atomic<std::size_t> next{0};
    std::atomic<int> retries{0};
    std::atomic<int> given_up{0};
    std::vector<std::thread> senders;
    for (int t = 0; t < 4; ++t) {
      senders.emplace_back([&] {
        httplib::Client client("127.0.0.1", port);
        for (std::size_t i = next.fetch_add(1); i < deliveries.size(); i = next.fetch_add(1)) {
          const Event& e = *deliveries[i];
          const std::string body =
              nlohmann::json{{"account", e.account}, {"cents", e.cents}}.dump();
          bool delivered = false;
          for (int attempt = 0; attempt < 5 && !delivered; ++attempt) {
            if (attempt > 0) retries.fetch_add(1);
            const auto res =
                client.Post("/webhooks", {{"Webhook-Id", e.id}}, body, "application/json");
            delivered = res && res->status / 100 == 2;
          }
          if (!delivered) given_up.fetch_add(1);
        }
      });
    }
    for (auto& s : senders) s.join();

    // ---- what the consumer holds
    const auto bad_id = httplib::Client("127.0.0.1", port)
                            .Post("/webhooks", {{"Webhook-Id", std::string(256, 'x')}},
                                  R"({"account":"acct-1","cents":1})", "application/json");
    std::map<std::string, std::int64_t> balances;
    std::int64_t ledger_rows = 0;
    {
      auto conn = pool.acquire();
      const auto rows = conn->query("SELECT id, cents FROM accounts ORDER BY id");
      for (std::size_t i = 0; i < rows.size(); ++i) {
        store::RowCursor row(rows, i);
        const std::string id = row.text();
        balances[id] = row.integer();
      }
      const store::Rows count = conn->query("SELECT COUNT(*) FROM ledger");
      ledger_rows = store::RowCursor(count, 0).integer();
    }
    const store::ProcessedCounts c = records.counts();
    std::printf(
        "%zu deliveries of %zu events: %lld processed, %lld duplicates skipped, %d retried "
        "after a failure\n",
        deliveries.size(), events.size(), static_cast<long long>(c.processed),
        static_cast<long long>(c.duplicates), retries.load());
    ok &= check(given_up.load() == 0, "every delivery got a 2xx in the end");
    ok &= check(balances == expected, "every balance is the sum of its events, each once");
    ok &=
        check(ledger_rows == static_cast<std::int64_t>(events.size()), "one ledger row per event");
    ok &= check(c.processed == static_cast<std::int64_t>(events.size()),
                "each event's effect ran once");
    ok &= check(c.duplicates == static_cast<std::int64_t>(deliveries.size() - events.size()),
                "every repeated delivery was skipped");
    ok &= check(retries.load() >= 20, "the injected failures were retried");
    ok &= check(bad_id && bad_id->status == 400, "an id longer than 255 bytes: 400");

    server.stop();
    listener.join();
  }
  std::filesystem::remove_all(dir);
  std::printf("%s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
