#!/usr/bin/env bash
# keel under a real failover manager: a Patroni 3.0 cluster of two PostgreSQL 15 nodes with
# etcd 3.4 (Debian's patroni and etcd-server, installed by scripts/bootstrap.sh --bench), all on
# loopback, and three `keel jobs work --share-breakers` workers draining a queue through the
# multi-host URL (target_session_attrs=read-write). Two events, each in the middle of a drain:
#
#   1. a switchover (patronictl switchover: the leader is demoted and restarted as a replica,
#      the replica promoted);
#   2. the leader killed (SIGKILL of its Patroni and its PostgreSQL): the replica's Patroni
#      takes the leader key when the old one expires (ttl), and promotes.
#
# For each it prints the figures: jobs lost (enqueued and missing after the event), jobs run
# twice (delivered more than once: the upstream, `keel-demo upstream`, logs every request with its
# Idempotency-Key), jobs dead (each job has one attempt: a run whose outcome was lost is dead),
# the new leader's time to accept writes, and the workers' time to resume (the first done of 60
# jobs enqueued on the new leader once it accepts writes) and to drain.
#
#   scripts/patroni-drill.sh [--build-dir DIR] [--jobs N] [--async] [--keep]
#     --build-dir DIR  where keel and keel-demo were built (default build/, bin/ under it)
#     --jobs N         jobs per drain (default 1000; each delivery takes 20 ms)
#     --async          Patroni's synchronous_mode off (default on: a commit waits for the replica)
#     --keep           leave the cluster running at the end (its directory is printed)
#
# Run by hand or by `make bench` (scripts/bench.sh), never by ctest: it takes a minute or two,
# most of it Patroni's ttl. Exits 0 when it ran, whatever the figures; 1 when it could not run.
# Like the ctest drill (tests/integration/db/failover_drill_test.cpp, on scripts/pg-cluster.sh),
# everything runs as the `postgres` user when started as root, and is removed at the end.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir="$root/build"
jobs=1000
sync_mode=true
keep=0
while (($#)); do
  case "$1" in
    --build-dir) build_dir=$2; shift ;;
    --jobs) jobs=$2; shift ;;
    --async) sync_mode=false ;;
    --keep) keep=1 ;;
    *) echo "usage: scripts/patroni-drill.sh [--build-dir DIR] [--jobs N] [--async] [--keep]" >&2; exit 2 ;;
  esac
  shift
done
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || { echo "patroni-drill: --jobs needs a positive number" >&2; exit 2; }

PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}
keel="$build_dir/bin/keel"
keel_demo="$build_dir/bin/keel-demo"
for tool in "$keel" "$keel_demo" "$PG_BIN/initdb"; do
  [[ -x "$tool" ]] || { echo "patroni-drill: $tool not found (build keel and keel-demo first)" >&2; exit 1; }
done
for tool in patroni patronictl etcd python3; do
  command -v "$tool" >/dev/null || {
    echo "patroni-drill: $tool not found; install it (scripts/bootstrap.sh --bench)" >&2
    exit 1
  }
done

