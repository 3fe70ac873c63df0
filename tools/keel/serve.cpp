// `keel serve`: a small payments API that shows the receiver's half of safe retries.
// POST /v1/charges goes through the idempotency middleware (keel/store/idempotency_middleware.hpp)
// on SQLite or PostgreSQL; GET /v1/charges/{id}, GET /v1/charges?customer=ID, /healthz, /metrics.
// --rate-limit answers 429 + Retry-After per principal; --max-concurrency sheds retries first
// (503 + Retry-After, keel/store/admission_middleware.hpp); the --chaos-* flags inject the
// failures that make clients retry (503s, delays, hangs, and "commit then drop the response").
// Stops cleanly on SIGTERM/SIGINT: the listener closes, in-flight requests finish.
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <openssl/rand.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <list>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <unordered_map>

#include "commands.hpp"
#include "keel/admission.hpp"
#include "keel/duration.hpp"
#include "keel/store/admission_middleware.hpp"
#include "keel/store/idempotency_middleware.hpp"
#include "keel/testing/chaos.hpp"

namespace keel::cli {
namespace {

using store::Connection;
using store::StoredResponse;

struct ServeOptions {
  std::string listen = "127.0.0.1:8080";
  std::string db = std::string(store::kDefaultDatabaseUrl);
  std::string ttl = "24h";
  std::string lock_timeout = "30s";
  std::string rate_limit;
  int rate_limit_principals = 10000;
  std::string scope_secret_file;
  std::string sweep_interval = "1m";
  int threads = 16;
  std::int64_t max_concurrency = 0;
  std::int64_t admission_queue = -1;
  std::string adaptive_latency;
  std::string max_body_bytes = "1048576";
  std::string max_json_depth = "64";
  bool reuse_port = false;
  bool no_idempotency = false;
  double chaos_503 = 0;
  std::string chaos_503_retry_after;
  double chaos_delay_fraction = 0;
  std::string chaos_delay = "1s";
  double chaos_hang_fraction = 0;
  std::string chaos_hang = "1m";
  double chaos_drop = 0;
  std::uint64_t chaos_seed = 1;
};

int usage_error(const std::string& flag, const std::string& message) {
  std::fprintf(stderr, "keel serve: %s: %s\n", flag.c_str(), message.c_str());
  return kExitUsage;
}

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

/// Per-principal token buckets: `rate` tokens a second, bursts of up to `rate` (at least 1),
/// keyed by the principal's hashed scope (never the credential) in a table of at most `capacity`
/// entries; the least recently used entry is evicted when it is full. Memory is bounded whatever
/// the number of distinct credentials. A principal not in the table (a new one, an evicted one)
/// and unauthenticated requests draw from one shared bucket of the same rate: rotating
/// credentials buys no more than `rate` admissions a second in total.
class RateLimiter {
 public:
  RateLimiter(double rate, std::size_t capacity)
      : rate_(rate), burst_(std::max(1.0, rate)), capacity_(capacity), shared_{burst_, {}} {
    shared_.last = steady_clock().now();
  }
  /// Zero when admitted; otherwise how long until a token is available.
  Duration admit(const std::string& scope) {
    const TimePoint now = steady_clock().now();
    std::lock_guard lock(mu_);
    if (scope != store::kAnonymousScope) {
      if (const auto it = index_.find(scope); it != index_.end()) {
        lru_.splice(lru_.begin(), lru_, it->second);  // most recently used first
        return take(it->second->second, now);
      }
    }
    const Duration wait = take(shared_, now);
    if (wait > Duration::zero() || scope == store::kAnonymousScope) return wait;
    // Admitted through the shared bucket: the principal gets a bucket of its own, the token it
    // just used already spent.
    if (lru_.size() >= capacity_) {
      index_.erase(lru_.back().first);
      lru_.pop_back();
    }
    lru_.emplace_front(scope, Bucket{burst_ - 1.0, now});
    index_.emplace(scope, lru_.begin());
    return Duration::zero();
  }
  /// Principals with a bucket of their own (at most the capacity).
  std::size_t size() {
    std::lock_guard lock(mu_);
    return lru_.size();
  }

