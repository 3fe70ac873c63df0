#include "payments_api.hpp"

#include <openssl/rand.h>

#include <algorithm>
#include <boost/asio/post.hpp>
#include <boost/beast/http/field.hpp>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "keel/core/random.hpp"
#include "keel/core/retry_after.hpp"
#include "keel/db/row_cursor.hpp"
#include "keel/db/transaction.hpp"

namespace payments {

namespace store = keel::store;
namespace beast = keel::store::beast;
namespace http = boost::beast::http;
using keel::AdmissionStats;
using keel::Error;
using keel::Expected;
using keel::ShedReason;
using keel::steady_clock;
using store::Connection;
using store::StoredResponse;

namespace {

/// A 200 answer to `req` with `body` of Content-Type `type`.
beast::Response ok_response(const beast::Request& req, std::string body,
                            std::string_view type = "application/json") {
  beast::Response res{http::status::ok, req.version()};
  res.set(http::field::content_type, std::string(type));
  res.body() = std::move(body);
  res.prepare_payload();
  return res;
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string percent_decode(std::string_view text) {
  std::string out;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '+') {
      out += ' ';
    } else if (text[i] == '%' && i + 2 < text.size() && hex_digit(text[i + 1]) >= 0 &&
               hex_digit(text[i + 2]) >= 0) {
      out += static_cast<char>(hex_digit(text[i + 1]) * 16 + hex_digit(text[i + 2]));
      i += 2;
    } else {
      out += text[i];
    }
  }
  return out;
}

// A row of the charges' columns (id, amount, currency, customer, created), read in their order.
nlohmann::json charge_json(const store::Rows& rows, std::size_t i) {
  store::RowCursor c(rows, i);
  nlohmann::json charge;
  charge["id"] = c.text();
  charge["amount"] = c.integer();
  charge["currency"] = c.text();
  charge["customer"] = c.text();
  charge["created"] = c.integer();
  return charge;
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
      const std::string stored = store::RowCursor(old, i).text();
      (void)conn.query("UPDATE " + table + " SET " + column + " = $1 WHERE " + column + " = $2",
                       {store::principal_scope(stored, secret), stored});
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
    const store::Rows stored = conn.query("SELECT secret FROM serve_scope_secret WHERE id = 1");
    scope_secret = store::RowCursor(stored, 0).text();
  }
  if (payments_before == 1) hash_stored_principals(conn, scope_secret);
  return scope_secret;
}

std::string scope_of(const beast::Request& request, std::string_view secret) {
  const auto it = request.find(http::field::authorization);
  std::optional<std::string_view> authorization;
  if (it != request.end()) authorization = std::string_view(it->value().data(), it->value().size());
  return store::principal_scope(store::principal_from_authorization(authorization), secret);
}

std::optional<std::string> query_param(std::string_view target, std::string_view name) {
  const std::size_t mark = target.find('?');
  if (mark == std::string_view::npos) return std::nullopt;
  std::string_view query = target.substr(mark + 1);
  while (!query.empty()) {
    const std::size_t amp = query.find('&');
    const std::string_view pair = query.substr(0, amp);
    const std::size_t eq = pair.find('=');
    if (percent_decode(pair.substr(0, eq)) == name) {
      return eq == std::string_view::npos ? std::string() : percent_decode(pair.substr(eq + 1));
    }
    if (amp == std::string_view::npos) break;
    query.remove_prefix(amp + 1);
  }
  return std::nullopt;
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
  charges_ = std::make_unique<beast::IdempotentHandler>(
      beast::IdempotentHandlerOptions{
          .flow = {.store = options_.idempotency,
                   .pool = options_.pool,
                   .scope_secret = options_.scope_secret,
                   .on_outcome =
                       [this](store::IdempotencyOutcome outcome) {
                         ++metrics_->outcomes[static_cast<int>(outcome)];
                       },
                   .json_limits = options_.json_limits,
                   .retry_after_spread = options_.retry_after_spread}},
      [this](const beast::Request& req, Connection& tx) { return create_charge(req, tx); });
  health_ = std::make_unique<beast::HealthCheck>(
      beast::HealthCheckOptions{.url = options_.pool->url(), .timeout = options_.health_timeout});
}

