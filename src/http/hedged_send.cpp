#include "hedged_send.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <memory>
#include <optional>
#include <stdexcept>
#include <utility>

namespace keel::http::detail {
namespace {

constexpr std::size_t kSlots = HedgePolicy::kMaxHedges + 1;
// The longest single wait in curl_multi_poll: libcurl's own timeouts end it sooner, this only
// bounds a wait on a clock that is not the system's.
constexpr int kMaxPollMs = 1000;

// One attempt of the round in flight on the multi handle.
struct Slot {
  CURL* easy = nullptr;
  std::unique_ptr<CurlAttempt> attempt;
  TimePoint began{};
  int number = 0;
};

}  // namespace

int send_hedged(const HedgedOperation& op, const HedgePolicy& policy, HedgeState& hedge,
                RetryState& retry, MultiPool& multis, Result& result) {
  // The attempts run at once: each collects its body in memory, and the winner's goes to the
  // caller's sink (finish_hedged_attempt).
  std::optional<Request> unsunk;
  if (op.request.body_sink.write) {
    unsunk.emplace(op.request);
    unsunk->body_sink = {};
  }
  const Request& sent = unsunk ? *unsunk : op.request;

  struct MultiLease {
    MultiPool& pool;
    CURLM* multi;
    ~MultiLease() { pool.release(multi); }
  } lease{multis, multis.acquire()};
  CURLM* multi = lease.multi;
  std::array<Slot, kSlots> slots;

  const auto drop = [&](int index) {
    Slot& s = slots[static_cast<std::size_t>(index)];
    if (s.easy == nullptr) return;
    curl_multi_remove_handle(multi, s.easy);  // a transfer in flight is aborted
    s.attempt.reset();
    op.release(s.easy);
    s.easy = nullptr;
  };
  const auto drop_all = [&] {
    for (int i = 0; i < static_cast<int>(kSlots); ++i) drop(i);
  };
  struct DropAll {
    const decltype(drop_all)& run;
    ~DropAll() { run(); }
  } drop_on_exit{drop_all};

  bool done = false;
  Decision decision;
  const auto finished = [&](int index, AttemptResult attempt) {
    Slot& s = slots[static_cast<std::size_t>(index)];
    const TimePoint ended = op.clock.now();
    HedgedAttempt what{.index = index, .number = s.number, .took = ended - s.began, .ended = ended};
    const HedgeVerdict verdict =
        finish_hedged_attempt(hedge, retry, what, std::move(attempt), op.options, op.request,
                              op.duplicate, op.timeout, result);
    if (verdict.done) {
      done = true;
      decision = verdict.decision;
    }
  };
  const auto launch = [&](int index, const AttemptInfo& engine_info) {
    Slot& s = slots[static_cast<std::size_t>(index)];
    s.began = op.clock.now();
    s.number = engine_info.number;
    const AttemptInfo info = adapt_attempt(engine_info, op.timeout, s.began);
    s.easy = op.acquire();
    curl_easy_reset(s.easy);
    s.attempt = std::make_unique<CurlAttempt>(s.easy, sent, op.traits, op.key, info, op.options);
    curl_easy_setopt(s.easy, CURLOPT_SHARE, op.share);
    if (std::optional<AttemptResult> refused = s.attempt->start()) {
      drop(index);
      finished(index, *std::move(refused));
      return;
    }
    curl_multi_add_handle(multi, s.easy);
  };

  for (AttemptStart start = retry.start_attempt(); start.proceed; start = retry.start_attempt()) {
    done = false;
    const Duration delay = hedge_delay(policy, op.timeout, op.clock.now());
    launch(0, hedge.begin_round(start.attempt, delay));
    while (!done) {
      const std::optional<TimePoint> due = hedge.next_hedge_at();
      if (due && op.clock.now() >= *due) {
        const HedgeStart h = hedge.start_hedge();
        if (h.proceed) launch(h.index, h.attempt);
        continue;
      }
      int running = 0;
      curl_multi_perform(multi, &running);
      int queued = 0;
      while (!done) {
        CURLMsg* message = curl_multi_info_read(multi, &queued);
        if (message == nullptr) break;
        if (message->msg != CURLMSG_DONE) continue;
        CURL* easy = message->easy_handle;  // read before the handle is removed
        const CURLcode rc = message->data.result;
        for (int i = 0; i < static_cast<int>(kSlots); ++i) {
          Slot& s = slots[static_cast<std::size_t>(i)];
          if (s.easy != easy) continue;
          AttemptResult attempt = s.attempt->finish(rc, op.classifier, op.clock);
          curl_multi_remove_handle(multi, s.easy);
          s.attempt.reset();
          op.release(s.easy);
          s.easy = nullptr;
          finished(i, std::move(attempt));
          break;
        }
      }
      if (done) break;
      int wait_ms = kMaxPollMs;
      if (const std::optional<TimePoint> next = hedge.next_hedge_at()) {
        const auto left =
            std::chrono::ceil<std::chrono::milliseconds>(*next - op.clock.now()).count();
        wait_ms = static_cast<int>(std::clamp<std::int64_t>(left, 0, kMaxPollMs));
      }
      curl_multi_poll(multi, nullptr, 0, wait_ms, nullptr);
    }
    // The round is over: the attempts still in flight lost.
    for (int i = 0; i < static_cast<int>(kSlots); ++i) {
      if (slots[static_cast<std::size_t>(i)].easy == nullptr) continue;
      drop(i);
      hedge.cancel(i);
    }
    if (!decision.retry) break;
    // wait: core: the retry engine's decision
    op.clock.sleep_for(decision.delay);
  }
  return hedge.sent();
}

}  // namespace keel::http::detail
