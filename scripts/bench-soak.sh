#!/usr/bin/env bash
# The held-snapshot soak: a producer at --rate jobs a second and a worker (2 slots, --batch) run
# for --seconds on a fresh PostgreSQL server while, from --hold-from to --hold-to seconds, another
# session holds a REPEATABLE READ snapshot (the classic queue failure: VACUUM may remove no dead
# version younger than it, so every finished job's dead versions stay in the tables and indexes).
# keel (keel_bench_queue --soak, a keel::store::Worker with `keel jobs work`'s defaults) runs
# first, then graphile-worker and pg-boss (bench/peers, npm) on servers of their own. Prints per
# system: jobs handled a second before the hold, through it (and its slowest second) and in its
# last 60 s, the largest backlog, how long after the release the backlog was gone, the three
# statements that took the most server time in the hold's last 60 s (pg_stat_statements: mean ms
# and buffers a call), and the queue's tables with their indexes at the start and at the end.
#
#   scripts/bench-soak.sh [--build-dir DIR] [--rate R] [--seconds S] [--hold-from A]
#                         [--hold-to B] [--batch N] [--only keel|graphile-worker|pg-boss]
#                         [--keep-done 0|1]
#
# --keep-done 0 runs keel's queue with QueueOptions::keep_done false (`keel jobs work
# --retain-done 0s`): each success deletes its job, as graphile-worker does.
# Defaults: 2,000 jobs a second for 360 s, the snapshot held from 60 s to 300 s, batch 1. The
# server runs with fsync off (scripts/pg-test-server.sh) and autovacuum on, as configured by
# default. Not in CI: it takes 6 minutes a system.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build="$root/build"
rate=2000
seconds=360
hold_from=60
hold_to=300
batch=1
only=""
keep_done=1
usage() {
  echo "usage: $0 [--build-dir DIR] [--rate R] [--seconds S] [--hold-from A] [--hold-to B] [--batch N] [--only keel|graphile-worker|pg-boss] [--keep-done 0|1]" >&2
  exit 2
}
while [[ $# -gt 0 ]]; do
  [[ $# -ge 2 ]] || usage
  case "$1" in
    --build-dir) build=$2 ;;
    --rate) rate=$2 ;;
    --seconds) seconds=$2 ;;
    --hold-from) hold_from=$2 ;;
    --hold-to) hold_to=$2 ;;
    --batch) batch=$2 ;;
    --only) only=$2 ;;
    --keep-done) keep_done=$2 ;;
    *) usage ;;
  esac
  shift 2
done
for n in "$rate" "$seconds" "$hold_from" "$hold_to" "$batch"; do
  [[ "$n" =~ ^[0-9]+$ && "$n" -gt 0 ]] || { echo "bench-soak: '$n' is not a positive whole number" >&2; exit 2; }
done
if ((hold_from < 5 || hold_from + 60 > hold_to || hold_to > seconds)); then
  echo "bench-soak: need 5 <= --hold-from, --hold-from + 60 <= --hold-to <= --seconds (got $hold_from, $hold_to, $seconds)" >&2
  exit 2
fi
case "$only" in ""|keel|graphile-worker|pg-boss) ;; *) usage ;; esac
case "$keep_done" in 0|1) ;; *) usage ;; esac
bench=$(find "$build" -name keel_bench_queue -type f -perm -u+x | head -n1)
if [[ -z "$bench" && ( -z "$only" || "$only" == keel ) ]]; then
  echo "bench-soak: keel_bench_queue not found under $build (cmake --build $build --target keel_bench_queue)" >&2
  exit 1
fi
peers="$root/bench/peers"
work=$(mktemp -d "${TMPDIR:-/tmp}/keel-bench-soak.XXXXXX")
holder=""
runner=""
cleanup() {
  [[ -n "$holder" ]] && kill "$holder" 2>/dev/null || true
  [[ -n "$runner" ]] && kill "$runner" 2>/dev/null || true
  "$root/scripts/pg-test-server.sh" stop "$work/pg" >/dev/null 2>&1 || true
  rm -rf -- "$work"
}
trap cleanup EXIT

# The queue's tables with their indexes, in MB, of a system's schema.
tables_mb() {  # tables_mb URL SCHEMA_PATTERN
  psql "$1" -Atc "SELECT round(coalesce(sum(pg_total_relation_size(c.oid)), 0) / 1048576.0, 1)
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE c.relkind = 'r' AND n.nspname LIKE '$2'"
}

