#!/usr/bin/env bash
# The main job: fetches the default model if missing, builds the server (the first build
# takes several minutes, shown as cargo prints it), then serves the model on
# http://127.0.0.1:8000 (OpenAI API, WebSocket, playground). Extra arguments go to
# `actorllm serve` (vLLM's flag names: --port, --max-model-len, --api-key, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch_model.sh
scripts/build.sh
exec target/release/actorllm serve "$@"