 private:
  struct Bucket {
    double tokens;
    TimePoint last;
  };
  Duration take(Bucket& b, TimePoint now) const {
    const double elapsed = std::chrono::duration<double>(now - b.last).count();
    b.tokens = std::min(burst_, b.tokens + std::max(0.0, elapsed) * rate_);
    b.last = now;
    if (b.tokens >= 1.0) {
      b.tokens -= 1.0;
      return Duration::zero();
    }
    return std::chrono::duration_cast<Duration>(
        std::chrono::duration<double>((1.0 - b.tokens) / rate_));
  }

  using Entry = std::pair<std::string, Bucket>;
  double rate_;
  double burst_;
  std::size_t capacity_;
  std::mutex mu_;
  Bucket shared_;                                                      // guarded by mu_
  std::list<Entry> lru_;                                               // guarded by mu_
  std::unordered_map<std::string, std::list<Entry>::iterator> index_;  // guarded by mu_
};

struct Metrics {
  std::atomic<std::uint64_t> outcomes[store::kIdempotencyOutcomes] = {};
  std::atomic<std::uint64_t> charges_created{0};
  std::atomic<std::uint64_t> rate_limited{0};
  std::atomic<std::uint64_t> rate_limit_principals{0};

  std::string render(const testing::Chaos& chaos) const {
    std::string out =
        "# HELP keel_idempotency_requests_total Requests through the idempotency layer by "
        "outcome.\n# TYPE keel_idempotency_requests_total counter\n";
    for (int i = 0; i < store::kIdempotencyOutcomes; ++i) {
      out += "keel_idempotency_requests_total{outcome=\"" +
             std::string(to_string(static_cast<store::IdempotencyOutcome>(i))) + "\"} " +
             std::to_string(outcomes[i].load()) + "\n";
    }
    out +=
        "# HELP keel_charges_created_total Charges committed.\n"
        "# TYPE keel_charges_created_total counter\n"
        "keel_charges_created_total " +
        std::to_string(charges_created.load()) + "\n";
    out +=
        "# HELP keel_rate_limited_total Requests answered 429.\n"
        "# TYPE keel_rate_limited_total counter\n"
        "keel_rate_limited_total " +
        std::to_string(rate_limited.load()) + "\n";
    out +=
        "# HELP keel_rate_limit_principals Principals with a rate-limit bucket of their own.\n"
        "# TYPE keel_rate_limit_principals gauge\n"
        "keel_rate_limit_principals " +
        std::to_string(rate_limit_principals.load()) + "\n";
    out += chaos.prometheus_text();
    return out;
  }
};

/// The --max-concurrency limiter's counters in the Prometheus text format.
std::string render_admission(const AdmissionStats& s) {
  std::string out =
      "# HELP keel_admission_shed_total Requests answered 503 by --max-concurrency, by reason "
      "(retry: a retry at the limit; over_capacity: a first attempt past the queue bound).\n"
      "# TYPE keel_admission_shed_total counter\n";
  for (const ShedReason r : {ShedReason::kRetryOverLimit, ShedReason::kOverCapacity}) {
    out += "keel_admission_shed_total{reason=\"" + std::string(to_string(r)) + "\"} " +
           std::to_string(s.shed[static_cast<int>(r)]) + "\n";
  }
  out +=
      "# HELP keel_admission_admitted_total Requests admitted by --max-concurrency, by attempt.\n"
      "# TYPE keel_admission_admitted_total counter\n"
      "keel_admission_admitted_total{attempt=\"first\"} " +
      std::to_string(s.admitted_first) + "\nkeel_admission_admitted_total{attempt=\"retry\"} " +
      std::to_string(s.admitted_retry) + "\n";
  out +=
      "# HELP keel_admission_limit In-flight requests beyond which retries are shed now.\n"
      "# TYPE keel_admission_limit gauge\n"
      "keel_admission_limit " +
      std::to_string(s.limit) + "\n";
  out +=
      "# HELP keel_admission_in_flight Requests holding an admission slot.\n"
      "# TYPE keel_admission_in_flight gauge\n"
      "keel_admission_in_flight " +
      std::to_string(s.in_flight) + "\n";
  return out;
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

struct ChargeInput {
  std::int64_t amount = 0;
  std::string currency;
  std::string customer;
};

std::optional<ChargeInput> parse_charge(const std::string& body, const store::JsonLimits& limits,
                                        std::string* error) {
  // Depth and duplicate members first: nothing untrusted reaches the parser before that.
  const store::JsonCheck checked = store::check_json(body, limits);
  if (checked.status == store::JsonStatus::kTooDeep ||
      checked.status == store::JsonStatus::kDuplicateKey) {
    *error = checked.detail;
    return std::nullopt;
  }
  const nlohmann::json j =
      checked.ok() ? nlohmann::json::parse(checked.canonical, nullptr, false) : nlohmann::json();
  if (!checked.ok() || j.is_discarded() || !j.is_object()) {
    *error = "the body is not a JSON object";
    return std::nullopt;
  }
  ChargeInput in;
  const auto amount = j.find("amount");
  if (amount == j.end() || !amount->is_number_integer() || amount->get<std::int64_t>() <= 0) {
    *error = "\"amount\" must be a positive integer";
    return std::nullopt;
  }
  in.amount = amount->get<std::int64_t>();
  const auto currency = j.find("currency");
  if (currency == j.end() || !currency->is_string() ||
      currency->get_ref<const std::string&>().size() != 3 ||
      !std::all_of(currency->get_ref<const std::string&>().begin(),
                   currency->get_ref<const std::string&>().end(),
                   [](char c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z'); })) {
    *error = "\"currency\" must be 3 letters";
    return std::nullopt;
  }
  in.currency = currency->get<std::string>();
  for (char& c : in.currency) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  const auto customer = j.find("customer");
  if (customer == j.end() || !customer->is_string() ||
      customer->get_ref<const std::string&>().empty() ||
      customer->get_ref<const std::string&>().size() > 255) {
    *error = "\"customer\" must be a non-empty string of at most 255 characters";
    return std::nullopt;
  }
  in.customer = customer->get<std::string>();
  return in;
}

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

int run_serve(const ServeOptions& o) {
  // ---- validate flags
  std::string error;
  const auto ttl = parse_duration(o.ttl, &error);
  if (!ttl || *ttl <= Duration::zero()) {
    return usage_error("--idempotency-ttl", ttl ? "must be > 0" : error);
  }
  const auto lock_timeout = parse_duration(o.lock_timeout, &error);
  if (!lock_timeout || *lock_timeout <= Duration::zero()) {
    return usage_error("--lock-timeout", lock_timeout ? "must be > 0" : error);
  }
  const auto sweep = parse_duration(o.sweep_interval, &error);
  if (!sweep || *sweep <= Duration::zero()) {
    return usage_error("--sweep-interval", sweep ? "must be > 0" : error);
  }
  std::optional<Duration> adaptive_latency;
  if (!o.adaptive_latency.empty()) {
    adaptive_latency = parse_duration(o.adaptive_latency, &error);
    if (!adaptive_latency || *adaptive_latency <= Duration::zero()) {
      return usage_error("--adaptive-latency", adaptive_latency ? "must be > 0" : error);
    }
    if (o.max_concurrency <= 0) {
      return usage_error("--adaptive-latency", "needs --max-concurrency (the upper limit)");
    }
  }
  const auto delay = parse_duration(o.chaos_delay, &error);
  if (!delay) return usage_error("--chaos-delay", error);
  const auto hang = parse_duration(o.chaos_hang, &error);
  if (!hang) return usage_error("--chaos-hang", error);
  std::optional<Duration> chaos_retry_after;
  if (!o.chaos_503_retry_after.empty()) {
    chaos_retry_after = parse_duration(o.chaos_503_retry_after, &error);
    if (!chaos_retry_after) return usage_error("--chaos-503-retry-after", error);
  }
  std::optional<double> rate;
  if (!o.rate_limit.empty()) {
    const std::size_t slash = o.rate_limit.find("/s");
    char* end = nullptr;
    const std::string number = o.rate_limit.substr(0, slash);
    const double r = std::strtod(number.c_str(), &end);
    if (slash == std::string::npos || slash + 2 != o.rate_limit.size() || number.empty() ||
        end != number.c_str() + number.size() || !(r > 0) || r > 1e9) {
      return usage_error("--rate-limit",
                         "'" + o.rate_limit + "' is not a positive rate like 100/s");
    }
    rate = r;
  }
  const std::size_t colon = o.listen.rfind(':');
  int port = -1;
  std::string host;
  if (colon != std::string::npos && colon > 0) {
    host = o.listen.substr(0, colon);
    const std::string p = o.listen.substr(colon + 1);
    char* end = nullptr;
    const long v = std::strtol(p.c_str(), &end, 10);
    if (!p.empty() && end == p.c_str() + p.size() && v >= 0 && v <= 65535)
      port = static_cast<int>(v);
  }
  if (port < 0) {
    return usage_error("--listen", "'" + o.listen + "' is not HOST:PORT (e.g. 127.0.0.1:8080)");
  }
  const auto url = store::parse_database_url(o.db, &error);
  if (!url) return usage_error("--db", error);
  const auto positive = [](const std::string& text,
                           unsigned long long max) -> std::optional<unsigned long long> {
    if (text.empty() || text.size() > 19 ||
        text.find_first_not_of("0123456789") != std::string::npos) {
      return std::nullopt;
    }
    const unsigned long long v = std::stoull(text);
    if (v < 1 || v > max) return std::nullopt;
    return v;
  };
  const auto max_body = positive(o.max_body_bytes, 1ULL << 32);
  if (!max_body) {
    return usage_error("--max-body-bytes",
                       "'" + o.max_body_bytes + "' is not a byte count in [1, 4294967296]");
  }
  const auto max_depth = positive(o.max_json_depth, 10000);
  if (!max_depth) {
    return usage_error("--max-json-depth",
                       "'" + o.max_json_depth + "' is not a nesting depth in [1, 10000]");
  }
  const store::JsonLimits json_limits{.max_depth = static_cast<std::size_t>(*max_depth)};
  std::string scope_secret;
  if (!o.scope_secret_file.empty()) {
    std::ifstream in(o.scope_secret_file, std::ios::binary);
    if (!in) return usage_error("--scope-secret-file", "cannot read '" + o.scope_secret_file + "'");
    scope_secret.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    while (!scope_secret.empty() && (scope_secret.back() == '\n' || scope_secret.back() == '\r')) {
      scope_secret.pop_back();
    }
    if (scope_secret.size() < 16) {
      return usage_error("--scope-secret-file",
                         "'" + o.scope_secret_file + "' holds fewer than 16 bytes");
    }
  }

  // ---- database
  store::ConnectionPool pool(*url, {.max_connections = o.threads + 2});
  {
    auto conn = pool.acquire();
    store::IdempotencyStore::migrate(*conn);
    const int payments_before = store::migrate(*conn, "payments", kPaymentsSchema);
    if (scope_secret.empty()) {
      (void)conn->query(
          "INSERT INTO serve_scope_secret (id, secret) VALUES (1, $1) ON CONFLICT (id) DO NOTHING",
          {random_hex(32)});
      scope_secret = conn->query("SELECT secret FROM serve_scope_secret WHERE id = 1").text(0, 0);
    }
    if (payments_before == 1) hash_stored_principals(*conn, scope_secret);
  }
  const store::IdempotencyStore idempotency({.ttl = *ttl, .lock_timeout = *lock_timeout});

  // ---- server
  Metrics metrics;
  std::atomic<bool> stopping{false};
  testing::Chaos chaos({.fraction_503 = o.chaos_503,
                        .retry_after_503 = chaos_retry_after,
                        .delay_fraction = o.chaos_delay_fraction,
                        .delay = *delay,
                        .hang_fraction = o.chaos_hang_fraction,
                        .hang = *hang,
                        .drop_after_commit = o.chaos_drop,
                        .seed = o.chaos_seed},
                       {.answer_503 =
                            [](httplib::Response& res, std::string_view /*detail*/) {
                              store::write_problem_and_close(res, 503, "Service unavailable",
                                                             "injected by --chaos-503");
                            },
                        .drop_connection = store::shutdown_connection});
  // Principals are stored and rate-limited by their keyed hash, never as the credential.
  const auto scope_of = [&](const httplib::Request& req) {
    return store::principal_scope(store::bearer_principal(req), scope_secret);
  };
  std::optional<RateLimiter> limiter;
  if (rate) limiter.emplace(*rate, static_cast<std::size_t>(o.rate_limit_principals));

  httplib::Server server;
  const int threads = o.threads;
  server.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };

  // Limits, framing checks and an exclusive port come first; then the rate limit and the chaos.
  store::ServerLimits limits{.max_body_bytes = static_cast<std::size_t>(*max_body),
                             .reuse_port = o.reuse_port,
                             .routes = {{"/v1/charges", "GET, POST"},
                                        {"/v1/charges/[A-Za-z0-9_]+", "GET"},
                                        {"/healthz", "GET"},
                                        {"/metrics", "GET"}}};
  limits.pre_routing = [&](const httplib::Request& req, httplib::Response& res) {
    if (req.path.rfind("/v1/", 0) != 0) return httplib::Server::HandlerResponse::Unhandled;
    if (limiter) {
      const Duration wait = limiter->admit(scope_of(req));
      metrics.rate_limit_principals = limiter->size();
      if (wait > Duration::zero()) {
        ++metrics.rate_limited;
        res.set_header("Retry-After",
                       std::to_string(std::max<std::int64_t>(
                           1, std::chrono::ceil<std::chrono::seconds>(wait).count())));
        store::write_problem_and_close(res, 429, "Too many requests",
                                       "the rate limit for this principal is " + o.rate_limit);
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    return chaos.pre_routing(req, res);
  };
  store::apply_server_limits(server, std::move(limits));

  // --max-concurrency: one limiter over every /v1 route, retries shed first. The injected delays
  // and hangs run inside the admitted region, as a slow handler or database would.
  std::optional<AdmissionLimiter> admission_limiter;
  if (o.max_concurrency > 0) {
    admission_limiter.emplace(AdmissionOptions{
        .max_concurrency = o.max_concurrency,
        .queue_bound = o.admission_queue >= 0 ? o.admission_queue
                                              : std::max<std::int64_t>(1, o.max_concurrency / 4),
        .latency_threshold = adaptive_latency.value_or(Duration::zero())});
  }
  const auto guarded = [&](httplib::Server::Handler handler) -> httplib::Server::Handler {
    httplib::Server::Handler slowed = chaos.wrap(std::move(handler));
    if (!admission_limiter) return slowed;
    return store::AdmissionMiddleware({.limiter = &*admission_limiter}).wrap(std::move(slowed));
  };

  const store::TransactionalHandler create_charge = [&](const httplib::Request& req,
                                                        Connection& tx) -> StoredResponse {
    std::string why;
    const auto input = parse_charge(req.body, json_limits, &why);
    if (!input) {
      const nlohmann::json problem = {
          {"type", "about:blank"}, {"title", "Invalid charge"}, {"status", 400}, {"detail", why}};
      return {400, {{"Content-Type", "application/problem+json"}}, problem.dump()};
    }
    const std::string id = "ch_" + random_hex(12);
    const std::int64_t created = std::chrono::duration_cast<std::chrono::seconds>(
                                     steady_clock().wall_now().time_since_epoch())
                                     .count();
    tx.query(
        "INSERT INTO charges (id, principal, amount, currency, customer, created)"
        " VALUES ($1, $2, $3, $4, $5, $6)",
        {id, scope_of(req), input->amount, input->currency, input->customer, created});
    const nlohmann::json body = {{"id", id},
                                 {"amount", input->amount},
                                 {"currency", input->currency},
                                 {"customer", input->customer},
                                 {"created", created}};
    return {201,
            {{"Content-Type", "application/json"}, {"Location", "/v1/charges/" + id}},
            body.dump()};
  };

  const auto after_commit = [&](const httplib::Request& req, httplib::Response& /*res*/) {
    ++metrics.charges_created;
    (void)chaos.after_commit(req);
  };

  store::IdempotencyMiddleware middleware({.store = &idempotency,
                                           .pool = &pool,
                                           .scope_secret = scope_secret,
                                           .on_outcome =
                                               [&](store::IdempotencyOutcome outcome) {
                                                 ++metrics.outcomes[static_cast<int>(outcome)];
                                               },
                                           .after_commit = after_commit,
                                           .json_limits = json_limits});

  if (o.no_idempotency) {
    server.Post("/v1/charges", guarded([&](const httplib::Request& req, httplib::Response& res) {
                  auto conn = pool.acquire();
                  StoredResponse out;
                  const auto tx = store::with_transaction_retry(*conn, [&](Connection& t) {
                    out = create_charge(req, t);
                    return out.status < 400;
                  });
                  if (!tx.committed() && tx.status != store::TransactionStatus::kRolledBack) {
                    std::fprintf(stderr, "keel serve: POST /v1/charges: %s\n", tx.error.c_str());
                    store::write_problem(res, 503, "Database unavailable",
                                         "the database is unavailable");
                    return;
                  }
                  res.status = out.status;
                  for (const auto& [name, value] : out.headers) {
                    if (name != "Content-Type") res.set_header(name, value);
                  }
                  res.set_content(
                      out.body, out.status < 400 ? "application/json" : "application/problem+json");
                  if (tx.committed()) after_commit(req, res);
                }));
  } else {
    server.Post("/v1/charges", guarded(middleware.wrap(create_charge)));
  }

  server.Get(R"(/v1/charges/([A-Za-z0-9_]+))",
             guarded([&](const httplib::Request& req, httplib::Response& res) {
               auto conn = pool.acquire();
               const store::Rows rows = conn->query(
                   "SELECT id, amount, currency, customer, created FROM charges"
                   " WHERE id = $1 AND principal = $2",
                   {req.matches[1].str(), scope_of(req)});
               if (rows.empty()) {
                 store::write_problem(res, 404, "Not found", "no such charge");
                 return;
               }
               res.set_content(charge_json(rows, 0).dump(), "application/json");
             }));
  server.Get("/v1/charges", guarded([&](const httplib::Request& req, httplib::Response& res) {
               if (!req.has_param("customer")) {
                 store::write_problem(res, 400, "Missing parameter",
                                      "GET /v1/charges needs ?customer=ID");
                 return;
               }
               auto conn = pool.acquire();
               const store::Rows rows = conn->query(
                   "SELECT id, amount, currency, customer, created FROM charges"
                   " WHERE principal = $1 AND customer = $2 ORDER BY created, id LIMIT 1000",
                   {scope_of(req), req.get_param_value("customer")});
               nlohmann::json list = nlohmann::json::array();
               for (std::size_t i = 0; i < rows.size(); ++i) list.push_back(charge_json(rows, i));
               res.set_content(nlohmann::json{{"data", list}}.dump(), "application/json");
             }));
  server.Get("/healthz", [&](const httplib::Request&, httplib::Response& res) {
    try {
      auto conn = pool.acquire();
      (void)conn->query("SELECT 1");
      res.set_content("ok\n", "text/plain");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "keel serve: /healthz: %s\n", e.what());
      store::write_problem(res, 503, "Database unavailable", "the database does not answer");
    }
  });
  server.Get("/metrics", [&](const httplib::Request&, httplib::Response& res) {
    std::string text = metrics.render(chaos);
    if (admission_limiter) text += render_admission(admission_limiter->stats());
    res.set_content(text, "text/plain; version=0.0.4");
  });
  server.set_exception_handler(
      [](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown error";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        // The text goes to the log, never to the client.
        std::fprintf(stderr, "keel serve: %s %s failed: %s\n", req.method.c_str(), req.path.c_str(),
                     what.c_str());
        res.set_header("Retry-After", "1");
        store::write_problem(res, 503, "Internal error", "the request failed on the server");
      });

  // ---- signals: handled by one thread with sigwait; every other thread has them blocked.
  signal(SIGPIPE, SIG_IGN);
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  int bound = port;
  errno = 0;
  if (port == 0) {
    bound = server.bind_to_any_port(host);
  } else if (!server.bind_to_port(host, port)) {
    bound = -1;
  }
  if (bound < 0) {
    const int why = errno;
    std::fprintf(
        stderr, "keel serve: --listen: cannot listen on %s: %s%s\n", o.listen.c_str(),
        why != 0 ? std::strerror(why) : "bind failed",
        why == EADDRINUSE ? " (another process listens there; --reuse-port shares it)" : "");
    return 1;
  }
  widen_backlog(bound);
  std::printf("keel serve: listening on http://%s:%d (db %s, idempotency %s)\n", host.c_str(),
              bound, url->redacted.c_str(), o.no_idempotency ? "off" : "on");
  std::fflush(stdout);

  std::atomic<bool> done{false};
  std::thread signal_thread([&] {
    int sig = 0;
    sigwait(&signals, &sig);
    stopping = true;
    chaos.stop();
    if (!done.load()) {
      std::fprintf(stderr, "keel serve: %s received, finishing in-flight requests\n",
                   sig == SIGINT ? "SIGINT" : "SIGTERM");
    }
    server.stop();
  });
  std::mutex sweep_mu;
  std::condition_variable sweep_cv;
  std::thread sweeper([&] {
    std::unique_lock lock(sweep_mu);
    while (!sweep_cv.wait_for(lock, *sweep, [&] { return stopping.load(); })) {
      try {
        auto conn = pool.acquire();
        while (idempotency.purge_expired(*conn) >= idempotency.options().purge_batch) {
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "keel serve: idempotency sweep failed: %s\n", e.what());
      }
    }
  });

  server.listen_after_bind();
  done = true;
  stopping = true;
  chaos.stop();
  if (!signal_thread.joinable()) return 0;
  pthread_kill(signal_thread.native_handle(), SIGTERM);  // wakes sigwait if no signal came
  signal_thread.join();
  { std::lock_guard lock(sweep_mu); }
  sweep_cv.notify_all();
  sweeper.join();
  std::printf("keel serve: stopped\n");
  return 0;
}

}  // namespace

Runner add_serve(CLI::App& app) {
  auto o = std::make_shared<ServeOptions>();
  CLI::App* sub = app.add_subcommand(
      "serve", "Run a small payments API with idempotency keys (POST /v1/charges)");
  sub->add_option("--listen", o->listen, "HOST:PORT to listen on (port 0: any free port)")
      ->capture_default_str();
  sub->add_option("--db", o->db, "Database URL: sqlite:PATH or postgres://...")
      ->capture_default_str();
  sub->add_option("--idempotency-ttl", o->ttl, "How long idempotency records are kept")
      ->capture_default_str();
  sub->add_option("--lock-timeout", o->lock_timeout,
                  "How long a claim holds a key before another request may take it over")
      ->capture_default_str();
  sub->add_option("--rate-limit", o->rate_limit, "Per-principal limit, e.g. 100/s (429 beyond)");
  sub->add_option("--rate-limit-principals", o->rate_limit_principals,
                  "Most principals with a rate-limit bucket of their own (least recently used "
                  "evicted; others share one bucket)")
      ->check(CLI::Range(1, 10000000))
      ->capture_default_str();
  sub->add_option("--scope-secret-file", o->scope_secret_file,
                  "File holding the key (>= 16 bytes) of the HMAC that hashes principals before "
                  "they are stored (default: a key kept in the database)");
  sub->add_option("--sweep-interval", o->sweep_interval, "How often expired records are purged")
      ->capture_default_str();
  sub->add_option("--threads", o->threads, "Worker threads")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  sub->add_option("--max-concurrency", o->max_concurrency,
                  "Requests in flight on /v1 beyond which retries (Keel-Attempt, "
                  "x-envoy-attempt-count or grpc-previous-rpc-attempts > first) are answered 503 "
                  "+ Retry-After (default 0: no limit)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30));
  sub->add_option("--admission-queue", o->admission_queue,
                  "First attempts admitted beyond --max-concurrency before they are shed too "
                  "(default max-concurrency / 4, at least 1)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30));
  sub->add_option("--adaptive-latency", o->adaptive_latency,
                  "Make --max-concurrency the upper bound of an adaptive limit (AIMD): a request "
                  "slower than this cuts it by 10%, a fast one while busy adds 1");
  sub->add_option("--max-body-bytes", o->max_body_bytes,
                  "Largest request body in bytes (413 beyond, before it is read)")
      ->capture_default_str();
  sub->add_option("--max-json-depth", o->max_json_depth,
                  "Deepest nesting of JSON arrays and objects in a request body (400 beyond)")
      ->capture_default_str();
  sub->add_flag("--reuse-port", o->reuse_port,
                "Share the listening port with other processes (SO_REUSEPORT); without it a port "
                "in use is an error");
  sub->add_flag("--no-idempotency", o->no_idempotency,
                "Serve POST /v1/charges without the idempotency layer (for comparison)");
  sub->add_option("--chaos-503", o->chaos_503, "Fraction of /v1 requests answered 503")
      ->check(CLI::Range(0.0, 1.0));
  sub->add_option("--chaos-503-retry-after", o->chaos_503_retry_after,
                  "Retry-After sent with injected 503s (default none)");
  sub->add_option("--chaos-delay-fraction", o->chaos_delay_fraction,
                  "Fraction of /v1 requests delayed by --chaos-delay")
      ->check(CLI::Range(0.0, 1.0));
  sub->add_option("--chaos-delay", o->chaos_delay, "Injected delay")->capture_default_str();
  sub->add_option("--chaos-hang-fraction", o->chaos_hang_fraction,
                  "Fraction of /v1 requests that hang for --chaos-hang (or until shutdown)")
      ->check(CLI::Range(0.0, 1.0));
  sub->add_option("--chaos-hang", o->chaos_hang, "How long a hang lasts")->capture_default_str();
  sub->add_option("--chaos-drop-after-commit", o->chaos_drop,
                  "Fraction of committed charges whose response is dropped (connection closed)")
      ->check(CLI::Range(0.0, 1.0));
  sub->add_option("--chaos-seed", o->chaos_seed, "Seed for the fault injection");
  return [o] { return run_serve(*o); };
}

}  // namespace keel::cli
