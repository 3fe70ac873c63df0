#!/usr/bin/env bash
# Job-queue throughput: jobs per second through enqueue + lease + done (no-op handler, 2 worker
# threads, each on its own connection), on PostgreSQL as a ratio to pgbench's single-row UPDATE
# rate measured on the same server in the same run, and on SQLite; each with batch sizes 1, 10
# and 100 to show what batching gains.
#
#   scripts/bench-queue.sh [--build-dir DIR] [--jobs N] [--seconds S]
#
# Needs keel_bench_queue built in DIR (default: build) and Debian's postgresql-15 (pgbench and a
# throwaway server from scripts/pg-test-server.sh; that server runs with fsync=off and
# synchronous_commit=off, for pgbench and the queue alike, so the ratio compares like with like
# but the absolute numbers are higher than on a durable server).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build="$root/build"
jobs=4000
seconds=10
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build-dir) build=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    *) echo "usage: $0 [--build-dir DIR] [--jobs N] [--seconds S]" >&2; exit 2 ;;
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
echo "pgbench single-row UPDATE, 2 clients, ${seconds}s: ${pgbench_tps} tps"

run() {  # run URL BATCH -> prints the result line, sets $rate
  local line
  line=$("$bench" --db "$1" --jobs "$jobs" --workers 2 --batch "$2")
  rate=$(sed -n 's/.*jobs_per_s=\([0-9.]*\).*/\1/p' <<<"$line")
}

echo
echo "PostgreSQL (same server), $jobs jobs, 2 workers: enqueue + lease + done per job"
for batch in 1 10 100; do
  run "$pg_url" "$batch"
  ratio=$(awk -v a="$rate" -v b="$pgbench_tps" 'BEGIN { printf "%.2f", a / b }')
  printf '  batch %-4s %10s jobs/s   %s x the pgbench rate\n' "$batch" "$rate" "$ratio"
done

echo
echo "SQLite (file in $work, WAL), $jobs jobs, 2 workers"
for batch in 1 10 100; do
  run "sqlite:$work/queue-$batch.db" "$batch"
  printf '  batch %-4s %10s jobs/s\n' "$batch" "$rate"
done
