#!/usr/bin/env bash
# Runs the fuzz targets in fuzz/ (cargo fuzz, libFuzzer, no sanitizer: stable Rust) for
# SECONDS each (default 60), all of them or those named, and prints each target's
# executions and whether it crashed. Corpora grow in fuzz/corpus/ (ignored by git), seeded
# from fuzz/seeds/; a crash is written to fuzz/artifacts/TARGET/ and should be copied into
# fuzz/seeds/TARGET/ as a regression case once fixed (the seeds run first every time).
# CI runs each target briefly; run it for longer by hand: scripts/fuzz.sh 3600
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(gguf safetensors config ws_frames request tokenizer)
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "installing cargo-fuzz..." >&2
  cargo install cargo-fuzz --locked --quiet
fi
(cd fuzz && cargo fuzz build -s none -O)
status=0
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t"
  log="fuzz/corpus/$t.log"
  if (cd fuzz && cargo fuzz run -s none -O "$t" "corpus/$t" "seeds/$t" -- \
      -max_total_time="$secs" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1) >"$log" 2>&1; then
    result="no crash"
  else
    result="CRASH (see $log and fuzz/artifacts/$t/)"
    status=1
  fi
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  printf '%-12s %12s executions in %ss: %s\n' "$t" "$execs" "$secs" "$result"
done
exit $status
