#!/usr/bin/env bash
# A throwaway PostgreSQL 15 cluster on loopback for failover drills: a primary, a streaming
# standby, and optionally PgBouncer in transaction pooling mode in front of the primary.
#
#   scripts/pg-cluster.sh start STATE_DIR [--async | --sync | --remote-apply] [--pgbouncer]
#                                         [--pool-size N]
#        node1 (the primary) and node2 (a standby made by pg_basebackup -R, streaming from it);
#        --sync (the default): synchronous_standby_names = node2, synchronous_commit = on (a
#        commit returns once the standby has flushed its WAL); --remote-apply: the same with
#        synchronous_commit = remote_apply (once the standby has applied it); --async: no
#        synchronous standby (a commit returns once it is flushed locally). --pgbouncer also
#        starts PgBouncer (pool_mode = transaction, default_pool_size N, default 4) in front of
#        the primary.
#   scripts/pg-cluster.sh stop STATE_DIR          stop everything and delete the data
#   scripts/pg-cluster.sh url STATE_DIR           the multi-host URL a client should use:
#        postgresql://keel@127.0.0.1:P1,127.0.0.1:P2/keel_drill?target_session_attrs=read-write
#   scripts/pg-cluster.sh node-url STATE_DIR NODE one node's own URL (NODE: node1, node2,
#                                                 primary or standby)
#   scripts/pg-cluster.sh bouncer-url STATE_DIR [keel_drill|keel_one]
#        PgBouncer's URL: keel_drill is the pool of default_pool_size server connections,
#        keel_one a pool of ONE server connection to the same database (for checking that no
#        client's session setting reaches the next client of a server connection)
#   scripts/pg-cluster.sh promote STATE_DIR       promote the standby, wait until it accepts
#        writes, point PgBouncer at it (a RELOAD with the new host), print the time it took
#   scripts/pg-cluster.sh kill STATE_DIR NODE     SIGKILL the node's postmaster and backends
#   scripts/pg-cluster.sh read-only STATE_DIR NODE
#        ALTER SYSTEM SET default_transaction_read_only = on and a reload: the node stays up and
#        reachable, and refuses writes (SQLSTATE 25006): a primary demoted by hand
#   scripts/pg-cluster.sh freeze STATE_DIR NODE   SIGSTOP the postmaster and every backend: TCP
#        connections stay open and connects are accepted by the kernel, nothing answers
#   scripts/pg-cluster.sh thaw STATE_DIR NODE     SIGCONT them
#   scripts/pg-cluster.sh lag STATE_DIR DELAY     recovery_min_apply_delay on the standby (e.g.
#        2s; 0 removes it): it receives WAL at once and applies it DELAY later
#   scripts/pg-cluster.sh pause-replay STATE_DIR | resume-replay STATE_DIR
#        pg_wal_replay_pause() / pg_wal_replay_resume() on the standby
#   scripts/pg-cluster.sh detach STATE_DIR | attach STATE_DIR
#        stop / restart the standby's streaming (primary_conninfo emptied and restored): what the
#        primary commits in between is not on the standby, and is lost if it is promoted then
#   scripts/pg-cluster.sh status STATE_DIR        per node: role, read-only, WAL positions
#
# What is lost at a promotion is what the standby has not RECEIVED: a promotion replays all the
# WAL the standby holds, so an apply delay or a paused replay make reads on the standby stale
# but lose nothing; detach shows the loss (asynchronous replication's bound: the WAL the
# primary had not sent when it died).
#
# Like scripts/pg-test-server.sh: Debian's postgresql-15 (PG_BIN, default
# /usr/lib/postgresql/15/bin), data under a mktemp directory in $TMPDIR (default /tmp), Unix
# sockets in that directory, TCP on 127.0.0.1 only, trust authentication; as root the servers
# (and PgBouncer, which refuses root) run as the `postgres` user. Fast settings (fsync and
# full_page_writes off: safe against a killed process, not against a crashed machine) unless
# KEEL_PG_DURABLE=1. Each node has the database keel_drill, owned by the role keel (LOGIN, no
# superuser, no CREATEDB, no CREATEROLE), which every URL printed here uses; the harness's own
# actions connect as postgres over the Unix socket. STATE_DIR holds the ports, the URLs and
# which node is the primary. PGC_TRACE=1 traces every command, with the time, to stderr;
# PGC_MAX_CONNECTIONS sets the servers' max_connections (default 200).
set -euo pipefail
[[ -n "${PGC_TRACE:-}" ]] && { PS4='+ $(date +%s.%N | cut -c1-14) '; set -x; }

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed -n 's/^#   scripts/scripts/p' >&2
  exit 2
}
[[ $# -ge 2 ]] || usage
action=$1
state=$2
shift 2
PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}
PGBOUNCER=${PGBOUNCER:-$(command -v pgbouncer || echo /usr/sbin/pgbouncer)}

die() {
  echo "pg-cluster: $*" >&2
  exit 1
}

as_pg() {
  if [[ $(id -u) -eq 0 ]]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

base_dir() {
  [[ -f "$state/base" ]] || die "no cluster in $state (start one first)"
  cat "$state/base"
}

# node NAME: node1 or node2, with primary and standby resolved through $state/primary.
node() {
  case "$1" in
    node1 | node2) echo "$1" ;;
    primary) cat "$state/primary" ;;
    standby) if [[ $(cat "$state/primary") == node1 ]]; then echo node2; else echo node1; fi ;;
    *) die "unknown node '$1' (expected node1, node2, primary or standby)" ;;
  esac
}

