#include "keel/http/detail/attempt.hpp"

#include <curl/curl.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "keel/core/backoff.hpp"
#include "keel/core/deadline_header.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"
#include "keel/core/retry_after.hpp"
#include "keel/http/url.hpp"

namespace keel::http::detail {
namespace {

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
                     " bytes (limits.max_response_bytes)";
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

template <typename Slist>
void append(Slist& list, const std::string& line) {
  curl_slist* next = curl_slist_append(list.get(), line.c_str());
  if (next == nullptr) throw std::bad_alloc();
  (void)list.release();
  list.reset(next);
}

// breaker_key(url), remembered for the last URL this thread asked about: a client sends most
// requests to a handful of URLs, and the key is a pure function of the URL, so the parse it
// costs is made once per URL and thread rather than once or twice per operation.
const std::optional<std::string>& cached_breaker_key(const std::string& url) {
  thread_local std::string last_url;
  thread_local std::optional<std::string> last_key;
  thread_local bool valid = false;
  if (!valid || url != last_url) {
    last_key = breaker_key(url);
    last_url = url;
    valid = true;
  }
  return last_key;
}

[[noreturn]] void reject(std::string_view type, std::string_view field,
                         std::string_view requirement, const std::string& got) {
  throw_invalid({.context = std::string(type),
                 .field = std::string(field),
                 .problem = "must be " + std::string(requirement),
                 .got = got});
}

}  // namespace

void global_init() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
      throw std::runtime_error("keel::http: curl_global_init failed");
    }
  });
}

long to_curl_ms(Duration d) noexcept {
  if (d >= kInfinite) return 0;  // libcurl: 0 means no timeout
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(d).count();
  return static_cast<long>(std::clamp<std::int64_t>(ms, 1, 0x7fffffff));
}

NetError net_error_of(CURLcode rc, long os_errno) noexcept {
  // A timeout reported by libcurl is the attempt's own; keep errno's reading otherwise.
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
    case CURLE_URL_MALFORMAT:         // a URL (or a host name in it) libcurl cannot parse
    case CURLE_UNSUPPORTED_PROTOCOL:  // a scheme this libcurl was not built with
    case CURLE_NOT_BUILT_IN:          // a feature the URL needs (IDN, say)
      return NetError::kUnusableUrl;
    default:
      return NetError::kOther;
  }
}

void check_options(const ClientOptions& options, std::string_view type) {
  if (options.transport.connect_timeout <= Duration::zero()) {
    reject(type, "transport.connect_timeout", "> 0",
           format_duration(options.transport.connect_timeout));
  }
  if (options.limits.max_header_bytes < 1) reject(type, "limits.max_header_bytes", ">= 1", "0");
  if (options.limits.max_response_bytes < 1) reject(type, "limits.max_response_bytes", ">= 1", "0");
  if (options.brakes.max_limit_wait < Duration::zero()) {
    reject(type, "brakes.max_limit_wait", ">= 0", format_duration(options.brakes.max_limit_wait));
  }
}

OperationGuards::OperationGuards(const ClientOptions& options) {
  if (options.brakes.adaptive_timeouts) {
    if (options.brakes.timeouts == nullptr) {
      own_timeouts_ = std::make_unique<AdaptiveTimeoutRegistry>(options.brakes.own_timeouts);
    }
    timeouts_ = options.brakes.timeouts != nullptr ? options.brakes.timeouts : own_timeouts_.get();
  }
  if (options.brakes.circuit_breakers) {
    if (options.brakes.breakers == nullptr) {
      own_breakers_ = std::make_unique<BreakerRegistry>(options.brakes.own_breakers);
    }
    breakers_ = options.brakes.breakers != nullptr ? options.brakes.breakers : own_breakers_.get();
  }
  rate_limits_ = options.brakes.rate_limits;
  if (options.brakes.adaptive_concurrency) {
    if (options.brakes.concurrency_limits == nullptr) {
      own_concurrency_ = std::make_unique<ConcurrencyLimitRegistry>(options.brakes.own_concurrency);
    }
    concurrency_ = options.brakes.concurrency_limits != nullptr ? options.brakes.concurrency_limits
                                                                : own_concurrency_.get();
  }
  if (options.brakes.retry_budget) {
    if (options.brakes.budget == nullptr) {
      own_budget_ = std::make_unique<TokenBucketBudget>(options.brakes.own_budget);
    }
    budget_ = options.brakes.budget != nullptr ? options.brakes.budget : own_budget_.get();
  }
}

