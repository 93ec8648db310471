#!/usr/bin/env bash
# Builds the container image (Dockerfile at the repository root) with the first OCI builder
# that can run here: docker, podman or buildah. Usage: scripts/build-image.sh [TAG]
# (default actorllm:latest). The build fetches its base images (rust, nvidia/cuda) from
# their registries, so it needs network access to docker.io.
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:-actorllm:latest}
for builder in docker podman buildah; do
  command -v "$builder" >/dev/null 2>&1 || continue
  case $builder in
    docker) docker info >/dev/null 2>&1 || { echo "docker: no engine answers; trying the next builder" >&2; continue; } ;;
    podman) podman info >/dev/null 2>&1 || { echo "podman cannot run here; trying the next builder" >&2; continue; } ;;
  esac
  echo "building $tag with $builder..." >&2
  if [ "$builder" = buildah ]; then
    exec buildah bud --layers -t "$tag" -f Dockerfile .
  fi
  exec "$builder" build -t "$tag" -f Dockerfile .
done
echo "no OCI builder can run here: install docker (with its engine running), podman or buildah" >&2
exit 1