PaymentsApi::~PaymentsApi() = default;

StoredResponse PaymentsApi::create_charge(const beast::Request& req, Connection& tx) const {
  const auto input = parse_charge(req.body(), options_.json_limits);
  if (!input) {
    const nlohmann::json problem = {{"type", "about:blank"},
                                    {"title", "Invalid charge"},
                                    {"status", 400},
                                    {"detail", input.error().message()}};
    return {400, {{"Content-Type", "application/problem+json"}}, problem.dump()};
  }
  const std::string id = "ch_" + random_hex(12);
  const std::int64_t created =
      std::chrono::duration_cast<std::chrono::seconds>(steady_clock().wall_now().time_since_epoch())
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
  return {
      201, {{"Content-Type", "application/json"}, {"Location", "/v1/charges/" + id}}, body.dump()};
}

void PaymentsApi::route(beast::Server& server, http::verb method, std::string path, bool guarded,
                        Work work) {
  server.on_async(
      method, std::move(path),
      [this, &server, guarded, work = std::move(work)](beast::Request request,
                                                       beast::Respond respond) {
        // On the event loop: the refusals that cost nothing, before the request waits for a worker.
        const keel::TimePoint arrival = steady_clock().now();
        keel::Admission admission;
        if (guarded && options_.refuse) {
          if (auto refused = options_.refuse(request)) return respond(std::move(*refused));
        }
        if (guarded && options_.limiter != nullptr) {
          admission = options_.limiter->admit(beast::request_attempt(request), keel::thread_rng());
          if (!admission) return respond(beast::shed_response(admission, request.version()));
        }
        // Move-only state in a shared_ptr: the work item must be copyable for the executor.
        struct Job {
          beast::Request request;
          keel::Admission admission;
          beast::Respond respond;
        };
        auto job = std::make_shared<Job>(
            Job{std::move(request), std::move(admission), std::move(respond)});
        boost::asio::post(server.worker_executor(), [this, job, guarded, arrival, &work] {
          // Nobody will read the answer (the client went away, or the drain gave up): no work.
          if (job->respond.is_abandoned()) return job->admission.release();
          beast::Response res;
          try {
            if (guarded && options_.before) options_.before(job->request);
            res = work(job->request, arrival, job->respond.abandoned());
          } catch (const std::exception& e) {
            // The text goes to the log, never to the client.
            std::fprintf(stderr, "%s: %s %s failed: %s\n", options_.log_prefix.c_str(),
                         std::string(job->request.method_string()).c_str(),
                         std::string(job->request.target()).c_str(), e.what());
            res = beast::problem_response(503, "Internal error", "the request failed on the server",
                                          job->request.version());
            res.set(http::field::retry_after,
                    keel::format_retry_after(
                        keel::spread_retry_after(options_.retry_after_spread, keel::thread_rng())));
          }
          // Timed from the arrival on the event loop: the wait for a worker thread is the queue
          // an adaptive limit must see (timed from here, an overloaded server looks idle).
          const keel::TimePoint ended = steady_clock().now();
          job->admission.release(ended - arrival, ended);
          job->respond(std::move(res));
        });
      });
}

