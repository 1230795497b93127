# Local Kubernetes for tests and the demo (issue 3). Included by the top-level Makefile;
# also usable alone: `make -f mk/cluster.mk cluster`. See docs/local-cluster.md.
#   make cluster-binaries  build missing binaries into $${TWINMQ_CACHE_DIR:-~/.cache/twinmq}/k8s
#   make cluster           start (idempotently) etcd, the control plane, the node (a real
#                          kubelet + containerd), kube-proxy and CoreDNS; kubeconfig in
#                          .cluster/kubeconfig
#   make cluster-down      stop all of it and remove the pods, routes and rules it made
#   make cluster-status    one line per component
#   make e2e               unit tests of this tooling, then the e2e suite against $$KUBECONFIG
#                          (default: the local cluster, started if needed and stopped again
#                          if the suite started it); tests marked `slow` only when asked:
#                          E2E_ARGS="-m slow -k ..."
#   make cluster-demo      chart + confirmed traffic through a Service + kill -9 + report
#   make spark-operator    build the Kubeflow Spark Operator's controller (on demand only:
#                          the slow SparkApplication audit test, docs/local-cluster.md)
# The node is a real kubelet + containerd running the project's image (TWINMQ_NODE=kubelet,
# the default: it also builds the kubelet and the images and installs containerd and runc);
# TWINMQ_NODE=agent is the fallback, the process-backed node agent (docs/local-cluster.md).

# Inside the top-level Makefile, use its venv (and its install stamp); alone, .venv or python3.
CLUSTER_PYTHON ?= $(or $(PY),$(if $(wildcard .venv/bin/python),.venv/bin/python,python3))
CLUSTER_DEPS ?= $(STAMP)

# Debian packages the local cluster needs (installed by the top-level `system-deps`).
SYSTEM_PACKAGES += containernetworking-plugins iproute2 iptables ipset conntrack openssl
# `make test` runs the e2e suite after the unit tests.
TEST_EXTRA_TARGETS += e2e

.PHONY: cluster-binaries cluster cluster-down cluster-status e2e cluster-demo spark-operator

cluster-binaries: $(CLUSTER_DEPS)
	$(CLUSTER_PYTHON) -m twinmq.localcluster.binaries

spark-operator: $(CLUSTER_DEPS)
	$(CLUSTER_PYTHON) -m twinmq.localcluster.binaries spark-operator

TWINMQ_NODE ?=
export TWINMQ_NODE
# The node `make cluster` runs (localcluster/layout.py's node_mode(): the same default).
CLUSTER_NODE := $(or $(TWINMQ_NODE),kubelet)
# The real node runs the project's image: build it first (seconds when unchanged). The
# e2e suite's audit tests and `make demo`'s audit also need the audit image (JRE + PySpark):
# `make cluster` imports it when it exists.
CLUSTER_IMAGE := $(if $(filter kubelet,$(CLUSTER_NODE)),image)
CLUSTER_AUDIT_IMAGE := $(if $(filter kubelet,$(CLUSTER_NODE)),image-audit)
# `make test`: the image tools before the unit tests (tests/test_image.py needs them), the
# images built while the unit tests run (the e2e suite after them needs both).
TEST_SETUP_TARGETS += $(if $(CLUSTER_IMAGE),image-tools)
TEST_BACKGROUND_TARGETS += $(CLUSTER_IMAGE) $(CLUSTER_AUDIT_IMAGE)

cluster: cluster-binaries $(CLUSTER_IMAGE)
	$(CLUSTER_PYTHON) -m twinmq.localcluster.cluster up

cluster-down: $(CLUSTER_DEPS)
	$(CLUSTER_PYTHON) -m twinmq.localcluster.cluster down

cluster-status: $(CLUSTER_DEPS)
	$(CLUSTER_PYTHON) -m twinmq.localcluster.cluster status

e2e: $(CLUSTER_DEPS) $(if $(KUBECONFIG),,cluster-binaries $(CLUSTER_IMAGE) $(CLUSTER_AUDIT_IMAGE))
	$(CLUSTER_PYTHON) -m pytest localcluster/tests e2e -p no:cacheprovider -m "not slow" $(E2E_ARGS)

# Leaves the cluster running; `make cluster-down` when done.
cluster-demo: cluster-binaries $(CLUSTER_IMAGE)
	$(CLUSTER_PYTHON) -m twinmq.localcluster.demo
