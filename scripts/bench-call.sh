#!/usr/bin/env bash
# Process start-to-exit of `keel call` next to `curl` for one GET against a local
# `keel-demo upstream` (127.0.0.1, port chosen by the kernel). Prints the mean wall time of each
# and their ratio. Uses hyperfine when it is installed, otherwise a timed loop.
#   scripts/bench-call.sh [--build-dir DIR] [--runs N]
set -euo pipefail

build_dir="$(cd "$(dirname "$0")/.." && pwd)/build"
runs=200
while (($#)); do
  case "$1" in
    --build-dir) build_dir=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    *) echo "bench-call: unknown option '$1' (expected --build-dir DIR or --runs N)" >&2; exit 2 ;;
  esac
done
if ! [[ "$runs" =~ ^[0-9]+$ ]] || ((runs < 1)); then
  echo "bench-call: --runs must be a positive integer, got '$runs'" >&2
  exit 2
fi
keel="$build_dir/bin/keel"
keel_demo="$build_dir/bin/keel-demo"
[[ -x "$keel" ]] || { echo "bench-call: $keel not found (build first)" >&2; exit 1; }
[[ -x "$keel_demo" ]] || { echo "bench-call: $keel_demo not found (build first)" >&2; exit 1; }
command -v curl >/dev/null || { echo "bench-call: curl not installed" >&2; exit 1; }

out=$(mktemp)
"$keel_demo" upstream --script 200 >"$out" &
upstream=$!
trap 'kill "$upstream" 2>/dev/null || true; wait "$upstream" 2>/dev/null || true; rm -f "$out"' EXIT
for _ in $(seq 100); do
  grep -q listening "$out" && break
  sleep 0.05
done
url=$(sed -n 's/.*listening on \(http:[^ ]*\).*/\1/p' "$out")/bench
[[ "$url" == http://127.0.0.1:* ]] || { echo "bench-call: upstream did not start" >&2; exit 1; }

# Mean seconds per run of "$@", output discarded.
mean_seconds() {
  local start end
  start=$(date +%s%N)
  for ((i = 0; i < runs; i++)); do "$@" >/dev/null; done
  end=$(date +%s%N)
  echo "scale=6; ($end - $start) / $runs / 1000000000" | bc -l
}

if command -v hyperfine >/dev/null; then
  hyperfine --warmup 10 --runs "$runs" -N "$keel call $url" "curl -s $url"
  exit 0
fi
"$keel" call "$url" >/dev/null && curl -s "$url" >/dev/null  # warm up
keel_s=$(mean_seconds "$keel" call "$url")
curl_s=$(mean_seconds curl -s "$url")
printf 'keel call: %.3f ms per run (%d runs)\n' "$(echo "$keel_s * 1000" | bc -l)" "$runs"
printf 'curl -s:   %.3f ms per run (%d runs)\n' "$(echo "$curl_s * 1000" | bc -l)" "$runs"
printf 'ratio keel/curl: %.2f\n' "$(echo "$keel_s / $curl_s" | bc -l)"
