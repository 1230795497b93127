# TwinMQ's images (issue 13, docs/image.md). Included by the top-level Makefile.
#   make image         the broker/operator image: .cache/image/twinmq-<version>.tar (OCI
#                      archive of docker.io/twinmq/twinmq:<version>) and its SBOM
#                      (.cdx.json); seconds when nothing changed
#   make image-audit   the audit image (JRE + PySpark): .cache/image/twinmq-audit-<version>.tar
#   make image-lock    rewrite image/*.lock from pyproject.toml and the versions in .venv
# Built by buildah from the Containerfile on Debian roots made by mmdebstrap: no daemon,
# no registry. The tools are installed here, not by `make test` (its image test skips
# without them).
IMAGE_PACKAGES := mmdebstrap buildah umoci
IMAGE_ARGS ?=

.PHONY: image image-audit image-lock image-tools

image-tools:
	@missing=""; for p in $(IMAGE_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing image tools:$$missing"; \
	  (apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

image: $(STAMP) image-tools
	$(PY) image/build.py --target broker $(IMAGE_ARGS)

image-audit: $(STAMP) image-tools
	$(PY) image/build.py --target audit $(IMAGE_ARGS)

image-lock: $(STAMP)
	$(PY) image/lock.py
