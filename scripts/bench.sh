#!/usr/bin/env bash
# keel next to the libraries users would otherwise pick, on this machine, in one run.
# What `make bench` runs. Writes bench/results/latest.md (the table) and bench/results/raw/*.json.
#
#   scripts/bench.sh                      full run: installs what is missing (Debian packages via
#                                         scripts/bootstrap.sh --bench, npm packages into
#                                         bench/peers/node_modules), 5 runs of everything
#   scripts/bench.sh --smoke              one short iteration of each program, installs nothing,
#                                         skips (with a message) peers that are not installed;
#                                         the ctest test bench.harness.smoke runs this
#   --build-dir DIR   where keel's benchmark binaries were built (default build/, the release preset)
#   --out DIR         where latest.md and raw/ go (default bench/results)
#   --runs N          measured runs per workload (default 5; medians and spread over them)
#
# Rows 4 and 5 (idempotency layer under wrk, job queue against pgbench) come from
# scripts/bench-serve.sh and scripts/bench-queue.sh when those exist (run with the build directory as
# their argument and in KEEL_BUILD_DIR, 15 minutes at most, output quoted in the report); row 4's
# one-client table from bench-serve.sh again with CONNECTIONS=1 WRK_THREADS=1; row 6 from the
# simulator's benchmark (keel_bench_sim) when it was built; row 7 (both HTTP clients against raw
# libcurl) from keel_bench_http, its benchmarks in randomly interleaved repetitions; row 8 (the
# event stream on the success path) from keel_bench_events. Missing ones are reported as "not
# available". scripts/bench-beast.sh (the idempotency layer on the Boost.Beast server) writes
# raw/beast.txt, a markdown table of its own, when keel_bench_beast_serve was built and wrk is
# installed. scripts/patroni-drill.sh (keel across a Patroni switchover and a killed leader) writes
# raw/patroni.txt when patroni and etcd are installed. scripts/bench-pooler.sh (a hundred
# workers through PgBouncer) writes raw/pooler.txt when pgbouncer is installed.
# scripts/bench-soak.sh (the job queues with a snapshot held) writes raw/soak.txt.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
smoke=0
build_dir="$root/build"
out="$root/bench/results"
runs=5

usage() {
  echo "bench: $1" >&2
  echo "usage: scripts/bench.sh [--smoke] [--build-dir DIR] [--out DIR] [--runs N>=1]" >&2
  exit 2
}

while (($#)); do
  case "$1" in
    --smoke) smoke=1 ;;
    --build-dir | --out | --runs)
      (($# >= 2)) || usage "missing value for $1"
      case "$1" in
        --build-dir) build_dir=$2 ;;
        --out) out=$2 ;;
        --runs)
          [[ "$2" =~ ^[1-9][0-9]*$ ]] || usage "--runs needs an integer >= 1, got '$2'"
          runs=$2
          ;;
      esac
      shift
      ;;
    *) usage "unknown option '$1'" ;;
  esac
  shift
done

log() { echo "bench: $*" >&2; }

command -v python3 >/dev/null || usage "python3 is needed to write the report (Debian python3)"

bin="$build_dir/bin"
[[ -x "$bin/keel_bench_peer_compare" && -x "$bin/keel_bench_fleet" ]] ||
  usage "keel_bench_peer_compare or keel_bench_fleet not found in $bin (build first: make build)"

if ((smoke)); then
  runs=1
  node_iterations=200
  py_iterations=100
  go_iterations=1000
  fleet_clients=200
  min_time=0.001
  http_min_time=0.001
else
  node_iterations=200000
  py_iterations=50000
  go_iterations=1000000
  fleet_clients=10000
  min_time=0.5
  http_min_time=1
fi

raw="$out/raw"
mkdir -p "$raw"
rm -f "$raw"/*.json "$raw"/*.txt "$raw"/*.skip

# --- install what is missing (full run only) ---------------------------------------------------
peers="$root/bench/peers"
if ((!smoke)); then
  "$root/scripts/bootstrap.sh" --bench
  if command -v npm >/dev/null &&
    { [[ ! -d "$peers/node_modules/cockatiel" || ! -d "$peers/node_modules/opossum" ||
      ! -d "$peers/node_modules/graphile-worker" || ! -d "$peers/node_modules/pg-boss" ]] ||
      [[ "$peers/package-lock.json" -nt "$peers/node_modules" ]]; }; then
    log "installing the npm peers into bench/peers/node_modules"
    (cd "$peers" && npm ci --no-audit --no-fund --loglevel=error)
  fi
fi

# --- the machine ---------------------------------------------------------------------------------
cpu_model=$(grep -m1 '^model name' /proc/cpuinfo 2>/dev/null | sed 's/^model name[[:space:]]*:[[:space:]]*//')
cat >"$raw/machine.json" <<EOF
{"nproc": $(nproc), "cpu_model": "${cpu_model:-unknown}",
 "date": "$(date -u +%Y-%m-%dT%H:%M:%SZ)", "kernel": "$(uname -r)",
 "load_average_at_start": "$(cut -d' ' -f1-3 /proc/loadavg)",
 "mode": "$( ((smoke)) && echo smoke || echo full)", "runs": $runs,
 "commit": "$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"}
