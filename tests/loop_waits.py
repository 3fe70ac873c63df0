#!/usr/bin/env python3
"""Checks that keel waits only on core's rules.

Outside src/core/, every sleep_for, wait_for and wait_until in src/ says on the line above what
its delay is, as one of:
  // wait: core: ...        the delay is core's (a retry decision, a BackoffSequence, a
                            PeriodicSchedule, jittered or uniform_duration, a limiter's slot)
  // wait: bound: ...       how long to wait for something to happen (an answer, a drain, a
                            grace, a timeout): not a period, not a retry
  // wait: scripted: ...    a fault's configured delay (keel::faults)
  // wait: documented: ...  SQLite's busy handler, the one documented exception
so that a loop that retries or repeats on a delay of its own cannot come in unnoticed: a new wait
fails this test until it is written on core's building blocks and says so, or is a bound.

Usage: loop_waits.py KEEL_SOURCE
"""
import pathlib
import re
import sys

CALL = re.compile(r"\b(sleep_for|wait_for|wait_until)\(")
MARK = re.compile(r"^\s*// wait: (core|bound|scripted|documented): \S")


def main() -> int:
    root = pathlib.Path(sys.argv[1])
    failures = []
    count = 0
    for path in sorted((root / "src").rglob("*")):
        if path.suffix not in (".cpp", ".hpp") or path.relative_to(root).parts[1] == "core":
            continue
        lines = path.read_text(encoding="utf-8").split("\n")
        for n, line in enumerate(lines, 1):
            if not CALL.search(line) or line.lstrip().startswith("//"):
                continue
            if re.search(r"\bbool wait_for\(", line):  # a helper's declaration
                continue
            count += 1
            if n < 2 or not MARK.match(lines[n - 2]):
                failures.append(f"{path.relative_to(root)}:{n}: a wait that does not say whose "
                                f"delay it is: {line.strip()}")
    if failures:
        print("waits outside core's rules:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print(f"{count} waits outside src/core/, each core's delay or a bound")
    return 0


if __name__ == "__main__":
    sys.exit(main())
