#!/usr/bin/env bash
# Runs the whole test suite (scripts/test.sh) N times in a row (default 20) while another
# process keeps one core busy, and stops at the first failure. It shows that the suite
# does not depend on timing: every run must pass on a loaded 2-core machine.
#   scripts/stress.sh [RUNS] [-- extra arguments for cargo test]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-20}
shift || true
[ "${1:-}" = "--" ] && shift
scripts/test.sh --no-run >/dev/null
log=target/stress
mkdir -p "$log"
# The CPU hog: a busy loop on one core for the whole run.
( while :; do :; done ) &
hog=$!
trap 'kill $hog 2>/dev/null' EXIT
started=$(date +%s)
for i in $(seq 1 "$runs"); do
  t0=$(date +%s)
  if scripts/test.sh "$@" >"$log/run-$i.log" 2>&1; then
    echo "run $i/$runs: passed in $(( $(date +%s) - t0 )) s"
  else
    echo "run $i/$runs: FAILED after $(( $(date +%s) - t0 )) s (log: $log/run-$i.log)"
    grep -E "^test .* FAILED|panicked|^failures:" "$log/run-$i.log" | head -20
    exit 1
  fi
done
echo "all $runs runs passed in $(( $(date +%s) - started )) s, beside a busy loop on one core"
