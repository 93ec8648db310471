#!/usr/bin/env bash
# Checks deploy/: `helm lint` on the chart, then `helm template` output (default values,
# then with LoRA on the CPU) and the examples validated by kubeconform against the
# Kubernetes schemas and the CRDs of the Gateway API Inference Extension and
# LeaderWorkerSet. Fetches helm, kubeconform and the CRDs' schemas into .tools/ when
# missing (needs network access to get.helm.sh, github.com and raw.githubusercontent.com).
set -euo pipefail
cd "$(dirname "$0")/.."
HELM_VERSION=v3.16.4
KUBECONFORM_VERSION=v0.6.7
tools=.tools
mkdir -p "$tools/schemas"
export PATH="$PWD/$tools:$PATH"
if ! command -v helm >/dev/null 2>&1; then
  echo "fetching helm $HELM_VERSION..." >&2
  curl -fsSL "https://get.helm.sh/helm-$HELM_VERSION-linux-amd64.tar.gz" | tar -xz -C "$tools" --strip-components=1 linux-amd64/helm
fi
if ! command -v kubeconform >/dev/null 2>&1; then
  echo "fetching kubeconform $KUBECONFORM_VERSION..." >&2
  curl -fsSL "https://github.com/yannh/kubeconform/releases/download/$KUBECONFORM_VERSION/kubeconform-linux-amd64.tar.gz" |
    tar -xz -C "$tools" kubeconform
fi
# The CRDs' JSON schemas, in kubeconform's {group}/{kind}_{version}.json layout.
crds=(
  "https://raw.githubusercontent.com/kubernetes-sigs/gateway-api-inference-extension/v0.3.0/config/crd/bases/inference.networking.x-k8s.io_inferencepools.yaml"
  "https://raw.githubusercontent.com/kubernetes-sigs/gateway-api-inference-extension/v0.3.0/config/crd/bases/inference.networking.x-k8s.io_inferencemodels.yaml"
  "https://raw.githubusercontent.com/kubernetes-sigs/lws/v0.6.1/config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml"
)
if [ ! -f "$tools/schemas/.done" ]; then
  for url in "${crds[@]}"; do
    curl -fsSL "$url" -o "$tools/crd.yaml"
    python3 - "$tools/crd.yaml" "$tools/schemas" <<'PY'
import json, os, sys, yaml
crd = yaml.safe_load(open(sys.argv[1]))
group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"].lower()
for v in crd["spec"]["versions"]:
    os.makedirs(f"{sys.argv[2]}/{group}", exist_ok=True)
    with open(f"{sys.argv[2]}/{group}/{kind}_{v['name']}.json", "w") as f:
        json.dump(v["schema"]["openAPIV3Schema"], f)
PY
  done
  touch "$tools/schemas/.done"
fi
chart=deploy/helm/actorllm
conform=(kubeconform -strict -summary -schema-location default
  -schema-location "$tools/schemas/{{.Group}}/{{.ResourceKind}}_{{.ResourceAPIVersion}}.json")
helm lint "$chart"
helm template llm "$chart" | "${conform[@]}"
helm template llm "$chart" --set gpu.count=0 --set model.fetch=false --set lora.enabled=true \
  --set 'lora.modules[0].name=sql' --set 'lora.modules[0].path=/models/adapters/sql' | "${conform[@]}"
"${conform[@]}" deploy/examples/*.yaml
echo "deploy/: chart and examples valid"
