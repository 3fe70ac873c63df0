#include "keel/http/client.hpp"

#include <curl/curl.h>
#include <openssl/rand.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "keel/retry_after.hpp"

namespace keel::http {
namespace {

void global_init() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
      throw std::runtime_error("keel::http: curl_global_init failed");
    }
  });
}

// Milliseconds for libcurl: rounded up so that a positive budget never becomes 0 ("no limit").
long to_curl_ms(Duration d) noexcept {
  if (d >= kInfinite) return 0;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(d).count();
  if (ms < 1) return 1;
  if (ms > 0x7fffffffL) return 0x7fffffffL;
  return static_cast<long>(ms);
}

NetError net_error_of(CURLcode rc, long os_errno) noexcept {
  if (os_errno != 0) {
    if (auto e = net_error_from_errno(static_cast<int>(os_errno))) {
      // A timeout reported by libcurl is the attempt's own; keep errno's reading otherwise.
      if (rc != CURLE_OPERATION_TIMEDOUT) return *e;
    }
  }
  switch (rc) {
    case CURLE_COULDNT_CONNECT:
      return NetError::kConnectionRefused;
    case CURLE_OPERATION_TIMEDOUT:
      return NetError::kTimedOut;
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_RESOLVE_PROXY:
      return NetError::kDnsNotFound;
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
      return NetError::kConnectionReset;
    default:
      return NetError::kOther;
  }
}

struct Transfer {
  Response response;
  ResponseHeadParser head;
  const Request::BodySink* sink = nullptr;  // none: the body goes to response.body
  std::size_t max_body = 0;
  // Why the transfer was ended from a callback (the response could not be taken); else empty.
  std::string local_error;
};

size_t on_body(char* data, size_t size, size_t count, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const std::size_t n = size * count;
  if (t->sink != nullptr) {
    if (!t->sink->write(std::string_view(data, n))) {
      t->local_error = "the response body could not be written (body sink failed)";
      return 0;
    }
    return n;
  }
  if (n > t->max_body - std::min(t->response.body.size(), t->max_body)) {
    t->local_error = "the response body is larger than " + std::to_string(t->max_body) +
                     " bytes (max_response_bytes)";
    return 0;
  }
  t->response.body.append(data, n);
  return n;
}

size_t on_header(char* data, size_t size, size_t count, void* user) {
  auto* t = static_cast<Transfer*>(user);
  if (!t->head.feed(std::string_view(data, size * count), t->response)) {
    t->local_error = t->head.error();
    return 0;
  }
  return size * count;
}

// libcurl refuses a single header line of more than its own limit (100 KB) before the header
// callback sees it, and reports it as out of memory (7.x) or "too large" (8.x): once a status
// line has arrived, that is what such an error means.
bool is_oversized_header(CURLcode rc, const Response& response) noexcept {
  if (rc != CURLE_OUT_OF_MEMORY && static_cast<int>(rc) != 100 /* CURLE_TOO_LARGE */) return false;
  return !response.status_line.empty();
}

struct SlistDeleter {
  void operator()(curl_slist* l) const noexcept { curl_slist_free_all(l); }
};
using Slist = std::unique_ptr<curl_slist, SlistDeleter>;

void append(Slist& list, const std::string& line) {
  curl_slist* next = curl_slist_append(list.get(), line.c_str());
  if (next == nullptr) throw std::bad_alloc();
  (void)list.release();
  list.reset(next);
}

}  // namespace

std::optional<std::string> breaker_key(const std::string& url) {
  const std::optional<Url> u = parse_url(url);
  if (!u) return std::nullopt;
  return u->host + ":" + std::to_string(u->port);
}

std::string check_request(const Request& request, std::string* key) {
  std::string why;
  if (!parse_url(request.url, &why)) return "invalid URL: " + why;
  std::string found = request.idempotency_key;
  for (const auto& [name, value] : request.headers) {
    if (std::string problem = check_header_field(name, value); !problem.empty()) return problem;
    if (!same_header_name(name, "Idempotency-Key")) continue;
    if (!found.empty() && found != value) {
      return "two different idempotency keys ('" + found.substr(0, 64) + "' and '" +
             value.substr(0, 64) + "')";
    }
    found = value;
  }
  if (!found.empty() || !request.idempotency_key.empty()) {
    if (std::string problem = check_idempotency_key(found); !problem.empty()) return problem;
  }
  for (char c : request.method) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u >= 0x7f) return "invalid method '" + request.method.substr(0, 32) + "'";
  }
  *key = std::move(found);
  return {};
}

