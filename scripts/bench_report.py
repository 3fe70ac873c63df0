#!/usr/bin/env python3
"""Turns the raw results of scripts/bench.sh into bench/results/latest.md.

Reads RAW/machine.json, RAW/keel_compare.json (Google Benchmark), RAW/peer_*.json (the programs
in bench/peers/), RAW/fleet_*.json (keel_bench_fleet, one per seed), RAW/sim.json, RAW/events.json, RAW/serve.txt,
RAW/queue.txt and RAW/*.skip (why something was not measured). Every figure is the median of the
runs, with [min-max] as the spread. Ratios are keel / peer: below 1 keel is faster (or, for the
fleet, hits the dependency less hard).

Usage: scripts/bench_report.py --raw DIR --out FILE
"""
import argparse
import glob
import json
import os
import re
import statistics
import sys


def load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def skipped(raw, name):
    path = os.path.join(raw, name + ".skip")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    return None


def fmt_ns(ns):
    if ns is None:
        return "n/a"
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e4:
        return f"{ns / 1e3:.1f} us"
    if ns >= 1e3:
        return f"{ns / 1e3:.2f} us"
    return f"{ns:.1f} ns" if ns < 100 else f"{ns:.0f} ns"


class Sample:
    """Per-run values of one workload: wall ns, cpu ns, allocations per call."""

    def __init__(self, wall, cpu, allocs):
        self.wall = wall
        self.cpu = cpu
        self.allocs = allocs

    def median(self, which="wall"):
        values = self.wall if which == "wall" else self.cpu
        return statistics.median(values) if values else None

    def cell(self):
        wall = self.median("wall")
        spread = f" [{fmt_ns(min(self.wall))}-{fmt_ns(max(self.wall))}]" if len(self.wall) > 1 else ""
        parts = [f"{fmt_ns(wall)}{spread}"]
        if self.cpu:
            parts.append(f"cpu {fmt_ns(self.median('cpu'))}")
        parts.append("allocs n/a" if self.allocs is None else f"{self.allocs:g} allocs")
        return "; ".join(parts)


def ratio(keel, peer):
    def one(which):
        k, p = keel.median(which), peer.median(which)
        if k is None or p is None or p == 0:
            return None
        return k / p

    wall, cpu = one("wall"), one("cpu")
    if wall is None:
        return "n/a", None
    text = f"wall {wall:.3g}"
    if cpu is not None:
        text += f", cpu {cpu:.3g}"
    return text, max(wall, cpu if cpu is not None else wall)


def keel_samples(paths):
    """Google Benchmark JSON files -> {name: Sample} over their per-repetition entries."""
    entries = []
    for path in paths:
        entries.extend(load(path).get("benchmarks", []))
    runs = {}
    errors = {}
    for b in entries:
        if b.get("run_type", "iteration") != "iteration":
            continue
        name = b.get("run_name", b["name"])
        if b.get("error_occurred"):
            errors[name] = b.get("error_message", "error")
            continue
        scale = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}[b.get("time_unit", "ns")]
        entry = runs.setdefault(name, {"wall": [], "cpu": [], "allocs": [], "items": []})
        entry["wall"].append(b["real_time"] * scale)
        entry["cpu"].append(b["cpu_time"] * scale)
        if "allocs/op" in b:
            entry["allocs"].append(b["allocs/op"])
        rate = b.get("events/s", b.get("items_per_second"))
        if rate is not None:
            entry["items"].append(rate)
    samples = {
        name: Sample(e["wall"], e["cpu"], statistics.median(e["allocs"]) if e["allocs"] else None)
        for name, e in runs.items()
    }
    items = {name: e["items"] for name, e in runs.items() if e["items"]}
    return samples, items, errors


def merge_peer_runs(docs):
    """One document per round -> the first document with the rounds' samples concatenated."""
    merged = dict(docs[0])
    merged["workloads"] = {}
    for doc in docs:
        for name, w in doc.get("workloads", {}).items():
            m = merged["workloads"].setdefault(
                name, {"ns_per_call": [], "cpu_ns_per_call": [], "allocs": []})
            m["ns_per_call"] += w.get("ns_per_call", [])
            m["cpu_ns_per_call"] += w.get("cpu_ns_per_call", [])
            if w.get("allocs_per_call") is not None:
                m["allocs"].append(w["allocs_per_call"])
    for m in merged["workloads"].values():
        m["allocs_per_call"] = statistics.median(m["allocs"]) if m["allocs"] else None
    return merged


def peer_samples(doc):
    out = {}
    for name, w in doc.get("workloads", {}).items():
        out[name] = Sample(w.get("ns_per_call", []), w.get("cpu_ns_per_call", []),
                           w.get("allocs_per_call"))
    return out


def spread(values, digits=0):
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


SERVE_LINE = re.compile(r"^(\w+)\s+(no idempotency|idempotency|floor \(httplib\))\s+([\d.]+)"
                        r"\s+(\S+)\s+(\S+)(?:\s+(\S+))?")


def parse_serve(text):
    """scripts/bench-serve.sh's lines '<backend> <mode> <requests/s> <p99> <non-2xx> [<p50>]' ->
    {backend: {mode: {"rps", "p99", "non2xx", "p50"}}}."""
    found = {}
    for line in text.splitlines():
        m = SERVE_LINE.match(line)
        if m:
            found.setdefault(m.group(1), {})[m.group(2)] = {
                "rps": float(m.group(3)), "p99": m.group(4), "non2xx": m.group(5),
                "p50": m.group(6)}
    return found


def latency_us(text):
    """wrk's latency ('205.00us', '1.23ms', '2.00s') in microseconds; None when unreadable."""
    m = re.match(r"^([\d.]+)(us|ms|s)$", text or "")
    if not m:
        return None
    return float(m.group(1)) * {"us": 1.0, "ms": 1e3, "s": 1e6}[m.group(2)]


