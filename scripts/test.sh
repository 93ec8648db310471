#!/usr/bin/env bash
# The test command. Installs what the tests need when it is missing (the default model,
# the `openai` Python client in .venv, Debian's chromium and playwright-core for the
# browser test), then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch_model.sh
if ! .venv/bin/python -c "import openai" >/dev/null 2>&1; then
  python3 -m venv .venv
  .venv/bin/python -m pip install --quiet --disable-pip-version-check openai
fi
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "the browser test needs Debian's chromium: sudo apt-get install chromium" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
if [ ! -d tests/browser/node_modules/playwright-core ]; then
  (cd tests/browser && npm ci --no-audit --no-fund --silent)
fi
export ACTORLLM_PYTHON="$PWD/.venv/bin/python"
cargo test --release "$@"
