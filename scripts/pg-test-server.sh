#!/usr/bin/env bash
# A throwaway PostgreSQL 15 server for keel's integration tests.
#
#   scripts/pg-test-server.sh start STATE_DIR   start a server; write its URL to STATE_DIR/url
#   scripts/pg-test-server.sh stop STATE_DIR    stop it and delete its data
#   scripts/pg-test-server.sh url STATE_DIR     print the URL of the running server
#   scripts/pg-test-server.sh pause STATE_DIR   stop the server, keeping its data
#   scripts/pg-test-server.sh resume STATE_DIR  start a paused server again, on the same port
#
# pause and resume restart the database under its clients (the fleet drill's "the database
# restarted mid-outage"): the URL stays valid, connections in between are refused.
#
# The server runs Debian's postgresql-15 (/usr/lib/postgresql/15/bin; override with PG_BIN) from
# a fresh data directory made with mktemp under $TMPDIR (default /tmp), listening on a Unix socket
# in that directory and on a free TCP port on 127.0.0.1 only, with trust authentication, and has
# one database, keel_test. As root it runs as the `postgres` user (initdb refuses root), and the
# data directory is handed to that user; as any other user it runs as that user. The server skips
# fsync for speed unless KEEL_PG_DURABLE=1 (benchmarks set it). STATE_DIR (any
# path you own, e.g. under the build directory) only holds the files `url`, `datadir` and `log`.
#
# ctest uses it as the fixture `postgres` (tests/integration/CMakeLists.txt registers
# keel.postgres.start / keel.postgres.stop, and keel_integration_test(... POSTGRES) makes a test
# require it and pass KEEL_TEST_POSTGRES_URL_FILE=STATE_DIR/url). Tests isolate themselves from
# each other inside keel_test with a schema of their own
# (tests/integration/support/test_support.hpp).
set -euo pipefail

usage() {
  echo "usage: $0 start|stop|url|pause|resume STATE_DIR" >&2
  exit 2
}
[[ $# -eq 2 ]] || usage
action=$1
state=$2
PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}

as_pg() {
  if [[ $(id -u) -eq 0 ]]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

stop_server() {
  [[ -f "$state/datadir" ]] || return 0
  local base
  base=$(cat "$state/datadir")
  if [[ -d "$base/data" ]]; then
    as_pg "$PG_BIN/pg_ctl" -D "$base/data" -m immediate -w stop >/dev/null 2>&1 || true
  fi
  case "$base" in
    */keel-pg.*) rm -rf -- "$base" ;;
  esac
  rm -f -- "$state/datadir" "$state/url"
}

# start_on_port BASE PORT: the server of BASE/data on 127.0.0.1:PORT; fails when it cannot.
start_on_port() {
  local fast="-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
  [[ "${KEEL_PG_DURABLE:-0}" == 1 ]] && fast=""
  # KEEL_PG_OPTIONS: more server options (scripts/bench-soak.sh loads pg_stat_statements).
  as_pg "$PG_BIN/pg_ctl" -D "$1/data" -w -t 30 -l "$1/server.log" \
    -o "-p $2 -k $1 -c listen_addresses=127.0.0.1 -c max_connections=300 $fast ${KEEL_PG_OPTIONS:-}" \
    start >/dev/null 2>&1
}

case "$action" in
  start)
    if [[ ! -x "$PG_BIN/initdb" ]]; then
      echo "pg-test-server: $PG_BIN/initdb not found; install postgresql-15 (scripts/bootstrap.sh --test)" >&2
      exit 1
    fi
    mkdir -p "$state"
    stop_server  # a server left over from an interrupted run
    base=$(mktemp -d "${TMPDIR:-/tmp}/keel-pg.XXXXXX")
    echo "$base" >"$state/datadir"
    if [[ $(id -u) -eq 0 ]]; then
      chown postgres: "$base"
    fi
    chmod 700 "$base"
    as_pg "$PG_BIN/initdb" -D "$base/data" -U postgres --auth=trust --encoding=UTF8 \
      --locale=C.UTF-8 --no-sync >"$base/initdb.log" 2>&1 || {
      cat "$base/initdb.log" >&2
      exit 1
    }
    # Try random ports until one is free (postgres cannot be told to pick one itself).
    started=0
    for _ in $(seq 1 20); do
      port=$((20000 + RANDOM % 40000))
      if start_on_port "$base" "$port"; then
        started=1
        break
      fi
    done
    if [[ $started -ne 1 ]]; then
      echo "pg-test-server: could not start PostgreSQL; log:" >&2
      cat "$base/server.log" >&2 || true
      exit 1
    fi
    as_pg "$PG_BIN/psql" -h "$base" -p "$port" -U postgres -d postgres -q -v ON_ERROR_STOP=1 \
      -c "CREATE DATABASE keel_test" >/dev/null
    echo "postgresql://postgres@127.0.0.1:$port/keel_test" >"$state/url"
    echo "pg-test-server: PostgreSQL 15 on 127.0.0.1:$port (data in $base)"
    ;;
  stop)
    stop_server
    echo "pg-test-server: stopped"
    ;;
  url)
    cat "$state/url"
    ;;
  pause)
    base=$(cat "$state/datadir")
    as_pg "$PG_BIN/pg_ctl" -D "$base/data" -m fast -w stop >/dev/null
    echo "pg-test-server: paused"
    ;;
  resume)
    base=$(cat "$state/datadir")
    port=$(sed -E 's|.*:([0-9]+)/.*|\1|' "$state/url")
    if ! start_on_port "$base" "$port"; then
      echo "pg-test-server: could not start PostgreSQL again on port $port; log:" >&2
      tail -n 20 "$base/server.log" >&2 || true
      exit 1
    fi
    echo "pg-test-server: resumed on 127.0.0.1:$port"
    ;;
  *) usage ;;
esac
