// The pieces of the failover drill (failover_drill_test.cpp): a PostgreSQL cluster of the test's
// own (scripts/pg-cluster.sh: a primary, a streaming standby, PgBouncer), `keel-demo serve` under
// a load of POSTs with Idempotency-Keys, and a consumer that applies messages through
// ProcessedMessages. Each piece records what it saw with steady-clock times, so that the drill
// can say how long after the promotion work resumed.
#pragma once

#include <gtest/gtest.h>
#include <httplib.h>
#include <libpq-fe.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "keel/consumers/processed_messages.hpp"
#include "keel/db/database.hpp"
#include "support/jobs_process_support.hpp"
#include "support/test_support.hpp"
#include "support/waiting.hpp"

namespace keel::store::failover {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

inline double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// scripts/pg-cluster.sh: started with the object, stopped and deleted with it. Every action's
// output goes to one log, shown when the test fails.
class Cluster {
 public:
  Cluster(const test::TempDir& dir, const std::string& options)
      : state_((dir.path() / "cluster").string()), log_((dir.path() / "cluster.log").string()) {
    started_ = run("start " + options);
  }
  ~Cluster() { (void)run("stop"); }
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  [[nodiscard]] bool started() const { return started_; }
  /// The multi-host URL (target_session_attrs=read-write).
  [[nodiscard]] std::string url() const { return output("url"); }
  /// One node's own URL: node1, node2, primary or standby.
  [[nodiscard]] std::string node_url(const std::string& node) const {
    return output("node-url " + node);
  }
  /// PgBouncer's URL: keel_drill (the pool) or keel_one (a pool of one server connection).
  [[nodiscard]] std::string bouncer_url(const std::string& pool = "keel_drill") const {
    return output("bouncer-url " + pool);
  }
  /// An action (promote, kill NODE, read-only NODE, freeze NODE, detach ...); true on success.
  bool run(const std::string& action) const {
    const std::string command =
        std::string(KEEL_PG_CLUSTER) + " " + action_words(action) + " >>'" + log_ + "' 2>&1";
    return std::system(command.c_str()) == 0;
  }
  [[nodiscard]] std::string log() const { return slurp(log_); }

 private:
  [[nodiscard]] std::string action_words(const std::string& action) const {
    const auto space = action.find(' ');
    const std::string verb = action.substr(0, space);
    const std::string rest = space == std::string::npos ? "" : action.substr(space);
    return verb + " '" + state_ + "'" + rest;
  }
  [[nodiscard]] std::string output(const std::string& action) const {
    const std::string file = state_ + ".out";
    const std::string command = std::string(KEEL_PG_CLUSTER) + " " + action_words(action) + " >'" +
                                file + "' 2>>'" + log_ + "'";
    if (std::system(command.c_str()) != 0) return {};
    std::string text = slurp(file);
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
    return text;
  }

  std::string state_;
  std::string log_;
  bool started_ = false;
};

// One answer of a plain libpq client (no keel): the first column of the first row of a simple
// query, or "error: ..." (a client of a PgBouncer pool looking at what the previous client of
// its server connection left behind).
inline std::string plain_query(const std::string& url, const std::string& sql) {
  const std::string conninfo =
      url + (url.find('?') == std::string::npos ? "?" : "&") + "connect_timeout=5";
  PGconn* conn = PQconnectdb(conninfo.c_str());
  std::string out;
  if (PQstatus(conn) != CONNECTION_OK) {
    out = std::string("error: ") + PQerrorMessage(conn);
  } else {
    PGresult* r = PQexec(conn, sql.c_str());
    if (PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) > 0) {
      out = PQgetvalue(r, 0, 0);
    } else {
      out = std::string("error: ") + PQresultErrorMessage(r);
    }
    PQclear(r);
  }
  PQfinish(conn);
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

// `keel-demo serve` on a free port (its stdout says which).
class Serve {
 public:
  Serve(const std::string& db, const test::TempDir& dir) {
    process_ = std::make_unique<test_jobs::Process>(
        std::vector<std::string>{KEEL_DEMO_BINARY, "serve", "--db", db, "--listen", "127.0.0.1:0",
                                 "--threads", "8", "--retry-after-spread", "1"},
        dir.path(), "serve");
    const auto out = dir.path() / "serve.out";
    (void)test::wait_until(
        [&] {
          const std::string text = slurp(out);
          const auto at = text.find("http://127.0.0.1:");
          if (at == std::string::npos || text.find('\n', at) == std::string::npos) {
            return process_->poll();
          }
          port_ = std::stoi(text.substr(at + 17));
          return true;
        },
        30s);
  }
  [[nodiscard]] int port() const { return port_; }
  [[nodiscard]] test_jobs::Process& process() { return *process_; }

