#include "payments_api.hpp"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <openssl/rand.h>
#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "keel/random.hpp"
#include "keel/retry_after.hpp"
#include "keel/store/db/transaction.hpp"

namespace payments {

namespace store = keel::store;
using keel::AdmissionStats;
using keel::Error;
using keel::Expected;
using keel::ShedReason;
using keel::steady_clock;
using store::Connection;
using store::StoredResponse;

namespace {

nlohmann::json charge_json(const store::Rows& rows, std::size_t i) {
  return {{"id", rows.text(i, 0)},
          {"amount", rows.integer(i, 1)},
          {"currency", rows.text(i, 2)},
          {"customer", rows.text(i, 3)},
          {"created", rows.integer(i, 4)}};
}

constexpr store::Migration kPaymentsSchema[] = {
    {"CREATE TABLE charges ("
     " id TEXT PRIMARY KEY,"
     " principal TEXT NOT NULL,"
     " amount BIGINT NOT NULL,"
     " currency TEXT NOT NULL,"
     " customer TEXT NOT NULL,"
     " created BIGINT NOT NULL);"
     "CREATE INDEX charges_customer ON charges (principal, customer);"},
    // The key of the principal scopes when no --scope-secret-file is given: one per database, so
    // that every server on it (and every restart) scopes a credential the same way.
    {"CREATE TABLE serve_scope_secret (id INTEGER PRIMARY KEY CHECK (id = 1),"
     " secret TEXT NOT NULL);"},
};

/// Upgrade from payments schema 1, which stored credentials as they came: replaces each plaintext
/// principal in charges and keel_idempotency by its hashed scope, so that owners still see their
/// charges and retries across the upgrade still replay. Once, in one transaction.
void hash_stored_principals(Connection& conn, const std::string& secret) {
  conn.begin();
  for (const auto& [table, column] : {std::pair<std::string, std::string>{"charges", "principal"},
                                      {"keel_idempotency", "scope"}}) {
    const store::Rows old =
        conn.query("SELECT DISTINCT " + column + " FROM " + table + " WHERE " + column +
                   " NOT LIKE 'p:%' AND " + column + " <> 'anonymous'");
    for (std::size_t i = 0; i < old.size(); ++i) {
      (void)conn.query("UPDATE " + table + " SET " + column + " = $1 WHERE " + column + " = $2",
                       {store::principal_scope(old.text(i, 0), secret), old.text(i, 0)});
    }
  }
  conn.commit();
}

}  // namespace

std::string random_hex(std::size_t bytes) {
  std::vector<unsigned char> buf(bytes);
  if (RAND_bytes(buf.data(), static_cast<int>(bytes)) != 1) throw std::runtime_error("RAND_bytes");
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (const unsigned char b : buf) {
    out += kDigits[b >> 4];
    out += kDigits[b & 0xf];
  }
  return out;
}

Expected<ChargeInput> parse_charge(const std::string& body, const store::JsonLimits& limits) {
  const auto fail = [](std::string field, std::string problem) {
    return Error{.field = std::move(field), .problem = std::move(problem)};
  };
  // Depth and duplicate members first: nothing untrusted reaches the parser before that.
  const store::JsonCheck checked = store::check_json(body, limits);
  if (checked.status == store::JsonStatus::kTooDeep ||
      checked.status == store::JsonStatus::kDuplicateKey) {
    return fail("the body", "is refused: " + checked.detail);
  }
  const nlohmann::json j =
      checked.ok() ? nlohmann::json::parse(checked.canonical, nullptr, false) : nlohmann::json();
  if (!checked.ok() || j.is_discarded() || !j.is_object()) {
    return fail("the body", "is not a JSON object");
  }
  ChargeInput in;
  const auto amount = j.find("amount");
  if (amount == j.end() || !amount->is_number_integer() || amount->get<std::int64_t>() <= 0) {
    return fail("\"amount\"", "must be a positive integer");
  }
  in.amount = amount->get<std::int64_t>();
  const auto currency = j.find("currency");
  if (currency == j.end() || !currency->is_string() ||
      currency->get_ref<const std::string&>().size() != 3 ||
      !std::all_of(currency->get_ref<const std::string&>().begin(),
                   currency->get_ref<const std::string&>().end(),
                   [](char c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z'); })) {
    return fail("\"currency\"", "must be 3 letters");
  }
  in.currency = currency->get<std::string>();
  for (char& c : in.currency) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  const auto customer = j.find("customer");
  if (customer == j.end() || !customer->is_string() ||
      customer->get_ref<const std::string&>().empty() ||
      customer->get_ref<const std::string&>().size() > 255) {
    return fail("\"customer\"", "must be a non-empty string of at most 255 characters");
  }
  in.customer = customer->get<std::string>();
  return in;
}

std::string prepare_database(Connection& conn, std::string scope_secret) {
  store::IdempotencyStore::migrate(conn);
  const int payments_before = store::migrate(conn, "payments", kPaymentsSchema);
  if (scope_secret.empty()) {
    (void)conn.query(
        "INSERT INTO serve_scope_secret (id, secret) VALUES (1, $1) ON CONFLICT (id) DO NOTHING",
        {random_hex(32)});
    scope_secret = conn.query("SELECT secret FROM serve_scope_secret WHERE id = 1").text(0, 0);
  }
  if (payments_before == 1) hash_stored_principals(conn, scope_secret);
  return scope_secret;
}

std::string scope_of(const httplib::Request& request, std::string_view secret) {
  return store::principal_scope(store::bearer_principal(request), secret);
}

/// cpp-httplib 0.11 listens with a backlog of 5: a burst of concurrent connections overflows it
/// and clients see resets. listen() again on the bound socket raises the backlog (Linux).
void widen_backlog(int port) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return;
  while (dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == dirfd(dir)) continue;
    int listening = 0;
    socklen_t len = sizeof listening;
    if (getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 ||
        listening == 0) {
      continue;
    }
    sockaddr_storage local{};
    len = sizeof local;
    if (getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &len) != 0) continue;
    const int p = local.ss_family == AF_INET
                      ? ntohs(reinterpret_cast<const sockaddr_in&>(local).sin_port)
                      : ntohs(reinterpret_cast<const sockaddr_in6&>(local).sin6_port);
    if (p == port) ::listen(static_cast<int>(fd), SOMAXCONN);
  }
  closedir(dir);
}

