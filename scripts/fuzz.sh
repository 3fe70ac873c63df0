#!/usr/bin/env bash
# Builds keel's libFuzzer targets with clang into BUILD_DIR and runs each for SECONDS seconds,
# starting from the checked-in corpus (copied, so the tree is never written to). With
# --build-only, builds them and runs nothing.
#   scripts/fuzz.sh [--build-only] BUILD_DIR [SECONDS]
# A failing target's whole output is printed, with the seed libFuzzer drew (rerun it with
# -seed=N) and the path of the input it wrote.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
usage="usage: fuzz.sh [--build-only] BUILD_DIR [SECONDS]"
build_only=0
if [ "${1:-}" = --build-only ]; then
  build_only=1
  shift
fi
build=${1:?$usage}
if [ "$build_only" -eq 0 ]; then seconds=${2:?$usage}; fi
command -v clang++ >/dev/null || { echo "fuzz.sh: clang++ is not installed" >&2; exit 1; }
cmake -S "$root/fuzz" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ >/dev/null
cmake --build "$build" >/dev/null
if [ "$build_only" -eq 1 ]; then exit 0; fi
# json_check gets longer inputs: its corpus holds deep-nesting seeds.
for target in retry_after duration deadline_header json_check url header_arg response_head database_url idempotency_key explorer_query storable_text grpc_pushback; do
  max_len=256
  if [ "$target" = json_check ]; then max_len=8192; fi
  corpus="$build/corpus-$target"
  mkdir -p "$corpus"
  cp -n "$root/fuzz/corpus/$target/"* "$corpus/" 2>/dev/null || true
  echo "fuzzing $target for ${seconds}s"
  log="$build/fuzz-$target.log"
  if "$build/fuzz_$target" -max_total_time="$seconds" -max_len="$max_len" -print_final_stats=1 \
    -artifact_prefix="$build/$target-" "$corpus" >"$log" 2>&1; then
    tail -n 4 "$log"
  else
    cat "$log"
    echo "fuzz.sh: fuzz_$target failed; its output is above and in $log" >&2
    exit 1
  fi
done
