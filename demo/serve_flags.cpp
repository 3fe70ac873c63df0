// `keel-demo serve`'s flags: registered with CLI11 and read into a ServeOptions (serve.hpp),
// each value checked as it is parsed; the flags that need another are checked before the server
// starts.
#include <memory>
#include <string>
#include <string_view>

#include "commands.hpp"
#include "flag_options.hpp"
#include "keel/db/database.hpp"
#include "rate_flag.hpp"
#include "serve.hpp"

namespace keel::cli {
namespace {

using serve_cli::ListenFlag;
using serve_cli::RateFlag;
using serve_cli::ServeOptions;
using serve_cli::usage_error;

constexpr const char* kCommand = "keel-demo serve";

Expected<ListenFlag> parse_listen_flag(std::string_view text) {
  auto listen = parse_host_port(text);
  if (!listen) {
    return Error{.field = "--listen",
                 .problem = "must be HOST:PORT (e.g. 127.0.0.1:8080)",
                 .got = quote_value(text)};
  }
  return ListenFlag{.host = listen->host, .port = listen->port, .text = std::string(text)};
}

Expected<store::DatabaseUrl> parse_db_flag(std::string_view text) {
  auto url = store::parse_database_url(text);
  if (!url) return url.error().in("--db");
  return url;
}

// A rate names its unit here (100/s, 6000/m): a bare number is refused.
Expected<RateFlag> parse_rate_flag(std::string_view text) {
  if (text.find('/') == std::string_view::npos) {
    return Error{.field = "--rate-limit",
                 .problem = "must be a positive rate like 100/s",
                 .got = quote_value(text)};
  }
  auto rate = parse_rate("--rate-limit", text);
  if (!rate) return rate.error();
  return RateFlag{.per_s = *rate, .text = std::string(text)};
}

// A timeout flag in whole milliseconds: at least 1 ms (0 too with `allow_zero`), at most a day.
Expected<std::chrono::milliseconds> parse_timeout_flag(std::string_view flag, std::string_view text,
                                                       bool allow_zero) {
  const auto d = parse_duration_flag(flag, text, !allow_zero);
  if (!d) return d.error();
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(*d);
  if (*d > std::chrono::hours(24) || (ms.count() == 0 && d->count() != 0)) {
    return Error{.field = std::string(flag),
                 .problem = allow_zero ? "must be 0 or from 1ms to 24h" : "must be from 1ms to 24h",
                 .got = quote_value(text)};
  }
  return ms;
}

CLI::Option* add_timeout(CLI::App* sub, const std::string& flag, std::chrono::milliseconds& target,
                         bool allow_zero, const std::string& help) {
  return add_checked(sub, kCommand, flag, target,
                     FlagParser<std::chrono::milliseconds>([flag, allow_zero](std::string_view t) {
                       return parse_timeout_flag(flag, t, allow_zero);
                     }),
                     help);
}

// The options of the flags that only mean something with another, for check_combinations.
struct Given {
  CLI::Option* rate_limit_principals = nullptr;
  CLI::Option* adaptive_latency = nullptr;
  CLI::Option* chaos_503_retry_after = nullptr;
  CLI::Option* chaos_delay = nullptr;
  CLI::Option* chaos_hang = nullptr;
};

// Where it listens, the database and its idempotency records, and the rate limit.
void add_store_flags(CLI::App* sub, ServeOptions& o, Given& given) {
  add_checked(sub, kCommand, "--listen", o.listen, FlagParser<ListenFlag>(parse_listen_flag),
              "HOST:PORT to listen on (port 0: any free port)")
      ->default_val("127.0.0.1:8080");
  add_checked(sub, kCommand, "--db", o.db, FlagParser<store::DatabaseUrl>(parse_db_flag),
              "Database URL: sqlite:PATH or postgres://...")
      ->default_val(std::string(store::kDefaultDatabaseUrl));
  add_duration(sub, kCommand, "--idempotency-ttl", o.ttl, true,
               "How long idempotency records are kept")
      ->default_val("24h");
  add_duration(sub, kCommand, "--lock-timeout", o.lock_timeout, true,
               "How long a claim holds a key before another request may take it over")
      ->default_val("30s");
  add_checked(sub, kCommand, "--rate-limit", o.rate_limit, FlagParser<RateFlag>(parse_rate_flag),
              "Per-principal limit, e.g. 100/s (429 beyond)");
  given.rate_limit_principals =
      sub->add_option("--rate-limit-principals", o.rate_limit_principals,
                      "Most principals with a rate-limit bucket of their own (least recently used "
                      "evicted; others share one bucket)")
          ->check(CLI::Range(1, 10000000))
          ->capture_default_str();
  sub->add_option("--scope-secret-file", o.scope_secret_file,
                  "File holding the key (>= 16 bytes) of the HMAC that hashes principals before "
                  "they are stored (default: a key kept in the database)");
  add_duration(sub, kCommand, "--sweep-interval", o.sweep_interval, true,
               "How often expired records are purged")
      ->default_val("1m");
}

// The server's limits: threads, admission, sizes.
void add_limit_flags(CLI::App* sub, ServeOptions& o, Given& given) {
  sub->add_option("--threads", o.threads,
                  "Worker threads (the database work; the event loop reads and writes apart)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  sub->add_option("--max-concurrency", o.max_concurrency,
                  "Requests in flight on /v1 beyond which retries (Keel-Attempt, "
                  "x-envoy-attempt-count or grpc-previous-rpc-attempts > first) are answered 503 "
                  "+ Retry-After (default 0: no limit)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30));
  sub->add_option("--admission-queue", o.admission_queue,
                  "First attempts admitted beyond --max-concurrency before they are shed too "
                  "(default max-concurrency / 4, at least 1)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30));
  given.adaptive_latency =
      add_duration(sub, kCommand, "--adaptive-latency", o.adaptive_latency, true,
                   "Make --max-concurrency the upper bound of an adaptive limit (AIMD): a request "
                   "slower than this, admitted with the limit full, cuts it by 10%; a limit's "
                   "worth of fast ones while busy add 1");
  sub->add_flag("--adaptive-admission", o.adaptive_admission,
                "Make --max-concurrency the upper bound of an adaptive limit without a "
                "threshold: found from the latency of admitted requests (from their arrival) "
                "against the server's own baseline (docs/admission.md)");
  add_count(sub, kCommand, "--max-body-bytes", o.max_body_bytes, 1, 1ULL << 32,
            "Largest request body in bytes (413 beyond, before it is read)")
      ->default_val("1048576");
  add_count(sub, kCommand, "--max-json-depth", o.max_json_depth, 1, 10000,
            "Deepest nesting of JSON arrays and objects in a request body (400 beyond)")
      ->default_val("64");
  add_count(sub, kCommand, "--retry-after-spread", o.retry_after_spread, 1, 3600,
            "Retry-After of the answers every client meets at once (database "
            "unavailable, commit in doubt): whole seconds uniform over 1..N")
      ->type_name("N")
      ->default_val("3");
  add_count(sub, kCommand, "--max-connections", o.max_connections, 1, 1 << 20,
            "Connections open at once; at the limit a new one takes the slot of the oldest "
            "connection not having a request handled (lowered when the limit of open files "
            "cannot hold it)")
      ->type_name("N")
      ->default_val("1024");
}

void add_timeout_flags(CLI::App* sub, ServeOptions& o) {
  add_timeout(sub, "--first-byte-timeout", o.first_byte_timeout, false,
              "How long a new connection may wait before sending its first byte")
      ->default_val("2s");
  add_timeout(sub, "--header-timeout", o.header_timeout, false,
              "Deadline of a request's head, from its first byte (from the accept for a "
              "connection's first request)")
      ->default_val("10s");
  add_timeout(sub, "--body-timeout", o.body_timeout, false,
              "Deadline of a request's body, from the end of its head")
      ->default_val("30s");
  add_timeout(sub, "--idle-timeout", o.idle_timeout, false,
              "How long a keep-alive connection may wait for its next request")
      ->default_val("5s");
  add_timeout(sub, "--write-timeout", o.write_timeout, false, "Deadline of writing one answer")
      ->default_val("10s");
  add_timeout(sub, "--drain-timeout", o.drain_timeout, true,
              "How long a stop (SIGTERM, SIGINT, SIGHUP) waits for in-flight requests; those "
              "left then are abandoned (nothing of them commits)")
      ->default_val("10s");
  add_timeout(sub, "--health-timeout", o.health_timeout, false,
              "How long GET /healthz waits for the database (on a connection of its own) "
              "before it answers 503")
      ->default_val("1s");
  sub->add_flag("--reuse-port", o.reuse_port,
                "Share the listening port with other processes (SO_REUSEPORT); without it a port "
                "in use is an error");
  sub->add_flag("--no-idempotency", o.no_idempotency,
                "Serve POST /v1/charges without the idempotency layer (for comparison)");
}

// A --chaos-* fraction: of the requests (or charges) a fault hits, from 0 to 1.
CLI::Option* add_fault_fraction(CLI::App* sub, const std::string& flag, double& fraction,
                                const std::string& help) {
  return sub->add_option(flag, fraction, help)->check(CLI::Range(0.0, 1.0));
}

// A fault that hits a fraction of the /v1 requests for a time: --chaos-NAME-fraction, then
// --chaos-NAME (default `lasts`), which is returned.
CLI::Option* add_timed_fault(CLI::App* sub, const std::string& name, double& fraction,
                             const std::string& fraction_help, Duration& time,
                             const std::string& time_help, const std::string& lasts) {
  add_fault_fraction(sub, "--chaos-" + name + "-fraction", fraction, fraction_help);
  return add_duration(sub, kCommand, "--chaos-" + name, time, false, time_help)->default_val(lasts);
}

// The --chaos-* faults.
void add_chaos_flags(CLI::App* sub, ServeOptions& o, Given& given) {
  add_fault_fraction(sub, "--chaos-503", o.chaos_503, "Fraction of /v1 requests answered 503");
  given.chaos_503_retry_after =
      add_duration(sub, kCommand, "--chaos-503-retry-after", o.chaos_503_retry_after, false,
                   "Retry-After sent with injected 503s (default none)");
  given.chaos_delay = add_timed_fault(sub, "delay", o.chaos_delay_fraction,
                                      "Fraction of /v1 requests delayed by --chaos-delay",
                                      o.chaos_delay, "Injected delay", "1s");
  given.chaos_hang =
      add_timed_fault(sub, "hang", o.chaos_hang_fraction,
                      "Fraction of /v1 requests that hang for --chaos-hang (or until shutdown)",
                      o.chaos_hang, "How long a hang lasts", "1m");
  add_fault_fraction(sub, "--chaos-drop-after-commit", o.chaos_drop,
                     "Fraction of committed charges whose response is dropped (connection "
                     "closed)");
  sub->add_option("--chaos-seed", o.chaos_seed, "Seed for the fault injection");
}

// A refused combination; `value` is the flag's own (empty for a switch: nothing to show).
int needs(std::string_view flag, std::string problem, std::string_view value) {
  return usage_error(Error{.field = std::string(flag),
                           .problem = std::move(problem),
                           .got = value.empty() ? std::string() : quote_value(value)}
                         .message());
}

// The flags that only mean something with another: 0, or kExitUsage after the message.
int check_combinations(const ServeOptions& o, const Given& given) {
  if (o.adaptive_latency && o.max_concurrency <= 0) {
    return needs("--adaptive-latency", "needs --max-concurrency (the upper limit)",
                 given_text(given.adaptive_latency));
  }
  if (o.adaptive_admission && o.max_concurrency <= 0) {
    return needs("--adaptive-admission", "needs --max-concurrency (the upper limit)", "");
  }
  if (o.adaptive_admission && o.adaptive_latency) {
    return needs("--adaptive-admission",
                 "cannot be used with --adaptive-latency (one adaptive limit at a time)",
                 given_text(given.adaptive_latency));
  }
  if (o.admission_queue >= 0 && o.max_concurrency <= 0) {
    return needs("--admission-queue", "needs --max-concurrency (the queue is beyond it)",
                 std::to_string(o.admission_queue));
  }
  if (given.rate_limit_principals->count() > 0 && !o.rate_limit) {
    return needs("--rate-limit-principals", "needs --rate-limit (the buckets it bounds)",
                 std::to_string(o.rate_limit_principals));
  }
  if (o.chaos_503_retry_after && !(o.chaos_503 > 0)) {
    return needs("--chaos-503-retry-after", "needs --chaos-503 (the answers it is sent with)",
                 given_text(given.chaos_503_retry_after));
  }
  if (given.chaos_delay->count() > 0 && !(o.chaos_delay_fraction > 0)) {
    return needs("--chaos-delay", "needs --chaos-delay-fraction (the requests it delays)",
                 given_text(given.chaos_delay));
  }
  if (given.chaos_hang->count() > 0 && !(o.chaos_hang_fraction > 0)) {
    return needs("--chaos-hang", "needs --chaos-hang-fraction (the requests that hang)",
                 given_text(given.chaos_hang));
  }
  return 0;
}

}  // namespace

Runner add_serve(CLI::App& app) {
  auto o = std::make_shared<ServeOptions>();
  auto given = std::make_shared<Given>();
  CLI::App* sub = app.add_subcommand(
      "serve", "Run a small payments API with idempotency keys (POST /v1/charges)");
  add_store_flags(sub, *o, *given);
  add_limit_flags(sub, *o, *given);
  add_timeout_flags(sub, *o);
  add_chaos_flags(sub, *o, *given);
  return [o, given] {
    if (const int status = check_combinations(*o, *given); status != 0) return status;
    return serve_cli::run_serve(*o);
  };
}

}  // namespace keel::cli
