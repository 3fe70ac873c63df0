#!/usr/bin/env bash
# Throughput of POST /v1/charges on Boost.Beast, on SQLite and on PostgreSQL, measured with wrk
# over loopback: keel::store::beast::Server with the idempotency layer (on_idempotent) and without
# it (on_async posting the same insert, in its own transaction, to a thread pool), and the
# smallest Boost.Beast server doing that insert (bench/beast_serve.cpp has the three modes). Every
# request carries a fresh Idempotency-Key, so the layer does its full work (claim, transactional
# completion) on every request. A fourth mode, record, is nolayer whose transaction also inserts a
# completed keel_idempotency row of the layer's size: record/nolayer is what storing the answer
# costs by itself, and layer/record what the layer costs beyond that. The modes run one after
# another in the same run, each after a warm-up, so each run's ratios share its moment of the
# machine's load.
#
#   scripts/bench-beast.sh [BUILD_DIR]        (default: build; needs BUILD_DIR/bin/keel_bench_beast_serve)
#
# Environment: DURATION (default 5s), WARMUP (1s), CONNECTIONS (16), WRK_THREADS (2), WORKERS (16:
# worker threads, one database connection each), BACKENDS ("sqlite postgres"). PostgreSQL is a
# throwaway server from scripts/pg-test-server.sh with durable settings (fsync on), one schema per
# mode; SQLite is a WAL file per mode in a temp dir. Prints a markdown table: requests/s of each
# mode, nolayer/bare and layer/nolayer per backend, and the non-2xx answers when there were any.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
server=$build/bin/keel_bench_beast_serve
DURATION=${DURATION:-5s}
WARMUP=${WARMUP:-1s}
CONNECTIONS=${CONNECTIONS:-16}
WRK_THREADS=${WRK_THREADS:-2}
WORKERS=${WORKERS:-16}
BACKENDS=${BACKENDS:-sqlite postgres}

[[ -x "$server" ]] || { echo "bench-beast: $server not found (build first)" >&2; exit 1; }
command -v wrk >/dev/null || { echo "bench-beast: wrk not installed (apt-get install wrk)" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/keel-bench-beast.XXXXXX")
server_pid=
cleanup() {
  if [[ -n "$server_pid" ]]; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  "$root/scripts/pg-test-server.sh" stop "$work/pg" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

# The request of scripts/bench-serve.sh: the same charge, a key that never repeats.
cat >"$work/charges.lua" <<'LUA'
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

# run_one MODE DB_URL: runs MODE's server on DB_URL, measures it after a warm-up and sets rps and
# non2xx. Runs in this shell (not a subshell), so that cleanup sees the server's pid.
run_one() {
  "$server" --mode "$1" --db "$2" --workers "$WORKERS" >"$work/serve.log" 2>&1 &
  server_pid=$!
  local port=
  for _ in $(seq 1 100); do
    port=$(grep -o '127\.0\.0\.1:[0-9]*' "$work/serve.log" 2>/dev/null | head -1 | cut -d: -f2 || true)
    [[ -n "$port" ]] && break
    sleep 0.1
  done
  [[ -n "$port" ]] || { echo "bench-beast: the $1 server did not start" >&2; cat "$work/serve.log" >&2; exit 1; }
  local duration
  for duration in "$WARMUP" "$DURATION"; do
    wrk -t"$WRK_THREADS" -c"$CONNECTIONS" -d"$duration" -s "$work/charges.lua" \
      "http://127.0.0.1:$port" >"$work/wrk.out" 2>&1 || {
      echo "bench-beast: wrk failed against the $1 server on $backend" >&2
      cat "$work/wrk.out" "$work/serve.log" >&2
      exit 1
    }
  done
  if ! kill "$server_pid" 2>/dev/null; then
    local status=0
    wait "$server_pid" || status=$?
    echo "bench-beast: the $1 server on $backend exited during the run (status $status)" >&2
    cat "$work/serve.log" >&2
    exit 1
  fi
  local status=0
  wait "$server_pid" 2>/dev/null || status=$?
  ((status == 0)) || echo "bench-beast: the $1 server on $backend stopped with status $status" >&2
  server_pid=
  rps=$(awk '/^Requests\/sec:/ {print $2}' "$work/wrk.out")
  non2xx=$(awk '/Non-2xx/ {print $NF}' "$work/wrk.out")
  non2xx=${non2xx:-0}
  [[ -n "$rps" ]] || { echo "bench-beast: wrk gave no rate for $1 on $backend" >&2; cat "$work/wrk.out" "$work/serve.log" >&2; exit 1; }
}

echo "| backend | bare req/s | nolayer req/s | record req/s | layer req/s | nolayer/bare | record/nolayer | layer/nolayer | layer/record |"
echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
notes=()
for backend in $BACKENDS; do
  declare -A url=()
  case $backend in
    sqlite)
      for mode in bare nolayer record layer; do url[$mode]="sqlite:$work/$mode.db"; done
      ;;
    postgres)
      KEEL_PG_DURABLE=1 "$root/scripts/pg-test-server.sh" start "$work/pg" >/dev/null
      base=$(cat "$work/pg/url")
      for mode in bare nolayer record layer; do
        psql "$base" -q -c "CREATE SCHEMA bench_$mode"
        url[$mode]="$base?options=-csearch_path%3Dbench_$mode"
      done
      ;;
    *) echo "bench-beast: unknown backend $backend" >&2; exit 2 ;;
  esac
  run_one bare "${url[bare]}"
  rps_bare=$rps bad_bare=$non2xx
  run_one nolayer "${url[nolayer]}"
  rps_nolayer=$rps bad_nolayer=$non2xx
  run_one record "${url[record]}"
  rps_record=$rps bad_record=$non2xx
  run_one layer "${url[layer]}"
  rps_layer=$rps bad_layer=$non2xx
  awk -v n="$backend" -v b="$rps_bare" -v o="$rps_nolayer" -v r="$rps_record" -v l="$rps_layer" \
    'BEGIN { printf "| %s | %.0f | %.0f | %.0f | %.0f | %.2f | %.2f | %.2f | %.2f |\n",
             n, b, o, r, l, o / b, r / o, l / o, l / r }'
  if [[ $bad_bare != 0 || $bad_nolayer != 0 || $bad_record != 0 || $bad_layer != 0 ]]; then
    notes+=("$backend non-2xx answers: bare $bad_bare, nolayer $bad_nolayer, record $bad_record, layer $bad_layer")
  fi
  if [[ $backend == postgres ]]; then
    "$root/scripts/pg-test-server.sh" stop "$work/pg" >/dev/null
  fi
  unset url
done
echo
for note in "${notes[@]}"; do echo "$note"; done
echo "(wrk -t$WRK_THREADS -c$CONNECTIONS -d$DURATION after a $WARMUP warm-up, $WORKERS workers," \
  "$(nproc) CPUs, load average at the end $(cut -d' ' -f1-3 /proc/loadavg))"
