# Local Kubernetes for tests and the demo (issue 3). Included by the top-level Makefile.
#   make cluster-binaries  build missing binaries into $${TWINMQ_CACHE_DIR:-~/.cache/twinmq}/k8s
#   make cluster           start (idempotently) etcd, the control plane, the node agent,
#                          kube-proxy and CoreDNS; kubeconfig in .cluster/kubeconfig
#   make cluster-down      stop all of it and remove the pods, routes and rules it made
#   make e2e               the e2e smoke suite against $$KUBECONFIG (default: the local
#                          cluster, started if needed and stopped again if it started it)

CLUSTER_PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)

.PHONY: cluster-binaries cluster cluster-down cluster-status e2e

cluster-binaries:
	$(CLUSTER_PYTHON) -m twinmq.localcluster.binaries

cluster: cluster-binaries
	$(CLUSTER_PYTHON) -m twinmq.localcluster.cluster up

cluster-down:
	$(CLUSTER_PYTHON) -m twinmq.localcluster.cluster down

cluster-status:
	$(CLUSTER_PYTHON) -m twinmq.localcluster.cluster status

e2e: $(if $(KUBECONFIG),,cluster-binaries)
	$(CLUSTER_PYTHON) -m pytest localcluster/tests e2e -p no:cacheprovider $(E2E_ARGS)

# The story so far on this machine (build, cluster, chart, confirmed traffic, kill -9, report).
# Leaves the cluster running; `make cluster-down` when done.
.PHONY: demo
demo:
	$(CLUSTER_PYTHON) -m twinmq.localcluster.demo