std::string make_idempotency_key() {
  std::array<unsigned char, 16> b{};
  if (RAND_bytes(b.data(), static_cast<int>(b.size())) != 1) {
    throw std::runtime_error("keel::http: the CSPRNG (RAND_bytes) could not supply bytes");
  }
  b[6] = static_cast<unsigned char>((b[6] & 0x0f) | 0x40);  // version 4
  b[8] = static_cast<unsigned char>((b[8] & 0x3f) | 0x80);  // RFC 4122 variant
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(36);
  for (std::size_t i = 0; i < b.size(); ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out.push_back('-');
    out.push_back(kHex[b[i] >> 4]);
    out.push_back(kHex[b[i] & 0x0f]);
  }
  return out;
}

struct Client::Impl {
  explicit Impl(ClientOptions o) : options(std::move(o)), policy(options.retry) {
    if (options.connect_timeout <= Duration::zero()) {
      throw std::invalid_argument("keel::http::ClientOptions: connect_timeout must be > 0, got " +
                                  std::to_string(options.connect_timeout.count()) + "ns");
    }
    if (options.max_header_bytes < 1) {
      throw std::invalid_argument(
          "keel::http::ClientOptions: max_header_bytes must be >= 1, got 0");
    }
    if (options.max_response_bytes < 1) {
      throw std::invalid_argument(
          "keel::http::ClientOptions: max_response_bytes must be >= 1, got 0");
    }
    if (options.max_idle_handles < 1) {
      throw std::invalid_argument("keel::http::ClientOptions: max_idle_handles must be >= 1, got " +
                                  std::to_string(options.max_idle_handles));
    }
    classifier.emplace(options.classifier);
    if (options.circuit_breakers && options.breakers == nullptr) {
      own_registry = std::make_unique<BreakerRegistry>(options.own_breakers);
    }
    registry = options.circuit_breakers
                   ? (options.breakers != nullptr ? options.breakers : own_registry.get())
                   : nullptr;
    if (options.retry_budget && options.budget == nullptr) {
      own_budget = std::make_unique<TokenBucketBudget>(options.own_budget);
    }
    budget = options.retry_budget ? (options.budget != nullptr ? options.budget : own_budget.get())
                                  : nullptr;
    global_init();
    share = curl_share_init();
    if (share == nullptr) throw std::runtime_error("keel::http: curl_share_init failed");
    curl_share_setopt(share, CURLSHOPT_LOCKFUNC, &Impl::lock);
    curl_share_setopt(share, CURLSHOPT_UNLOCKFUNC, &Impl::unlock);
    curl_share_setopt(share, CURLSHOPT_USERDATA, this);
    curl_share_setopt(share, CURLSHOPT_SHARE, CURL_LOCK_DATA_CONNECT);
    curl_share_setopt(share, CURLSHOPT_SHARE, CURL_LOCK_DATA_DNS);
    curl_share_setopt(share, CURLSHOPT_SHARE, CURL_LOCK_DATA_SSL_SESSION);
  }

  ~Impl() {
    for (CURL* h : idle) curl_easy_cleanup(h);
    idle.clear();
    curl_share_cleanup(share);
  }

  static void lock(CURL*, curl_lock_data data, curl_lock_access, void* user) {
    auto* self = static_cast<Impl*>(user);
    self->share_locks[static_cast<std::size_t>(data) % self->share_locks.size()].lock();
  }
  static void unlock(CURL*, curl_lock_data data, void* user) {
    auto* self = static_cast<Impl*>(user);
    self->share_locks[static_cast<std::size_t>(data) % self->share_locks.size()].unlock();
  }

  CURL* acquire() {
    {
      std::lock_guard<std::mutex> guard(idle_mutex);
      if (!idle.empty()) {
        CURL* h = idle.back();
        idle.pop_back();
        return h;
      }
    }
    CURL* h = curl_easy_init();
    if (h == nullptr) throw std::runtime_error("keel::http: curl_easy_init failed");
    return h;
  }