soak_one() {  # soak_one SYSTEM
  local system=$1 out="$work/$1.out" url schema
  KEEL_PG_OPTIONS="-c shared_preload_libraries=pg_stat_statements" \
    "$root/scripts/pg-test-server.sh" start "$work/pg" >/dev/null
  url=$(cat "$work/pg/url")
  psql "$url" -qc "CREATE EXTENSION pg_stat_statements" >/dev/null
  case "$system" in
    keel) schema=public ;;
    graphile-worker) schema=graphile_worker% ;;
    pg-boss) schema=pgboss% ;;
  esac
  case "$system" in
    keel) "$bench" --db "$url" --soak "$rate" --seconds "$seconds" --workers 2 --batch "$batch" \
      --keep-done "$keep_done" >"$out" 2>"$work/$system.err" & ;;
    *) node "$peers/queue_peer.mjs" --peer "$system" --db "$url" --mode soak --rate "$rate" \
      --seconds "$seconds" --workers 2 --batch "$batch" >"$out" 2>"$work/$system.err" & ;;
  esac
  runner=$!
  local start_mb=""
  # The tables once the system has made them (a few seconds in), then the hold.
  sleep 5
  start_mb=$(tables_mb "$url" "$schema")
  sleep $((hold_from - 5))
  psql "$url" -q >/dev/null 2>&1 <<SQL &
BEGIN ISOLATION LEVEL REPEATABLE READ;
SELECT count(*) FROM pg_class;
SELECT pg_sleep($((hold_to - hold_from)));
COMMIT;
SQL
  holder=$!
  sleep 2
  if [[ $(psql "$url" -Atc "SELECT count(*) FROM pg_stat_activity WHERE backend_xmin IS NOT NULL
      AND query LIKE '%pg_sleep%' AND pid <> pg_backend_pid()") -lt 1 ]]; then
    echo "  $system: the snapshot is not held (its session failed); the figures are not a hold's" >&2
  fi
  local rest=$((hold_to - hold_from - 62))
  ((rest > 0)) && sleep "$rest"
  psql "$url" -Atqc "SELECT pg_stat_statements_reset()" >/dev/null
  sleep 60
  local top
  top=$(psql "$url" -At -F '|' -c "SELECT round(mean_exec_time::numeric, 3),
      round((shared_blks_hit + shared_blks_read)::numeric / greatest(calls, 1), 0), calls,
      regexp_replace(left(query, 90), '\s+', ' ', 'g')
    FROM pg_stat_statements WHERE query NOT LIKE '%pg_stat_statements%'
      AND query NOT LIKE '%pg_sleep%' ORDER BY total_exec_time DESC LIMIT 3")
  wait "$holder" 2>/dev/null || true
  holder=""
  local finished=0
  wait "$runner" && finished=1
  runner=""
  if ((!finished)); then
    echo "  $system: failed; its stderr:" >&2
    tail -n 20 "$work/$system.err" >&2
    "$root/scripts/pg-test-server.sh" stop "$work/pg" >/dev/null
    return 0
  fi
  local end_mb
  end_mb=$(tables_mb "$url" "$schema")
  "$root/scripts/pg-test-server.sh" stop "$work/pg" >/dev/null
  awk -v from="$hold_from" -v to="$hold_to" -v name="$system" -v start_mb="$start_mb" \
    -v end_mb="$end_mb" '
    /^soak t=/ {
      split($2, a, "="); t = a[2] + 0
      split($4, h, "="); split($5, b, "=")
      handled[t] = h[2] + 0; backlog[t] = b[2] + 0; last = t
    }
    /mode=soak/ { summary = $0 }
    END {
      for (t = 1; t <= last; t++) {
        if (t <= from) { before += handled[t]; nb++ }
        else if (t <= to) {
          during += handled[t]; nd++
          if (t > to - 60) { tail += handled[t]; nt++ }
          if (low == "" || handled[t] < low) low = handled[t]
        }
        if (backlog[t] > most) most = backlog[t]
      }
      caught = "not within the run"
      for (t = to + 1; t <= last; t++) if (backlog[t] <= backlog[from] + 100) { caught = (t - to) " s"; break }
      printf "%s: %s\n", name, summary
      printf "  handled/s: before the hold %.0f, through it %.0f (its slowest second %d), in its last 60 s %.0f; largest backlog %d; backlog gone %s after the release\n",
        before / (nb ? nb : 1), during / (nd ? nd : 1), low, tail / (nt ? nt : 1), most, caught
      printf "  tables with indexes: %s MB at 5 s, %s MB at the end\n", start_mb, end_mb
    }' "$out"
  echo "  the statements that took the most server time in the hold's last 60 s (mean ms, buffers a call, calls):"
  while IFS='|' read -r mean bufs calls query; do
    printf '    %8s ms %8s buffers %8s calls  %s\n' "$mean" "$bufs" "$calls" "$query"
  done <<<"$top"
}

echo "held-snapshot soak: $rate jobs/s for $seconds s, a snapshot held from $hold_from s to $hold_to s, 2 slots, batch $batch (load $(cut -d' ' -f1 /proc/loadavg))"
for system in keel graphile-worker pg-boss; do
  [[ -z "$only" || "$only" == "$system" ]] || continue
  if [[ "$system" != keel ]] && { ! command -v node >/dev/null || [[ ! -d "$peers/node_modules/$system" ]]; }; then
    echo "$system: not installed in bench/peers/node_modules (make bench installs it)"
    continue
  fi
  soak_one "$system"
done