def serve_rows(text, emit, mach, date, goals):
    """Table rows from scripts/bench-serve.sh (many connections): with/without the layer, and
    without the layer against the minimal server (the floor)."""
    found = parse_serve(text)
    if not found:
        return
    emit("keel = with the idempotency layer, peer = the same server without it (one wrk run each);"
         " then the server without the layer against the minimal server (bench/serve_floor.cpp, a"
         " bare cpp-httplib server doing the same single-row insert). Ratio = keel / peer in"
         " requests/s (below 1: the layer costs that share of the throughput).")
    emit("")
    emit("| workload | keel | peer | ratio | machine | date |")
    emit("| --- | --- | --- | --- | --- | --- |")
    for backend, modes in found.items():
        w, wo, fl = modes.get("idempotency"), modes.get("no idempotency"), modes.get("floor (httplib)")
        if w and wo:
            r = w["rps"] / wo["rps"] if wo["rps"] else float("nan")
            emit(f"| POST /v1/charges, {backend} | {w['rps']:.0f} req/s, p99 {w['p99']}, non-2xx"
                 f" {w['non2xx']} | without the layer: {wo['rps']:.0f} req/s, p99 {wo['p99']},"
                 f" non-2xx {wo['non2xx']} | {r:.2f} | {mach} | {date} |")
            goals.append((f"receiver, {backend}, many connections: with / without the layer",
                          f"{r:.2f}"))
        if wo and fl:
            r = wo["rps"] / fl["rps"] if fl["rps"] else float("nan")
            emit(f"| POST /v1/charges, {backend}, without the layer vs the floor | {wo['rps']:.0f}"
                 f" req/s, p99 {wo['p99']} | floor: {fl['rps']:.0f} req/s, p99 {fl['p99']} |"
                 f" {r:.2f} | {mach} | {date} |")
            goals.append((f"receiver, {backend}, many connections: without the layer / floor",
                          f"{r:.2f}"))
    emit("")


def serve_one_client_rows(text, emit, mach, date, goals):
    """Table rows from scripts/bench-serve.sh run with one keep-alive connection (CONNECTIONS=1
    WRK_THREADS=1): p50 per idempotent POST with and without the layer, and against the floor."""
    found = parse_serve(text)
    if not found:
        emit("not available: scripts/bench-serve.sh printed no result lines.")
        emit("")
        return
    emit("One wrk connection, one request at a time: the latency of one idempotent POST. Ratio ="
         " keel / peer (p50: above 1 the layer adds that factor; requests/s: below 1).")
    emit("")
    emit("| workload | keel | peer | ratio | machine | date |")
    emit("| --- | --- | --- | --- | --- | --- |")
    for backend, modes in found.items():
        w, wo, fl = modes.get("idempotency"), modes.get("no idempotency"), modes.get("floor (httplib)")
        if w and wo:
            pw, pwo = latency_us(w["p50"]), latency_us(wo["p50"])
            r50 = f"{pw / pwo:.2f}" if pw and pwo else "n/a"
            emit(f"| POST /v1/charges p50, 1 client, {backend} | with the layer {w['p50']} |"
                 f" without {wo['p50']} | {r50} | {mach} | {date} |")
            r = w["rps"] / wo["rps"] if wo["rps"] else float("nan")
            emit(f"| POST /v1/charges req/s, 1 client, {backend} | with the layer {w['rps']:.0f} |"
                 f" without {wo['rps']:.0f} | {r:.2f} | {mach} | {date} |")
            goals.append((f"receiver, {backend}, 1 client: p50 with / without the layer", r50))
        if wo and fl:
            pwo, pfl = latency_us(wo["p50"]), latency_us(fl["p50"])
            r50 = f"{pwo / pfl:.2f}" if pwo and pfl else "n/a"
            r = wo["rps"] / fl["rps"] if fl["rps"] else float("nan")
            emit(f"| without the layer vs the floor, 1 client, {backend} | {wo['rps']:.0f} req/s,"
                 f" p50 {wo['p50']} | floor {fl['rps']:.0f} req/s, p50 {fl['p50']} | req/s"
                 f" {r:.2f}, p50 {r50} | {mach} | {date} |")
            goals.append((f"receiver, {backend}, 1 client: without the layer / floor (req/s)",
                          f"{r:.2f}"))
    emit("")


# keel_bench_http (bench/http_bench.cpp): each client next to the raw libcurl it is measured
# against. (label, keel benchmark, raw benchmark, what the raw one is, whether the row is one of
# the goals (>= 0.95) or a split of the difference).
HTTP_PAIRS = (
    ("GET, keel::http::Client vs raw libcurl", "KeelClientGet", "RawCurlGet",
     "raw libcurl, one easy handle set up once", True),
    ("GET, keel::http::Client vs raw libcurl, same connection reuse", "KeelClientGet",
     "RawCurlSharedResetGet", "raw libcurl, handle reset per request, shared connection cache",
     True),
    ("GET, keel::http::Client vs raw libcurl, same reuse and request head", "KeelClientGet",
     "RawCurlSameRequestGet", "raw libcurl, same reuse, sending the client's User-Agent,"
     " Keel-Attempt and Keel-Deadline-Ms", False),
    ("GET, keel::http::Client without breaker and budget vs raw libcurl, same reuse",
     "KeelClientGetNoGuards", "RawCurlSharedResetGet", "raw libcurl, same connection reuse", False),
    ("GET, keel::asio::HttpClient vs raw curl_multi on an io_context", "AsioClientGet",
     "RawCurlMultiAsioGet", "raw curl_multi_socket_action loop, one easy handle set up once", True),
    ("GET, keel::asio::HttpClient without breaker and budget vs raw curl_multi",
     "AsioClientGetNoGuards", "RawCurlMultiAsioGet", "raw curl_multi loop", False),
    ("GET, keel::asio::HttpClient without attempt timeouts (no backstop timer raced) vs raw"
     " curl_multi", "AsioClientGetNoTimeouts", "RawCurlMultiAsioGet", "raw curl_multi loop", False),
)