  void release(CURL* h) {
    {
      std::lock_guard<std::mutex> guard(idle_mutex);
      if (static_cast<int>(idle.size()) < options.max_idle_handles) {
        idle.push_back(h);
        return;
      }
    }
    curl_easy_cleanup(h);
  }

  struct AttemptResult {
    Outcome outcome;
    std::optional<Response> response;
    std::string error;
  };

  AttemptResult run_attempt(const Request& request, const RequestTraits& traits,
                            const std::string& key, const AttemptInfo& attempt, Clock& clock) {
    CURL* h = acquire();
    struct Lease {
      Impl* impl;
      CURL* h;
      ~Lease() { impl->release(h); }
    } lease{this, h};
    curl_easy_reset(h);

    Transfer transfer;
    transfer.head = ResponseHeadParser(options.max_header_bytes);
    transfer.max_body = options.max_response_bytes;
    if (request.body_sink.write) transfer.sink = &request.body_sink;
    char error_buffer[CURL_ERROR_SIZE] = {};
    Slist headers;
    bool has_user_agent = false;
    for (const auto& [name, value] : request.headers) {
      if (same_header_name(name, "User-Agent")) has_user_agent = true;
      if (same_header_name(name, "Idempotency-Key") || same_header_name(name, "Keel-Attempt")) {
        continue;
      }
      append(headers, value.empty() ? name + ";" : name + ": " + value);
    }
    append(headers, "Keel-Attempt: " + std::to_string(request.prior_attempts + attempt.number));
    if (!key.empty()) append(headers, "Idempotency-Key: " + key);
    append(headers, "Expect:");  // no 100-continue round trip

    curl_easy_setopt(h, CURLOPT_SHARE, share);
    curl_easy_setopt(h, CURLOPT_URL, request.url.c_str());
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, error_buffer);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers.get());
    if (!has_user_agent) curl_easy_setopt(h, CURLOPT_USERAGENT, options.user_agent.c_str());
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, &on_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &transfer);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, &on_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, &transfer);
    curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
    const Duration connect = std::min(options.connect_timeout, attempt.timeout);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, to_curl_ms(connect));
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, to_curl_ms(attempt.timeout));
    if (!traits.safe_to_repeat()) curl_easy_setopt(h, CURLOPT_FRESH_CONNECT, 1L);

    const std::string& m = request.method;
    const bool send_body = !request.body.empty() || m == "POST" || m == "PUT" || m == "PATCH";
    if (m == "HEAD") {
      curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    } else if (m == "GET" && !send_body) {
      curl_easy_setopt(h, CURLOPT_HTTPGET, 1L);
    } else {
      if (send_body) {
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, request.body.data());
        curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE,
                         static_cast<curl_off_t>(request.body.size()));
      }
      if (m != "POST") curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, m.c_str());
    }

    AttemptResult out;
    if (transfer.sink != nullptr && transfer.sink->restart && !transfer.sink->restart()) {
      out.outcome = Outcome::permanent();
      out.error = "the response body could not be written (body sink failed to restart)";
      return out;
    }
    const CURLcode rc = curl_easy_perform(h);
    if (!transfer.local_error.empty() || is_oversized_header(rc, transfer.response)) {
      // The response arrived but cannot be taken: a local limit or the caller's sink, which a
      // retry would meet again. Nothing of it is kept.
      out.outcome = Outcome::permanent();
      out.error = !transfer.local_error.empty()
                      ? transfer.local_error
                      : "a response header line is larger than libcurl accepts (100 KB; "
                        "max_header_bytes is " +
                            std::to_string(options.max_header_bytes) + ")";
      return out;
    }
    if (rc == CURLE_OK) {
      long status = 0;
      curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
      transfer.response.status = static_cast<int>(status);
      std::optional<Duration> retry_after;
      if (auto value = find_header(transfer.response.headers, "Retry-After")) {
        retry_after = parse_retry_after(*value, clock.wall_now());
      }
      out.outcome = classifier->classify(transfer.response.status, transfer.response.body, traits,
                                         retry_after);
      out.response = std::move(transfer.response);
      return out;
    }
    long request_size = 0;
    curl_easy_getinfo(h, CURLINFO_REQUEST_SIZE, &request_size);
    long os_errno = 0;
    curl_easy_getinfo(h, CURLINFO_OS_ERRNO, &os_errno);
    const bool sent = request_size > 0;
    out.outcome = classify_network(net_error_of(rc, os_errno), sent);
    if (rc == CURLE_OPERATION_TIMEDOUT) out.outcome.timed_out = true;
    out.error = error_buffer[0] != '\0' ? std::string(error_buffer) : curl_easy_strerror(rc);
    return out;
  }

  ClientOptions options;
  RetryPolicy policy;
  std::unique_ptr<BreakerRegistry> own_registry;
  BreakerRegistry* registry = nullptr;  // none when breakers are off
  std::unique_ptr<TokenBucketBudget> own_budget;
  RetryBudget* budget = nullptr;  // none when the budget is off
  std::optional<HttpClassifier> classifier;
  CURLSH* share = nullptr;
  std::array<std::mutex, CURL_LOCK_DATA_LAST> share_locks;  // one per shared kind
  std::mutex idle_mutex;
  std::vector<CURL*> idle;  // GUARDED_BY(idle_mutex)
};

