#!/usr/bin/env bash
# The test command. Installs what the tests need when it is missing (the default model
# and its GGUF, the `openai` Python client in .venv, Debian's chromium and playwright-core
# for the browser test), then builds and runs every test. The GPU tests (tests/cuda.rs)
# show as ignored here; on a GPU host run them with
# `cargo test --release --test cuda -- --ignored`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch_model.sh
if ! .venv/bin/python -c "import openai" >/dev/null 2>&1; then
  echo "installing the openai Python client into .venv..." >&2
  python3 -m venv .venv
  .venv/bin/python -m pip install --quiet --disable-pip-version-check openai
fi
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "the browser test needs Debian's chromium: sudo apt-get install chromium" >&2
    exit 1
  fi
  echo "installing Debian's chromium for the browser test..." >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
if [ ! -d tests/browser/node_modules/playwright-core ]; then
  (cd tests/browser && npm ci --no-audit --no-fund --silent)
fi
export ACTORLLM_PYTHON="$PWD/.venv/bin/python"
if [ ! -d target/release/deps ] || ! ls target/release/deps/engine-* >/dev/null 2>&1; then
  echo "building the tests: the first build takes 6 to 10 minutes on 2 cores" >&2
fi
cargo test --release "$@"
