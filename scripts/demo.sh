#!/usr/bin/env bash
# make demo: keel's whole story on real parts, on loopback, with SQLite files in a temporary
# folder.
#
#  1. `keel-demo serve` runs a flaky payments API: 503s (some with Retry-After), slow requests, and
#     "commit then drop the response" (the charge is written, the answer never arrives).
#  2. The same 500 charge jobs are drained twice: by a naive retry loop (immediate retries, a
#     fresh Idempotency-Key per attempt: the bug the seeds warn about), then by keel (a durable
#     queue whose jobs carry one key from enqueue, full-jitter backoff, keel's HTTP client with a
#     per-host circuit breaker).
#  3. The outage: jobs arrive at a steady rate while the payments API goes down (every request
#     answered 503) for a stretch and comes back; naive retries and keel's queue, side by side:
#     requests sent while it was down, jobs given up or dead-lettered, time to drain after it is
#     back.
#  4. A side-by-side report from what the server committed, then a short retry-storm simulation
#     with a picture.
#
# Exits non-zero if keel's run shows a duplicate or a lost charge.
#   scripts/demo.sh [--jobs N]   (KEEL=path/to/keel, KEEL_DEMO=path/to/keel-demo: other binaries;
#                                 KEEL_DEMO_OUT=DIR: where the picture goes, default build/demo)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
keel=${KEEL:-$root/build/bin/keel}
keel_demo=${KEEL_DEMO:-$root/build/bin/keel-demo}
jobs=500
while (($#)); do
  case "$1" in
    --jobs)
      jobs=${2:-}
      [[ "$jobs" =~ ^[1-9][0-9]{0,4}$ ]] || { echo "demo: --jobs needs a number from 1 to 99999" >&2; exit 2; }
      shift 2 ;;
    *) echo "demo: unknown option '$1' (expected --jobs N)" >&2; exit 2 ;;
  esac
