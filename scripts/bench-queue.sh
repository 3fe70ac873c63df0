#!/usr/bin/env bash
# Job-queue throughput: jobs per second through enqueue + lease + done (no-op handler, 2 worker
# threads, each on its own connection), on PostgreSQL as a ratio to pgbench's single-row UPDATE
# rate measured on the same server in the same run, with the WAL bytes written per job, and on
# SQLite; each with batch sizes 1, 10 and 100 to show what batching gains, and SQLite unbatched
# with glibc's heap trimming off. Then the table after
# --bloat-jobs jobs (batch 100, in a schema of their own): keel_jobs' and keel_job_attempts' size
# with their indexes, and their live and dead tuples. Between the two, the fleet: keel's Worker
# with 2 to 16 slots in 1 and 4 processes against graphile-worker and pg-boss (npm, bench/peers)
# on the same server, each row at most --fleet-seconds, the six rows of the side-by-side
# comparison (--side-jobs jobs each, with WAL bytes per job and keel's ratio to the best peer),
# and the pickup latency of each.
#
#   scripts/bench-queue.sh [--build-dir DIR] [--jobs N] [--seconds S] [--bloat-jobs N]
#                          [--fleet-jobs N] [--fleet-seconds S] [--side-jobs N]
#
# Needs keel_bench_queue built in DIR (default: build) and Debian's postgresql-15 (pgbench and a
# throwaway server from scripts/pg-test-server.sh; that server runs with fsync=off and
# synchronous_commit=off, for pgbench and the queue alike, so the ratio compares like with like
# but the absolute numbers are higher than on a durable server). Each PostgreSQL row ends with the
# machine's 1-minute load average when it finished.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build="$root/build"
jobs=4000
seconds=10
bloat_jobs=100000
fleet_jobs=30000
fleet_seconds=3
side_jobs=20000
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build-dir) build=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --bloat-jobs) bloat_jobs=$2; shift 2 ;;
    --fleet-jobs) fleet_jobs=$2; shift 2 ;;
    --fleet-seconds) fleet_seconds=$2; shift 2 ;;
    --side-jobs) side_jobs=$2; shift 2 ;;
    *) echo "usage: $0 [--build-dir DIR] [--jobs N] [--seconds S] [--bloat-jobs N] [--fleet-jobs N] [--fleet-seconds S] [--side-jobs N]" >&2; exit 2 ;;
  esac
done
bench=$(find "$build" -name keel_bench_queue -type f -perm -u+x | head -n1)
if [[ -z "$bench" ]]; then
  echo "bench-queue: keel_bench_queue not found under $build (cmake --build $build --target keel_bench_queue)" >&2
  exit 1
fi
PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}

work=$(mktemp -d "${TMPDIR:-/tmp}/keel-bench-queue.XXXXXX")
cleanup() {
  "$root/scripts/pg-test-server.sh" stop "$work/pg" >/dev/null 2>&1 || true
  rm -rf -- "$work"
}
trap cleanup EXIT

"$root/scripts/pg-test-server.sh" start "$work/pg" >/dev/null
pg_url=$(cat "$work/pg/url")

# pgbench: 2 clients, one single-row UPDATE per transaction (the queue's unit of work is a few
# such statements per transaction).
"$PG_BIN/pgbench" -i -q -s 1 "$pg_url" >/dev/null 2>&1
cat >"$work/update.sql" <<'SQL'
\set aid random(1, 100000)
UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :aid;
SQL
pgbench_tps=$("$PG_BIN/pgbench" -n -c 2 -j 2 -T "$seconds" -f "$work/update.sql" "$pg_url" 2>/dev/null |
  awk '/^tps = / { print $3; exit }')
# The machine's load next to each figure: on a shared machine a ratio holds only within one run.
loadavg() { cut -d' ' -f1 /proc/loadavg; }
echo "pgbench single-row UPDATE, 2 clients, ${seconds}s: ${pgbench_tps} tps   load $(loadavg)"

run() {  # run URL BATCH -> prints the result line, sets $rate
  local line
  line=$("$bench" --db "$1" --jobs "$jobs" --workers 2 --batch "$2")
  rate=$(sed -n 's/.*jobs_per_s=\([0-9.]*\).*/\1/p' <<<"$line")
}

echo
echo "PostgreSQL (same server), $jobs jobs, 2 workers: enqueue + lease + done per job"
wal_lsn() { psql "$pg_url" -Atc "SELECT pg_current_wal_insert_lsn()"; }
for batch in 1 10 100; do
  before=$(wal_lsn)
  run "$pg_url" "$batch"
  wal=$(psql "$pg_url" -Atc "SELECT round(pg_wal_lsn_diff('$(wal_lsn)', '$before') / $jobs)")
  ratio=$(awk -v a="$rate" -v b="$pgbench_tps" 'BEGIN { printf "%.2f", a / b }')
  printf '  batch %-4s %10s jobs/s   %s x the pgbench rate   %s WAL bytes/job   load %s\n' "$batch" \
    "$rate" "$ratio" "$wal" "$(loadavg)"
