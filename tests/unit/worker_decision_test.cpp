// The Worker's decisions about one job of a batch (src/queue/detail/worker_decision.hpp), by
// table with no database: how a job starts (the crash rule: a committed start before its handler,
// so that a crash charges only the job that was running) and how its outcome is recorded.
#include "queue/detail/worker_decision.hpp"

#include <gtest/gtest.h>

#include <string>

using keel::store::detail::decide_recording;
using keel::store::detail::decide_start;
using keel::store::detail::Recording;
using keel::store::detail::RecordingFacts;
using keel::store::detail::StartDecision;
using keel::store::detail::StartFacts;

namespace {

std::string name(Recording r) {
  switch (r) {
    case Recording::kRecorded:
      return "recorded";
    case Recording::kSettle:
      return "settle";
    case Recording::kWithNextStart:
      return "with the next start";
    case Recording::kWithNextLease:
      return "with the next lease";
    case Recording::kAlone:
      return "alone";
  }
  return "?";
}

// Every combination of the facts, against the rule written out once more as a table of cases.
TEST(WorkerDecision, EveryJobNotStartedByItsLeaseStartsCommittedBeforeItsHandler) {
  for (const bool paused : {false, true}) {
    for (const bool started : {false, true}) {
      for (const bool previous : {false, true}) {
        SCOPED_TRACE(std::string(paused ? "paused" : "running") +
                     (started ? ", started by its lease" : ", not started") +
                     (previous ? ", a success before it" : ""));
        const StartDecision d =
            decide_start({.paused = paused, .started = started, .previous_success = previous});
        // Paused: nothing is sent, so nothing starts and nothing is charged.
        EXPECT_EQ(d.defer, paused);
        EXPECT_EQ(d.start, !paused && !started);
        // The previous success rides on a start only when there is a start to ride on.
        EXPECT_EQ(d.previous_with_start, d.start && previous);
      }
    }
  }
}

struct RecordingRow {
  std::string name;
  RecordingFacts facts;
  Recording expected;
};

TEST(WorkerDecision, OnlyASuccessOfAWorkerGoingOnRidesOnTheNextStatement) {
  const RecordingRow rows[] = {
      {"a success inside the batch", {.success = true}, Recording::kWithNextStart},
      {"the batch's last success",
       {.success = true, .last_of_batch = true},
       Recording::kWithNextLease},
      {"a failure inside the batch", {}, Recording::kAlone},
      {"the batch's last failure", {.last_of_batch = true}, Recording::kAlone},
      {"a success while stopping", {.success = true, .stopping = true}, Recording::kAlone},
      {"the last success while stopping",
       {.success = true, .stopping = true, .last_of_batch = true},
       Recording::kAlone},
      {"a success while paused", {.success = true, .paused = true}, Recording::kAlone},
      {"the last success while paused",
       {.success = true, .paused = true, .last_of_batch = true},
       Recording::kAlone},
      {"recorded by the handler's transaction",
       {.recorded_by_handler = true, .success = true},
       Recording::kRecorded},
      {"recorded by the handler's transaction, last",
       {.recorded_by_handler = true, .success = true, .last_of_batch = true},
       Recording::kRecorded},
      {"the handler's COMMIT in doubt", {.in_doubt = true}, Recording::kSettle},
      {"in doubt, last of its batch",
       {.in_doubt = true, .last_of_batch = true},
       Recording::kSettle},
      // An in-doubt COMMIT never rides on a later statement, whatever else is said of it.
      {"in doubt, reported as a success", {.in_doubt = true, .success = true}, Recording::kSettle},
  };
  for (const RecordingRow& row : rows) {
    EXPECT_EQ(name(decide_recording(row.facts)), name(row.expected)) << row.name;
  }
}

// Over every combination: a failure is never deferred to a later statement (its retry and its
// brakes are due now), and a stopping or paused worker never leases for one.
TEST(WorkerDecision, NoFailureWaitsAndNoStoppingWorkerLeases) {
  for (int bits = 0; bits < 64; ++bits) {
    const RecordingFacts f{.recorded_by_handler = (bits & 1) != 0,
                           .in_doubt = (bits & 2) != 0,
                           .success = (bits & 4) != 0,
                           .stopping = (bits & 8) != 0,
                           .paused = (bits & 16) != 0,
                           .last_of_batch = (bits & 32) != 0};
    const Recording r = decide_recording(f);
    const bool rides = r == Recording::kWithNextStart || r == Recording::kWithNextLease;
    if (!f.success || f.in_doubt || f.recorded_by_handler) {
      EXPECT_FALSE(rides) << bits;
    }
    if (f.stopping || f.paused) {
      EXPECT_FALSE(rides) << bits;
    }
    EXPECT_EQ(r == Recording::kWithNextLease, rides && f.last_of_batch) << bits;
    EXPECT_EQ(r == Recording::kWithNextStart, rides && !f.last_of_batch) << bits;
  }
}

}  // namespace