CallOptions OperationGuards::call_options(const Request& request, const RequestTraits& traits,
                                          Clock& clock,
                                          std::shared_ptr<CircuitBreaker>& breaker) const {
  CallOptions call;
  call.clock = &clock;
  call.deadline = request.deadline;
  call.ceiling = request.ceiling;
  call.safe_to_repeat = traits.safe_to_repeat();
  call.budget = budget_;
  call.prior_attempts = request.prior_attempts;
  if (breakers_ != nullptr) {
    const std::optional<std::string>& key = cached_breaker_key(request.url);
    if (key.has_value()) breaker = breakers_->get(*key);
  }
  call.breaker = breaker.get();
  return call;
}

std::shared_ptr<RateLimit> OperationGuards::rate_limit(const Request& request) const {
  if (rate_limits_ == nullptr) return nullptr;
  const std::optional<std::string>& key = cached_breaker_key(request.url);
  return key.has_value() ? rate_limits_->get(*key) : nullptr;
}

std::shared_ptr<AdaptiveConcurrencyLimit> OperationGuards::concurrency_limit(
    const Request& request) const {
  if (concurrency_ == nullptr) return nullptr;
  const std::optional<std::string>& key = cached_breaker_key(request.url);
  return key.has_value() ? concurrency_->get(*key) : nullptr;
}

std::optional<Duration> LimitGate::pass(Clock& clock, const Deadline& deadline) {
  Rng& rng = thread_rng();
  // The wait counted is the time spent here, not the sleeps asked for: a timer that wakes late
  // and a fleet lease's round trip (inside reserve) spend max_limit_wait too.
  const TimePoint entered = clock.now();
  const Duration before = waited_;
  // What is left of the wait at this moment: counted, and cut to the deadline.
  const auto left_now = [&] {
    const TimePoint now = clock.now();
    waited_ = before + (now - entered);
    const Duration left = std::max(max_wait_ - waited_, Duration::zero());
    return deadline.is_infinite() ? left : std::min(left, deadline.remaining(now));
  };
  const auto wait = [&](Duration d) {
    // wait: core: a rate limit's slot or a concurrency limit's hold, from core's limiters
    clock.sleep_for(d);
  };
  for (;;) {
    const TimePoint now = clock.now();
    const Duration left = left_now();
    if (rate_ && !slot_) {
      const RateDecision d = rate_->reserve(now, left, rng);
      if (!d.go) {
        permit_.ignore();  // a permit kept from a late slot is not held through a refusal
        if (d.wait > left_now()) {
          in_line_ = waits_in_line(d, max_wait_);
          return d.wait;
        }
        wait(d.wait);  // paused (its end plus jitter), or a slot came within the wait
        continue;
      }
      // The slot comes d.wait after `now`: reserve may have spent some of it on the fleet.
      if (const Duration until = now + d.wait - clock.now(); until > Duration::zero()) {
        wait(until);
        // A pause that began while this call waited for its slot holds it too.
        if (rate_->paused_until() > clock.now()) continue;
      }
      slot_ = d;
    }
    if (concurrency_ && !permit_) {
      permit_ = concurrency_->try_acquire();
      if (!permit_) {
        // About one call's time, jittered, so that the waiters do not come back together.
        const Duration d = jittered(concurrency_->retry_in(), rng);
        if (d > left_now()) return d;
        wait(d);
        continue;
      }
    }
    // Core's rule for a slot whose call would leave late (its thread woke late, or it waited
    // for the permit): the slot is given up and another asked for. A permit it waited for is
    // kept, so that a wait for a permit costs at most one slot.
    if (slot_ && !rate_->on_time(*slot_, clock.now())) {
      slot_.reset();
      continue;
    }
    slot_.reset();
    (void)left_now();  // counts the wait up to now
    return std::nullopt;
  }
}

