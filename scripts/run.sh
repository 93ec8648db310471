#!/usr/bin/env bash
# The main job: fetches the default model if missing, then runs actorllm on it.
# Extra arguments go to `actorllm generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch_model.sh
if [ $# -eq 0 ]; then
  set -- --chat "Write a haiku about the sea."
fi
exec cargo run --release --quiet -- generate "$@"
