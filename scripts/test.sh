#!/usr/bin/env bash
# The test command: fetches the default model if missing, then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch_model.sh
cargo test --release "$@"