Client::Client(ClientOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
Client::~Client() = default;

const ClientOptions& Client::options() const noexcept { return impl_->options; }

Result Client::send(const Request& request) {
  if (request.url.empty()) throw std::invalid_argument("keel::http::Request: url is empty");
  if (request.method.empty()) throw std::invalid_argument("keel::http::Request: method is empty");
  Impl& impl = *impl_;
  Clock& clock = impl.options.clock != nullptr ? *impl.options.clock : steady_clock();

  Result result;
  if (std::string why = check_request(request, &result.idempotency_key); !why.empty()) {
    // Refused before any attempt: nothing was sent, and sending it again would not help.
    result.outcome = Outcome::permanent();
    result.reason = StopReason::kPermanent;
    result.error = std::move(why);
    return result;
  }
  const Method method = parse_method(request.method);
  if (result.idempotency_key.empty() && request.generate_idempotency_key &&
      (method == Method::kPost || method == Method::kPatch)) {
    result.idempotency_key = make_idempotency_key();  // once, before the first attempt
  }
  const RequestTraits traits{method, !result.idempotency_key.empty()};

  CallOptions call;
  call.clock = &clock;
  call.deadline = request.deadline;
  call.safe_to_repeat = traits.safe_to_repeat();
  call.budget = impl.budget;
  call.prior_attempts = request.prior_attempts;
  std::shared_ptr<CircuitBreaker> breaker;  // held for the whole operation
  if (impl.registry != nullptr) {
    if (auto key = breaker_key(request.url)) {
      breaker = impl.registry->get(*key);
      call.breaker = breaker.get();
    }
  }
  RetryState state(impl.policy, call);
  RetryScope scope;  // a keel operation started from a hook is one layer down

  for (AttemptStart start = state.start_attempt(); start.proceed; start = state.start_attempt()) {
    const TimePoint began = clock.now();
    Impl::AttemptResult attempt =
        impl.run_attempt(request, traits, result.idempotency_key, start.attempt, clock);
    const Duration took = clock.now() - began;
    const Decision decision = state.next(attempt.outcome);
    result.outcome = attempt.outcome;
    result.response = std::move(attempt.response);
    result.error = std::move(attempt.error);
    if (impl.options.on_attempt) {
      AttemptEvent event;
      event.method = request.method;
      event.url = request.url;
      event.attempt = start.attempt.number;
      event.outcome = attempt.outcome;
      event.error = result.error;
      event.took = took;
      event.will_retry = decision.retry;
      event.delay = decision.retry ? decision.delay : Duration::zero();
      event.reason = decision.reason;
      impl.options.on_attempt(event);
    }
    if (!decision.retry) break;
    clock.sleep_for(decision.delay);
  }
  result.attempts = state.attempts();
  if (result.attempts == 0) result.outcome = state.last_outcome();  // kNotAttempted
  result.elapsed = state.elapsed();
  result.reason = state.stop_reason();
  if (result.reason != StopReason::kSuccess) {
    GiveUpEvent event;
    event.attempts = result.attempts;
    event.elapsed = result.elapsed;
    event.reason = result.reason;
    event.last = result.outcome;
    const std::string line = format_give_up(event, request.method + " " + request.url);
    if (impl.options.log) {
      impl.options.log(line);
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
  }
  return result;
}

}  // namespace keel::http