Outcome LimitGate::finish(const Outcome& outcome, Duration took, TimePoint now) {
  paused_ = false;
  const bool overload = outcome.kind == OutcomeKind::kThrottled &&
                        outcome.source == OutcomeSource::kHttp &&
                        (outcome.code == 429 || outcome.code == 503);
  if (permit_) {
    if (outcome.timed_out || overload) {
      permit_.drop(now);
    } else if (outcome.attempted()) {
      permit_.release(took, now);
    } else {
      permit_.ignore();
    }
  }
  // A 429 or 503 whose Retry-After pauses the host is the host's limit, not this call's
  // failure (core's rule: pause_asked; an advice of 0 or none is charged as throttled).
  if (const std::optional<Duration> pause = overload ? pause_asked(outcome) : std::nullopt;
      rate_ && pause) {
    (void)rate_->pause(now, *pause);
    paused_ = true;
    return Outcome::not_attempted(std::min(*pause, rate_->options().max_pause));
  }
  return outcome;
}

std::shared_ptr<AdaptiveTimeout> OperationGuards::adaptive_timeout(const Request& request) const {
  if (timeouts_ == nullptr) return nullptr;
  const std::optional<std::string>& key = cached_breaker_key(request.url);
  return key.has_value() ? timeouts_->get(*key) : nullptr;
}

AttemptInfo adapt_attempt(const AttemptInfo& info, const AdaptiveTimeout* timeout,
                          TimePoint now) noexcept {
  AttemptInfo out = info;
  if (timeout != nullptr) out.timeout = timeout->attempt_timeout(info.timeout, now);
  return out;
}

void record_latency(AdaptiveTimeout* timeout, const AttemptResult& attempt, Duration took,
                    TimePoint now) noexcept {
  if (timeout == nullptr) return;
  if (attempt.response.has_value()) {
    timeout->record(took, now);
  } else if (attempt.outcome.timed_out) {
    timeout->record_timeout(took, now);
  }
}

void apply_duplicate_success(const DuplicateSuccessRule* rule, const Outcome& previous,
                             AttemptResult& attempt) {
  if (rule == nullptr || !attempt.response.has_value()) return;
  attempt.outcome = rule->apply(previous, attempt.outcome, attempt.response->body);
}

std::optional<Request> duplicate_lookup(const ClientOptions& options, const Request& sent,
                                        const Result& result) {
  if (!options.classify.duplicate_lookup || !result.ok() || !result.outcome.duplicate)
    return std::nullopt;
  if (!result.response.has_value()) return std::nullopt;
  return options.classify.duplicate_lookup(sent, *result.response);
}

void adopt_lookup(Result& result, Result found) {
  found.attempts += result.attempts;
  found.elapsed += result.elapsed;
  found.idempotency_key = std::move(result.idempotency_key);
  if (found.ok()) found.outcome.duplicate = true;
  result = std::move(found);
}

std::optional<RequestTraits> begin_operation(const Request& request, Result& result,
                                             std::string_view request_type) {
  if (request.url.empty()) {
    throw_invalid(
        {.context = std::string(request_type), .field = "url", .problem = "must not be empty"});
  }
  if (request.method.empty()) {
    throw_invalid(
        {.context = std::string(request_type), .field = "method", .problem = "must not be empty"});
  }
  auto checked = check_request(request);
  if (!checked) {
    // Refused before any attempt: nothing was sent, and sending it again would not help.
    result.outcome = Outcome::permanent();
    result.reason = StopReason::kPermanent;
    result.error = checked.error().message();
    return std::nullopt;
  }
  result.idempotency_key = std::move(*checked);
  const Method method = parse_method(request.method);
  if (result.idempotency_key.empty() && request.generate_idempotency_key &&
      (method == Method::kPost || method == Method::kPatch)) {
    result.idempotency_key = make_idempotency_key();  // once, before the first attempt
  }
  return RequestTraits{method, !result.idempotency_key.empty()};
}