EOF

skip() {  # skip NAME REASON
  log "skipping $1: $2"
  printf '%s\n' "$2" >"$raw/$1.skip"
}

# --- which peers can run --------------------------------------------------------------------------
declare -a peer_names=() peer_cmds=()
if ! command -v node >/dev/null; then
  skip peer_cockatiel "node is not installed (scripts/bootstrap.sh --bench installs nodejs)"
  skip peer_opossum "node is not installed (scripts/bootstrap.sh --bench installs nodejs)"
else
  for peer in cockatiel opossum; do
    if [[ -d "$peers/node_modules/$peer" ]]; then
      peer_names+=("$peer")
      peer_cmds+=("node $peers/$peer.js --iterations $node_iterations --runs 1")
    else
      skip "peer_$peer" "npm package $peer is not installed in bench/peers/node_modules (make bench installs it)"
    fi
  done
fi

python_peer=${KEEL_BENCH_PYTHON:-/usr/bin/python3}
[[ -x "$python_peer" ]] || python_peer=$(command -v python3 || true)
if [[ -n "$python_peer" ]] && "$python_peer" -c 'import tenacity' 2>/dev/null; then
  peer_names+=(tenacity)
  peer_cmds+=("$python_peer $peers/tenacity_peer.py --iterations $py_iterations --runs 1")
else
  skip peer_tenacity "python3 module tenacity is not installed (Debian python3-tenacity)"
fi

gocode=/usr/share/gocode
if command -v go >/dev/null && [[ -d "$gocode/src/github.com/cenkalti/backoff" ]]; then
  log "cenkalti/backoff: building offline against $gocode"
  go_version=$(dpkg-query -W -f='${Version}' golang-github-cenkalti-backoff-dev 2>/dev/null || echo v4)
  (cd "$peers/cenkalti" &&
    GOPATH=$gocode GO111MODULE=off GOFLAGS='' GOCACHE="$out/.gocache" \
      go build -ldflags "-X main.version=$go_version" -o "$out/.cenkalti-peer" main.go)
  peer_names+=(cenkalti)
  peer_cmds+=("$out/.cenkalti-peer -iterations $go_iterations -runs 1")
else
  skip peer_cenkalti "go or the cenkalti/backoff sources are not installed (Debian golang-go, golang-github-cenkalti-backoff-dev)"
fi

# --- decision overhead: keel and the peers in interleaved rounds -------------------------------
# The programs run one after another; on a shared machine the load changes between them. Each
# round runs every program once, so every median mixes the same moments for keel and the peers.
for ((round = 1; round <= runs; round++)); do
  log "round $round/$runs: keel ${peer_names[*]}"
  "$bin/keel_bench_peer_compare" --benchmark_min_time="$min_time" \
    --benchmark_out="$raw/keel_compare_$round.json" --benchmark_out_format=json \
    >"$raw/keel_compare_$round.log.txt" 2>&1
  for i in "${!peer_names[@]}"; do
    # shellcheck disable=SC2086 # the command line is split on purpose
    ${peer_cmds[$i]} >"$raw/peer_${peer_names[$i]}_$round.json"
  done
done

# --- backoff at fleet scale ----------------------------------------------------------------------
log "fleet backoff: $fleet_clients clients, $runs seeds"
for ((seed = 1; seed <= runs; seed++)); do
  "$bin/keel_bench_fleet" --clients "$fleet_clients" --seed "$seed" >"$raw/fleet_$seed.json"
done

