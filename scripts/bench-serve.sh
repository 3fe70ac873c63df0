#!/usr/bin/env bash
# Throughput of POST /v1/charges with and without the idempotency layer, on SQLite and on
# PostgreSQL, measured with wrk over loopback. Every request carries a fresh Idempotency-Key, so
# the layer does its full work (claim, transactional completion) on every request.
#
#   scripts/bench-serve.sh [BUILD_DIR]        (default: build; needs BUILD_DIR/bin/keel-demo)
#
# Environment: DURATION (default 10s), CONNECTIONS (16), WRK_THREADS (2), SERVER_THREADS (16),
# BACKENDS ("sqlite postgres"). PostgreSQL is a throwaway server from scripts/pg-test-server.sh
# with durable settings (fsync on); SQLite is a WAL file with synchronous=NORMAL in a temp dir.
# Prints requests/s, p99 and p50 latency for each run, and the with/without ratio per backend.
# One keep-alive client's latency per request: CONNECTIONS=1 WRK_THREADS=1.
# keel-demo serve runs on keel::store::beast::Server while the floor is a bare cpp-httplib
# server, so the server ratio here includes the change of framework; scripts/bench-beast.sh
# compares against a bare Beast server.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
keel_demo=$build/bin/keel-demo
floor=$build/bin/keel_bench_serve_floor
DURATION=${DURATION:-10s}
CONNECTIONS=${CONNECTIONS:-16}
WRK_THREADS=${WRK_THREADS:-2}
SERVER_THREADS=${SERVER_THREADS:-16}
BACKENDS=${BACKENDS:-sqlite postgres}

[[ -x "$keel_demo" ]] || { echo "bench-serve: $keel_demo not found (build first)" >&2; exit 1; }
command -v wrk >/dev/null || { echo "bench-serve: wrk not installed (apt-get install wrk)" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/keel-bench.XXXXXX")
server_pid=
cleanup() {
  [[ -n "$server_pid" ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null || true
  "$root/scripts/pg-test-server.sh" stop "$work/pg" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

cat >"$work/charges.lua" <<'LUA'
-- Each wrk thread numbers its requests under a prefix of its own (set from the main state, where
-- every thread gets a different number); keys never repeat across threads or runs.
counter = 0
prefix = "unset-"
local next_thread = 0
function setup(thread)
  next_thread = next_thread + 1
  thread:set("prefix", string.format("%d-%d-t%d-", os.time(), math.random(1, 1e9), next_thread))
end
function request()
  counter = counter + 1
  local headers = {
    ["Content-Type"] = "application/json",
    ["Authorization"] = "Bearer bench",
    ["Idempotency-Key"] = prefix .. counter,
  }
  return wrk.format("POST", "/v1/charges", headers,
                    '{"amount": 1250, "currency": "EUR", "customer": "cus_bench"}')
end
LUA

# run_one DB_URL [--no-idempotency | --floor]: prints "rps p99 non2xx p50". --floor runs
# keel_bench_serve_floor (bench/serve_floor.cpp: a bare cpp-httplib server doing the same insert)
# instead of keel-demo serve.
run_one() {
  local db=$1
  shift
  if [[ ${1:-} == --floor ]]; then
    "$floor" --db "$db" --threads "$SERVER_THREADS" >"$work/serve.log" 2>&1 &
  else
    "$keel_demo" serve --listen 127.0.0.1:0 --db "$db" --threads "$SERVER_THREADS" "$@" \
      >"$work/serve.log" 2>&1 &
  fi
  server_pid=$!
  local port=
  for _ in $(seq 1 100); do
    port=$(grep -o '127\.0\.0\.1:[0-9]*' "$work/serve.log" 2>/dev/null | head -1 | cut -d: -f2 || true)
    [[ -n "$port" ]] && break
    sleep 0.1
  done
  [[ -n "$port" ]] || { cat "$work/serve.log" >&2; exit 1; }
  wrk -t"$WRK_THREADS" -c"$CONNECTIONS" -d"$DURATION" --latency -s "$work/charges.lua" \
    "http://127.0.0.1:$port" >"$work/wrk.out" 2>&1
  curl -s "http://127.0.0.1:$port/metrics" >"$work/metrics.txt" || true
  kill "$server_pid"
  wait "$server_pid" 2>/dev/null || true
  server_pid=
  local rps p99 non2xx
  rps=$(awk '/^Requests\/sec:/ {print $2}' "$work/wrk.out")
  p99=$(awk '$1 == "99%" {print $2}' "$work/wrk.out")
  p50=$(awk '$1 == "50%" {print $2}' "$work/wrk.out")
  non2xx=$(awk '/Non-2xx/ {print $NF}' "$work/wrk.out")
  echo "$rps $p99 ${non2xx:-0} $p50"
  # What the non-2xx answers were, from the server's own counters.
  grep -E '^keel_(idempotency_requests_total\{outcome="(in_progress|mismatch|error|not_stored|replayed)"|rate_limited_total)' \
    "$work/metrics.txt" | grep -v ' 0$' | sed 's/^/    # /' >&2 || true
}

printf '%-9s %-16s %12s %10s %8s %10s\n' backend mode requests/s p99 non-2xx p50
for backend in $BACKENDS; do
  case $backend in
    sqlite)
      url_with="sqlite:$work/with.db" url_without="sqlite:$work/without.db"
      url_floor="sqlite:$work/floor.db"
      ;;
    postgres)
      KEEL_PG_DURABLE=1 "$root/scripts/pg-test-server.sh" start "$work/pg" >/dev/null
      base=$(cat "$work/pg/url")
      psql "$base" -q -c "CREATE SCHEMA bench_with" -c "CREATE SCHEMA bench_without" \
        -c "CREATE SCHEMA bench_floor"
      url_with="$base?options=-csearch_path%3Dbench_with"
      url_without="$base?options=-csearch_path%3Dbench_without"
      url_floor="$base?options=-csearch_path%3Dbench_floor"
      ;;
    *) echo "bench-serve: unknown backend $backend" >&2; exit 2 ;;
  esac
  read -r rps_without p99_without bad_without p50_without < <(run_one "$url_without" --no-idempotency)
  read -r rps_with p99_with bad_with p50_with < <(run_one "$url_with")
  printf '%-9s %-16s %12s %10s %8s %10s\n' "$backend" "no idempotency" "$rps_without" "$p99_without" \
    "$bad_without" "$p50_without"
  printf '%-9s %-16s %12s %10s %8s %10s\n' "$backend" "idempotency" "$rps_with" "$p99_with" \
    "$bad_with" "$p50_with"
  awk -v a="$rps_with" -v b="$rps_without" -v n="$backend" \
    'BEGIN { printf "%-9s ratio with/without: %.2f\n", n, a / b }'
  if [[ -x "$floor" ]]; then
    read -r rps_floor p99_floor bad_floor p50_floor < <(run_one "$url_floor" --floor)
    printf '%-9s %-16s %12s %10s %8s %10s\n' "$backend" "floor (httplib)" "$rps_floor" \
      "$p99_floor" "$bad_floor" "$p50_floor"
    awk -v a="$rps_without" -v b="$rps_floor" -v n="$backend" \
      'BEGIN { printf "%-9s ratio without/floor: %.2f\n", n, a / b }'
  fi
  if [[ $backend == postgres ]]; then
    "$root/scripts/pg-test-server.sh" stop "$work/pg" >/dev/null
  fi
done
echo "(wrk -t$WRK_THREADS -c$CONNECTIONS -d$DURATION, keel-demo serve --threads $SERVER_THREADS, $(nproc) CPUs shared)"
