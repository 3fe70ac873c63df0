#include "keel/asio/http_client.hpp"

#include <curl/curl.h>

#include <algorithm>
#include <array>
#include <asio/use_awaitable.hpp>
#include <cstdio>
#include <new>
#include <stdexcept>
#include <string_view>
#include <vector>

#include "curl_multi.hpp"
#include "keel/asio/retry.hpp"
#include "keel/duration.hpp"
#include "keel/retry_after.hpp"

namespace keel::asio {
namespace {

long to_curl_ms(Duration d) noexcept {
  if (d >= kInfinite) return 0;  // libcurl: 0 means no timeout
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(d).count();
  return static_cast<long>(std::clamp<std::int64_t>(ms, 1, 0x7fffffff));
}

NetError net_error_of(CURLcode rc, long os_errno) noexcept {
  if (os_errno != 0 && rc != CURLE_OPERATION_TIMEDOUT) {
    if (auto e = net_error_from_errno(static_cast<int>(os_errno))) return *e;
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

struct EasyDeleter {
  void operator()(CURL* h) const noexcept { curl_easy_cleanup(h); }
};
using Easy = std::unique_ptr<CURL, EasyDeleter>;

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

// What libcurl writes into during one attempt.
struct Sink {
  HttpResponse response;
  http::ResponseHeadParser head;
  const HttpRequest::BodySink* body_sink = nullptr;  // none: the body goes to response.body
  std::size_t max_body = 0;
  // Why the transfer was ended from a callback (the response could not be taken); else empty.
  std::string local_error;
};

size_t on_body(char* data, size_t size, size_t count, void* user) {
  auto* sink = static_cast<Sink*>(user);
  const std::size_t n = size * count;
  if (sink->body_sink != nullptr) {
    if (!sink->body_sink->write(std::string_view(data, n))) {
      sink->local_error = "the response body could not be written (body sink failed)";
      return 0;
    }
    return n;
  }
  if (n > sink->max_body - std::min(sink->response.body.size(), sink->max_body)) {
    sink->local_error = "the response body is larger than " + std::to_string(sink->max_body) +
                        " bytes (max_response_bytes)";
    return 0;
  }
  sink->response.body.append(data, n);
  return n;
}

size_t on_header(char* data, size_t size, size_t count, void* user) {
  auto* sink = static_cast<Sink*>(user);
  if (!sink->head.feed(std::string_view(data, size * count), sink->response)) {
    sink->local_error = sink->head.error();
    return 0;
  }
  return size * count;
}

// libcurl refuses a single header line of more than its own limit (100 KB) before the header
// callback sees it, and reports it as out of memory (7.x) or "too large" (8.x): once a status
// line has arrived, that is what such an error means.
bool is_oversized_header(CURLcode rc, const HttpResponse& response) noexcept {
  if (rc != CURLE_OUT_OF_MEMORY && static_cast<int>(rc) != 100 /* CURLE_TOO_LARGE */) return false;
  return !response.status_line.empty();
}

struct AttemptResult {
  Outcome outcome;
  std::optional<HttpResponse> response;
  std::string error;
};

// libcurl's transfer timeout fires first; the race in keel::asio::retry is only a backstop.
constexpr Duration kTimeoutGrace = std::chrono::milliseconds(250);

}  // namespace

struct HttpClient::Impl {
  Impl(::asio::any_io_executor ex, HttpClientOptions opts)
      : executor(std::move(ex)),
        options(std::move(opts)),
        policy(options.retry),
        classifier(options.classifier) {
    if (options.connect_timeout <= Duration::zero()) {
      throw std::invalid_argument(
          "keel::asio::HttpClientOptions: connect_timeout must be > 0 (got " +
          format_duration(options.connect_timeout) + ")");
    }
    if (options.max_header_bytes < 1) {
      throw std::invalid_argument(
          "keel::asio::HttpClientOptions: max_header_bytes must be >= 1 (got 0)");
    }
    if (options.max_response_bytes < 1) {
      throw std::invalid_argument(
          "keel::asio::HttpClientOptions: max_response_bytes must be >= 1 (got 0)");
    }
    if (options.max_host_connections < 0) {
      throw std::invalid_argument(
          "keel::asio::HttpClientOptions: max_host_connections must be >= 0 (got " +
          std::to_string(options.max_host_connections) + ")");
    }
    if (options.max_transfers < 0) {
      throw std::invalid_argument(
          "keel::asio::HttpClientOptions: max_transfers must be >= 0 (got " +
          std::to_string(options.max_transfers) + ")");
    }
    if (options.circuit_breakers && options.breakers == nullptr) {
      own_breakers = std::make_unique<BreakerRegistry>(options.own_breakers);
    }
    if (options.retry_budget && options.budget == nullptr) {
      own_budget = std::make_unique<TokenBucketBudget>(options.own_budget);
    }
    multi = detail::CurlMulti::create(executor, options.max_host_connections,
                                      static_cast<std::size_t>(options.max_transfers));
  }

  ::asio::awaitable<AttemptResult> attempt(const HttpRequest& request, const RequestTraits& traits,
                                           const std::string& key, const AttemptInfo& info,
                                           Clock& clock) {
    // An easy handle from the idle list (reset), returned to it when the attempt ends.
    struct Lease {
      Impl* impl;
      Easy easy;
      ~Lease() {
        if (easy && impl->idle.size() < kMaxIdleHandles) impl->idle.push_back(std::move(easy));
      }
    } lease{this, acquire()};
    CURL* h = lease.easy.get();
    Sink sink;
    sink.head = http::ResponseHeadParser(options.max_header_bytes);
    sink.max_body = options.max_response_bytes;
    if (request.body_sink.write) sink.body_sink = &request.body_sink;
    char error_buffer[CURL_ERROR_SIZE] = {};
    Slist headers;
    bool has_user_agent = false;
    for (const auto& [name, value] : request.headers) {
      if (http::same_header_name(name, "User-Agent")) has_user_agent = true;
      if (http::same_header_name(name, "Idempotency-Key") ||
          http::same_header_name(name, "Keel-Attempt")) {
        continue;
      }
      append(headers, value.empty() ? name + ";" : name + ": " + value);
    }
    append(headers, "Keel-Attempt: " + std::to_string(request.prior_attempts + info.number));
    if (!key.empty()) append(headers, "Idempotency-Key: " + key);
    append(headers, "Expect:");  // no 100-continue round trip

    curl_easy_setopt(h, CURLOPT_URL, request.url.c_str());
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, error_buffer);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers.get());
    if (!has_user_agent) curl_easy_setopt(h, CURLOPT_USERAGENT, options.user_agent.c_str());
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, &on_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &sink);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, &on_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, &sink);
    curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
    const Duration connect = std::min(options.connect_timeout, info.timeout);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, to_curl_ms(connect));
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, to_curl_ms(info.timeout));
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
    if (sink.body_sink != nullptr && sink.body_sink->restart && !sink.body_sink->restart()) {
      out.outcome = Outcome::permanent();
      out.error = "the response body could not be written (body sink failed to restart)";
      co_return out;
    }
    const CURLcode rc = co_await detail::async_perform(multi, h, ::asio::use_awaitable);
    if (!sink.local_error.empty() || is_oversized_header(rc, sink.response)) {
      // The response arrived but cannot be taken: a local limit or the caller's sink, which a
      // retry would meet again. Nothing of it is kept.
      out.outcome = Outcome::permanent();
      out.error = !sink.local_error.empty()
                      ? sink.local_error
                      : "a response header line is larger than libcurl accepts (100 KB; "
                        "max_header_bytes is " +
                            std::to_string(options.max_header_bytes) + ")";
      co_return out;
    }
    if (rc == CURLE_ABORTED_BY_CALLBACK) {
      // Cancelled by keel (the backstop timeout) or by the caller; the retry loop knows which.
      out.outcome = attempt_timeout_outcome();
      out.error = "cancelled";
      co_return out;
    }
    if (rc == CURLE_OK) {
      long status = 0;
      curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
      sink.response.status = static_cast<int>(status);
      std::optional<Duration> retry_after;
      if (auto value = find_header(sink.response.headers, "Retry-After")) {
        retry_after = parse_retry_after(*value, clock.wall_now());
      }
      out.outcome =
          classifier.classify(sink.response.status, sink.response.body, traits, retry_after);
      out.response = std::move(sink.response);
      co_return out;
    }
    long request_size = 0;
    curl_easy_getinfo(h, CURLINFO_REQUEST_SIZE, &request_size);
    long os_errno = 0;
    curl_easy_getinfo(h, CURLINFO_OS_ERRNO, &os_errno);
    out.outcome = classify_network(net_error_of(rc, os_errno), request_size > 0);
    if (rc == CURLE_OPERATION_TIMEDOUT) out.outcome.timed_out = true;
    out.error = error_buffer[0] != '\0' ? std::string(error_buffer) : curl_easy_strerror(rc);
    co_return out;
  }

  ::asio::any_io_executor executor;
  HttpClientOptions options;
  RetryPolicy policy;
  HttpClassifier classifier;
  // The engine's per-call inputs for one operation; `breaker` receives the host's breaker
  // (kept alive by the caller for the operation).
  [[nodiscard]] CallOptions call_options(const HttpRequest& request, const RequestTraits& traits,
                                         Clock& clock, RetryContext* context,
                                         std::shared_ptr<CircuitBreaker>& breaker) const {
    CallOptions call;
    call.clock = &clock;
    call.deadline = request.deadline;
    call.safe_to_repeat = traits.safe_to_repeat();
    call.rng = options.rng;
    call.budget = budget();
    call.prior_attempts = request.prior_attempts;
    call.context = context;
    BreakerRegistry* registry = breakers();
    if (registry != nullptr) {
      const std::optional<std::string> key = breaker_key(request.url);
      if (key.has_value()) breaker = registry->get(*key);
    }
    call.breaker = breaker.get();
    return call;
  }

  Easy acquire() {
    if (!idle.empty()) {
      Easy easy = std::move(idle.back());
      idle.pop_back();
      curl_easy_reset(easy.get());
      return easy;
    }
    Easy easy(curl_easy_init());
    if (!easy) throw std::runtime_error("keel::asio: curl_easy_init failed");
    return easy;
  }

  static constexpr std::size_t kMaxIdleHandles = 64;
  std::vector<Easy> idle;  // handles of finished attempts, kept for reuse (executor-only)
  std::unique_ptr<BreakerRegistry> own_breakers;
  std::unique_ptr<TokenBucketBudget> own_budget;
  std::shared_ptr<detail::CurlMulti> multi;

  [[nodiscard]] BreakerRegistry* breakers() const noexcept {
    if (!options.circuit_breakers) return nullptr;
    return options.breakers != nullptr ? options.breakers : own_breakers.get();
  }
  [[nodiscard]] RetryBudget* budget() const noexcept {
    if (!options.retry_budget) return nullptr;
    return options.budget != nullptr ? options.budget : own_budget.get();
  }
};

