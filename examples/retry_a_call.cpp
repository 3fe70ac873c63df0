// Retrying a call with keel::core: full jitter, a deadline, Retry-After honoured, and one log
// line when it gives up. The "dependency" here is a function that fails twice, then succeeds.
#include <cstdio>
#include <keel/core/duration.hpp>
#include <keel/core/retry.hpp>

int main() {
  using namespace std::chrono_literals;
  keel::RetryPolicy policy({
      .max_attempts = 4,
      .per_try_timeout = 2s,
      .overall_timeout = 10s,
      .backoff = {.base = 5ms, .cap = 50ms},  // full jitter by default
      .on_retry =
          [](const keel::RetryEvent& e) {
            std::printf("attempt %d failed (%s); retrying in %s\n", e.attempt,
                        keel::describe(e.outcome).c_str(), keel::format_duration(e.delay).c_str());
          },
      .on_give_up =
          [](const keel::GiveUpEvent& e) {
            std::fprintf(stderr, "%s\n", keel::format_give_up(e, "GET /v1/balance").c_str());
          },
  });

  int calls = 0;
  const keel::RequestTraits request{keel::Method::kGet, /*has_idempotency_key=*/false};
  keel::CallOptions call;
  call.safe_to_repeat = request.safe_to_repeat();
  auto result = keel::retry(
      policy,
      [&](const keel::AttemptInfo& attempt) {
        ++calls;
        std::printf("attempt %d (timeout %s)\n", attempt.number,
                    keel::format_duration(attempt.timeout).c_str());
        const int status = calls < 3 ? 503 : 200;  // a real client would make the request here
        return keel::classify_http_status(status, request);
      },
      call);
  std::printf("stopped: %s after %d attempts\n",
              std::string(keel::to_string(result.reason)).c_str(), result.attempts);
  return result.ok() ? 0 : 1;
}
