#!/usr/bin/env bash
# make demo: the story keel tells, on what exists so far.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
keel="$root/build/bin/keel"
[[ -x "$keel" ]] || { echo "demo: $keel is missing; run 'make build' first" >&2; exit 1; }
echo "== keel demo: the core engine on a simulated flaky dependency (virtual time) =="
"$keel" demo-core --operations 5 --failure-rate 0.6 --seed 7