 private:
  std::unique_ptr<test_jobs::Process> process_;
  int port_ = 0;
};

// Clients POSTing charges to keel-demo serve, each charge under its own Idempotency-Key (and its
// own customer, so that a charge made twice is visible in the table), retried with the same key
// until an answer that is not a 5xx, a 409 or a lost connection: what a client of an idempotent
// API does. Every answer is counted by status (0: no answer).
class ChargeLoad {
 public:
  ChargeLoad(int port, int clients) {
    for (int c = 0; c < clients; ++c) {
      threads_.emplace_back([this, port, c] { client(port, c); });
    }
  }
  ~ChargeLoad() { stop(); }
  void stop() {
    stop_.store(true);
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
  }
  struct Figures {
    std::map<int, int> statuses;           // status -> answers (0: none)
    std::vector<std::string> charged;      // customers answered 2xx
    std::vector<Clock::time_point> ok_at;  // when each 2xx came
  };
  [[nodiscard]] Figures figures() {
    std::lock_guard lock(mu_);
    return figures_;
  }
  /// The first 2xx at or after `t`, if any.
  [[nodiscard]] std::optional<Clock::time_point> first_ok_after(Clock::time_point t) {
    std::lock_guard lock(mu_);
    for (const auto at : figures_.ok_at) {
      if (at >= t) return at;
    }
    return std::nullopt;
  }

 private:
  void client(int port, int c) {
    httplib::Client http("127.0.0.1", port);
    http.set_connection_timeout(2, 0);
    http.set_read_timeout(5, 0);
    http.set_write_timeout(5, 0);
    for (int i = 0; !stop_.load(); ++i) {
      const std::string customer = "cus-" + std::to_string(c) + "-" + std::to_string(i);
      const httplib::Headers headers = {{"Authorization", "Bearer drill"},
                                        {"Idempotency-Key", "key-" + customer}};
      const std::string body =
          R"({"amount": 100, "currency": "eur", "customer": ")" + customer + R"("})";
      while (!stop_.load()) {
        const auto r = http.Post("/v1/charges", headers, body, "application/json");
        const int status = r ? r->status : 0;
        const auto at = Clock::now();
        {
          std::lock_guard lock(mu_);
          ++figures_.statuses[status];
          if (status >= 200 && status < 300) {
            figures_.charged.push_back(customer);
            figures_.ok_at.push_back(at);
          }
        }
        if (status != 0 && status < 500 && status != 409) break;
        std::this_thread::sleep_for(100ms);  // a retry, with the same key
      }
      std::this_thread::sleep_for(2ms);
    }
  }

  std::atomic<bool> stop_{false};
  std::mutex mu_;
  Figures figures_;  // guarded by mu_
  std::vector<std::thread> threads_;
};

// A consumer that receives messages m-0, m-1, ... at least once (a message is delivered again
// until its effect is in place) and applies each through ProcessedMessages: a ledger row in the
// record's transaction. It uses keel's ConnectionPool on the cluster's URL, as a service would.
class Consumer {
 public:
  explicit Consumer(const std::string& url)
      : pool_(parse_database_url(url).value(), {.max_connections = 2}) {
    thread_ = std::thread([this] { consume(); });
  }
  ~Consumer() { stop(); }
  void stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  /// Messages whose effect the consumer saw committed (or found recorded).
  [[nodiscard]] std::vector<std::string> done() {
    std::lock_guard lock(mu_);
    return done_;
  }
  [[nodiscard]] std::optional<Clock::time_point> first_done_after(Clock::time_point t) {
    std::lock_guard lock(mu_);
    for (const auto at : done_at_) {
      if (at >= t) return at;
    }
    return std::nullopt;
  }
  [[nodiscard]] int failures() const { return failures_.load(); }

 private:
  void consume() {
    ProcessedMessages records({.consumer = "drill"});
    for (int i = 0; !stop_.load(); ++i) {
      const std::string id = "m-" + std::to_string(i);
      while (!stop_.load()) {
        bool ok = false;
        try {
          auto conn = pool_.acquire();
          const auto r = records.process(*conn, id, [&](Connection& tx) {
            (void)tx.query("INSERT INTO ledger (message) VALUES ($1)", {id});
            return true;
          });
          ok = r && r->done();
        } catch (const std::exception&) {
          ok = false;
        }
        if (ok) {
          std::lock_guard lock(mu_);
          done_.push_back(id);
          done_at_.push_back(Clock::now());
          break;
        }
        failures_.fetch_add(1);
        std::this_thread::sleep_for(50ms);  // then the message is delivered again
      }
      std::this_thread::sleep_for(5ms);
    }
  }

  ConnectionPool pool_;
  std::atomic<bool> stop_{false};
  std::atomic<int> failures_{0};
  std::mutex mu_;
  std::vector<std::string> done_;           // guarded by mu_
  std::vector<Clock::time_point> done_at_;  // guarded by mu_
  std::thread thread_;
};

}  // namespace keel::store::failover
