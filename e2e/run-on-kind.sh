#!/usr/bin/env bash
# Run the e2e suite on kind (needs docker, kind and helm on PATH).
#   e2e/run-on-kind.sh [pytest args...]
# Keeps the kind cluster afterwards; delete it with `kind delete cluster --name twinmq-e2e`.
set -euo pipefail
cd "$(dirname "$0")/.."
name=twinmq-e2e
image=${TWINMQ_E2E_IMAGE:-twinmq/twinmq:dev}
for tool in docker kind helm; do
  command -v "$tool" >/dev/null || { echo "run-on-kind: $tool not found" >&2; exit 2; }
done
if ! kind get clusters | grep -qx "$name"; then
  kind create cluster --config e2e/kind.yaml --wait 120s
fi
# The product's audit image from the top-level Containerfile (the file `make image` builds),
# then the suite's layer on it (moto's S3 server, e2e/Dockerfile).
docker build -t "$image-product" -f Containerfile --target audit .
docker build -t "$image" --build-arg PRODUCT="$image-product" - < e2e/Dockerfile
kind load docker-image "$image" --name "$name"
mkdir -p .cluster
kind get kubeconfig --name "$name" > .cluster/kind-kubeconfig
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
# The suite's image is built on the audit image: it serves as both (spec.audit.image too).
KUBECONFIG=$PWD/.cluster/kind-kubeconfig TWINMQ_E2E_IMAGE="$image" \
  TWINMQ_E2E_AUDIT_IMAGE="$image" TWINMQ_E2E_KIND_NODE="$name-control-plane" \
  exec "$PYTHON" -m pytest e2e -m "e2e and not slow" -p no:cacheprovider "$@"
