#!/usr/bin/env bash
# A fleet through PgBouncer: PROCESSES `keel jobs work` processes (CONCURRENCY slots each, 100 x 4
# by default) drain JOBS jobs through PgBouncer in transaction pooling mode with a pool of POOL
# server connections (20), in front of a server that allows MAX_CONNECTIONS (50): what a fleet
# that outgrows max_connections runs. Prints the drain time, the jobs done and dead, the server
# connections in use at the peak, and the workers' database errors.
#
#   scripts/bench-pooler.sh [BUILD_DIR]     (default build; env PROCESSES, CONCURRENCY, JOBS, POOL,
#                                            MAX_CONNECTIONS)
#
# Run by `make bench` (scripts/bench.sh) and by hand; not by ctest (a hundred processes).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../build}
keel=$build/bin/keel
processes=${PROCESSES:-100}
concurrency=${CONCURRENCY:-4}
jobs=${JOBS:-4000}
pool=${POOL:-20}
max_connections=${MAX_CONNECTIONS:-50}
[[ -x "$keel" ]] || { echo "bench-pooler: $keel not found (build first)" >&2; exit 1; }
command -v pgbouncer >/dev/null || { echo "bench-pooler: pgbouncer not installed (scripts/bootstrap.sh --test)" >&2; exit 1; }

state=$(mktemp -d "${TMPDIR:-/tmp}/keel-pooler.XXXXXX")
work=$state/work
mkdir -p "$work"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  "$here/pg-cluster.sh" stop "$state/cluster" >/dev/null 2>&1 || true
  rm -rf "$state"
}
trap cleanup EXIT

PGC_MAX_CONNECTIONS=$max_connections "$here/pg-cluster.sh" start "$state/cluster" --async \
  --pgbouncer --pool-size "$pool" >/dev/null
direct=$("$here/pg-cluster.sh" node-url "$state/cluster" node1)
pooled="$("$here/pg-cluster.sh" bouncer-url "$state/cluster")?keel_pooler=transaction"

"$keel" migrate --db "$direct" --component queue >/dev/null
seq 1 "$jobs" | sed 's/.*/{"n": &}/' >"$work/payloads"
"$keel" jobs --db "$pooled" enqueue --queue fleet --payloads-from "$work/payloads" >/dev/null

start=$(date +%s.%N)
for i in $(seq 1 "$processes"); do
  "$keel" jobs --db "$pooled" work --queue fleet --exec 'exit 0' --concurrency "$concurrency" \
    --lease 30s --poll 200ms --exit-when-idle 2>"$work/worker$i.log" &
  pids+=($!)
done
peak=0
while :; do
  left=$(psql "$direct" -Atc "SELECT count(*) FROM keel_jobs WHERE queue = 'fleet' AND state NOT IN ('done', 'dead')")
  in_use=$(psql "$direct" -Atc "SELECT count(*) FROM pg_stat_activity WHERE datname = 'keel_drill' AND usename = 'keel'")
  (( in_use > peak )) && peak=$in_use
  [[ $left == 0 ]] && break
  if (( $(echo "$(date +%s.%N) - $start > 300" | bc) )); then echo "bench-pooler: not drained in 300 s ($left left)"; break; fi
  sleep 0.5
done
drained=$(echo "$(date +%s.%N) - $start" | bc)
for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
pids=()
done_jobs=$(psql "$direct" -Atc "SELECT count(*) FROM keel_jobs WHERE queue = 'fleet' AND state = 'done'")
dead=$(psql "$direct" -Atc "SELECT count(*) FROM keel_jobs WHERE queue = 'fleet' AND state = 'dead'")
errors=$(cat "$work"/worker*.log | grep -c "SQLSTATE" || true)
printf 'pooler: %d processes x %d slots through PgBouncer (transaction pooling, pool %d) on max_connections %d: %d jobs drained in %.1f s (%.0f jobs/s); done %d, dead %d; server connections of the role at the peak %d; worker log lines with a SQLSTATE %d\n' \
  "$processes" "$concurrency" "$pool" "$max_connections" "$jobs" "$drained" \
  "$(echo "$jobs / $drained" | bc -l)" "$done_jobs" "$dead" "$peak" "$errors"
grep -h "SQLSTATE" "$work"/worker*.log | sort | uniq -c | sort -rn | head -3 || true
