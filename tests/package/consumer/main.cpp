// A program that uses an installed keel through find_package(keel).
#include <cstdio>
#include <keel/core/retry.hpp>
#include <keel/version.hpp>

int main() {
  keel::ManualClock clock;
  keel::RetryPolicy policy(keel::RetryOptions{.max_attempts = 3});
  int calls = 0;
  keel::CallOptions call;
  call.clock = &clock;
  auto result = keel::retry(
      policy, [&] { return ++calls < 3 ? keel::Outcome::transient() : keel::Outcome::success(); },
      call);
  std::printf("keel %s: attempts=%d reason=%s\n", KEEL_VERSION_STRING, result.attempts,
              std::string(keel::to_string(result.reason)).c_str());
  return result.ok() && result.attempts == 3 ? 0 : 1;
}