void report_attempt(const ClientOptions& options, const Request& request, int attempt,
                    const Outcome& outcome, std::string_view error, Duration took,
                    const Decision& decision) {
  if (!options.observability.on_attempt) return;
  AttemptEvent event;
  event.method = request.method;
  event.url = request.url;
  event.attempt = attempt;
  event.outcome = outcome;
  event.error = error;
  event.took = took;
  event.will_retry = decision.retry;
  event.delay = decision.retry ? decision.delay : Duration::zero();
  event.reason = decision.reason;
  options.observability.on_attempt(event);
}

void log_give_up(const ClientOptions& options, const Request& request, const Result& result) {
  if (result.reason == StopReason::kSuccess) return;
  GiveUpEvent event;
  event.attempts = result.attempts;
  event.elapsed = result.elapsed;
  event.reason = result.reason;
  event.last = result.outcome;
  const std::string line = format_give_up(event, request.method + " " + request.url);
  if (options.observability.log) {
    options.observability.log(line);
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
}

Duration hedge_delay(const HedgePolicy& policy, const AdaptiveTimeout* timeout,
                     TimePoint now) noexcept {
  return policy.delay(timeout != nullptr ? &timeout->tracker() : nullptr, now);
}

HedgeVerdict finish_hedged_attempt(HedgeState& hedge, RetryState& retry, const HedgedAttempt& done,
                                   AttemptResult attempt, const ClientOptions& options,
                                   const Request& request, const DuplicateSuccessRule* duplicate,
                                   AdaptiveTimeout* timeout, Result& result) {
  const OutcomeKind kind = attempt.outcome.kind;
  const bool ends =
      hedge.in_flight() == 1 || kind == OutcomeKind::kSuccess || kind == OutcomeKind::kPermanent;
  const Request::BodySink& sink = request.body_sink;
  const bool to_sink = ends && attempt.response.has_value() && sink.write;
  if (to_sink && !((!sink.restart || sink.restart()) && sink.write(attempt.response->body))) {
    attempt.outcome = Outcome::permanent();
    attempt.error = "the response body could not be written (body sink failed)";
    attempt.response.reset();
  }
  apply_duplicate_success(duplicate, retry.last_outcome(), attempt);
  record_latency(timeout, attempt, done.took, done.ended);
  if (to_sink && attempt.response.has_value()) attempt.response->body.clear();  // in the sink
  const HedgeVerdict verdict = hedge.finish(done.index, attempt.outcome);
  Decision goes_on;
  goes_on.retry = true;
  report_attempt(options, request, done.number, attempt.outcome, attempt.error, done.took,
                 verdict.done ? verdict.decision : goes_on);
  if (verdict.done) {
    result.outcome = attempt.outcome;
    result.response = std::move(attempt.response);
    result.error = std::move(attempt.error);
  }
  return verdict;
}

CurlAttempt::CurlAttempt(CURL* easy, const Request& request, const RequestTraits& traits,
                         const std::string& key, const AttemptInfo& info,
                         const ClientOptions& options)
    : easy_(easy), traits_(traits), max_header_bytes_(options.limits.max_header_bytes) {
  transfer_.head = ResponseHeadParser(options.limits.max_header_bytes);
  transfer_.max_body = options.limits.max_response_bytes;
  transfer_.response.headers.reserve(8);  // a typical response's fields, without regrowing
  if (request.body_sink.write) transfer_.sink = &request.body_sink;
  const std::string& m = request.method;
  const bool send_body = !request.body.empty() || m == "POST" || m == "PUT" || m == "PATCH";
  bool has_user_agent = false;
  std::string line;  // each header line in turn (curl_slist_append copies it)
  line.reserve(64);
  for (const auto& [name, value] : request.headers) {
    if (same_header_name(name, "User-Agent")) has_user_agent = true;
    if (same_header_name(name, "Idempotency-Key") || same_header_name(name, "Keel-Attempt") ||
        same_header_name(name, kDeadlineHeader)) {
      continue;
    }
    line.assign(name);
    line += value.empty() ? ";" : ": ";
    line += value;
    append(headers_, line);
  }
  line.assign("Keel-Attempt: ");
  line += std::to_string(request.prior_attempts + info.number);
  append(headers_, line);
  if (!key.empty()) {
    line.assign("Idempotency-Key: ");
    line += key;
    append(headers_, line);
  }
  if (options.transport.propagate_deadline && !info.deadline.is_infinite()) {
    // What is left now, as the transfer is set up: the receiver's budget, never more than ours.
    Clock& clock = options.clock != nullptr ? *options.clock : steady_clock();
    line.assign(kDeadlineHeader);
    line += ": ";
    line += format_deadline_header(info.deadline.remaining(clock.now()));
    append(headers_, line);
  }
  // No 100-continue round trip. libcurl only adds "Expect: 100-continue" to a request with a
  // body, so a request without one needs no header to suppress it.
  if (send_body) append(headers_, "Expect:");

  CURL* h = easy_;
  // An internationalised host goes out in its ASCII form (parse_url converts it: libcurl's own
  // conversion depends on the process's locale); libcurl copies the string.
  std::string converted;
  if (std::any_of(request.url.begin(), request.url.end(),
                  [](char c) { return static_cast<unsigned char>(c) >= 0x80; })) {
    if (auto url = parse_url(request.url); url) converted = std::move(url->converted);
  }
  curl_easy_setopt(h, CURLOPT_URL, converted.empty() ? request.url.c_str() : converted.c_str());
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(h, CURLOPT_ERRORBUFFER, error_buffer_);
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers_.get());
  if (!has_user_agent) curl_easy_setopt(h, CURLOPT_USERAGENT, options.transport.user_agent.c_str());
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, &on_body);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, &transfer_);
  curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, &on_header);
  curl_easy_setopt(h, CURLOPT_HEADERDATA, &transfer_);
  curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
  const Duration connect = std::min(options.transport.connect_timeout, info.timeout);
  curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, to_curl_ms(connect));
  curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, to_curl_ms(info.timeout));
  if (!traits.safe_to_repeat()) curl_easy_setopt(h, CURLOPT_FRESH_CONNECT, 1L);

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
}

