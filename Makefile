# TwinMQ: `make demo` runs the main job on an embedded default; `make test` runs every test.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.twinmq-installed
TYPECHECK_VIEW := .cache/typecheck

# Component make files (the local cluster, ...) add targets and, for `make test`,
# TEST_SETUP_TARGETS (made before the tests), TEST_BACKGROUND_TARGETS (made while the unit
# tests run: the images, minutes of downloads and compression that need no test) and
# TEST_EXTRA_TARGETS (made after them: the e2e suite).
TEST_SETUP_TARGETS ?=
TEST_BACKGROUND_TARGETS ?=
TEST_EXTRA_TARGETS ?=
SYSTEM_PACKAGES ?=
-include mk/*.mk
.PHONY: help venv system-deps lint typecheck unit test test-fast soak demo bench clean

help:
	@echo "make demo       the demo on an embedded default: a broker, a pair failover, the local cluster"
	@echo "make test       install everything needed and run lint, mypy and every test"
	@echo "make test-fast  lint, mypy and the fast unit tests only"
	@echo "make bench      TwinMQ vs RabbitMQ with PerfTest (see docs/benchmarks.md)"

# The virtual environment is reinstalled when pyproject.toml, constraints.txt (the exact
# versions: pip's resolver backtracked for many minutes without them) or the package layout
# changes.
# The product (pyproject.toml) and the dev distribution (dev/pyproject.toml: the local
# cluster, the test rigs, the demo; never in the product wheel), both editable.
$(STAMP): pyproject.toml dev/pyproject.toml constraints.txt $(wildcard */__init__.py */py.typed)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -c constraints.txt -e '.[test]' -e ./dev
	@touch $@

venv: $(STAMP)

# Debian packages the tests use (listed by mk/*.mk), installed only when missing.
system-deps:
	@missing=""; for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  (apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The component folders are `twinmq.*` packages only once installed; mypy reads a
# view of symlinks laid out as the import names, generated from both pyproject.toml files.
typecheck: $(STAMP)
	@rm -rf $(TYPECHECK_VIEW) && mkdir -p $(TYPECHECK_VIEW)/twinmq
	@$(PY) -c 'import tomllib,os; [os.symlink(os.path.abspath(os.path.join(r, d)), "$(TYPECHECK_VIEW)/"+n.replace(".","/")) for r in (".", "dev") for n,d in tomllib.load(open(r+"/pyproject.toml","rb"))["tool"]["setuptools"]["package-dir"].items()]'
	MYPYPATH=$(TYPECHECK_VIEW) $(VENV)/bin/mypy -p twinmq

unit: $(STAMP) system-deps
	$(VENV)/bin/pytest -m "not slow" -q tests

test-fast: lint typecheck unit

# The long fault run of the replication engine (120 cycles by default; TWINMQ_FAULT_CYCLES).
soak: $(STAMP)
	$(VENV)/bin/pytest -q -s -m "soak and not faults" tests

# The local cluster's binaries (helm among them) are built first: the chart tests need helm.
# Every test but the soak runs (see `make soak`), then the e2e suite (mk/cluster.mk).
test: lint typecheck system-deps $(TEST_SETUP_TARGETS)
	@if $(MAKE) -n cluster-binaries >/dev/null 2>&1; then $(MAKE) --no-print-directory cluster-binaries; fi
	@bg=""; background="$(strip $(TEST_BACKGROUND_TARGETS))"; \
	if [ -n "$$background" ]; then \
	  mkdir -p .cache; echo "make $$background: in the background while the tests run (log: .cache/test-background.log)"; \
	  $(MAKE) --no-print-directory $$background >.cache/test-background.log 2>&1 & bg=$$!; \
	fi; \
	$(VENV)/bin/pytest -q -m "not soak" --durations=30 tests; rc=$$?; \
	if [ -n "$$bg" ]; then \
	  if wait $$bg; then tail -n 3 .cache/test-background.log; \
	  else cat .cache/test-background.log; echo "make $$background failed"; exit 1; fi; \
	fi; \
	exit $$rc
	@for t in $(TEST_EXTRA_TARGETS); do $(MAKE) --no-print-directory $$t || exit 1; done

# The broker and pair story on loopback, then the Kubernetes story: the local cluster
# (built and started by mk/cluster.mk), the chart's operator, a BrokerCluster, a failover.
demo: $(STAMP)
	$(VENV)/bin/twinmq-demo
	$(MAKE) --no-print-directory $(CLUSTER_AUDIT_IMAGE) cluster
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m twinmq.demo.kubernetes

clean:
	rm -rf $(VENV) .cache build *.egg-info