void PaymentsApi::install(beast::Server& server) {
  const std::string prefix = options_.log_prefix;
  const auto after_commit = [this](const beast::Request& req, beast::Response& res) {
    ++metrics_->charges_created;
    if (options_.after_commit) options_.after_commit(req, res);
  };

  // GET before POST on /v1/charges: a 405's Allow lists them in that order.
  route(server, http::verb::get, "/v1/charges", true,
        [this](const beast::Request& req, keel::TimePoint, const std::atomic<bool>*) {
          const auto customer =
              query_param(std::string_view(req.target().data(), req.target().size()), "customer");
          if (!customer) {
            return beast::problem_response(400, "Missing parameter",
                                           "GET /v1/charges needs ?customer=ID", req.version());
          }
          auto conn = options_.pool->acquire();
          const store::Rows rows = conn->query(
              "SELECT id, amount, currency, customer, created FROM charges"
              " WHERE principal = $1 AND customer = $2 ORDER BY created, id LIMIT 1000",
              {scope_of(req, options_.scope_secret), *customer});
          nlohmann::json list = nlohmann::json::array();
          for (std::size_t i = 0; i < rows.size(); ++i) list.push_back(charge_json(rows, i));
          return ok_response(req, nlohmann::json{{"data", list}}.dump());
        });

  if (options_.no_idempotency) {
    route(server, http::verb::post, "/v1/charges", true,
          [this, prefix, after_commit](const beast::Request& req, keel::TimePoint,
                                       const std::atomic<bool>* abandoned) {
            auto conn = options_.pool->acquire();
            StoredResponse out;
            const auto tx = store::with_transaction_retry(*conn, [&](Connection& t) {
              out = create_charge(req, t);
              // Nothing commits once nobody will read the answer.
              return out.status < 400 &&
                     (abandoned == nullptr || !abandoned->load(std::memory_order_acquire));
            });
            if (!tx.committed() && tx.status != store::TransactionStatus::kRolledBack) {
              std::fprintf(stderr, "%s: POST /v1/charges: %s\n", prefix.c_str(), tx.error.c_str());
              return beast::problem_response(503, "Database unavailable",
                                             "the database is unavailable", req.version());
            }
            beast::Response res = beast::to_response(
                {.status = out.status, .headers = out.headers, .body = out.body}, req.version());
            if (tx.committed()) after_commit(req, res);
            return res;
          });
  } else {
    route(server, http::verb::post, "/v1/charges", true,
          [this, after_commit](const beast::Request& req, keel::TimePoint arrival,
                               const std::atomic<bool>* abandoned) {
            beast::Response res =
                charges_->handle(req, charges_->principal(req), arrival, abandoned);
            // A 2xx or 3xx the flow did not replay is a charge it committed just now.
            if (res.result_int() < 400 && res.find("Idempotent-Replayed") == res.end()) {
              after_commit(req, res);
            }
            return res;
          });
  }

  route(server, http::verb::get, "/v1/charges/*", true,
        [this](const beast::Request& req, keel::TimePoint, const std::atomic<bool>*) {
          const std::string_view target(req.target().data(), req.target().size());
          const std::string_view path = target.substr(0, target.find('?'));
          const std::string id(path.substr(std::string_view("/v1/charges/").size()));
          const bool well_formed = std::all_of(id.begin(), id.end(), [](char c) {
            return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_';
          });
          if (!well_formed) {
            return beast::problem_response(404, "Not found", "no resource at this path",
                                           req.version());
          }
          auto conn = options_.pool->acquire();
          const store::Rows rows = conn->query(
              "SELECT id, amount, currency, customer, created FROM charges"
              " WHERE id = $1 AND principal = $2",
              {id, scope_of(req, options_.scope_secret)});
          if (rows.empty()) {
            return beast::problem_response(404, "Not found", "no such charge", req.version());
          }
          return ok_response(req, charge_json(rows, 0).dump());
        });

  // On a connection and threads of its own: never behind the routes' work, answered within
  // health_timeout whatever the database does.
  server.on_async(
      http::verb::get, "/healthz", [this, prefix](beast::Request req, beast::Respond respond) {
        health_->check([respond = std::move(respond), prefix,
                        req = std::move(req)](const beast::HealthResult& result) {
          if (result.healthy()) return respond(ok_response(req, "ok\n", "text/plain"));
          std::fprintf(stderr, "%s: /healthz: %s\n", prefix.c_str(), result.error.c_str());
          respond(beast::problem_response(503, "Database unavailable",
                                          "the database does not answer", req.version()));
        });
      });

  // Counters only: answered on the event loop.
  server.on(http::verb::get, "/metrics", [this](const beast::Request& req) {
    std::string text = metrics_->render();
    if (options_.extra_metrics) text += options_.extra_metrics();
    return ok_response(req, std::move(text), "text/plain; version=0.0.4");
  });
}

}  // namespace payments