port_of() { cat "$state/$1.port"; }

# psql_node NODE SQL: run SQL as postgres on the node's Unix socket, unaligned, tuples only.
psql_node() {
  local base
  base=$(base_dir)
  # A frozen node accepts the connection and never answers: give up after 2 s.
  PGCONNECT_TIMEOUT=2 as_pg "$PG_BIN/psql" -h "$base/$1" -p "$(port_of "$1")" -U postgres \
    -d postgres -X -A -t -q -v ON_ERROR_STOP=1 -c "$2"
}

postmaster_pid() {
  local base
  base=$(base_dir)
  [[ -f "$base/$1/data/postmaster.pid" ]] || die "$1 is not running"
  head -n 1 "$base/$1/data/postmaster.pid"
}

# The node's server options: fast unless durable.
node_options() {
  local name=$1 port=$2 base=$3
  local opts="-p $port -k $base/$name -c listen_addresses=127.0.0.1"
  opts+=" -c max_connections=${PGC_MAX_CONNECTIONS:-200}"
  opts+=" -c wal_level=replica -c max_wal_senders=5 -c hot_standby=on -c cluster_name=$name"
  # A standby whose primary died looks for WAL again every wal_retrieve_retry_interval (5 s by
  # default), and a promotion asked for in between was seen to wait for it.
  opts+=" -c wal_sender_timeout=5s -c wal_receiver_status_interval=1s"
  opts+=" -c wal_retrieve_retry_interval=500ms"
  [[ "${KEEL_PG_DURABLE:-0}" == 1 ]] || opts+=" -c fsync=off -c full_page_writes=off"
  # synchronous_commit stays on (a commit is flushed locally; waits for no standby unless node1's
  # synchronous_standby_names, set by start, names one): not on this command line, which would
  # override ALTER SYSTEM.
  echo "$opts"
}

# start_node NAME BASE: on a random free port; writes $state/NAME.port.
start_node() {
  local name=$1 base=$2 port
  for _ in $(seq 1 20); do
    port=$((20000 + RANDOM % 40000))
    if as_pg "$PG_BIN/pg_ctl" -D "$base/$name/data" -w -t 60 -l "$base/$name/server.log" \
      -o "$(node_options "$name" "$port" "$base")" start >/dev/null 2>&1; then
      echo "$port" >"$state/$name.port"
      return 0
    fi
  done
  cat "$base/$name/server.log" >&2 || true
  die "could not start $name"
}

write_urls() {
  local p1 p2
  p1=$(port_of node1)
  p2=$(port_of node2)
  echo "postgresql://keel@127.0.0.1:$p1,127.0.0.1:$p2/keel_drill?target_session_attrs=read-write" \
    >"$state/url"
}

# The PgBouncer configuration, pointing at the node in $state/primary.
write_bouncer_ini() {
  local base=$1 port=$2 pool=$3 primary_port
  primary_port=$(port_of "$(node primary)")
  cat >"$base/pgbouncer/pgbouncer.ini.new" <<EOF
[databases]
keel_drill = host=127.0.0.1 port=$primary_port dbname=keel_drill
keel_one = host=127.0.0.1 port=$primary_port dbname=keel_drill pool_size=1

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
auth_type = trust
auth_file = $base/pgbouncer/userlist.txt
admin_users = postgres
pool_mode = transaction
default_pool_size = $pool
reserve_pool_size = 0
max_client_conn = 1000
server_login_retry = 1
query_wait_timeout = 30
logfile = $base/pgbouncer/pgbouncer.log
pidfile = $base/pgbouncer/pgbouncer.pid
EOF
  mv "$base/pgbouncer/pgbouncer.ini.new" "$base/pgbouncer/pgbouncer.ini"
}