# --- idempotency layer and queue (scripts owned by the store and queue work) ---------------------
for item in serve queue; do
  script="$root/scripts/bench-$item.sh"
  if ((smoke)); then
    skip "$item" "not run in smoke mode (needs wrk/PostgreSQL and minutes)"
  elif [[ -x "$script" ]]; then
    log "$item: running scripts/bench-$item.sh"
    # bench-serve.sh takes the build directory as its argument, bench-queue.sh as --build-dir.
    args=("$build_dir")
    [[ $item == queue ]] && args=(--build-dir "$build_dir")
    if ! KEEL_BUILD_DIR="$build_dir" timeout 900 "$script" "${args[@]}" >"$raw/$item.txt" \
      2>"$raw/$item.stderr.txt"; then
      skip "$item" "scripts/bench-$item.sh failed (see raw/$item.stderr.txt)"
    fi
  else
    skip "$item" "not available: scripts/bench-$item.sh does not exist yet"
  fi
done

# One keep-alive client: the latency of one idempotent POST, with and without the layer and on
# the minimal server.
if ((smoke)); then
  skip serve_1client "not run in smoke mode (needs wrk/PostgreSQL and minutes)"
elif [[ -x "$root/scripts/bench-serve.sh" ]]; then
  log "serve, one client: running CONNECTIONS=1 WRK_THREADS=1 scripts/bench-serve.sh"
  if ! CONNECTIONS=1 WRK_THREADS=1 DURATION=${KEEL_BENCH_SERVE_1CLIENT_DURATION:-5s} \
    KEEL_BUILD_DIR="$build_dir" timeout 900 "$root/scripts/bench-serve.sh" "$build_dir" \
    >"$raw/serve_1client.txt" 2>"$raw/serve_1client.stderr.txt"; then
    skip serve_1client "scripts/bench-serve.sh with one client failed (see raw/serve_1client.stderr.txt)"
  fi
else
  skip serve_1client "not available: scripts/bench-serve.sh does not exist yet"
fi

# Boost.Beast: keel::store::beast::Server with and without the idempotency layer, and the bare
# Beast server doing the same insert (scripts/bench-beast.sh; raw/beast.txt holds its table).
if ((smoke)); then
  skip beast "not run in smoke mode (needs wrk/PostgreSQL and minutes)"
elif [[ ! -x "$bin/keel_bench_beast_serve" ]]; then
  skip beast "not available: keel_bench_beast_serve was not built (bench/beast_serve.cpp, needs keel::store_beast)"
elif ! command -v wrk >/dev/null; then
  skip beast "wrk is not installed (Debian wrk)"
else
  log "beast: running scripts/bench-beast.sh"
  if ! timeout 900 "$root/scripts/bench-beast.sh" "$build_dir" >"$raw/beast.txt" \
    2>"$raw/beast.stderr.txt"; then
    skip beast "scripts/bench-beast.sh failed (see raw/beast.stderr.txt)"
  fi
fi

# The Patroni failover drill: keel workers across a switchover and a killed leader
# (scripts/patroni-drill.sh; raw/patroni.txt holds its figures).
if ((smoke)); then
  skip patroni "not run in smoke mode (a Patroni cluster and minutes)"
elif ! command -v patroni >/dev/null || ! command -v etcd >/dev/null; then
  skip patroni "patroni or etcd is not installed (Debian patroni, etcd-server)"
else
  log "patroni: running scripts/patroni-drill.sh"
  if ! timeout 600 "$root/scripts/patroni-drill.sh" --build-dir "$build_dir" >"$raw/patroni.txt" \
    2>"$raw/patroni.stderr.txt"; then
    skip patroni "scripts/patroni-drill.sh failed (see raw/patroni.stderr.txt)"
  fi
fi

# A fleet through PgBouncer: 100 worker processes of 4 slots on a pool of 20 server connections
# (scripts/bench-pooler.sh; raw/pooler.txt holds its figures).
if ((smoke)); then
  skip pooler "not run in smoke mode (a hundred worker processes)"
elif ! command -v pgbouncer >/dev/null; then
  skip pooler "pgbouncer is not installed (scripts/bootstrap.sh --test)"
else
  log "pooler: running scripts/bench-pooler.sh"
  if ! timeout 600 "$root/scripts/bench-pooler.sh" "$build_dir" >"$raw/pooler.txt" \
    2>"$raw/pooler.stderr.txt"; then
    skip pooler "scripts/bench-pooler.sh failed (see raw/pooler.stderr.txt)"
  fi
fi

# The held-snapshot soak: keel, graphile-worker and pg-boss at 2,000 jobs/s for 6 minutes each
# with a snapshot held for 4 (scripts/bench-soak.sh; raw/soak.txt holds its figures).
if ((smoke)); then
  skip soak "not run in smoke mode (6 minutes a queue)"