std::vector<std::pair<std::string, std::string>> routes() {
  return {{"/v1/charges", "GET, POST"},
          {"/v1/charges/[A-Za-z0-9_]+", "GET"},
          {"/healthz", "GET"},
          {"/metrics", "GET"}};
}

PaymentsApi::PaymentsApi(PaymentsApiOptions options) : options_(std::move(options)) {
  if (options_.pool == nullptr || options_.idempotency == nullptr) {
    throw std::invalid_argument("payments::PaymentsApiOptions: pool and idempotency are required");
  }
  if (options_.scope_secret.empty()) {
    throw std::invalid_argument("payments::PaymentsApiOptions: scope_secret is required");
  }
  if (options_.metrics == nullptr) own_metrics_ = std::make_unique<Metrics>();
  metrics_ = options_.metrics != nullptr ? options_.metrics : own_metrics_.get();
  middleware_ = std::make_unique<store::IdempotencyMiddleware>(
      store::MiddlewareOptions{.store = options_.idempotency,
                               .pool = options_.pool,
                               .scope_secret = options_.scope_secret,
                               .on_outcome =
                                   [this](store::IdempotencyOutcome outcome) {
                                     ++metrics_->outcomes[static_cast<int>(outcome)];
                                   },
                               .after_commit =
                                   [this](const httplib::Request& req, httplib::Response& /*res*/) {
                                     ++metrics_->charges_created;
                                     if (options_.after_commit) options_.after_commit(req);
                                   },
                               .json_limits = options_.json_limits,
                               .retry_after_spread = options_.retry_after_spread});
}

PaymentsApi::~PaymentsApi() = default;