def http_rows(path, emit, mach, date, goals):
    samples, items, errors = keel_samples([path])

    def cell(name):
        name += "/real_time"  # every one of them measures wall time (UseRealTime)
        s, rate = samples.get(name), items.get(name)
        if s is None or not rate:
            return None
        allocs = "allocs n/a" if s.allocs is None else f"{s.allocs:.3g} allocs/req"
        return (f"{spread(rate)} req/s; cpu {fmt_ns(s.median('cpu'))}/req; {allocs}",
                statistics.median(rate), s.median("cpu"))

    emit("One GET at a time over one keep-alive connection to keel::faults::FaultServer on"
         " 127.0.0.1 (bench/http_bench.cpp), keel and raw libcurl in randomly interleaved"
         " repetitions. Ratio = keel / raw in requests/s (goal >= 0.95), then raw / keel in the"
         " client thread's CPU time per request; allocs = operator new calls per request on the"
         " client's thread (libcurl's malloc not counted).")
    emit("")
    emit("| workload | keel | peer | ratio | machine | date |")
    emit("| --- | --- | --- | --- | --- | --- |")
    for label, keel_name, raw_name, raw_what, goal in HTTP_PAIRS:
        k, r = cell(keel_name), cell(raw_name)
        if k is None or r is None:
            why = (errors.get(keel_name + "/real_time") or errors.get(raw_name + "/real_time") or
                   "not measured")
            emit(f"| {label} | {keel_name}: {why} | {raw_name} | n/a | {mach} | {date} |")
            continue
        throughput = k[1] / r[1] if r[1] else float("nan")
        cpu = r[2] / k[2] if k[2] else float("nan")
        text = f"req/s {throughput:.2f}, cpu {cpu:.2f}"
        emit(f"| {label} | {k[0]} | {raw_what}: {r[0]} | {text} | {mach} | {date} |")
        if goal:
            goals.append((f"{label} (goal >= 0.95)", text))
    emit("")


# keel_bench_grpc (bench/grpc_bench.cpp): keel::grpc::Client next to the plain generated stub
# (label, keel benchmark, stub benchmark, what the stub one is, goal row or a split).
GRPC_PAIRS = (
    ("unary call, keel::grpc::Client vs the plain stub", "KeelClientCharge", "PlainStubCharge",
     "the generated stub, a ClientContext per call", True),
    ("unary call, keel::grpc::Client vs the stub sending the same head", "KeelClientCharge",
     "PlainStubChargeSameHead", "the stub with a deadline and an idempotency-key per call", False),
    ("unary call marked idempotent (no key), keel::grpc::Client vs the plain stub",
     "KeelClientChargeIdempotent", "PlainStubCharge", "the generated stub", False),
    ("unary call, keel::grpc::Client without breaker and budget vs the plain stub",
     "KeelClientChargeNoGuards", "PlainStubCharge", "the generated stub", False),
)
GRPC_TROUBLE = (
    ("outage (every call UNAVAILABLE)", "Outage"),
    ("flaky (every fourth arrival UNAVAILABLE)", "Flaky"),
)
GRPC_CLIENTS = (
    ("gRPC's retryPolicy (5 attempts)", "GrpcPolicy"),
    ("gRPC's retryPolicy with retryThrottling (10 tokens, ratio 0.1)", "GrpcPolicyThrottled"),
    ("keel::grpc::Client (5 attempts, budget and breaker)", "KeelClient"),
    ("keel::grpc::Client, budget only", "KeelClientBudgetOnly"),
)


def grpc_rows(path, emit, mach, date, goals):
    samples, items, errors = keel_samples([path])
    emit("One unary call at a time to an in-process gRPC server on 127.0.0.1"
         " (bench/grpc_bench.cpp), keel and the plain stub in randomly interleaved repetitions."
         " Ratio = keel / stub in calls/s (goal >= 0.95).")
    emit("")
    emit("| workload | keel | peer | ratio | machine | date |")
    emit("| --- | --- | --- | --- | --- | --- |")
    for label, keel_name, stub_name, stub_what, goal in GRPC_PAIRS:
        k, r = items.get(keel_name + "/real_time"), items.get(stub_name + "/real_time")
        if not k or not r:
            emit(f"| {label} | not measured | {stub_name} | n/a | {mach} | {date} |")
            continue
        ratio = statistics.median(k) / statistics.median(r)
        emit(f"| {label} | {spread(k)} calls/s | {stub_what}: {spread(r)} calls/s |"
             f" {ratio:.2f} | {mach} | {date} |")
        if goal:
            goals.append((f"{label} (goal >= 0.95)", f"{ratio:.2f}"))
    emit("")
    emit("Against a server in trouble, 300 calls per client (a fresh channel or client each"
         " repetition): the requests the server received per call and per success (medians).")
    emit("")
    emit("| server | client | requests per call | requests per success | calls that succeeded |")
    emit("| --- | --- | --- | --- | --- |")
    counters = {}
    for b in load(path).get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration" or b.get("error_occurred"):
            continue
        name = b.get("run_name", b["name"]).split("/")[0]
        counters.setdefault(name, []).append(b)
    for server_label, suffix in GRPC_TROUBLE:
        for client_label, prefix in GRPC_CLIENTS:
            runs = counters.get(prefix + suffix)
            if not runs:
                emit(f"| {server_label} | {client_label} | n/a | n/a | n/a |")
                continue
            med = lambda key: statistics.median(r.get(key, float("nan")) for r in runs)
            emit(f"| {server_label} | {client_label} | {med('requests_per_call'):.2f} |"
                 f" {med('requests_per_success'):.3g} | {100 * med('success_rate'):.0f}% |")
    outage = {p: counters.get(p + "Outage") for _, p in GRPC_CLIENTS}
    if outage.get("KeelClientBudgetOnly") and outage.get("GrpcPolicy"):
        k = statistics.median(r["requests_per_call"] for r in outage["KeelClientBudgetOnly"])
        g = statistics.median(r["requests_per_call"] for r in outage["GrpcPolicy"])
        goals.append(("gRPC outage: requests per call, keel with a budget / gRPC's retryPolicy"
                      " (goal < 1)", f"{k / g:.2f}"))
    emit("")