HttpClient::HttpClient(::asio::any_io_executor executor, HttpClientOptions options)
    : impl_(std::make_shared<Impl>(std::move(executor), std::move(options))) {}

HttpClient::~HttpClient() = default;

const HttpClientOptions& HttpClient::options() const noexcept { return impl_->options; }

std::size_t HttpClient::transfers_in_flight() const noexcept { return impl_->multi->in_flight(); }

::asio::awaitable<HttpResult> HttpClient::send(HttpRequest request, RetryContext* context) {
  if (request.url.empty()) throw std::invalid_argument("keel::asio::HttpRequest: url is empty");
  if (request.method.empty()) {
    throw std::invalid_argument("keel::asio::HttpRequest: method is empty");
  }
  std::shared_ptr<Impl> impl = impl_;
  Clock& clock = impl->options.clock != nullptr ? *impl->options.clock : steady_clock();

  HttpResult result;
  if (std::string why = http::check_request(request, &result.idempotency_key); !why.empty()) {
    // Refused before any attempt: nothing was sent, and sending it again would not help.
    result.outcome = Outcome::permanent();
    result.reason = StopReason::kPermanent;
    result.error = std::move(why);
    co_return result;
  }
  const Method method = parse_method(request.method);
  if (result.idempotency_key.empty() && request.generate_idempotency_key &&
      (method == Method::kPost || method == Method::kPatch)) {
    result.idempotency_key = make_idempotency_key();  // once, before the first attempt
  }
  const RequestTraits traits{method, !result.idempotency_key.empty()};

  // Set up outside the coroutine body proper: plain code, no declarations in conditions.
  std::shared_ptr<CircuitBreaker> breaker;  // held for the whole operation
  const CallOptions call = impl->call_options(request, traits, clock, context, breaker);

  // The last attempt's details, kept by the op for the result and the on_attempt hook.
  std::string last_error;
  auto op = [&](const AttemptInfo& info) -> ::asio::awaitable<AttemptResult> {
    last_error.clear();
    AttemptResult a = co_await impl->attempt(request, traits, result.idempotency_key, info, clock);
    last_error = a.error;
    co_return a;
  };
  auto classify = [](const AttemptResult& a) { return a.outcome; };
  auto observer = [&](const AttemptInfo& info, const Outcome& outcome, const Decision& decision,
                      Duration took) {
    if (!impl->options.on_attempt) return;
    HttpAttemptEvent event;
    event.method = request.method;
    event.url = request.url;
    event.attempt = info.number;
    event.outcome = outcome;
    event.error = last_error;
    event.took = took;
    event.will_retry = decision.retry;
    event.delay = decision.retry ? decision.delay : Duration::zero();
    event.reason = decision.reason;
    impl->options.on_attempt(event);
  };

  RetryResult<AttemptResult> r = co_await detail::retry_loop<AttemptResult>(
      impl->executor, impl->policy, op, classify, call, observer, kTimeoutGrace);

  if (r.value) {
    result.response = std::move(r.value->response);
    result.error = std::move(r.value->error);
  }
  result.outcome = r.outcome;
  result.reason = r.reason;
  result.attempts = r.attempts;
  result.elapsed = r.elapsed;
  if (result.reason == StopReason::kCancelled) result.error = "cancelled";
  if (result.reason != StopReason::kSuccess) {
    GiveUpEvent event;
    event.attempts = result.attempts;
    event.elapsed = result.elapsed;
    event.reason = result.reason;
    event.last = result.outcome;
    const std::string line = format_give_up(event, request.method + " " + request.url);
    if (impl->options.log) {
      impl->options.log(line);
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
  }
  co_return result;
}

}  // namespace keel::asio
