#!/bin/sh
# verify_systemd_unit.sh UNIT KEEL WORKDIR: checks deploy/systemd/keel-worker@.service.
#
# systemd-analyze verify resolves ExecStart's binary, and the unit names where an install puts
# keel (/usr/local/bin/keel), which need not exist here: it verifies a copy in WORKDIR whose
# ExecStart is the built KEEL instead, everything else unchanged. Any warning fails the test (an
# unknown or misspelt key is only a warning to systemd). Then it checks that TimeoutStopSec is
# longer than the worker's --grace plus 1 s (the worker is gone within its grace plus ~0.3 s
# after SIGTERM) and that the stop signal reaches the worker alone (KillMode=mixed).
# Exit 77 (ctest's SKIP_RETURN_CODE) when systemd-analyze is not installed.
set -eu
unit=$1 keel=$2 work=$3
if ! command -v systemd-analyze >/dev/null 2>&1; then
  echo "systemd-analyze not found: skipped" >&2
  exit 77
fi
fail() { echo "FAIL: $*" >&2; exit 1; }

grep -q '^ExecStart=/usr/local/bin/keel ' "$unit" || fail "ExecStart is not /usr/local/bin/keel"
rm -rf "$work" && mkdir -p "$work"
name=$(basename "$unit")                # keel-worker@.service
sed "s#^ExecStart=/usr/local/bin/keel #ExecStart=$keel #" "$unit" > "$work/$name"
instance="$work/${name%@.service}@test.service"
out=$(systemd-analyze verify "$instance" 2>&1) || fail "systemd-analyze verify: $out"
[ -z "$out" ] || fail "systemd-analyze verify warned: $out"

seconds() {  # "15s", "15" or "2min" in seconds
  case $1 in
    *min) echo $(( ${1%min} * 60 )) ;;
    *s) echo "${1%s}" ;;
    *) echo "$1" ;;
  esac
}
grace=$(sed -n 's/^ExecStart=.* --grace \([0-9]*[a-z]*\).*/\1/p' "$unit")
stop=$(sed -n 's/^TimeoutStopSec=//p' "$unit")
[ -n "$grace" ] || fail "ExecStart gives no --grace"
[ -n "$stop" ] || fail "no TimeoutStopSec"
[ "$(seconds "$stop")" -gt $(( $(seconds "$grace") + 1 )) ] ||
  fail "TimeoutStopSec=$stop is not longer than --grace $grace plus 1 s"
grep -qx 'KillMode=mixed' "$unit" || fail "KillMode is not mixed: SIGTERM would reach --exec commands"
grep -qx 'KillSignal=SIGTERM' "$unit" || fail "KillSignal is not SIGTERM"
echo "$name: verified (ExecStart=$keel), TimeoutStopSec=$stop, --grace $grace"
