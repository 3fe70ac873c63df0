"""tenacity (Debian python3-tenacity): retry only (tenacity has no circuit breaker and no budget).

Workloads as in bench/peer_compare_bench.cpp:
  floor      bare call of the dependency (one next() on an itertools.count, atomic under the GIL)
  success    Retrying(stop_after_attempt(3), wait_none())(call) that succeeds
  fail_once  the call raises once, then succeeds; tenacity's sleep is replaced by a no-op, as
             keel's ManualClock absorbs its delay
Python exposes no per-call allocation count, so allocs_per_call is null.
Usage: python3 tenacity_peer.py [--iterations N] [--runs N]
"""
import itertools
import json
import platform
import sys
import time

import tenacity

_counter = itertools.count()


class Transient(Exception):
    pass


def dependency(fail):
    next(_counter)
    if fail:
        raise Transient("transient")
    return 1


def measure(fn, iterations, runs):
    wall, cpu = [], []
    for r in range(runs + 1):
        cpu_start = time.process_time_ns()
        start = time.perf_counter_ns()
        for _ in range(iterations):
            fn()
        ns = (time.perf_counter_ns() - start) / iterations
        cpu_ns = (time.process_time_ns() - cpu_start) / iterations
        if r > 0:  # run 0 warms caches up
            wall.append(ns)
            cpu.append(cpu_ns)
    return {"ns_per_call": wall, "cpu_ns_per_call": cpu, "allocs_per_call": None,
            "iterations": iterations}


def parse_args(argv):
    out = {"iterations": 50000, "runs": 5}
    if len(argv) % 2 != 0:
        sys.exit(f"tenacity_peer: flags come in pairs (--iterations N, --runs N): {argv}")
    for flag, value in zip(argv[0::2], argv[1::2]):
        if flag not in ("--iterations", "--runs"):
            print(f"tenacity_peer: unknown flag '{flag}'", file=sys.stderr)
            sys.exit(2)
        if not value.isdigit() or int(value) < 1:
            print(f"tenacity_peer: {flag} needs an integer >= 1, got '{value}'", file=sys.stderr)
            sys.exit(2)
        out[flag[2:]] = int(value)
    return out


def main():
    args = parse_args(sys.argv[1:])
    iterations, runs = args["iterations"], args["runs"]
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(3),
        wait=tenacity.wait_none(),
        sleep=lambda seconds: None,
        reraise=True,
    )

    def fail_once():
        attempt = itertools.count()
        return retrying(lambda: dependency(next(attempt) == 0))

    workloads = {
        "floor": measure(lambda: dependency(False), iterations, runs),
        "success": measure(lambda: retrying(dependency, False), iterations, runs),
        "fail_once": measure(fail_once, iterations, runs),
    }
    print(json.dumps({
        "peer": "tenacity",
        "version": getattr(tenacity, "__version__", None) or _dist_version(),
        "runtime": f"python {platform.python_version()}",
        "composition": "Retrying(stop_after_attempt(3), wait_none()); no breaker, no budget",
        "workloads": workloads,
    }))


def _dist_version():
    try:
        from importlib.metadata import version
        return version("tenacity")
    except Exception:  # noqa: BLE001 - the version is informative only
        return "unknown"


if __name__ == "__main__":
    main()