void CurlAttempt::SlistFree::operator()(curl_slist* list) const noexcept {
  curl_slist_free_all(list);
}

std::optional<AttemptResult> CurlAttempt::start() {
  const Request::BodySink* sink = transfer_.sink;
  if (sink == nullptr || !sink->restart || sink->restart()) return std::nullopt;
  AttemptResult out;
  out.outcome = Outcome::permanent();
  out.error = "the response body could not be written (body sink failed to restart)";
  return out;
}

AttemptResult CurlAttempt::finish(CURLcode rc, const HttpClassifier& classifier, Clock& clock) {
  AttemptResult out;
  if (!transfer_.local_error.empty() || is_oversized_header(rc, transfer_.response)) {
    // The response arrived but cannot be taken: a local limit or the caller's sink, which a
    // retry would meet again. Nothing of it is kept.
    out.outcome = Outcome::permanent();
    out.error = !transfer_.local_error.empty()
                    ? transfer_.local_error
                    : "a response header line is larger than libcurl accepts (100 KB; "
                      "limits.max_header_bytes is " +
                          std::to_string(max_header_bytes_) + ")";
    return out;
  }
  if (rc == CURLE_OK) {
    long status = 0;
    curl_easy_getinfo(easy_, CURLINFO_RESPONSE_CODE, &status);
    transfer_.response.status = static_cast<int>(status);
    std::optional<Duration> retry_after;
    if (auto value = find_header(transfer_.response.headers, "Retry-After")) {
      retry_after = parse_retry_after(*value, clock.wall_now());
    }
    out.outcome = classifier.classify(transfer_.response.status, transfer_.response.body, traits_,
                                      retry_after);
    out.response = std::move(transfer_.response);
    return out;
  }
  long request_size = 0;
  curl_easy_getinfo(easy_, CURLINFO_REQUEST_SIZE, &request_size);
  long os_errno = 0;
  curl_easy_getinfo(easy_, CURLINFO_OS_ERRNO, &os_errno);
  out.outcome = classify_network(net_error_of(rc, os_errno), request_size > 0);
  if (rc == CURLE_OPERATION_TIMEDOUT) out.outcome.timed_out = true;
  out.error = error_buffer_[0] != '\0' ? std::string(error_buffer_) : curl_easy_strerror(rc);
  return out;
}

}  // namespace keel::http::detail
