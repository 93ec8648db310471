#!/usr/bin/env bash
# Builds the release binary (target/release/actorllm) that run.sh, fetch_model.sh and the
# tests share, with cargo's own progress on screen. Cargo skips what is already built.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x target/release/actorllm ]; then
  echo "building actorllm (release): the first build compiles about 250 crates and takes" \
    "6 to 10 minutes on 2 cores; later builds take seconds" >&2
fi
cargo build --release