else
  log "soak: running scripts/bench-soak.sh"
  if ! timeout 1500 "$root/scripts/bench-soak.sh" --build-dir "$build_dir" >"$raw/soak.txt" \
    2>"$raw/soak.stderr.txt"; then
    skip soak "scripts/bench-soak.sh failed (see raw/soak.stderr.txt)"
  fi
fi

# --- HTTP clients against raw libcurl -----------------------------------------------------------
if [[ -x "$bin/keel_bench_http" ]]; then
  log "HTTP clients vs raw libcurl: keel_bench_http ($runs interleaved repetitions)"
  if ! "$bin/keel_bench_http" --benchmark_min_time="$http_min_time" \
    --benchmark_repetitions="$runs" --benchmark_enable_random_interleaving=true \
    --benchmark_out="$raw/http.json" --benchmark_out_format=json >"$raw/http.log.txt" 2>&1; then
    skip http "keel_bench_http failed (see raw/http.log.txt)"
  fi
else
  skip http "not available: keel_bench_http was not built (bench/http_bench.cpp, needs keel::http)"
fi

# --- gRPC client against the plain stub and gRPC's own retry policy -----------------------------
if [[ -x "$bin/keel_bench_grpc" ]]; then
  log "gRPC client vs the plain stub and gRPC's retry policy: keel_bench_grpc ($runs repetitions)"
  if ! "$bin/keel_bench_grpc" --benchmark_min_time="$http_min_time" \
    --benchmark_repetitions="$runs" --benchmark_enable_random_interleaving=true \
    --benchmark_out="$raw/grpc.json" --benchmark_out_format=json >"$raw/grpc.log.txt" 2>&1; then
    skip grpc "keel_bench_grpc failed (see raw/grpc.log.txt)"
  fi
else
  skip grpc "not available: keel_bench_grpc was not built (bench/grpc_bench.cpp, needs keel::grpc)"
fi

# --- simulator -----------------------------------------------------------------------------------
sim_bench=""
for candidate in "$bin"/keel_bench_sim*; do
  [[ -x "$candidate" ]] && sim_bench=$candidate && break
done
if [[ -n "$sim_bench" ]]; then
  log "simulator: $(basename "$sim_bench") ($runs runs)"
  "$sim_bench" --benchmark_repetitions="$runs" --benchmark_min_time="$min_time" \
    --benchmark_out="$raw/sim.json" --benchmark_out_format=json >"$raw/sim.log.txt" 2>&1
else
  skip sim "not available: no keel_bench_sim* program was built (bench/sim_bench.cpp)"
fi

# --- event stream: the success path without and with subscribers --------------------------------
if [[ -x "$bin/keel_bench_events" ]]; then
  log "event stream: keel_bench_events ($runs runs)"
  # Interleaved repetitions: the variants share the machine's load, so their ratios hold.
  "$bin/keel_bench_events" --benchmark_repetitions="$runs" --benchmark_min_time="$min_time" \
    --benchmark_enable_random_interleaving=true \
    --benchmark_out="$raw/events.json" --benchmark_out_format=json >"$raw/events.log.txt" 2>&1
else
  skip events "not available: keel_bench_events was not built (bench/events_bench.cpp)"
fi

# --- limits on calls to a dependency: adaptive concurrency and rate limit, next to none ---------
if [[ -x "$bin/keel_bench_limits" ]]; then
  log "limits: keel_bench_limits ($runs runs)"
  "$bin/keel_bench_limits" --benchmark_repetitions="$runs" --benchmark_min_time="$min_time" \
    --benchmark_enable_random_interleaving=true \
    --benchmark_out="$raw/limits.json" --benchmark_out_format=json >"$raw/limits.log.txt" 2>&1
else
  skip limits "not available: keel_bench_limits was not built (bench/limits_bench.cpp)"
fi

# --- hedging: on but not triggered, next to off -----------------------------------------------------
if [[ -x "$bin/keel_bench_hedge" ]]; then
  log "hedging: keel_bench_hedge ($runs runs)"
  "$bin/keel_bench_hedge" --benchmark_repetitions="$runs" --benchmark_min_time="$min_time" \
    --benchmark_enable_random_interleaving=true \
    --benchmark_out="$raw/hedge.json" --benchmark_out_format=json >"$raw/hedge.log.txt" 2>&1
else
  skip hedge "not available: keel_bench_hedge was not built (bench/hedge_bench.cpp)"
fi

# --- report --------------------------------------------------------------------------------------
python3 "$root/scripts/bench_report.py" --raw "$raw" --out "$out/latest.md"
log "wrote $out/latest.md"
