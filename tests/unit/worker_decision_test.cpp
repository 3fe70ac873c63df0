// The Worker's decisions about one job of a batch (src/queue/detail/worker_decision.hpp), by
// table with no database: how a job starts (the crash rule: a batch starts no job, and a job of a
// crashed batch runs alone, its start committed before its handler, so that a crash is charged to
// it and no other) and how its outcome is recorded.
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
    case Recording::kBuffered:
      return "buffered";
    case Recording::kWithNextLease:
      return "with the next lease";
    case Recording::kAlone:
      return "alone";
  }
  return "?";
}

// Every combination of the facts, against the rule written out once more.
TEST(WorkerDecision, OnlyASuspectStartsCommittedAndAloneBeforeItsHandler) {
  for (int bits = 0; bits < 32; ++bits) {
    const StartFacts f{.paused = (bits & 1) != 0,
                       .started = (bits & 2) != 0,
                       .suspect = (bits & 4) != 0,
                       .buffered = (bits & 8) != 0,
                       .buffer_due = (bits & 16) != 0};
    SCOPED_TRACE(bits);
    const StartDecision d = decide_start(f);
    // Paused: nothing is sent, so nothing starts and nothing is charged.
    EXPECT_EQ(d.defer, f.paused);
    // A batch's job starts uncharged; a suspect (in a crashed batch) starts committed, alone.
    EXPECT_EQ(d.start, !f.paused && f.suspect && !f.started);
    EXPECT_EQ(d.alone, d.start);
    // The buffer rides on a start when there is one; otherwise it is flushed when due, and by a
    // deferral (no statement follows soon); never both, never when empty.
    EXPECT_EQ(d.buffer_with_start, d.start && f.buffered);
    EXPECT_EQ(d.flush, f.buffered && !d.start && (f.paused || f.buffer_due));
    EXPECT_FALSE(d.flush && d.buffer_with_start);
  }
}

TEST(WorkerDecision, ABatchStartsNoJobThatWasNotInACrashedBatch) {
  const StartDecision batch = decide_start({});
  EXPECT_FALSE(batch.start);
  EXPECT_FALSE(batch.alone);
  const StartDecision suspect = decide_start({.suspect = true, .buffered = true});
  EXPECT_TRUE(suspect.start);
  EXPECT_TRUE(suspect.alone);
  EXPECT_TRUE(suspect.buffer_with_start);
  // Started by its lease (batch 1): charged already, nothing more to start.
  EXPECT_FALSE(decide_start({.started = true, .suspect = true}).start);
}

struct RecordingRow {
  std::string name;
  RecordingFacts facts;
  Recording expected;
};

TEST(WorkerDecision, OnlyTheOutcomesOfAWorkerGoingOnRideOnALaterStatement) {
  const RecordingRow rows[] = {
      {"a success inside the batch", {.success = true}, Recording::kBuffered},
      {"the batch's last success",
       {.success = true, .last_of_batch = true},
       Recording::kWithNextLease},
      // A suspect ran alone, its start committed: recorded before another handler may run.
      {"a success run alone inside the batch",
       {.success = true, .ran_alone = true},
       Recording::kAlone},
      {"the batch's last success, run alone",
       {.success = true, .last_of_batch = true, .ran_alone = true},
       Recording::kWithNextLease},
      // A failure waits in the buffer too: a flush records successes and failures together.
      {"a failure inside the batch", {}, Recording::kBuffered},
      {"the batch's last failure", {.last_of_batch = true}, Recording::kAlone},
      {"a failure run alone inside the batch", {.ran_alone = true}, Recording::kAlone},
      // A brake's refusal pauses the worker when it is recorded: now.
      {"a refusal inside the batch", {.refused = true}, Recording::kAlone},
      {"the batch's last refusal", {.refused = true, .last_of_batch = true}, Recording::kAlone},
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

// Over every combination: only the outcomes of a worker going on wait for a later statement;
// a failure waits only in the buffer (a lease's statement records successes only), and a
// refusal, an outcome in doubt or one recorded already never waits.
TEST(WorkerDecision, NoRefusalWaitsAndNoStoppingWorkerLeases) {
  for (int bits = 0; bits < 256; ++bits) {
    const RecordingFacts f{.recorded_by_handler = (bits & 1) != 0,
                           .in_doubt = (bits & 2) != 0,
                           .success = (bits & 4) != 0,
                           .refused = (bits & 64) != 0,
                           .stopping = (bits & 8) != 0,
                           .paused = (bits & 16) != 0,
                           .last_of_batch = (bits & 32) != 0,
                           .ran_alone = (bits & 128) != 0};
    const Recording r = decide_recording(f);
    const bool rides = r == Recording::kBuffered || r == Recording::kWithNextLease;
    if (f.refused || f.in_doubt || f.recorded_by_handler || f.stopping || f.paused) {
      EXPECT_FALSE(rides) << bits;
    }
    if (!f.success) {
      EXPECT_NE(r, Recording::kWithNextLease) << bits;
    }
    if (f.ran_alone) {
      EXPECT_NE(r, Recording::kBuffered) << bits;
    }
    EXPECT_EQ(r == Recording::kWithNextLease, rides && f.last_of_batch) << bits;
    EXPECT_EQ(r == Recording::kBuffered, rides && !f.last_of_batch) << bits;
  }
}

}  // namespace