start_bouncer() {
  local base=$1 pool=$2 port
  [[ -x "$PGBOUNCER" ]] || die "pgbouncer not found; install it (scripts/bootstrap.sh --test)"
  mkdir -p "$base/pgbouncer"
  printf '"keel" ""\n"postgres" ""\n' >"$base/pgbouncer/userlist.txt"
  if [[ $(id -u) -eq 0 ]]; then chown -R postgres: "$base/pgbouncer"; fi
  for _ in $(seq 1 20); do
    port=$((20000 + RANDOM % 40000))
    write_bouncer_ini "$base" "$port" "$pool"
    if [[ $(id -u) -eq 0 ]]; then chown postgres: "$base/pgbouncer/pgbouncer.ini"; fi
    rm -f "$base/pgbouncer/pgbouncer.pid"
    if as_pg "$PGBOUNCER" -d "$base/pgbouncer/pgbouncer.ini" >/dev/null 2>&1; then
      # -d returns once it has forked: wait until it listens (or has died of a busy port).
      for _ in $(seq 1 50); do
        if as_pg "$PG_BIN/psql" -h 127.0.0.1 -p "$port" -U keel -d keel_drill -X -A -t -q \
          -c "SELECT 1" >/dev/null 2>&1; then
          echo "$port" >"$state/bouncer.port"
          echo "$pool" >"$state/bouncer.pool"
          echo "postgresql://keel@127.0.0.1:$port/keel_drill" >"$state/bouncer-url"
          return 0
        fi
        [[ -f "$base/pgbouncer/pgbouncer.pid" ]] || break
        sleep 0.1
      done
      stop_bouncer "$base"
    fi
  done
  tail -n 20 "$base/pgbouncer/pgbouncer.log" >&2 || true
  die "could not start PgBouncer"
}

stop_bouncer() {
  local base=$1 pid
  [[ -f "$base/pgbouncer/pgbouncer.pid" ]] || return 0
  pid=$(cat "$base/pgbouncer/pgbouncer.pid" 2>/dev/null || true)
  if [[ -n "$pid" ]]; then kill -KILL "$pid" 2>/dev/null || true; fi
  rm -f "$base/pgbouncer/pgbouncer.pid"
}

stop_all() {
  [[ -f "$state/base" ]] || return 0
  local base
  base=$(cat "$state/base")
  stop_bouncer "$base"
  for name in node1 node2; do
    if [[ -f "$base/$name/data/postmaster.pid" ]]; then
      local pm
      pm=$(head -n 1 "$base/$name/data/postmaster.pid")
      # A frozen node cannot stop: wake it first.
      # shellcheck disable=SC2046
      kill -CONT "$pm" $(pgrep -P "$pm" 2>/dev/null) 2>/dev/null || true
      # shellcheck disable=SC2046
      as_pg "$PG_BIN/pg_ctl" -D "$base/$name/data" -m immediate -w -t 10 stop >/dev/null 2>&1 ||
        kill -KILL "$pm" $(pgrep -P "$pm" 2>/dev/null) 2>/dev/null || true
    fi
  done
  case "$base" in
    */keel-pgc.*) rm -rf -- "$base" ;;
  esac
  rm -f -- "$state"/{base,url,bouncer-url,bouncer.port,bouncer.pool,primary,mode}
  rm -f -- "$state"/node{1,2}.port "$state/primary_conninfo"
}

# Seconds since the epoch with milliseconds.
now() { date +%s.%3N; }