def beast_rows(raw, emit, goals):
    """The table scripts/bench-beast.sh wrote (raw/beast.txt): the idempotency layer on
    keel::store::beast::Server against the same server without it, and that server against a bare
    Boost.Beast server doing the same insert; its two ratios per backend go to the goals."""
    emit("### The idempotency layer on Boost.Beast")
    emit("")
    path = os.path.join(raw, "beast.txt")
    reason = skipped(raw, "beast")
    if reason is not None or not os.path.exists(path):
        emit(reason or "not measured")
        emit("")
        return
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    emit("Output of scripts/bench-beast.sh:")
    emit("")
    emit(text or "(no output)")
    emit("")
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0] in ("sqlite", "postgres"):
            goals.append((f"Beast server, {cells[0]}: no layer / bare Beast (goal 0.9)", cells[4]))
            goals.append((f"Beast server, {cells[0]}: layer / no layer (goal 0.9)", cells[5]))


def queue_rows(text, emit, mach, date, goals):
    """Table rows from scripts/bench-queue.sh: the pgbench rate, then PostgreSQL and SQLite
    '  batch N  <rate> jobs/s ...' lines."""
    pgbench = re.search(r"pgbench single-row UPDATE[^:]*:\s*([\d.]+)\s*tps(?:\s+load ([\d.]+))?",
                        text)
    rows = []
    section = None
    for line in text.splitlines():
        if line.startswith("PostgreSQL"):
            section = "PostgreSQL"
        elif line.startswith("SQLite with heap trimming off"):
            section = "SQLite, heap trimming off"
        elif line.startswith("SQLite"):
            section = "SQLite"
        m = re.match(r"^\s+batch\s+(\d+)\s+([\d.]+)\s+jobs/s(?:.*\sload ([\d.]+))?", line)
        if m and section:
            rows.append((section, m.group(1), float(m.group(2)), m.group(3) or "-"))
    if not rows:
        return
    emit("keel = jobs/s through enqueue + lease + done; peer = pgbench's single-row UPDATE rate on"
         " the same PostgreSQL server in the same run; load = the machine's 1-minute load average"
         " when the row finished (pgbench's: when pgbench finished).")
    emit("")
    emit("| workload | keel | peer | ratio | load | machine | date |")
    emit("| --- | --- | --- | --- | --- | --- | --- |")
    tps = float(pgbench.group(1)) if pgbench else None
    tps_load = pgbench.group(2) if pgbench and pgbench.group(2) else "-"
    for section, batch, rate, load in rows:
        if section == "PostgreSQL" and tps:
            emit(f"| queue, PostgreSQL, batch {batch} | {rate:.0f} jobs/s | pgbench {tps:.0f} tps |"
                 f" {rate / tps:.2f} | {load} (pgbench {tps_load}) | {mach} | {date} |")
            goals.append((f"queue, PostgreSQL, batch {batch}: jobs/s / pgbench tps",
                          f"{rate / tps:.2f}"))
        else:
            emit(f"| queue, {section}, batch {batch} | {rate:.0f} jobs/s | - | - | - | {mach} |"
                 f" {date} |")
    emit("")
    fleet_rows(text, emit, mach, date, goals, tps)
    side_rows(text, emit, mach, date, goals)