done
[[ -x "$keel" ]] || { echo "demo: $keel is missing; run 'make demo'" >&2; exit 1; }
[[ -x "$keel_demo" ]] || { echo "demo: $keel_demo is missing; run 'make demo'" >&2; exit 1; }
command -v curl >/dev/null || { echo "demo: curl is needed (scripts/bootstrap.sh installs it)" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/keel-demo.XXXXXX")
out_dir=${KEEL_DEMO_OUT:-$root/build/demo}
mkdir -p "$out_dir"
pids=()
cleanup() {
  local rc=$? pid f
  # A run that failed shows what its servers said before their logs go with $work.
  if ((rc != 0)); then
    for f in "$work"/*-serve.log; do
      [[ -f "$f" ]] || continue
      echo "--- ${f##*/}, its last 20 lines:" >&2
      tail -n 20 "$f" >&2
    done
  fi
  # Servers an outage subshell started (it records them) and ours.
  [[ -f "$work/outage.pids" ]] && pids+=($(cat "$work/outage.pids"))
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'echo; echo "demo: interrupted, cleaning up" >&2; exit 130' INT TERM

step() { printf '\n== %s\n' "$*"; }
now_ms() { date +%s%3N; }

# The same faults, from the same seed, for both runs.
chaos=(--chaos-503 0.2 --chaos-503-retry-after 200ms --chaos-delay-fraction 0.05 --chaos-delay 300ms
       --chaos-drop-after-commit 0.1 --chaos-seed 42)

# start_server NAME [FLAGS...]: starts `keel-demo serve` on a free port with the run's own SQLite
# file; sets $url.
start_server() {
  local name=$1 log="$work/$1-serve.log"
  shift
  "$keel_demo" serve --listen "${LISTEN:-127.0.0.1:0}" --db "sqlite:$work/$name-payments.db" --threads 16 \
    "$@" >"$log" 2>&1 &
  pids+=($!)
  local i
  for i in $(seq 1 100); do
    # The server's shell opens $log: it may not exist yet on the first look.
    url=$(sed -n 's/^keel-demo serve: listening on \(http:\/\/[0-9.]*:[0-9]*\).*/\1/p' "$log" 2>/dev/null || true)
    if [[ -n "$url" ]]; then
      # It said where it listens: it answers there, or the run stops here saying why.
      curl -sS -m 5 -o /dev/null "$url/metrics" && return 0
      if kill -0 "${pids[-1]}" 2>/dev/null; then
        echo "demo: keel-demo serve is running but does not answer on $url" >&2
      else
        local status=0
        wait "${pids[-1]}" 2>/dev/null || status=$?
        echo "demo: keel-demo serve exited (status $status) after it printed $url" >&2
      fi
      exit 1
    fi
    kill -0 "${pids[-1]}" 2>/dev/null || { cat "$log" >&2; echo "demo: keel-demo serve exited" >&2; exit 1; }
    sleep 0.1
  done
  echo "demo: keel-demo serve did not start" >&2
  exit 1
}

stop_server() {
  local pid=${pids[-1]} state
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  # In a subshell (the outage) the server is not our child: wait until it has exited (gone, or a
  # zombie: its port is free either way), bounded.
  for _ in $(seq 1 100); do
    state=$(awk '/^State:/ { print $2 }' "/proc/$pid/status" 2>/dev/null || true)
    [[ -z "$state" || "$state" == Z ]] && break
    sleep 0.05
  done
  unset 'pids[-1]'
}

payload() { printf '{"amount":%d,"currency":"usd","customer":"cus_%05d"}' $((1000 + $1)) "$1"; }

# audit NAME: restarts the run's server without faults on the same database and counts, for
# every job's customer, the charges it committed. Sets $duplicates (extra charges), $lost
# (customers with none) and $charged.
audit() {
  stop_server
  start_server "$1"
  local i
  for i in $(seq 1 "$jobs"); do printf 'url = "%s/v1/charges?customer=cus_%05d"\n' "$url" "$i"; done \
    >"$work/audit.curl"
  # One curl process, one kept-alive connection: every charge in the answers names its customer.
  curl -sS --config "$work/audit.curl" | { grep -o '"customer":"cus_[0-9]*"' || true; } | sort \
    | uniq -c >"$work/audit.counts"
  charged=$(awk '{ s += $1 } END { print s + 0 }' "$work/audit.counts")
  duplicates=$(awk '$1 > 1 { s += $1 - 1 } END { print s + 0 }' "$work/audit.counts")
  lost=$((jobs - $(wc -l <"$work/audit.counts")))
  stop_server
}

metric() { curl -sS "$url/metrics" | awk -v m="$1" '$1 == m { s += $2 } END { print s + 0 }'; }
requests_seen() {
  # Every POST the server answered or dropped: idempotency outcomes plus injected 503s.
  curl -sS "$url/metrics" | awk '/^keel_idempotency_requests_total|^keel_chaos_injected_total\{fault="503"\}/ { s += $2 } END { print s + 0 }'
}

echo "keel demo: $jobs charge jobs against a flaky payments API, naive retries vs keel"
echo "faults: 20% 503 (Retry-After 200ms), 5% slow (300ms), 10% commit-then-drop-the-response"

# ---------------------------------------------------------------------------------------------
step "1/4 naive: immediate retries, 4 attempts, a fresh Idempotency-Key per attempt"
start_server naive "${chaos[@]}"
export url
naive_job() {
  local i=$1 attempt key code sent=0
  local body
  body=$(payload "$i")
  for attempt in 1 2 3 4; do
    key=$(cat /proc/sys/kernel/random/uuid)  # the bug: a new key inside the loop
    sent=$((sent + 1))
    code=$(curl -s -o /dev/null -w '%{http_code}' -m 2 -X POST "$url/v1/charges" \
      -H 'Content-Type: application/json' -H "Idempotency-Key: $key" -d "$body" || true)
    [[ "$code" == 2* ]] && { echo "$sent ok"; return 0; }
  done
  echo "$sent failed"
}
export -f naive_job payload
t0=$(now_ms)
seq 1 "$jobs" | xargs -P 8 -I{} bash -c 'naive_job {}' >"$work/naive.out"
naive_ms=$(($(now_ms) - t0))
naive_sent=$(awk '{ s += $1 } END { print s + 0 }' "$work/naive.out")
naive_gave_up=$(grep -c failed "$work/naive.out" || true)
naive_seen=$(requests_seen)
audit naive
naive_dups=$duplicates naive_lost=$lost naive_charged=$charged
echo "naive: $naive_sent requests, $naive_charged charges committed for $jobs jobs in $((naive_ms / 1000)).$(((naive_ms % 1000) / 100))s"

# ---------------------------------------------------------------------------------------------
step "2/4 keel: a durable queue (one key per job from enqueue), full-jitter backoff, per-host breaker"
start_server keel "${chaos[@]}"
queue_db="sqlite:$work/queue.db"
t0=$(now_ms)
for i in $(seq 1 "$jobs"); do payload "$i"; echo; done >"$work/payloads.jsonl"
"$keel" jobs --db "$queue_db" enqueue --queue charges --payloads-from "$work/payloads.jsonl" \
  --max-attempts 8 >/dev/null
echo "enqueued $jobs jobs, each with its own Idempotency-Key, in $(($(now_ms) - t0)) ms"
"$keel" jobs --db "$queue_db" work --queue charges --deliver "$url/v1/charges" --concurrency 8 \
  --backoff-base 50ms --backoff-cap 2s --timeout 1s --poll 20ms --exit-when-idle \
  >"$work/worker.log" 2>&1 || { cat "$work/worker.log" >&2; echo "demo: the keel worker failed" >&2; exit 1; }
keel_ms=$(($(now_ms) - t0))
keel_seen=$(requests_seen)
audit keel
keel_dups=$duplicates keel_lost=$lost keel_charged=$charged
dead=$("$keel" dlq --db "$queue_db" depth)
echo "keel: $keel_seen requests, $keel_charged charges committed for $jobs jobs in $((keel_ms / 1000)).$(((keel_ms % 1000) / 100))s"
if [[ "$dead" != "0" ]]; then
  echo "dead-letter queue ($dead jobs; replay with: keel dlq --db URL replay --all):"
  "$keel" dlq --db "$queue_db" list | head -n 10
fi
# A customer without a charge is lost only if its job is not waiting in the dead-letter queue.
keel_unexplained=$keel_lost
if ((keel_lost > 0)) && [[ "$dead" != "0" ]]; then
  keel_unexplained=$((keel_lost > dead ? keel_lost - dead : 0))
fi

# ---------------------------------------------------------------------------------------------
step "3/4 the outage: the API answers every request with 503 for ${outage_s:=6}s, mid-run"
# Jobs arrive at 20 a second for a few seconds; a second in, the API goes down (a server on the
# same port that answers 503 to everything), then comes back on the same database.
outage_jobs=$((jobs < 100 ? jobs : 100))
arrivals() { local i; for i in $(seq 1 "$outage_jobs"); do echo "$i"; sleep 0.05; done; }
# outage NAME: takes the API down after 1 s for $outage_s seconds, then brings it back; sets
# $down_requests (what the down API answered) and $back_ms (when it came back).
outage() {
  trap - EXIT  # the parent cleans up
  local port=${url##*:}
  sleep 1
  stop_server
  LISTEN=127.0.0.1:$port start_server "$1" --chaos-503 1
  echo "${pids[-1]}" >>"$work/outage.pids"
  sleep "$outage_s"
  down_requests=$(metric 'keel_chaos_injected_total{fault="503"}')
  stop_server
  LISTEN=127.0.0.1:$port start_server "$1"
  echo "${pids[-1]}" >>"$work/outage.pids"
  back_ms=$(now_ms)
  echo "$down_requests $back_ms ${pids[-1]}" >"$work/$1.outage"
}
# after_outage NAME: the parent's view of what the outage subshell did: the API that came back is
# the parent's to stop.
after_outage() {
  local server
  read -r down_requests back_ms server <"$work/$1.outage"
  unset 'pids[-1]'
  pids+=("$server")
}

start_server naive-outage
outage naive-outage &
outage_pid=$!
arrivals | xargs -P 8 -I{} bash -c 'naive_job {}' >"$work/naive-outage.out"
naive_done_ms=$(now_ms)
wait "$outage_pid"
after_outage naive-outage
naive_down=$down_requests
naive_out_gave_up=$(grep -c failed "$work/naive-outage.out" || true)
naive_drain_ms=$((naive_done_ms > back_ms ? naive_done_ms - back_ms : 0))
stop_server

start_server keel-outage
outage_db="sqlite:$work/outage-queue.db"
"$keel" jobs --db "$outage_db" enqueue --queue charges --payload "$(payload 0)" >/dev/null
"$keel" jobs --db "$outage_db" work --queue charges --deliver "$url/v1/charges" --concurrency 8 \
  --backoff-base 50ms --backoff-cap 2s --timeout 1s --poll 20ms >"$work/outage-worker.log" 2>&1 &
worker_pid=$!
echo "$worker_pid" >>"$work/outage.pids"  # cleaned up with the outage's servers
outage keel-outage &
outage_pid=$!
arrivals | while read -r i; do
  "$keel" jobs --db "$outage_db" enqueue --queue charges --payload "$(payload "$i")" >/dev/null
done
wait "$outage_pid"
after_outage keel-outage
keel_down=$down_requests
# Drained: nothing ready, running or scheduled for retry (bounded wait).
for _ in $(seq 1 600); do
  busy=$("$keel" jobs --db "$outage_db" stats --json | awk -F: '/"(ready|running|retry_scheduled)"/ { s += $2 } END { print s + 0 }')
  ((busy == 0)) && break
  sleep 0.1
done
keel_drain_ms=$(($(now_ms) - back_ms))
kill -TERM "$worker_pid" 2>/dev/null || true
wait "$worker_pid" 2>/dev/null || true
keel_out_dead=$("$keel" dlq --db "$outage_db" depth)
((busy == 0)) || { cat "$work/outage-worker.log" >&2; echo "demo: keel's queue did not drain after the outage" >&2; exit 1; }
grep -h 'circuit' "$work/outage-worker.log" || true
stop_server
secs() { printf '%d.%ds' $(($1 / 1000)) $((($1 % 1000) / 100)); }

# ---------------------------------------------------------------------------------------------
step "report"
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2fx", (b > 0 ? a / b : 0) }'; }
printf '%-34s %12s %12s\n' "" "naive" "keel"
printf '%-34s %12s %12s\n' "jobs" "$jobs" "$jobs"
printf '%-34s %12s %12s\n' "requests the server saw" "$naive_seen" "$keel_seen"
printf '%-34s %12s %12s\n' "amplification (requests / jobs)" "$(ratio "$naive_seen" "$jobs")" "$(ratio "$keel_seen" "$jobs")"
printf '%-34s %12s %12s\n' "duplicate charges" "$naive_dups" "$keel_dups"
printf '%-34s %12s %12s\n' "customers never charged" "$naive_lost" "$keel_lost"
printf '%-34s %12s %12s\n' "  of which gave up / dead-lettered" "$naive_gave_up" "$dead"
printf '%-34s %12s %12s\n' "time taken" "$((naive_ms / 1000)).$(((naive_ms % 1000) / 100))s" "$((keel_ms / 1000)).$(((keel_ms % 1000) / 100))s"
printf '%-34s %12s %12s\n' "outage: jobs arriving" "$outage_jobs" "$outage_jobs"
printf '%-34s %12s %12s\n' "outage: requests while it was down" "$naive_down" "$keel_down"
printf '%-34s %12s %12s\n' "outage: given up / dead-lettered" "$naive_out_gave_up" "$keel_out_dead"
printf '%-34s %12s %12s\n' "outage: drained after it was back" "$(secs "$naive_drain_ms")" "$(secs "$keel_drain_ms")"
echo
echo "naive: a dropped response after a commit was retried under a new key, so the server charged again;"
echo "       a job that ran out of its 4 immediate attempts was simply given up (nothing remembers it)."
echo "keel:  every retry carried the job's key, so a repeat was replayed, not re-charged; a job out of"
echo "       attempts would wait in the dead-letter queue, counted and replayable."
echo "outage: naive gave up on every job that arrived while the API was down; keel's breaker opened,"
echo "       the queue deferred those jobs without spending their attempts, probed once per break,"
echo "       and delivered them all when the API came back."

# ---------------------------------------------------------------------------------------------
step "4/4 the same story as a retry storm (keel sim, demo-story: a 3 s blip, then a 10 s outage)"
plot="$out_dir/retry-storm.svg"
"$keel" sim run --scenario demo-story --policy naive --policy full-jitter \
  --policy full-jitter+budget --plot "$plot" >"$work/sim.txt"
echo "picture: $plot (one panel per policy: attempts/s against the CAPACITY line, phases shaded)"
sed -n '/^story:/,$p' "$work/sim.txt"

status=0
if ((keel_dups > 0)); then
  echo "demo: FAILED: keel's run committed $keel_dups duplicate charges" >&2
  status=1
fi
if [[ "$keel_out_dead" != "0" ]]; then
  echo "demo: FAILED: keel's queue dead-lettered $keel_out_dead jobs during the outage" >&2
  status=1
fi
if ((keel_unexplained > 0)); then
  echo "demo: FAILED: keel's run lost $keel_unexplained charges (not charged, not dead-lettered)" >&2
  status=1
fi
exit $status
