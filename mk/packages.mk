# Packages for users (issue 13): the Helm chart for a chart repository (docs/helm-chart.md)
# and the krew package of the kubectl plugin. Included by the top-level Makefile.
#   make chart-package   lint, then $(CHART_DIST)/twinmq-<version>.tgz and
#                        $(CHART_DIST)/index.yaml (serve the folder as a chart repository)
# CHART_REPO_URL: the URL the folder is served at (written into index.yaml); empty: the
# index names the packages relative to itself, which `helm repo add` resolves.
# HELM: the helm binary; default: the local cluster's cached build, else helm on PATH.
CHART_DIR := helm/twinmq
CHART_DIST ?= dist/charts
CHART_REPO_URL ?=
CHART_PYTHON := $(or $(PY),$(if $(wildcard .venv/bin/python),.venv/bin/python,python3))
HELM ?= $(shell $(CHART_PYTHON) -c 'from twinmq.localcluster.binaries import find; print(find("helm"))' 2>/dev/null || command -v helm)

.PHONY: chart-package

chart-package:
	@test -n "$(HELM)" || { echo "no helm: run make cluster-binaries, or put helm on PATH" >&2; exit 1; }
	@mkdir -p $(CHART_DIST)
	$(HELM) lint --strict $(CHART_DIR)
	$(HELM) package $(CHART_DIR) --destination $(CHART_DIST)
	$(HELM) repo index $(CHART_DIST) $(if $(CHART_REPO_URL),--url $(CHART_REPO_URL))

# The krew package of `kubectl twinmq` (plugins/build.py, docs/kubectl-plugin.md):
#   make krew-package   dist/krew/kubectl-twinmq_<version>_<os>_<arch>.tar.gz (this
#                       platform and Python) and dist/krew/twinmq.yaml (krew manifest)
# KREW_URI_BASE: where the archive will be published (the manifest's uri); default: the
# release's assets.
KREW_URI_BASE ?=
.PHONY: krew-package

krew-package:
	$(CHART_PYTHON) plugins/build.py --out dist/krew $(if $(KREW_URI_BASE),--uri-base $(KREW_URI_BASE))
