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

// The attempts of one hedged operation in flight, a slot each, on a multi handle leased from the
// pool. Ending it aborts the transfers still in flight and returns the multi handle.
class HedgedTransfers {
 public:
  // `sent` is the request the attempts send; it must outlive this.
  HedgedTransfers(const HedgedOperation& op, const Request& sent, MultiPool& multis)
      : op_(op), sent_(sent), multis_(multis), multi_(multis.acquire()) {}
  HedgedTransfers(const HedgedTransfers&) = delete;
  HedgedTransfers& operator=(const HedgedTransfers&) = delete;
  ~HedgedTransfers() {
    for (int i = 0; i < static_cast<int>(kSlots); ++i) drop(i);
    multis_.release(multi_);
  }

  // Starts the attempt `engine_info` in slot `index`. Returns its result when it was refused
  // before anything was sent (the slot is then free again).
  std::optional<AttemptResult> launch(int index, const AttemptInfo& engine_info) {
    Slot& s = slot(index);
    s.began = op_.clock.now();
    s.number = engine_info.number;
    const AttemptInfo info = adapt_attempt(engine_info, op_.timeout, s.began);
    s.easy = op_.acquire();
    curl_easy_reset(s.easy);
    s.attempt =
        std::make_unique<CurlAttempt>(s.easy, sent_, op_.traits, op_.key, info, op_.options);
    curl_easy_setopt(s.easy, CURLOPT_SHARE, op_.share);
    if (std::optional<AttemptResult> refused = s.attempt->start()) {
      drop(index);
      return refused;
    }
    curl_multi_add_handle(multi_, s.easy);
    return std::nullopt;
  }

  // Moves the transfers on as far as they go without waiting.
  void perform() {
    int running = 0;
    curl_multi_perform(multi_, &running);
  }

  // The next attempt whose transfer ended, with its slot, which is free again; nullopt when
  // there is none (until the next perform).
  std::optional<std::pair<int, AttemptResult>> next_finished() {
    int queued = 0;
    while (CURLMsg* message = curl_multi_info_read(multi_, &queued)) {
      if (message->msg != CURLMSG_DONE) continue;
      CURL* easy = message->easy_handle;  // read before the handle is removed
      const CURLcode rc = message->data.result;
      for (int i = 0; i < static_cast<int>(kSlots); ++i) {
        Slot& s = slot(i);
        if (s.easy != easy) continue;
        AttemptResult attempt = s.attempt->finish(rc, op_.classifier, op_.clock);
        drop(i);
        return std::pair{i, std::move(attempt)};
      }
    }
    return std::nullopt;
  }

  // What finish_hedged_attempt needs to know of the attempt of slot `index`, ending now.
  [[nodiscard]] HedgedAttempt ending(int index) const {
    const Slot& s = slots_[static_cast<std::size_t>(index)];
    const TimePoint ended = op_.clock.now();
    return {.index = index, .number = s.number, .took = ended - s.began, .ended = ended};
  }

  // Waits in curl_multi_poll until a transfer has news or `next_hedge` is due.
  void poll(std::optional<TimePoint> next_hedge) {
    int wait_ms = kMaxPollMs;
    if (next_hedge) {
      const auto left =
          std::chrono::ceil<std::chrono::milliseconds>(*next_hedge - op_.clock.now()).count();
      wait_ms = static_cast<int>(std::clamp<std::int64_t>(left, 0, kMaxPollMs));
    }
    curl_multi_poll(multi_, nullptr, 0, wait_ms, nullptr);
  }

  // Aborts the attempts still in flight (they lost the round) and tells `hedge` of each.
  void end_round(HedgeState& hedge) {
    for (int i = 0; i < static_cast<int>(kSlots); ++i) {
      if (slot(i).easy == nullptr) continue;
      drop(i);
      hedge.cancel(i);
    }
  }

 private:
  // One attempt of the round; easy is nullptr while the slot is free.
  struct Slot {
    CURL* easy = nullptr;
    std::unique_ptr<CurlAttempt> attempt;
    TimePoint began{};
    int number = 0;
  };

  Slot& slot(int index) { return slots_[static_cast<std::size_t>(index)]; }

  // Frees slot `index`, aborting its transfer if one is in flight.
  void drop(int index) {
    Slot& s = slot(index);
    if (s.easy == nullptr) return;
    curl_multi_remove_handle(multi_, s.easy);
    s.attempt.reset();
    op_.release(s.easy);
    s.easy = nullptr;
  }

  const HedgedOperation& op_;
  const Request& sent_;
  MultiPool& multis_;
  CURLM* multi_;
  std::array<Slot, kSlots> slots_;
};

// Runs one round, from its first attempt `first` until a finished attempt's verdict ends it, and
// returns that verdict's decision. The attempts still in flight are left to the caller.
Decision run_round(HedgedTransfers& transfers, const HedgedOperation& op, const HedgePolicy& policy,
                   HedgeState& hedge, RetryState& retry, const AttemptInfo& first, Result& result) {
  std::optional<Decision> decision;
  const auto finished = [&](int index, AttemptResult attempt) {
    const HedgeVerdict verdict =
        finish_hedged_attempt(hedge, retry, transfers.ending(index), std::move(attempt), op.options,
                              op.request, op.duplicate, op.timeout, result);
    if (verdict.done) decision = verdict.decision;
  };
  const auto launch = [&](int index, const AttemptInfo& info) {
    if (std::optional<AttemptResult> refused = transfers.launch(index, info)) {
      finished(index, *std::move(refused));
    }
  };

  launch(0, hedge.begin_round(first, hedge_delay(policy, op.timeout, op.clock.now())));
  while (!decision) {
    const std::optional<TimePoint> due = hedge.next_hedge_at();
    if (due && op.clock.now() >= *due) {
      const HedgeStart h = hedge.start_hedge();
      if (h.proceed) launch(h.index, h.attempt);
      continue;
    }
    transfers.perform();
    while (!decision) {
      std::optional<std::pair<int, AttemptResult>> done = transfers.next_finished();
      if (!done) break;
      finished(done->first, std::move(done->second));
    }
    if (!decision) transfers.poll(hedge.next_hedge_at());
  }
  return *decision;
}

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
  HedgedTransfers transfers(op, unsunk ? *unsunk : op.request, multis);
  for (AttemptStart start = retry.start_attempt(); start.proceed; start = retry.start_attempt()) {
    const Decision decision = run_round(transfers, op, policy, hedge, retry, start.attempt, result);
    transfers.end_round(hedge);
    if (!decision.retry) break;
    // wait: core: the retry engine's decision
    op.clock.sleep_for(decision.delay);
  }
  return hedge.sent();
}

}  // namespace keel::http::detail