def side_rows(text, emit, mach, date, goals):
    """The side-by-side part of scripts/bench-queue.sh: a row's label ('  <label>'), then one line
    per system ('    <system>  <rate> jobs/s  <wal> WAL bytes/job  load L'). Goal: keel at least
    1.5 times the best peer on every row, and its WAL per job at most graphile-worker's."""
    start = text.find("\nside by side")
    if start < 0:
        return
    rows = []
    for line in text[start + 1:].splitlines()[1:]:
        if not line.startswith("  "):
            break
        m = re.match(r"^    (\S+)\s+([\d.]+) jobs/s\s+(\d+) WAL bytes/job(?:\s+load ([\d.]+))?", line)
        if m and rows:
            rows[-1][1][m.group(1)] = (float(m.group(2)), m.group(3), m.group(4) or "-")
        elif not line.startswith("    "):
            rows.append((line.strip(), {}))
    if not rows:
        return
    emit("Side by side: each system in a fresh database of the same server, the same no-op jobs"
         " (jobs/s; WAL = bytes per job over the whole run, a drain's bulk enqueue included).")
    emit("")
    emit("| row | keel | graphile-worker | pg-boss | keel / best peer | WAL keel / graphile-worker |"
         " machine | date |")
    emit("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, systems in rows:
        keel = systems.get("keel")
        peers = [v[0] for k, v in systems.items() if k != "keel"]
        ratio = f"{keel[0] / max(peers):.2f}" if keel and peers else "-"
        cell = lambda k: f"{systems[k][0]:.0f}" if k in systems else "-"
        wal = (f"{keel[1]} / {systems['graphile-worker'][1]}"
               if keel and "graphile-worker" in systems else "-")
        emit(f"| {label} | {cell('keel')} | {cell('graphile-worker')} | {cell('pg-boss')} |"
             f" {ratio} | {wal} | {mach} | {date} |")
        if ratio != "-":
            goals.append((f"queue side by side, {label}: keel / best peer (goal >= 1.5)", ratio))
    emit("")


def fleet_rows(text, emit, mach, date, goals, tps):
    """The fleet part of scripts/bench-queue.sh: keel's Worker and the npm peers draining the
    same backlog ('  <who> batch B, W workers, P process(es)  <rate> jobs/s ...'), then the
    pickup latency ('  <who>  median M ms   p99 Q ms'). Goals: keel's Worker against the best
    peer batched and unbatched (>= 1.5), unbatched against pgbench (>= 0.5), and no row where
    more workers drain slower than fewer in as many processes (beyond 5%, the noise of a shared
    machine)."""
    fleet = []
    for m in re.finditer(r"^\s+(.+?) batch (\d+), (\d+) workers, (\d+) process\S*\s+([\d.]+) jobs/s"
                         r"(?:.*\sload ([\d.]+))?", text, re.M):
        fleet.append((m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)),
                      float(m.group(5)), m.group(6) or "-"))
    latency = re.findall(r"^\s+(.+?)\s+median\s+([\d.]+) ms\s+p99\s+([\d.]+) ms", text, re.M)
    if not fleet:
        return
    emit("Fleet: keel::store::Worker against graphile-worker and pg-boss on the same server, the same"
         " no-op job, draining a backlog (jobs/s; ratio = x pgbench's single-row UPDATE rate).")
    emit("")
    emit("| workload | jobs/s | x pgbench | load | machine | date |")
    emit("| --- | --- | --- | --- | --- | --- |")
    for who, batch, workers, procs, rate, load in fleet:
        ratio = f"{rate / tps:.2f}" if tps else "-"
        emit(f"| {who}, batch {batch}, {workers} workers, {procs} process(es) | {rate:.0f} |"
             f" {ratio} | {load} | {mach} | {date} |")
    emit("")
    if latency:
        emit("| pickup latency (enqueue to handler start, in-process producer) | median | p99 |")
        emit("| --- | --- | --- |")
        for who, median, p99 in latency:
            emit(f"| {who} | {median} ms | {p99} ms |")
        emit("")
    for batch in (1, 10):
        keel = max((r for w, b, _, _, r, _ in fleet if w.startswith("keel") and b == batch),
                   default=0)
        peer = max((r for w, b, _, _, r, _ in fleet if not w.startswith("keel") and b == batch),
                   default=0)
        if keel and peer:
            goals.append((f"queue fleet, batch {batch}: keel Worker / best peer (goal >= 1.5)",
                          f"{keel / peer:.2f}"))
        if keel and tps and batch == 1:
            goals.append(("queue fleet, batch 1: keel Worker / pgbench tps (goal >= 0.5)",
                          f"{keel / tps:.2f}"))
    slower = [f"{w} batch {b}: {n} workers in {p}" for w, b, n, p, r, _ in fleet
              for w2, b2, n2, p2, r2, _ in fleet
              if (w2, b2, p2) == (w, b, p) and n2 < n and r < 0.95 * r2]
    goals.append(("queue fleet: rows where more workers drain over 5% slower than fewer"
                  " (goal none)",
                  "; ".join(sorted(set(slower))) or "none"))


def hedge_rows(raw, emit, goals):
    """Section 9: keel_bench_hedge, each client with hedging on but never triggered next to the
    same client without it."""
    emit("## 9. Hedging enabled but not triggered")
    emit("")
    path = os.path.join(raw, "hedge.json")
    if not os.path.exists(path):
        emit(skipped(raw, "hedge") or "not available")
        emit("")
        return
    samples, _, errors = keel_samples([path])
    emit("One GET at a time to a loopback server that answers at once (bench/hedge_bench.cpp), with"
         " ClientOptions::hedge set to a delay no answer reaches, next to the same client without"
         " it, in randomly interleaved repetitions. Ratio = hedged / not hedged (goal: within 10%,"
         " so <= 1.10).")
    emit("")
    emit("| client | without hedging | hedging on, not triggered | ratio (wall, cpu) |")
    emit("| --- | --- | --- | --- |")
    for label, plain, hedged in (("keel::http::Client", "BlockingGet", "BlockingGetHedgeNotTriggered"),
                                 ("keel::asio::HttpClient", "AsyncGet", "AsyncGetHedgeNotTriggered")):
        a = samples.get(plain + "/real_time") or samples.get(plain)
        b = samples.get(hedged + "/real_time") or samples.get(hedged)
        if a is None or b is None:
            emit(f"| {label} | not available | not available | - |")
            continue
        wall = b.median("wall") / a.median("wall") if a.median("wall") else None
        cpu = b.median("cpu") / a.median("cpu") if a.median("cpu") else None
        text = f"wall {wall:.2f}" + (f", cpu {cpu:.2f}" if cpu is not None else "")
        emit(f"| {label} | {a.cell()} | {b.cell()} | {text} |")
        goals.append((f"hedging on but not triggered / off, {label} (goal <= 1.10)", text))
    for name, why in errors.items():
        emit(f"| {name} | error: {why} | | |")
    emit("")


def events_rows(raw, emit, goals):
    """Section 8: keel_bench_events, each variant next to the success path without a stream."""
    emit("## 8. Event stream on the success path")
    emit("")
    path = os.path.join(raw, "events.json")
    if not os.path.exists(path):
        emit(skipped(raw, "events") or "not available")
        emit("")
        return
    samples, _, errors = keel_samples([path])
    emit("keel::retry of a call that succeeds first time (steady clock), with the events it"
         " publishes (attempt started, attempt finished) going nowhere, to a stream nobody listens"
         " to, and to one or two subscribers. The goal: one subscriber adds at most 10% (cpu).")
    emit("")
    emit("| benchmark | time per call | vs no stream (cpu) |")
    emit("| --- | --- | --- |")
    for name, s in samples.items():
        threads = name.rsplit("/", 1)[1] if "/threads:" in name else "threads:1"
        base = samples.get(f"BM_Events_Success_NoStream/{threads}")
        if base is None:
            base = samples.get("BM_Events_Success_NoStream/threads:1")
        versus = "n/a"
        if base is not None and base.median("cpu") and s.median("cpu") is not None:
            versus = f"{100.0 * (s.median('cpu') / base.median('cpu') - 1.0):+.1f}%"
        emit(f"| {name} | {s.cell()} | {versus} |")
        if name in ("BM_Events_Success_OneOutcomeSubscriber/threads:1",
                    "BM_Events_Success_NoSubscriber/threads:1") and versus != "n/a":
            what = "one outcome subscriber" if "Outcome" in name else "a stream, no subscriber"
            goals.append((f"event stream, {what} / no stream, 1 thread, cpu (goal <= +10%)", versus))
    for name, why in errors.items():
        emit(f"| {name} | error: {why} | |")
    emit("")