case "$action" in
  start)
    mode=sync
    bouncer=0
    pool=4
    while [[ $# -gt 0 ]]; do
      case "$1" in
        --sync) mode=sync ;;
        --remote-apply) mode=remote_apply ;;
        --async) mode=async ;;
        --pgbouncer) bouncer=1 ;;
        --pool-size)
          [[ $# -ge 2 && "$2" =~ ^[1-9][0-9]*$ ]] || die "--pool-size needs a positive number"
          pool=$2
          shift
          ;;
        *) die "unknown option '$1'" ;;
      esac
      shift
    done
    [[ -x "$PG_BIN/initdb" ]] || die "$PG_BIN/initdb not found; install postgresql-15"
    mkdir -p "$state"
    stop_all # a cluster left over from an interrupted run
    base=$(mktemp -d "${TMPDIR:-/tmp}/keel-pgc.XXXXXX")
    echo "$base" >"$state/base"
    echo "$mode" >"$state/mode"
    echo node1 >"$state/primary"
    mkdir -p "$base/node1" "$base/node2"
    if [[ $(id -u) -eq 0 ]]; then chown -R postgres: "$base"; fi
    chmod 700 "$base"
    as_pg "$PG_BIN/initdb" -D "$base/node1/data" -U postgres --auth=trust --encoding=UTF8 \
      --locale=C.UTF-8 --no-sync >"$base/initdb.log" 2>&1 || {
      cat "$base/initdb.log" >&2
      exit 1
    }
    start_node node1 "$base"
    p1=$(port_of node1)
    psql_node node1 "CREATE ROLE keel LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE" >/dev/null
    psql_node node1 "CREATE DATABASE keel_drill OWNER keel" >/dev/null
    as_pg "$PG_BIN/pg_basebackup" -h 127.0.0.1 -p "$p1" -U postgres -D "$base/node2/data" -R \
      -X stream -c fast --no-sync >"$base/basebackup.log" 2>&1 || {
      cat "$base/basebackup.log" >&2
      exit 1
    }
    start_node node2 "$base"
    # node1's part in the replication, set after the base backup so that node2 does not inherit
    # it (a promoted node2 would wait for a synchronous standby of its own).
    if [[ $mode != async ]]; then
      commit=on
      [[ $mode == remote_apply ]] && commit=remote_apply
      psql_node node1 "ALTER SYSTEM SET synchronous_standby_names = 'node2'" >/dev/null
      psql_node node1 "ALTER SYSTEM SET synchronous_commit = '$commit'" >/dev/null
      psql_node node1 "SELECT pg_reload_conf()" >/dev/null
    fi
    # Streaming, and (synchronous modes) node2 is the synchronous standby.
    for _ in $(seq 1 100); do
      s=$(psql_node node1 "SELECT sync_state FROM pg_stat_replication WHERE application_name = 'node2'" || true)
      if [[ ($mode == async && -n "$s") || ($mode != async && "$s" == sync) ]]; then
        break
      fi
      sleep 0.1
    done
    [[ -n "${s:-}" ]] || die "node2 does not stream from node1 (see $base/node2/server.log)"
    psql_node node2 "SHOW primary_conninfo" >"$state/primary_conninfo"
    write_urls
    echo "pg-cluster: node1 (primary) on 127.0.0.1:$p1, node2 ($mode standby) on 127.0.0.1:$(port_of node2)"
    if [[ $bouncer == 1 ]]; then
      start_bouncer "$base" "$pool"
      echo "pg-cluster: PgBouncer (transaction pooling, pool $pool) on 127.0.0.1:$(cat "$state/bouncer.port")"
    fi
    echo "pg-cluster: $(cat "$state/url")"
    ;;
  stop)
    stop_all
    echo "pg-cluster: stopped"
    ;;
  url)
    cat "$state/url"
    ;;
  node-url)
    [[ $# -eq 1 ]] || usage
    echo "postgresql://keel@127.0.0.1:$(port_of "$(node "$1")")/keel_drill"
    ;;
  bouncer-url)
    [[ -f "$state/bouncer.port" ]] || die "no PgBouncer in this cluster (start --pgbouncer)"
    echo "postgresql://keel@127.0.0.1:$(cat "$state/bouncer.port")/${1:-keel_drill}"
    ;;
  promote)
    base=$(base_dir)
    target=$(node standby)
    started=$(now)
    as_pg "$PG_BIN/pg_ctl" -D "$base/$target/data" -w -t 60 promote >/dev/null
    # Accepting writes: out of recovery, and a write commits (as keel, in keel's database).
    for _ in $(seq 1 200); do
      if as_pg "$PG_BIN/psql" -h "$base/$target" -p "$(port_of "$target")" -U keel -d keel_drill \
        -X -q -v ON_ERROR_STOP=1 -c "CREATE TEMP TABLE promoted (x int)" >/dev/null 2>&1; then
        break
      fi
      sleep 0.05
    done
    echo "$target" >"$state/primary"
    if [[ -f "$state/bouncer.port" ]]; then
      write_bouncer_ini "$base" "$(cat "$state/bouncer.port")" "$(cat "$state/bouncer.pool")"
      if [[ $(id -u) -eq 0 ]]; then chown postgres: "$base/pgbouncer/pgbouncer.ini"; fi
      kill -HUP "$(cat "$base/pgbouncer/pgbouncer.pid")"
    fi
    echo "pg-cluster: $target promoted, accepting writes after $(awk -v a="$(now)" -v b="$started" 'BEGIN { printf "%.3f", a - b }') s"
    ;;
  kill)
    [[ $# -eq 1 ]] || usage
    name=$(node "$1")
    pm=$(postmaster_pid "$name")
    # The postmaster and whatever it had forked, in one kill: listed after the postmaster's death
    # they would be init's children, and a frozen backend would never exit by itself.
    # shellcheck disable=SC2046
    kill -KILL "$pm" $(pgrep -P "$pm" 2>/dev/null) 2>/dev/null || true
    echo "pg-cluster: $name killed"
    ;;
  read-only)
    [[ $# -eq 1 ]] || usage
    name=$(node "$1")
    psql_node "$name" "ALTER SYSTEM SET default_transaction_read_only = on" >/dev/null
    psql_node "$name" "SELECT pg_reload_conf()" >/dev/null
    echo "pg-cluster: $name is read-only (default_transaction_read_only = on)"
    ;;
  freeze)
    [[ $# -eq 1 ]] || usage
    name=$(node "$1")
    pm=$(postmaster_pid "$name")
    kill -STOP "$pm"
    # Twice: a backend being forked when the first list was taken is stopped by the second.
    for _ in 1 2; do
      kill -STOP $(pgrep -P "$pm" 2>/dev/null) 2>/dev/null || true
    done
    echo "pg-cluster: $name frozen (SIGSTOP)"
    ;;
  thaw)
    [[ $# -eq 1 ]] || usage
    name=$(node "$1")
    pm=$(postmaster_pid "$name")
    kill -CONT $(pgrep -P "$pm" 2>/dev/null) 2>/dev/null || true
    kill -CONT "$pm"
    echo "pg-cluster: $name thawed (SIGCONT)"
    ;;
  lag)
    [[ $# -eq 1 ]] || usage
    name=$(node standby)
    psql_node "$name" "ALTER SYSTEM SET recovery_min_apply_delay = '$1'" >/dev/null
    psql_node "$name" "SELECT pg_reload_conf()" >/dev/null
    echo "pg-cluster: $name applies WAL $1 after receiving it"
    ;;
  pause-replay)
    psql_node "$(node standby)" "SELECT pg_wal_replay_pause()" >/dev/null
    echo "pg-cluster: replay paused on $(node standby)"
    ;;
  resume-replay)
    psql_node "$(node standby)" "SELECT pg_wal_replay_resume()" >/dev/null
    echo "pg-cluster: replay resumed on $(node standby)"
    ;;
  detach)
    name=$(node standby)
    psql_node "$name" "ALTER SYSTEM SET primary_conninfo = ''" >/dev/null
    psql_node "$name" "SELECT pg_reload_conf()" >/dev/null
    # Until its WAL receiver has stopped.
    for _ in $(seq 1 100); do
      [[ -z $(psql_node "$name" "SELECT pid FROM pg_stat_wal_receiver") ]] && break
      sleep 0.05
    done
    echo "pg-cluster: $name no longer streams"
    ;;
  attach)
    name=$(node standby)
    conninfo=$(sed "s/'/''/g" "$state/primary_conninfo")
    psql_node "$name" "ALTER SYSTEM SET primary_conninfo = '$conninfo'" >/dev/null
    psql_node "$name" "SELECT pg_reload_conf()" >/dev/null
    echo "pg-cluster: $name streams again"
    ;;
  status)
    for name in node1 node2; do
      if ! out=$(psql_node "$name" "SELECT CASE WHEN pg_is_in_recovery() THEN 'standby' ELSE 'primary' END
          || ' read_only=' || current_setting('default_transaction_read_only')
          || ' lsn=' || COALESCE(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_receive_lsn()::text
                                      || ' replayed=' || pg_last_wal_replay_lsn()::text
                                      ELSE pg_current_wal_lsn()::text END, '-')" 2>/dev/null); then
        out="down or frozen"
      fi
      echo "$name 127.0.0.1:$(port_of "$name") $out"
    done
    ;;
  *) usage ;;
esac
