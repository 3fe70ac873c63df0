// keel::store::beast::HealthCheck: a probe thread with its own connection and a watchdog thread
// that answers the checks the probe keeps waiting past their timeout (see
// keel/serve/beast/health_check.hpp).
#include "keel/serve/beast/health_check.hpp"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"

namespace keel::store::beast {

std::string_view to_string(Health health) noexcept {
  switch (health) {
    case Health::kHealthy:
      return "healthy";
    case Health::kUnavailable:
      return "unavailable";
    case Health::kTimedOut:
      return "timed_out";
  }
  return "unknown";
}

struct HealthCheck::State {
  using SteadyTime = std::chrono::steady_clock::time_point;
  using Done = std::function<void(const HealthResult&)>;
  struct Waiter {
    SteadyTime due;
    Done done;
  };

  explicit State(HealthCheckOptions o) : options(std::move(o)) {}

  // The probe thread: one probe whenever checks wait, its result to every check still waiting.
  void probe_loop() {
    std::unique_lock lock(mu);
    for (;;) {
      wake_probe.wait(lock, [this] { return stop || !waiters.empty(); });
      if (stop) break;
      probing = true;
      lock.unlock();
      const HealthResult result = probe();
      lock.lock();
      probing = false;
      std::deque<Waiter> answered;
      answered.swap(waiters);
      lock.unlock();
      for (Waiter& w : answered) w.done(result);
      lock.lock();
    }
  }

  // The watchdog thread: answers kTimedOut each check still waiting at its due time.
  void watch_loop() {
    std::unique_lock lock(mu);
    while (!stop) {
      if (waiters.empty()) {
        wake_watch.wait(lock);
        continue;
      }
      const SteadyTime now = std::chrono::steady_clock::now();
      // A copy: the waiter may be answered (and freed) by the probe while this thread waits.
      const SteadyTime due = waiters.front().due;
      if (now < due) {
        // wait: bound: a check's timeout, answered kTimedOut when it passes
        wake_watch.wait_until(lock, due);
        continue;
      }
      std::vector<Done> expired;
      while (!waiters.empty() && waiters.front().due <= now) {  // due times only grow
        expired.push_back(std::move(waiters.front().done));
        waiters.pop_front();
      }
      lock.unlock();
      const HealthResult result{
          .health = Health::kTimedOut,
          .error = "the database did not answer within " + format_duration(options.timeout)};
      for (Done& done : expired) done(result);
      lock.lock();
    }
  }

  // One probe on the check's own connection, opened (again) when it has none or it broke.
  HealthResult probe() {
    try {
      if (connection == nullptr || connection->broken()) {
        connection.reset();
        connection = options.open(options.url);
      }
      options.probe(*connection);
      return {};
    } catch (const std::exception& e) {
      if (connection != nullptr && connection->broken()) connection.reset();
      return {.health = Health::kUnavailable, .error = e.what()};
    }
  }

  HealthCheckOptions options;
  std::mutex mu;
  std::condition_variable wake_probe;
  std::condition_variable wake_watch;
  std::deque<Waiter> waiters;              // guarded by mu: by due time
  bool stop = false;                       // guarded by mu
  bool probing = false;                    // guarded by mu
  std::unique_ptr<Connection> connection;  // the probe thread's only
  std::thread probe_thread;
  std::thread watch_thread;
};

HealthCheck::HealthCheck(HealthCheckOptions options) {
  if (options.url.target.empty()) {
    throw_invalid({.context = "keel::store::beast::HealthCheckOptions",
                   .field = "url",
                   .problem = "must be set",
                   .got = "empty"});
  }
  if (options.timeout.count() <= 0) {
    throw_invalid({.context = "keel::store::beast::HealthCheckOptions",
                   .field = "timeout",
                   .problem = "must be > 0",
                   .got = format_duration(options.timeout)});
  }
  if (!options.probe) {
    options.probe = [](Connection& c) { (void)c.query("SELECT 1"); };
  }
  if (!options.open) {
    const ConnectOptions connect{
        .busy_timeout = options.timeout,
        .connect_timeout = std::max(std::chrono::seconds(1),
                                    std::chrono::ceil<std::chrono::seconds>(options.timeout))};
    options.open = [connect](const DatabaseUrl& url) { return open_database(url, connect); };
  }
  state_ = std::make_shared<State>(std::move(options));
  // Each thread holds the state: the probe thread may outlive the check (see the destructor).
  state_->probe_thread = std::thread([state = state_] { state->probe_loop(); });
  state_->watch_thread = std::thread([state = state_] { state->watch_loop(); });
}

HealthCheck::~HealthCheck() {
  std::deque<State::Waiter> waiting;
  bool blocked = false;
  {
    std::lock_guard lock(state_->mu);
    state_->stop = true;
    waiting.swap(state_->waiters);
    blocked = state_->probing;
  }
  state_->wake_probe.notify_all();
  state_->wake_watch.notify_all();
  const HealthResult stopping{.health = Health::kUnavailable, .error = "the health check stopped"};
  for (State::Waiter& w : waiting) w.done(stopping);
  state_->watch_thread.join();
  // A probe blocked in the database is left to return on its own: it holds only the state.
  if (blocked) {
    state_->probe_thread.detach();
  } else {
    state_->probe_thread.join();
  }
}

void HealthCheck::check(std::function<void(const HealthResult&)> done) {
  {
    std::lock_guard lock(state_->mu);
    if (!state_->stop) {
      state_->waiters.push_back(
          {std::chrono::steady_clock::now() + state_->options.timeout, std::move(done)});
      done = nullptr;
    }
  }
  if (done) {
    done({.health = Health::kUnavailable, .error = "the health check stopped"});
    return;
  }
  state_->wake_probe.notify_one();
  state_->wake_watch.notify_one();
}

}  // namespace keel::store::beast