done

# The fleet: keel::store::Worker (what `keel jobs work` runs) with 2, 8 and 16 slots in one
# process and 8 and 16 split over 4 processes, unbatched and leasing 10 at a time, then the npm
# peers (bench/peers/queue_peer.mjs: graphile-worker and pg-boss, each with its own batching) on
# the same server with the same no-op job. Each row drains a backlog for at most $fleet_seconds s.
# Then pickup latency: enqueue to handler start, producer in the worker's process, one job every
# 10-30 ms on an idle queue.
echo
echo "fleet (same server), no-op jobs, at most ${fleet_seconds}s per row: jobs/s and x the pgbench rate"
fleet_row() {  # fleet_row LABEL LINE
  local rate
  rate=$(sed -n 's/.*jobs_per_s=\([0-9.]*\).*/\1/p' <<<"$2")
  printf '  %-46s %10s jobs/s   %s x pgbench   load %s\n' "$1" "$rate" \
    "$(awk -v a="$rate" -v b="$pgbench_tps" 'BEGIN { printf "%.2f", a / b }')" "$(loadavg)"
}
for batch in 1 10; do
  for shape in 2:1 8:1 16:1 8:4 16:4; do
    w=${shape%:*} p=${shape#*:}
    line=$("$bench" --db "$pg_url" --jobs "$fleet_jobs" --workers "$w" --batch "$batch" \
      --worker 1 --processes "$p" --seconds "$fleet_seconds")
    fleet_row "keel Worker batch $batch, $w workers, $p process(es)" "$line"
  done
done
peers="$root/bench/peers"
for peer in graphile-worker pg-boss; do
  if ! command -v node >/dev/null || [[ ! -d "$peers/node_modules/$peer" ]]; then
    echo "  $peer: not installed in bench/peers/node_modules (make bench installs it)"
    continue
  fi
  for batch in 1 10; do
    for w in 2 8 16; do
      if line=$(timeout 60 node "$peers/queue_peer.mjs" --peer "$peer" --db "$pg_url" \
        --jobs "$fleet_jobs" --workers "$w" --batch "$batch" --seconds "$fleet_seconds"); then
        version=$(sed -n 's/.* version=\([^ ]*\).*/\1/p' <<<"$line")
        fleet_row "$peer $version batch $batch, $w workers, 1 process" "$line"
      else
        echo "  $peer batch $batch, $w workers: failed"
      fi
    done
  done
done

# Side by side: the six rows of the queue's comparison (docs/queue.md, "Against graphile-worker
# and pg-boss"), each system in a fresh database of the same server, --side-jobs no-op jobs a
# row: jobs/s, WAL bytes per job (the whole run: a drain's WAL includes its bulk enqueue), and
# keel's ratio to the best peer of the row.
side_row() {  # side_row LABEL KEEL_ARGS -- PEER_ARGS
  local label=$1 keel_args=() peer_args=() line rate wal db best=0 best_name="" keel_rate=0
  shift
  while [[ $1 != -- ]]; do keel_args+=("$1"); shift; done
  shift
  peer_args=("$@")
  printf '  %s\n' "$label"
  for system in keel graphile-worker pg-boss; do
    if [[ $system != keel ]] && { ! command -v node >/dev/null ||
      [[ ! -d "$peers/node_modules/$system" ]]; }; then
      continue
    fi
    db="side_$RANDOM$RANDOM"
    psql "$pg_url" -qc "CREATE DATABASE $db"
    local url="${pg_url%/*}/$db" before
    before=$(psql "$url" -Atc "SELECT pg_current_wal_insert_lsn()")
    if [[ $system == keel ]]; then
      line=$("$bench" --db "$url" --jobs "$side_jobs" "${keel_args[@]}" || true)
    else
      line=$(timeout 120 node "$peers/queue_peer.mjs" --peer "$system" --db "$url" \
        --jobs "$side_jobs" --seconds 60 "${peer_args[@]}" || true)
    fi
    wal=$(psql "$url" -Atc "SELECT round(pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '$before') / $side_jobs)")
    psql "$pg_url" -qc "DROP DATABASE $db"
    rate=$(sed -n 's/.*jobs_per_s=\([0-9.]*\).*/\1/p' <<<"$line")
    if [[ -z $rate ]]; then
      printf '    %-16s failed\n' "$system"
      continue
    fi
    printf '    %-16s %10s jobs/s   %5s WAL bytes/job   load %s\n' "$system" "$rate" "$wal" "$(loadavg)"
    if [[ $system == keel ]]; then
      keel_rate=$rate
    elif awk -v a="$rate" -v b="$best" 'BEGIN { exit !(a > b) }'; then
      best=$rate best_name=$system
    fi
  done
  if [[ -n $best_name ]]; then
    printf '    keel / best peer (%s): %s\n' "$best_name" \
      "$(awk -v a="$keel_rate" -v b="$best" 'BEGIN { printf "%.2f", a / b }')"
  fi
}
echo
echo "side by side, $side_jobs no-op jobs a row, each system in a fresh database (pgbench ${pgbench_tps} tps above)"
side_row "enqueue + drain, batch 1" --workers 2 --batch 1 --cycle 1 -- --mode cycle --workers 2 --batch 1
side_row "enqueue + drain, batch 100" --workers 2 --batch 100 --cycle 1 -- --mode cycle --workers 2 --batch 100
side_row "enqueue one job per call, 2 threads" --workers 2 --enqueue 1 -- --mode enqueue --workers 2 --chunk 1
side_row "bulk enqueue, 100 per call, 2 threads" --workers 2 --enqueue 100 -- --mode enqueue --workers 2 --chunk 100
side_row "Worker drain unbatched, 8 slots" --workers 8 --batch 1 --worker 1 --seconds 60 -- --workers 8 --batch 1
side_row "Worker drain batch 100, 2 slots" --workers 2 --batch 100 --worker 1 --seconds 60 -- --workers 2 --batch 100

echo
echo "pickup latency (enqueue to handler start, producer in the same process, 200 jobs 10-30 ms apart)"
latency_row() {  # latency_row LABEL LINE
  printf '  %-24s median %8s ms   p99 %8s ms\n' "$1" \
    "$(sed -n 's/.*median_ms=\([0-9.]*\).*/\1/p' <<<"$2")" "$(sed -n 's/.*p99_ms=\([0-9.]*\).*/\1/p' <<<"$2")"
}
latency_row "keel Worker" "$("$bench" --db "$pg_url" --latency 200 --gap-ms 10 --producer thread)"
for peer in graphile-worker pg-boss; do
  [[ -d "$peers/node_modules/$peer" ]] && command -v node >/dev/null || continue
  if line=$(timeout 60 node "$peers/queue_peer.mjs" --peer "$peer" --db "$pg_url" --latency 200 \
    --gap-ms 10); then
    latency_row "$peer $(sed -n 's/.* version=\([^ ]*\).*/\1/p' <<<"$line")" "$line"
  fi
done

if ((bloat_jobs > 0)); then
  psql "$pg_url" -q -c "CREATE SCHEMA bench_bloat"
  bloat_url="$pg_url?options=-csearch_path%3Dbench_bloat"
  "$bench" --db "$bloat_url" --jobs "$bloat_jobs" --workers 2 --batch 100 >/dev/null
  echo
  echo "table after $bloat_jobs jobs on PostgreSQL (batch 100; autovacuum as configured):"
  psql "$bloat_url" -At -F ' ' -c "SELECT relname, pg_total_relation_size(relid), n_live_tup,
      n_dead_tup FROM pg_stat_user_tables WHERE schemaname = 'bench_bloat'
      AND relname IN ('keel_jobs', 'keel_job_attempts') ORDER BY relname" |
    while read -r name bytes live dead; do
      printf '  %-18s %8.1f MB with indexes  %9s live  %9s dead tuples\n' "$name" \
        "$(awk -v b="$bytes" 'BEGIN { print b / 1048576 }')" "$live" "$dead"
    done
fi

echo
echo "SQLite (file in $work, WAL), $jobs jobs, 2 workers"
for batch in 1 10 100; do
  run "sqlite:$work/queue-$batch.db" "$batch"
  printf '  batch %-4s %10s jobs/s\n' "$batch" "$rate"
done

# The same unbatched run with glibc's heap trimming off. Before schema version 4, SQLite
# allocated and freed a temporary b-tree's page cache in most of a job's statements, and glibc
# handed the top of the worker thread's heap back to the kernel (madvise) only to fault it in
# again; with those gone the two rows should agree (docs/queue.md).
echo
echo "SQLite with heap trimming off (MALLOC_TRIM_THRESHOLD_=67108864), $jobs jobs, 2 workers"
MALLOC_TRIM_THRESHOLD_=67108864 run "sqlite:$work/queue-no-trim.db" 1
printf '  batch %-4s %10s jobs/s\n' 1 "$rate"