void PaymentsApi::install(httplib::Server& server) {
  const std::string prefix = options_.log_prefix;
  const auto guarded = [this](httplib::Server::Handler handler) {
    return options_.guard ? options_.guard(std::move(handler)) : handler;
  };
  const auto after_commit = [this](const httplib::Request& req, httplib::Response& /*res*/) {
    ++metrics_->charges_created;
    if (options_.after_commit) options_.after_commit(req);
  };
  const store::TransactionalHandler create_charge = [this](const httplib::Request& req,
                                                           Connection& tx) -> StoredResponse {
    const auto input = parse_charge(req.body, options_.json_limits);
    if (!input) {
      const nlohmann::json problem = {{"type", "about:blank"},
                                      {"title", "Invalid charge"},
                                      {"status", 400},
                                      {"detail", input.error().message()}};
      return {400, {{"Content-Type", "application/problem+json"}}, problem.dump()};
    }
    const std::string id = "ch_" + random_hex(12);
    const std::int64_t created = std::chrono::duration_cast<std::chrono::seconds>(
                                     steady_clock().wall_now().time_since_epoch())
                                     .count();
    tx.query(
        "INSERT INTO charges (id, principal, amount, currency, customer, created)"
        " VALUES ($1, $2, $3, $4, $5, $6)",
        {id, scope_of(req, options_.scope_secret), input->amount, input->currency, input->customer,
         created});
    const nlohmann::json body = {{"id", id},
                                 {"amount", input->amount},
                                 {"currency", input->currency},
                                 {"customer", input->customer},
                                 {"created", created}};
    return {201,
            {{"Content-Type", "application/json"}, {"Location", "/v1/charges/" + id}},
            body.dump()};
  };

  if (options_.no_idempotency) {
    server.Post(
        "/v1/charges",
        store::read_whole_body(guarded([this, create_charge, after_commit, prefix](
                                           const httplib::Request& req, httplib::Response& res) {
          auto conn = options_.pool->acquire();
          StoredResponse out;
          const auto tx = store::with_transaction_retry(*conn, [&](Connection& t) {
            out = create_charge(req, t);
            return out.status < 400;
          });
          if (!tx.committed() && tx.status != store::TransactionStatus::kRolledBack) {
            std::fprintf(stderr, "%s: POST /v1/charges: %s\n", prefix.c_str(), tx.error.c_str());
            store::write_problem(res, 503, "Database unavailable", "the database is unavailable");
            return;
          }
          res.status = out.status;
          for (const auto& [name, value] : out.headers) {
            if (name != "Content-Type") res.set_header(name, value);
          }
          res.set_content(out.body,
                          out.status < 400 ? "application/json" : "application/problem+json");
          if (tx.committed()) after_commit(req, res);
        })));
  } else {
    server.Post("/v1/charges", store::read_whole_body(guarded(middleware_->wrap(create_charge))));
  }

  server.Get(R"(/v1/charges/([A-Za-z0-9_]+))",
             guarded([this](const httplib::Request& req, httplib::Response& res) {
               auto conn = options_.pool->acquire();
               const store::Rows rows = conn->query(
                   "SELECT id, amount, currency, customer, created FROM charges"
                   " WHERE id = $1 AND principal = $2",
                   {req.matches[1].str(), scope_of(req, options_.scope_secret)});
               if (rows.empty()) {
                 store::write_problem(res, 404, "Not found", "no such charge");
                 return;
               }
               res.set_content(charge_json(rows, 0).dump(), "application/json");
             }));
  server.Get("/v1/charges", guarded([this](const httplib::Request& req, httplib::Response& res) {
               if (!req.has_param("customer")) {
                 store::write_problem(res, 400, "Missing parameter",
                                      "GET /v1/charges needs ?customer=ID");
                 return;
               }
               auto conn = options_.pool->acquire();
               const store::Rows rows = conn->query(
                   "SELECT id, amount, currency, customer, created FROM charges"
                   " WHERE principal = $1 AND customer = $2 ORDER BY created, id LIMIT 1000",
                   {scope_of(req, options_.scope_secret), req.get_param_value("customer")});
               nlohmann::json list = nlohmann::json::array();
               for (std::size_t i = 0; i < rows.size(); ++i) list.push_back(charge_json(rows, i));
               res.set_content(nlohmann::json{{"data", list}}.dump(), "application/json");
             }));
  server.Get("/healthz", [this, prefix](const httplib::Request&, httplib::Response& res) {
    try {
      auto conn = options_.pool->acquire();
      (void)conn->query("SELECT 1");
      res.set_content("ok\n", "text/plain");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: /healthz: %s\n", prefix.c_str(), e.what());
      store::write_problem(res, 503, "Database unavailable", "the database does not answer");
    }
  });
  server.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    std::string text = metrics_->render();
    if (options_.extra_metrics) text += options_.extra_metrics();
    res.set_content(text, "text/plain; version=0.0.4");
  });
  server.set_exception_handler(
      [prefix, this](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown error";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        // The text goes to the log, never to the client.
        std::fprintf(stderr, "%s: %s %s failed: %s\n", prefix.c_str(), req.method.c_str(),
                     req.path.c_str(), what.c_str());
        res.set_header("Retry-After", keel::format_retry_after(keel::spread_retry_after(
                                          options_.retry_after_spread, keel::thread_rng())));
        store::write_problem(res, 503, "Internal error", "the request failed on the server");
      });
}

}  // namespace payments