def limits_rows(raw, emit, goals):
    """keel_bench_limits: each limit's cost per call next to no limit, and the fleet's chunks."""
    emit("## Limits on calls to a dependency")
    emit("")
    path = os.path.join(raw, "limits.json")
    if not os.path.exists(path):
        emit(skipped(raw, "limits") or "not available")
        emit("")
        return
    samples, _, errors = keel_samples([path])
    emit("A call's permit and its release with a latency (keel::AdaptiveConcurrencyLimit), and a"
         " rate limit's reserve() (keel::RateLimit), next to no limit (an in-flight count kept with"
         " two relaxed atomics). The goal: the adaptive limit's fast path at 20 ns or less (cpu,"
         " 1 thread).")
    emit("")
    emit("| benchmark | time per call | vs no limit (cpu) |")
    emit("| --- | --- | --- |")
    for name, s in samples.items():
        threads = name.rsplit("/", 1)[1] if "/threads:" in name else "threads:1"
        base = samples.get(f"BM_NoLimit/real_time/{threads}")
        versus = "n/a"
        if base is not None and base.median("cpu") and s.median("cpu") is not None:
            versus = f"{s.median('cpu') / base.median('cpu'):.2f}x"
        emit(f"| {name} | {s.cell()} | {versus} |")
        if name == "BM_AdaptiveConcurrencyLimit/real_time/threads:1" and s.median("cpu"):
            goals.append(("adaptive concurrency limit, fast path, 1 thread, cpu (goal <= 20 ns)",
                          f"{s.median('cpu'):.1f} ns ({versus} no limit)"))
    for name, why in errors.items():
        emit(f"| {name} | error: {why} | |")
    emit("")
    trips = {}
    for b in load(path).get("benchmarks", []):
        if "fleet_round_trips_per_1000_calls" in b and b.get("run_type", "iteration") == "iteration":
            trips.setdefault(b.get("run_name", b["name"]), []).append(
                b["fleet_round_trips_per_1000_calls"])
    if trips:
        emit("The fleet's shared bucket: database round trips per 1,000 calls (a chunk of a tenth"
             " of a second's slots per lease, two round trips each; no call waits on them while"
             " the next chunk comes in time).")
        emit("")
        emit("| rate | round trips per 1,000 calls |")
        emit("| --- | --- |")
        for name, values in trips.items():
            emit(f"| {name.rsplit('/', 1)[-1]}/s | {statistics.median(values):.0f} |")
        emit("")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--raw", required=True, help="directory written by scripts/bench.sh")
    parser.add_argument("--out", required=True, help="the markdown file to write")
    args = parser.parse_args()
    raw = args.raw
    machine_path = os.path.join(raw, "machine.json")
    if not os.path.exists(machine_path):
        sys.exit(f"bench_report: {machine_path} is missing (run scripts/bench.sh)")
    keel_paths = sorted(glob.glob(os.path.join(raw, "keel_compare_*.json")))
    if not keel_paths:
        sys.exit(f"bench_report: no keel_compare_*.json in {raw} (run scripts/bench.sh)")
    machine = load(machine_path)
    mach = f"{machine['nproc']} x {machine['cpu_model']}"
    date = machine["date"][:10]
    keel, keel_items, keel_errors = keel_samples(keel_paths)

    lines = []
    emit = lines.append
    emit("# keel next to its peers")
    emit("")
    emit(f"Produced by `make bench` (scripts/bench.sh, {machine['mode']} mode) at {machine['date']}"
         f" on commit {machine['commit']}.")
    emit(f"Machine: {machine['nproc']} CPUs ({machine['cpu_model']}), kernel {machine['kernel']},"
         f" load average at start {machine['load_average_at_start']}.")
    emit(f"Every figure is the median of {machine['runs']} runs, [min-max] the spread; keel and"
         " the peers run in interleaved rounds (keel, then each peer, per round) so that load from"
         " other work on the machine falls on all of them alike. Ratio = keel / peer: below 1"
         " keel is faster. Cells give wall time per call; cpu is the process's CPU time per call"
         " (all threads, so a runtime's GC and helper threads count against it), which is less"
         " disturbed by other load.")
    emit("")
    summary_at = len(lines)
    emit("## 1. Decision overhead (ns per call)")
    emit("")
    emit("Same workloads everywhere: `floor` = a bare call that does one uncontended atomic"
         " increment; `success` = that call wrapped, succeeding first time; `fail_once` = it fails"
         " once and then succeeds, the retry delay computed but not waited (keel: ManualClock;"
         " tenacity: no-op sleep; cenkalti: instant timer; cockatiel cannot skip its timer).")
    emit("")
    emit("| workload | keel | peer | ratio | machine | date |")
    emit("| --- | --- | --- | --- | --- | --- |")

    peers = {}
    by_peer = {}
    for path in sorted(glob.glob(os.path.join(raw, "peer_*_*.json"))):
        key = os.path.basename(path)[len("peer_"):].rsplit("_", 1)[0]
        by_peer.setdefault(key, []).append(load(path))
    for key, docs in by_peer.items():
        peers[key] = merge_peer_runs(docs)
    peer_wins = []
    goals = []  # (what, ratio text): every ratio of this run, listed again at the top

    def row(workload, keel_name, keel_label, peer_key, peer_workload):
        k = keel.get(keel_name)
        if k is None:
            why = keel_errors.get(keel_name, "not measured")
            emit(f"| {workload} | {keel_label}: {why} | | | {mach} | {date} |")
            return
        doc = peers.get(peer_key)
        if doc is None:
            reason = skipped(raw, "peer_" + peer_key) or "not measured"
            emit(f"| {workload} | {keel_label}: {k.cell()} | {peer_key}: skipped ({reason}) | n/a"
                 f" | {mach} | {date} |")
            return
        p = peer_samples(doc).get(peer_workload)
        if p is None:
            emit(f"| {workload} | {keel_label}: {k.cell()} | {doc['peer']}: no such workload | n/a"
                 f" | {mach} | {date} |")
            return
        text, value = ratio(k, p)
        label = f"{doc['peer']} {doc.get('version', '')} ({doc.get('runtime', '')})"
        emit(f"| {workload} | {keel_label}: {k.cell()} | {label}: {p.cell()} | {text} | {mach}"
             f" | {date} |")
        if value is not None and value > 1:
            peer_wins.append(f"{workload}: {doc['peer']} ({text})")
        if peer_key == "cenkalti" and not workload.startswith("floor"):
            goals.append((f"{workload}, keel / {doc['peer']}", text))

    for peer_key, runtime in (("cockatiel", "Node.js"), ("tenacity", "Python"),
                              ("cenkalti", "Go")):
        row(f"floor, {runtime} vs C++", "BM_Floor", "keel (C++)", peer_key, "floor")
    compositions = (
        ("RetryBreaker", "retry + breaker", "cockatiel"),
        ("Breaker", "breaker only", "opossum"),
        ("Retry", "retry only", "tenacity"),
        ("Retry", "retry only", "cenkalti"),
    )
    for keel_prefix, what, peer_key in compositions:
        for workload, suffix in (("success", "Success"), ("fail_once", "FailOnce")):
            row(f"{workload}, {what}", f"BM_{keel_prefix}_{suffix}", "keel", peer_key, workload)
    row("success, retry only, keel on coarse clock", "BM_Retry_Success_CoarseClock", "keel",
        "cenkalti", "success")
    for workload, suffix in (("success", "Success"), ("fail_once", "FailOnce")):
        k = keel.get(f"BM_RetryBreakerBudget_{suffix}")
        if k is not None:
            # No peer has a budget: the ratio is to keel's own retry only, what the guards cost.
            alone = keel.get(f"BM_Retry_{suffix}")
            text = ratio(k, alone)[0] if alone is not None else "n/a"
            emit(f"| {workload}, retry + breaker + budget | keel: {k.cell()} | no peer has a"
                 f" budget; keel retry only: {alone.cell() if alone else 'n/a'} | {text} | {mach}"
                 f" | {date} |")
            goals.append((f"{workload}, retry + breaker + budget / keel retry only", text))
    emit("")

    emit("## 2. Circuit breaker under contention")
    emit("")
    kinds = (("time window", "BM_BreakerRecord", "default 30 s time window, steady clock"),
             ("count window", "BM_BreakerRecordCountWindow", "a count window of the last 100 calls"))
    measured = [(label, what, keel_items.get(f"{name}/real_time/threads:1"),
                 keel_items.get(f"{name}/real_time/threads:2")) for label, name, what in kinds]
    if any(one and two for _, _, one, two in measured):
        emit("try_acquire + record(success) into one shared CircuitBreaker, per window kind."
             " No peer: opossum and cockatiel run on one JavaScript thread. Ratio = calls/s on 2"
             " threads / on 1 thread (above 1: the breaker scales).")
        emit("")
        emit("| workload | keel | peer | ratio | machine | date |")
        emit("| --- | --- | --- | --- | --- | --- |")
        for label, what, one, two in measured:
            if not (one and two):
                emit(f"| breaker record, {label} | not measured | - | n/a | {mach} | {date} |")
                continue
            r = statistics.median(two) / statistics.median(one)
            emit(f"| breaker record, {label} ({what}), 1 thread | {spread([v / 1e6 for v in one], 2)}"
                 f" M calls/s | - | - | {mach} | {date} |")
            emit(f"| breaker record, {label}, 2 threads | {spread([v / 1e6 for v in two], 2)}"
                 f" M calls/s | - | 2 threads / 1 thread = {r:.2f} | {mach} | {date} |")
            goals.append((f"breaker record, {label}: 2 threads / 1 thread", f"{r:.2f}"))
        if machine["nproc"] <= 2:
            emit("")
            emit(f"With {machine['nproc']} CPUs shared with everything else on the machine, two"
                 " threads rarely run at the same time; the scaling figure is a lower bound.")
    else:
        emit("not available: keel_bench_peer_compare did not report BM_BreakerRecord.")
    emit("")

    emit("## 3. Backoff at fleet scale")
    emit("")
    fleet_paths = sorted(glob.glob(os.path.join(raw, "fleet_*.json")))
    if fleet_paths:
        docs = [load(p) for p in fleet_paths]
        clients, retries = docs[0]["clients"], docs[0]["retries"]
        emit(f"{clients} clients fail at the same instant; the dependency stays down; each retries"
             f" {retries} times with the formula. Peak = most retries arriving in one 100 ms slice"
             f" (median over {len(docs)} seeds [min-max]). keel uses keel::Backoff; the peers"
             " their documented defaults (bench/fleet_backoff.cpp). Ratio = keel default / peer.")
        emit("")
        by_name = {}
        for d in docs:
            for r in d["rows"]:
                by_name.setdefault(r["name"], {"row": r, "peak": [], "last": []})
                by_name[r["name"]]["peak"].append(r["peak_per_100ms"])
                by_name[r["name"]]["last"].append(r["median_last_retry_s"])
        keel_default = statistics.median(by_name["keel (default)"]["peak"])
        emit("| workload | keel | peer | ratio | machine | date |")
        emit("| --- | --- | --- | --- | --- | --- |")
        for name, e in by_name.items():
            if e["row"]["keel"]:
                continue
            peak = statistics.median(e["peak"])
            r = keel_default / peak if peak else float("nan")
            emit(f"| peak arrivals / 100 ms vs {name} ({e['row']['formula']}) | keel default:"
                 f" {spread(by_name['keel (default)']['peak'])} | {spread(e['peak'])} | {r:.2f}"
                 f" | {mach} | {date} |")
            if r > 1:
                peer_wins.append(f"fleet peak: {name} ({r:.2f})")
        preset = by_name.get("keel fleet preset")
        if preset is not None:
            # BackoffOptions::fleet(), for many clients that fail together, against each peer.
            preset_peak = statistics.median(preset["peak"])
            ratios = []
            for name, e in by_name.items():
                if e["row"]["keel"]:
                    continue
                peak = statistics.median(e["peak"])
                r = preset_peak / peak if peak else float("nan")
                ratios.append(r)
                emit(f"| peak arrivals / 100 ms vs {name} | keel fleet preset"
                     f" (BackoffOptions::fleet()): {spread(preset['peak'])} | {spread(e['peak'])} |"
                     f" {r:.2f} | {mach} | {date} |")
            if ratios:
                goals.append(("fleet peak, keel fleet preset / each peer",
                              ", ".join(f"{r:.2f}" for r in ratios)))
        emit("")
        emit("All formulas, absolute:")
        emit("")
        emit("| formula | peak / 100 ms | median client's last retry at |")
        emit("| --- | --- | --- |")
        for name, e in by_name.items():
            emit(f"| {name}: {e['row']['formula']} | {spread(e['peak'])} |"
                 f" {spread(e['last'], 2)} s |")
    else:
        emit("not available: no fleet results.")
    emit("")

    for number, item, title in ((4, "serve", "Idempotency layer (wrk over loopback)"),
                                (5, "queue", "Queue (jobs/s vs pgbench)")):
        emit(f"## {number}. {title}")
        emit("")
        path = os.path.join(raw, item + ".txt")
        reason = skipped(raw, item)
        if reason is None and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                text = f.read().strip()
            if item == "serve":
                serve_rows(text, emit, mach, date, goals)
            else:
                queue_rows(text, emit, mach, date, goals)
            emit(f"Output of scripts/bench-{item}.sh:")
            emit("")
            emit("```")
            emit(text or "(no output)")
            emit("```")
        else:
            emit(f"| workload | keel | peer | ratio | machine | date |")
            emit("| --- | --- | --- | --- | --- | --- |")
            emit(f"| {title} | not available | not available | n/a | {mach} | {date} |")
            emit("")
            emit(reason or "not measured")
        emit("")
        if item == "serve":
            emit("### One keep-alive client, and the floor")
            emit("")
            path = os.path.join(raw, "serve_1client.txt")
            reason = skipped(raw, "serve_1client")
            if reason is None and os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    text = f.read().strip()
                serve_one_client_rows(text, emit, mach, date, goals)
                emit("Output of `CONNECTIONS=1 WRK_THREADS=1 scripts/bench-serve.sh`:")
                emit("")
                emit("```")
                emit(text or "(no output)")
                emit("```")
            else:
                emit(reason or "not measured")
            emit("")
            beast_rows(raw, emit, goals)

    emit("## 6. Simulator")
    emit("")
    sim_path = os.path.join(raw, "sim.json")
    if os.path.exists(sim_path):
        samples, items, errors = keel_samples([sim_path])
        emit("Simulated events per second of CPU time (Google Benchmark's rate counter).")
        emit("")
        emit("| benchmark | events per second | wall time per iteration |")
        emit("| --- | --- | --- |")
        for name, s in samples.items():
            rate = items.get(name)
            rate_text = f"{spread([v / 1e6 for v in rate], 2)} M/s" if rate else "n/a"
            emit(f"| {name} | {rate_text} | {fmt_ns(s.median('wall'))} |")
        for name, why in errors.items():
            emit(f"| {name} | error: {why} | |")
    else:
        emit(skipped(raw, "sim") or "not available")
    emit("")

    emit("## 7. HTTP clients vs raw libcurl")
    emit("")
    http_path = os.path.join(raw, "http.json")
    if skipped(raw, "http") is None and os.path.exists(http_path):
        http_rows(http_path, emit, mach, date, goals)
    else:
        emit(skipped(raw, "http") or "not available")
        emit("")

    emit("### gRPC: keel::grpc::Client vs the plain stub and gRPC's own retry policy")
    emit("")
    grpc_path = os.path.join(raw, "grpc.json")
    if skipped(raw, "grpc") is None and os.path.exists(grpc_path):
        grpc_rows(grpc_path, emit, mach, date, goals)
    else:
        emit(skipped(raw, "grpc") or "not available")
        emit("")

    events_rows(raw, emit, goals)
    hedge_rows(raw, emit, goals)
    limits_rows(raw, emit, goals)

    emit("## Where a peer wins in this run")
    emit("")
    if peer_wins:
        for w in peer_wins:
            emit(f"- {w}")
        emit("")
        emit("The reasons, and what would change them, are in bench/README.md.")
    else:
        emit("Nowhere.")
    emit("")
    if keel_errors:
        emit("Errors reported by keel's benchmarks: " +
             "; ".join(f"{k}: {v}" for k, v in keel_errors.items()))
        emit("")

    summary = ["## Every ratio of this run", "",
               "Each goal's ratio as the sections below compute it (their notes say which way is"
               " better).", "", "| what | ratio |", "| --- | --- |"]
    summary += [f"| {what} | {text} |" for what, text in goals] or ["| (none measured) | |"]
    summary.append("")
    lines[summary_at:summary_at] = summary

    with open(args.out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
