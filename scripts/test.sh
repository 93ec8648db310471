#!/usr/bin/env bash
# The test command: fetches the default model if missing, puts the `openai` Python client
# in .venv (for the client-compatibility test), then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch_model.sh
if ! .venv/bin/python -c "import openai" >/dev/null 2>&1; then
  python3 -m venv .venv
  .venv/bin/python -m pip install --quiet --disable-pip-version-check openai
fi
export ACTORLLM_PYTHON="$PWD/.venv/bin/python"
cargo test --release "$@"