as_pg() {
  if [[ $(id -u) -eq 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi
}
now() { date +%s.%3N; }
since() { awk -v a="$(now)" -v b="$1" 'BEGIN { printf "%.2f", a - b }'; }
say() { echo "patroni-drill: $*"; }
# wait_for SECONDS COMMAND...: until COMMAND succeeds, at most SECONDS; fails after that.
wait_for() {
  local until
  until=$(awk -v a="$(now)" -v b="$1" 'BEGIN { printf "%.3f", a + b }')
  shift
  until "$@"; do
    awk -v a="$(now)" -v b="$until" 'BEGIN { exit !(a >= b) }' && return 1
    sleep 0.1
  done
}

work=$(mktemp -d "${TMPDIR:-/tmp}/keel-patroni.XXXXXX")
if [[ $(id -u) -eq 0 ]]; then chown postgres: "$work"; fi
chmod 755 "$work"
pids=()

cleanup() {
  if [[ $keep == 1 ]]; then
    say "left running in $work (kill ${pids[*]})"
    return
  fi
  # Workers and upstream first, then Patroni (which stops its PostgreSQL), then etcd.
  # shellcheck disable=SC2046
  kill -TERM "${pids[@]}" $(pgrep -f -- "$work/") 2>/dev/null || true
  sleep 2
  # shellcheck disable=SC2046
  kill -KILL "${pids[@]}" $(pgrep -f -- "$work/") 2>/dev/null || true
  for node in pg1 pg2; do
    if [[ -f "$work/$node/data/postmaster.pid" ]]; then
      as_pg "$PG_BIN/pg_ctl" -D "$work/$node/data" -m immediate -w -t 10 stop >/dev/null 2>&1 || true
    fi
  done
  rm -rf -- "$work"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# Free ports on 127.0.0.1, chosen by the kernel.
read -r p_etcd p_peer p1 p2 r1 r2 < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(6)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])
for s in socks: s.close()')

# ---- etcd (v3 API; Patroni's etcd3 section speaks it over its JSON gateway)
as_pg etcd --name drill --data-dir "$work/etcd" \
  --listen-client-urls "http://127.0.0.1:$p_etcd" --advertise-client-urls "http://127.0.0.1:$p_etcd" \
  --listen-peer-urls "http://127.0.0.1:$p_peer" --initial-advertise-peer-urls "http://127.0.0.1:$p_peer" \
  --initial-cluster "drill=http://127.0.0.1:$p_peer" >"$work/etcd.log" 2>&1 &
pids+=($!)
etcd_up() { curl -s "http://127.0.0.1:$p_etcd/health" | grep -q true; }
wait_for 20 etcd_up || { tail "$work/etcd.log" >&2; exit 1; }

# ---- Patroni, one per node
patroni_config() {
  local name=$1 port=$2 rest=$3
  cat <<EOF
scope: keel-drill
namespace: /keel/
name: $name
restapi:
  listen: 127.0.0.1:$rest
  connect_address: 127.0.0.1:$rest
etcd3:
  hosts: 127.0.0.1:$p_etcd
bootstrap:
  dcs:
    ttl: 20
    loop_wait: 2
    retry_timeout: 5
    maximum_lag_on_failover: 1048576
    synchronous_mode: $sync_mode
    postgresql:
      use_pg_rewind: false
      parameters:
        max_connections: 200
        fsync: 'off'
        full_page_writes: 'off'
        wal_retrieve_retry_interval: 500ms
  initdb:
    - encoding: UTF8
    - locale: C.UTF-8
  pg_hba:
    - local all all trust
    - host replication all 127.0.0.1/32 trust
    - host all all 127.0.0.1/32 trust
postgresql:
  listen: 127.0.0.1:$port
  connect_address: 127.0.0.1:$port
  data_dir: $work/$name/data
  bin_dir: $PG_BIN
  pgpass: $work/$name/pgpass
  authentication:
    superuser:
      username: postgres
    replication:
      username: postgres
  parameters:
    unix_socket_directories: $work/$name
EOF
}
start_patroni() {
  local name=$1 port=$2 rest=$3
  mkdir -p "$work/$name"
  if [[ $(id -u) -eq 0 ]]; then chown postgres: "$work/$name"; fi
  patroni_config "$name" "$port" "$rest" >"$work/$name.yml"
  as_pg patroni "$work/$name.yml" >"$work/$name.log" 2>&1 &
  pids+=($!)
}
ctl() { as_pg patronictl -c "$work/pg1.yml" "$@"; }
leader() { ctl list -f json 2>/dev/null | python3 -c '
import json, sys
for m in json.load(sys.stdin):
    if m["Role"] == "Leader" and m["State"] == "running": print(m["Member"])'; }
port_of() { if [[ $1 == pg1 ]]; then echo "$p1"; else echo "$p2"; fi; }
# Whether NODE accepts a write from keel now.
writable() {
  PGCONNECT_TIMEOUT=2 as_pg "$PG_BIN/psql" -h 127.0.0.1 -p "$(port_of "$1")" -U keel -d keel_drill \
    -X -q -v ON_ERROR_STOP=1 -c "CREATE TEMP TABLE w (x int)" >/dev/null 2>&1
}
# A replica ready to take over: with synchronous_mode, the synchronous standby (Patroni promotes
# no other, so as to lose nothing).
replica_ready() { ctl list -f json 2>/dev/null | SYNC=$sync_mode python3 -c '
import json, os, sys
roles = ("Sync Standby",) if os.environ["SYNC"] == "true" else ("Replica", "Sync Standby")
sys.exit(0 if any(m["Role"] in roles and m["State"] in ("running", "streaming")
                  for m in json.load(sys.stdin)) else 1)'; }
is_leader() { [[ "$(leader)" == "$1" ]]; }

start_patroni pg1 "$p1" "$r1"
wait_for 60 is_leader pg1 || { tail -n 30 "$work/pg1.log" >&2; exit 1; }
start_patroni pg2 "$p2" "$r2"
wait_for 60 replica_ready || { tail -n 30 "$work/pg2.log" >&2; exit 1; }
as_pg "$PG_BIN/psql" -h 127.0.0.1 -p "$p1" -U postgres -d postgres -X -q -v ON_ERROR_STOP=1 \
  -c "CREATE ROLE keel LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE" \
  -c "CREATE DATABASE keel_drill OWNER keel" >/dev/null
say "Patroni 3.0 + etcd 3.4: leader pg1 on 127.0.0.1:$p1, replica pg2 on 127.0.0.1:$p2 (synchronous_mode: $sync_mode)"
ctl list

url="postgresql://keel@127.0.0.1:$p1,127.0.0.1:$p2/keel_drill?target_session_attrs=read-write"

# ---- the upstream and the workers
"$keel_demo" upstream --script '200/delay=20ms' >"$work/upstream.out" 2>&1 &
pids+=($!)
wait_for 10 grep -q 'listening on' "$work/upstream.out"
hook="$(grep -o 'http://127.0.0.1:[0-9]*' "$work/upstream.out" | head -n 1)/hook"

node_query() {  # node_query NODE SQL: one value, or nothing when the node does not answer
  PGCONNECT_TIMEOUT=2 as_pg "$PG_BIN/psql" -h 127.0.0.1 -p "$(port_of "$1")" -U keel -d keel_drill \
    -X -A -t -q -c "$2" 2>/dev/null || true
}
# Jobs of a phase (their payloads start {"phase": N,).
of_phase() { echo "queue = 'drill' AND payload LIKE '{\"phase\": $1,%'"; }
settled() { node_query "$1" "SELECT count(*) FROM keel_jobs WHERE $(of_phase "$2") AND state IN ('done', 'dead')"; }

enqueue() {  # enqueue PHASE: $jobs jobs of one attempt each
  seq 1 "$jobs" | awk -v p="$1" '{ printf "{\"phase\": %d, \"n\": %d}\n", p, $1 }' >"$work/payloads.$1"
  "$keel" jobs --db "$url" enqueue --queue drill --payloads-from "$work/payloads.$1" \
    --max-attempts 1 >"$work/ids.$1"
}
enqueue 0
for i in 1 2 3; do
  "$keel" jobs --db "$url" work --queue drill --deliver "$hook" --concurrency 4 --lease 2s \
    --timeout 5s --backoff-base 10ms --backoff-cap 100ms --idle-poll 200ms --grace 2s \
    --share-breakers >"$work/worker$i.log" 2>&1 &
  pids+=($!)
done

# phase PHASE NAME ACTION...: a drain of $jobs jobs, the event run a quarter of the way through,
# then the figures.
phase() {
  local p=$1 name=$2
  shift 2
  local old new t0 t_writes t_resume t_drain
  enqueue "$p"
  old=$(leader)
  quarter() { [[ "$(settled "$old" "$p")" -ge $((jobs / 4)) ]]; }
  wait_for 60 quarter || say "$name: the drain did not reach a quarter within 60 s"
  t0=$(now)
  "$@"
  # The new leader, once it accepts keel's writes.
  new_leader() {
    new=$(leader)
    [[ -n "$new" && "$new" != "$old" ]] && writable "$new"
  }
  if ! wait_for 90 new_leader; then
    say "$name: no new leader within 90 s"
    ctl list || true
    return
  fi
  t_writes=$(since "$t0")
  # Jobs that only the new leader has: they run once the workers have found it.
  local t1 after=$((p + 10))
  t1=$(now)
  seq 1 60 | awk -v p="$after" '{ printf "{\"phase\": %d, \"n\": %d}\n", p, $1 }' >"$work/payloads.$after"
  "$keel" jobs --db "postgresql://keel@127.0.0.1:$(port_of "$new")/keel_drill" enqueue --queue drill \
    --payloads-from "$work/payloads.$after" --max-attempts 1 >/dev/null
  t_resume=-1
  t_drain=-1
  while [[ $(since "$t1" | cut -d. -f1) -lt 60 ]]; do
    if [[ $t_resume == -1 && "$(settled "$new" "$after")" -gt 0 ]]; then t_resume=$(since "$t1"); fi
    if [[ $t_resume != -1 && "$(settled "$new" "$p")" -ge "$jobs" && "$(settled "$new" "$after")" -ge 60 ]]; then
      t_drain=$(since "$t1")
      break
    fi
    sleep 0.05
  done
  sleep 3 # leases of jobs whose outcome was lost expire (2 s) and they run again
  local lost dead twice
  lost=$(node_query "$new" "SELECT $jobs - count(*) FROM keel_jobs WHERE $(of_phase "$p")")
  dead=$(node_query "$new" "SELECT count(*) FROM keel_jobs WHERE $(of_phase "$p") AND state = 'dead'")
  keys=$(node_query "$new" "SELECT string_agg(idem_key, ',') FROM keel_jobs WHERE $(of_phase "$p")")
  twice=$(curl -s "${hook%/hook}/_keel/log" | KEYS="$keys" python3 -c '
import collections, json, os, sys
keys = set(os.environ["KEYS"].split(","))
n = collections.Counter(a.get("idempotency_key") for a in json.load(sys.stdin)["arrivals"])
print(sum(1 for k, c in n.items() if k in keys and c > 1))')
  say "$name: leader $old -> $new; new leader accepting writes after $t_writes s; jobs enqueued on it first done $t_resume s later, everything done after $t_drain s (-1: not within 60 s); jobs lost $lost, run twice $twice, dead $dead (of $jobs, one attempt each)"
}

switchover() { ctl switchover --leader "$(leader)" --candidate "$(if [[ $(leader) == pg1 ]]; then echo pg2; else echo pg1; fi)" --force >"$work/switchover.log" 2>&1; }
kill_leader() {
  local node pm
  node=$(leader)
  pm=$(head -n 1 "$work/$node/data/postmaster.pid")
  # shellcheck disable=SC2046
  kill -KILL $(pgrep -f -- "$work/$node.yml") "$pm" $(pgrep -P "$pm") 2>/dev/null || true
}

phase 1 "switchover" switchover
# The demoted leader is a replica again (the synchronous standby) before the next event.
wait_for 60 replica_ready || say "the old leader is not a replica ready to take over"
ctl list
phase 2 "leader killed" kill_leader
ctl list || true
for i in 1 2 3; do
  say "worker $i, first lines of each kind:"
  grep -E "lease failed|commit in doubt|25006" "$work/worker$i.log" | sort -u -k4,6 | head -n 3 | sed 's/^/    /' || true
done
